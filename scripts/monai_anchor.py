"""The PyTorch / MONAI anchor for ctseg's GPU figures: the same 3-D U-Net in PyTorch.

Depth 4, two conv-BN-ReLU per level, 2× max-pool, 2×2×2 stride-2 transposed conv up,
concatenation [skip, up], 1×1×1 head to 3 classes: ctseg's U-Net (`ctseg.model.unet`), so
that a step or a prediction can be put against a widely used implementation measured
on the same GPU. Needs the `bench` extra (`pip install -e '.[bench]'`) and a CUDA GPU,
or `--device cpu` for inference on the host's cores (float32, one timed run):

    python scripts/monai_anchor.py train --size 128 --base 32 [--compile]
    python scripts/monai_anchor.py infer --size 512 --base 32 [--sw 128 --overlap 0.5]
    python scripts/monai_anchor.py infer --shape 560 560 320 --sw 128 --overlap 0.25 --device cpu

train: median step time of weighted cross-entropy (1/8/16) + soft Dice, AdamW, bfloat16
autocast, channels_last_3d, cudnn.benchmark. infer: a whole-volume forward pass, or
MONAI's sliding_window_inference (Gaussian weights) with --sw; `seconds` is what
ctseg's `infer` phase covers — the grid from host memory to the GPU, the network, the
class probabilities back to host memory — the median of three runs after a warm-up
(as ctseg's scans after the first); `device_seconds`, the network alone. Prints one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv3d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm3d(cout),
        nn.ReLU(inplace=True),
        nn.Conv3d(cout, cout, 3, padding=1, bias=False),
        nn.BatchNorm3d(cout),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    def __init__(self, base: int = 32, depth: int = 4):
        super().__init__()
        w = [base * 2**i for i in range(depth)]
        self.down = nn.ModuleList([block(1 if i == 0 else w[i - 1], w[i]) for i in range(depth)])
        self.upc = nn.ModuleList(
            [nn.ConvTranspose3d(w[i + 1], w[i], 2, stride=2) for i in range(depth - 1)]
        )
        self.up = nn.ModuleList([block(2 * w[i], w[i]) for i in range(depth - 1)])
        self.head = nn.Conv3d(w[0], 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, down in enumerate(self.down):
            if i:
                x = F.max_pool3d(x, 2)
            x = down(x)
            skips.append(x)
        for i in reversed(range(len(self.up))):
            x = self.up[i](torch.cat([skips[i], self.upc[i](x)], 1))
        return self.head(x)


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """ctseg's loss: weighted cross-entropy plus soft Dice of liver (1 and 2) and tumour."""
    w = torch.tensor([1.0, 8.0, 16.0], device=logits.device)
    ce = F.cross_entropy(logits.float(), y, weight=w)
    p = logits.float().softmax(1)
    dice = 0
    for c, m in ((1, y >= 1), (2, y == 2)):
        pc = p[:, 1:].sum(1) if c == 1 else p[:, 2]
        m = m.float()
        dice = dice + 1 - (2 * (pc * m).sum() + 1) / (pc.sum() + m.sum() + 1)
    return ce + dice


def timed(run, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return sorted(times)


def peak_rss_gib() -> float:
    """This process's peak resident memory (the CPU's counterpart of the GPU's peak)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["train", "infer"])
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--base", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--sw", type=int, default=0, help="sliding-window size; 0: whole")
    parser.add_argument("--overlap", type=float, default=0.5)
    parser.add_argument(
        "--shape", type=int, nargs=3, help="infer: the grid's x y z voxels (default --size³)"
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    if args.device == "cpu" and args.mode == "train":
        raise SystemExit("error: the CPU anchor infers only")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: the anchor needs a CUDA GPU (torch.cuda.is_available() is False)")
    return args


def train_seconds(net: torch.nn.Module, args: argparse.Namespace) -> float:
    """The median seconds of a training step at `--size`³ (bfloat16 autocast, fused AdamW)."""
    r, device = args.size, args.device
    x = torch.randn(1, 1, r, r, r, device=device).to(memory_format=torch.channels_last_3d)
    y = torch.randint(0, 3, (1, r, r, r), device=device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)
    forward = torch.compile(net) if args.compile else net

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = forward(x)
        loss_fn(logits, y).backward()
        opt.step()

    timed(step, 3)  # warm-up: cuDNN's algorithm search, torch.compile
    return timed(step, args.steps)[args.steps // 2]


def infer_seconds(net: torch.nn.Module, args: argparse.Namespace, shape: tuple) -> dict:
    """Seconds of one inference host to host (and on the device alone, on a GPU): the whole
    grid, or MONAI's sliding window with `--sw`."""
    net.eval()
    device = args.device
    host = np.random.default_rng(0).standard_normal((1, 1, *shape), dtype=np.float32)
    if args.sw:
        from monai.inferers import sliding_window_inference

        def network(x: torch.Tensor) -> torch.Tensor:
            window = (args.sw,) * 3
            overlap = args.overlap
            return sliding_window_inference(x, window, 4, net, overlap=overlap, mode="gaussian")
    else:
        network = net
    on_device = torch.from_numpy(host).to(device).to(memory_format=torch.channels_last_3d)

    def host_to_host() -> None:
        x = torch.from_numpy(host).to(device).to(memory_format=torch.channels_last_3d)
        network(x).float().softmax(1).cpu()

    if device == "cpu":  # float32, as ctseg runs on the CPU; one run: minutes, no warm-up
        with torch.inference_mode():
            return {"seconds": timed(host_to_host, 1)[0]}
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        timed(host_to_host, 1)  # warm-up
        return {
            "seconds": timed(host_to_host, 3)[1],
            "device_seconds": timed(lambda: network(on_device), 3)[1],
        }


def main() -> None:
    args = parse()
    cpu = args.device == "cpu"
    torch.backends.cudnn.benchmark = True
    net = UNet(args.base).to(args.device).to(memory_format=torch.channels_last_3d)
    r = args.size
    shape = tuple(args.shape) if args.shape else (r, r, r)
    out = {
        "mode": args.mode,
        "size": r,
        "shape": list(shape),
        "base": args.base,
        "compile": args.compile,
        "sw": args.sw,
        "overlap": args.overlap,
        "torch": torch.__version__,
        "gpu": "none (CPU)" if cpu else torch.cuda.get_device_name(),
    }
    if not cpu:
        torch.cuda.reset_peak_memory_stats()
    if args.mode == "train":
        out["step_seconds"] = train_seconds(net, args)
    else:
        out.update(infer_seconds(net, args, shape))
    out["peak_gib"] = peak_rss_gib() if cpu else torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
