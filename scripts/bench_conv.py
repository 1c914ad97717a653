"""One 3×3×3 convolution of the U-Net, its three passes timed apart, in JAX and PyTorch.

    python scripts/bench_conv.py [--size 256] [--cin 32] [--cout 32]
        [--variants padding,valid,slabs4,matrix] [--device gpu] [--torch]

A training step runs each convolution three times: forward, the gradient of its input
(dgrad) and that of its weights (wgrad). On an H100 the 256³ step spent 70 of its 154 ms
in cuDNN's wgrad kernels (docs/experiments/gpu.md), so this times the passes of one
bfloat16, channels-last convolution alone, as ctseg compiles it, in these variants:
`padding`, the zero padding inside the convolution (XLA folds ctseg's padding into it on
one device); `valid`, the input padded beforehand (as a partitioned step's halo exchange
builds it); `slabsK`, the padded volume cut along its last axis into K slabs with
one-voxel halos, stacked as a batch (the same sums; another shape for cuDNN to choose
kernels for); `matrix`, the image's convolution as ctseg runs it on GPUs
(`ctseg.model.image_conv.as_matrix_products`; `--cin 1` only). `--torch` times
PyTorch's (`channels_last_3d`, `cudnn.benchmark`) on the same GPU. The median of
`--repeats` runs after a warm-up; TFLOP/s counts 2·27·cin·cout per output voxel. Prints
one JSON line per variant.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from ctseg.parallel import jax_start


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--cin", type=int, default=32)
    parser.add_argument("--cout", type=int, default=32)
    parser.add_argument(
        "--variants", default="padding,valid", help="comma-separated, as above ('': none)"
    )
    parser.add_argument("--device", default="gpu", choices=["cpu", "gpu"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--torch", action="store_true", help="also time PyTorch's passes")
    return parser.parse_args()


def median_seconds(
    run: Callable[[], object], repeats: int, sync: Callable[[object], None]
) -> float:
    sync(run())  # the warm-up: compiling, cuDNN's choice of kernels
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        sync(run())
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def jax_passes(args: argparse.Namespace, variant: str) -> dict[str, float]:
    import jax
    import jax.numpy as jnp

    from ctseg.model.image_conv import as_matrix_products

    s, cin, cout = args.size, args.cin, args.cout
    slabs = int(variant.removeprefix("slabs")) if variant.startswith("slabs") else 1
    halo = 0 if variant == "padding" else 1
    padding = [(1 - halo, 1 - halo)] * 3
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (slabs, *[s + 2 * halo] * 2, s // slabs + 2 * halo, cin))
    w = jax.random.normal(keys[1], (3, 3, 3, cin, cout))
    dy = jax.random.normal(keys[2], (slabs, s, s, s // slabs, cout))
    x, w, dy = (a.astype(jnp.bfloat16) for a in (x, w, dy))
    numbers = ("NHWDC", "HWDIO", "NHWDC")

    def conv(x, w):
        if variant == "matrix":
            return as_matrix_products(x, w)
        return jax.lax.conv_general_dilated(x, w, (1, 1, 1), padding, dimension_numbers=numbers)

    forward = jax.jit(conv)
    dgrad = jax.jit(lambda x, w, dy: jax.vjp(lambda x: conv(x, w), x)[1](dy)[0])
    wgrad = jax.jit(lambda x, w, dy: jax.vjp(lambda w: conv(x, w), w)[1](dy)[0])
    sync = jax.block_until_ready
    return {
        "forward": median_seconds(lambda: forward(x, w), args.repeats, sync),
        "dgrad": median_seconds(lambda: dgrad(x, w, dy), args.repeats, sync),
        "wgrad": median_seconds(lambda: wgrad(x, w, dy), args.repeats, sync),
    }


def torch_passes(args: argparse.Namespace) -> dict[str, float]:
    import torch

    torch.backends.cudnn.benchmark = True
    s, cl = args.size, torch.channels_last_3d
    x = torch.randn(1, args.cin, s, s, s, device="cuda", dtype=torch.bfloat16)
    x = x.to(memory_format=cl)
    w = torch.randn(args.cout, args.cin, 3, 3, 3, device="cuda", dtype=torch.bfloat16)
    w = w.to(memory_format=cl)
    dy = torch.randn(1, args.cout, s, s, s, device="cuda", dtype=torch.bfloat16)
    dy = dy.to(memory_format=cl)

    def backward(mask: list[bool]) -> object:
        return torch.ops.aten.convolution_backward(
            dy, x, w, None, [1] * 3, [1] * 3, [1] * 3, False, [0] * 3, 1, mask
        )

    def sync(_: object) -> None:
        torch.cuda.synchronize()

    return {
        "forward": median_seconds(
            lambda: torch.nn.functional.conv3d(x, w, padding=1), args.repeats, sync
        ),
        "dgrad": median_seconds(lambda: backward([True, False, False]), args.repeats, sync),
        "wgrad": median_seconds(lambda: backward([False, True, False]), args.repeats, sync),
    }


def report(args: argparse.Namespace, variant: str, seconds: dict[str, float]) -> None:
    flop = 2 * 27 * args.cin * args.cout * args.size**3
    line = {"variant": variant, "size": args.size, "cin": args.cin, "cout": args.cout}
    for name, sec in seconds.items():
        line[f"{name}_ms"] = round(1e3 * sec, 3)
        line[f"{name}_tflops"] = round(flop / sec / 1e12, 2)
    print(json.dumps(line), flush=True)


def main() -> None:
    args = parse()
    jax_start.start_quietly(args.device)  # with ctseg's XLA options, as its commands start
    for variant in filter(None, args.variants.split(",")):  # '' times PyTorch's alone
        report(args, f"jax {variant}", jax_passes(args, variant))
    if args.torch:
        report(args, "torch", torch_passes(args))


if __name__ == "__main__":
    main()
