"""Forward pass of our 3-D U-Net on XLA:CPU and ONNX Runtime against PyTorch.

One process, one input: base 16, depth 4, 128³, float32, batch 1, 2 threads,
inference mode; best of a few runs after warm-up. ONNX Runtime runs our exported
graph (`ctseg.inference.network.onnx.export`) of the same weights as the JAX run. PyTorch is not a
ctseg dependency; install it and the onnx extra into the virtualenv first:

    pip install torch==2.13.0 'ctseg[onnx]'
    GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184 \\
        python scripts/cpu_speed.py [--size 128] [--repeats 3]

(The GLIBC_TUNABLES setting keeps freed activation buffers in the process instead of
handing them back to the system; run once with and once without it to see its effect,
as docs/experiments/cpu-speed.md does.)
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads=2"
)

from ctseg.parallel.held_output import held_start_output  # noqa: E402

with held_start_output():  # importing JAX imports its plugins, which speak
    import jax  # noqa: E402
import numpy as np  # noqa: E402

from ctseg import config as cfg  # noqa: E402
from ctseg.model import unet  # noqa: E402
from ctseg.parallel.partition import LOCAL  # noqa: E402

BASE, DEPTH = 16, 4
THREADS = 2


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up (and compilation)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def jax_forward(x: np.ndarray, graphdef, params, stats):
    forward = jax.jit(lambda p, s, v: unet.apply(graphdef, p, s, v, LOCAL, train=False)[0])
    image = jax.numpy.asarray(x[None, ..., None])
    return lambda: forward(params, stats, image).block_until_ready()


def onnx_forward(x: np.ndarray, graphdef, params, stats):
    import onnxruntime as ort

    from ctseg.inference.network.onnx import export as onnx_export

    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    proto = onnx_export.export(graphdef, params, stats)
    session = ort.InferenceSession(
        proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    image = x[None, ..., None]
    return lambda: session.run(None, {onnx_export.INPUT: image})


def torch_forward(x: np.ndarray):
    import torch
    from torch import nn

    torch.set_num_threads(THREADS)

    def level(cin: int, cout: int) -> nn.Sequential:
        layers = []
        for c in (cin, cout):
            layers += [
                nn.Conv3d(c, cout, 3, padding=1, bias=False),
                nn.BatchNorm3d(cout),
                nn.ReLU(),
            ]
        return nn.Sequential(*layers)

    class UNet(nn.Module):
        def __init__(self):
            super().__init__()
            widths = [BASE * 2**i for i in range(DEPTH)]
            self.down = nn.ModuleList(
                [level(1 if i == 0 else widths[i - 1], w) for i, w in enumerate(widths)]
            )
            self.ups = nn.ModuleList(
                [
                    nn.ConvTranspose3d(widths[i + 1], widths[i], 2, stride=2)
                    for i in range(DEPTH - 1)
                ]
            )
            self.up = nn.ModuleList([level(2 * widths[i], widths[i]) for i in range(DEPTH - 1)])
            self.head = nn.Conv3d(widths[0], 3, 1)

        def forward(self, h):
            skips = []
            for i, block in enumerate(self.down):
                h = block(nn.functional.max_pool3d(h, 2) if i else h)
                skips.append(h)
            for i in reversed(range(DEPTH - 1)):
                h = self.up[i](torch.cat([skips[i], self.ups[i](h)], dim=1))
            return self.head(h)

    model = UNet().eval().to(memory_format=torch.channels_last_3d)
    image = torch.from_numpy(x[None, None]).to(memory_format=torch.channels_last_3d)

    def run():
        with torch.inference_mode():
            model(image)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    x = np.random.default_rng(0).uniform(-1, 1, (args.size,) * 3).astype(np.float32)
    model_cfg = cfg.from_dict({"model": {"base_filters": BASE, "depth": DEPTH}}).model
    model = unet.create(model_cfg, seed=0)
    seconds = {
        "pytorch": best_time(torch_forward(x), args.repeats),
        "onnx": best_time(onnx_forward(x, *model), args.repeats),
        "jax": best_time(jax_forward(x, *model), args.repeats),
    }
    for name, value in seconds.items():
        print(f"{name:8s} {value:8.2f} s  ({args.size}³, base {BASE}, depth {DEPTH}, float32)")
    print(f"XLA:CPU / PyTorch time ratio: {seconds['jax'] / seconds['pytorch']:.1f}×")
    print(f"ONNX Runtime / PyTorch throughput: {seconds['pytorch'] / seconds['onnx']:.2f}×")
    print(f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '(unset)')}")


if __name__ == "__main__":
    main()
