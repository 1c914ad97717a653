"""The XLA options ctseg sets: for every program before JAX starts its backends, and for
some programs as they compile.

An option the user set in XLA_FLAGS stands. All but the last change GPU programs only
(the CPU and TPU compilers ignore them). Measured on an H100 on 2026-11-26
(docs/experiments/gpu.md):

- **channels-last convolutions.** cuDNN runs 3-D convolutions fastest channels-last (NDHWC,
  PyTorch's `channels_last_3d`), but XLA lays out only 2-D convolutions that way and keeps
  3-D ones channels-first. Channels-last made the bfloat16 training step at 128³ 0.017 s
  instead of 0.021 s, and the lits512 windows' pass 0.64 s instead of 0.79 s.
- **cuBLAS for matrix products, not Triton.** The U-Net's matrix products (the
  up-convolutions, the head) are a few per program, and XLA tunes a Triton kernel for each
  by compiling and timing dozens of variants: 50 of the 54 s lits256's training step took
  to compile. With cuBLAS it compiled in 4.7 s and ran as fast (0.158 s against 0.156 s).
- **No tuning of fusions' emitters for the on-device augmentation** (`compile_untuned`).
  XLA times Triton's emitter against its own for reductions and transposes as it
  compiles for a GPU; the augmentation's program for warped blocks, all gathers, sums and
  transposes, took 40 s to compile on the H100 (3.3 s compiled for one on this CPU, which
  tunes nothing), while the training step it compiles beside took 4.7 s alone. Other
  JAX projects turn this tuning off for the same reason. Set per program, not in
  XLA_FLAGS: the option is experimental, and XLA stops the process at a flag its version
  does not know, where a program's compile options raise an error ctseg can pass over.

And on every platform:

- **No optimisation of the model's initial weights** (`compile_unoptimised`). They are
  random numbers made once; made op by op, the tiny test model's took 33 programs and
  4.5 s on a 2-core CPU (lits256's 60 programs, 8 s, on the H100). As one program they
  take 3 s with XLA's optimisations and 0.6 s without (lits256's compiled for an H100
  without one: 2.5 s). Unoptimised, 4 % of the weights differ from the optimised
  program's in the last bit, which no run depends on: a run's weights are made once and
  checkpointed.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

CHANNELS_LAST = "--xla_gpu_force_conv_nhwc"
CUBLAS_GEMMS = "--xla_gpu_enable_triton_gemm=false"
# Each option, and the flags by which a user has already chosen otherwise.
_OPTIONS = (
    (CHANNELS_LAST, {"--xla_gpu_force_conv_nhwc", "--xla_gpu_force_conv_nchw"}),
    (CUBLAS_GEMMS, {"--xla_gpu_enable_triton_gemm"}),
)
OPTIONS = tuple(option for option, _ in _OPTIONS)


def add_options(environ: MutableMapping[str, str]) -> None:
    """Add ctseg's options to `environ`'s XLA_FLAGS, each unless a flag of the user's
    chooses otherwise. XLA reads the variable when JAX starts its backends."""
    flags = environ.get("XLA_FLAGS", "").split()
    named = {flag.split("=")[0] for flag in flags}
    flags += [option for option, choices in _OPTIONS if not named & choices]
    environ["XLA_FLAGS"] = " ".join(flags)


UNTUNED_FUSIONS = {"xla_gpu_experimental_enable_fusion_autotuner": False}


def compile_untuned(lowered: Any) -> Any:
    """`lowered` (a `jax.stages.Lowered`) compiled without the tuning of fusions' emitters;
    compiled as it is where this JAX's XLA has no such option."""
    import jax

    try:
        return lowered.compile(compiler_options=UNTUNED_FUSIONS)
    except jax.errors.JaxRuntimeError as error:
        if "No such compile option" not in str(error):
            raise
        return lowered.compile()


UNOPTIMISED = {"xla_backend_optimization_level": 0}


def compile_unoptimised(lowered: Any) -> Any:
    """`lowered` compiled without XLA's optimisations: for programs run once."""
    return lowered.compile(compiler_options=UNOPTIMISED)
