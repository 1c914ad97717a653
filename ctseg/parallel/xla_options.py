"""The XLA options ctseg sets: for every program before JAX starts its backends, and for
some programs as they compile.

An option the user set in XLA_FLAGS stands. All but the last change GPU programs only
(the CPU and TPU compilers ignore them). Each was measured worth it, on a GPU where it
changes GPU programs: docs/experiments/design-figures.md#xla-options has the figures.

- **channels-last convolutions.** cuDNN runs 3-D convolutions fastest channels-last (NDHWC,
  PyTorch's `channels_last_3d`), but XLA lays out only 2-D convolutions that way and keeps
  3-D ones channels-first. Channels-last made the training step and the prediction
  windows' pass faster.
- **cuBLAS for matrix products, not Triton.** The U-Net's matrix products (the
  up-convolutions, the head) are a few per program, and XLA tunes a Triton kernel for each
  by compiling and timing dozens of variants: most of the training step's compile time.
  With cuBLAS it compiles in a fraction of that and runs as fast.
- **No tuning of fusions' emitters for the on-device augmentation** (`compile_untuned`).
  XLA times Triton's emitter against its own for reductions and transposes as it
  compiles for a GPU; the augmentation's program for warped blocks, all gathers, sums and
  transposes, took several times as long to compile on a GPU as the training step it
  compiles beside (a CPU, which tunes nothing, compiles it in a fraction of that). Other
  JAX projects turn this tuning off for the same reason. Set per program, not in
  XLA_FLAGS: the option is experimental, and XLA stops the process at a flag its version
  does not know, where a program's compile options raise an error ctseg can pass over.

And on every platform:

- **No optimisation of the model's initial weights** (`compile_unoptimised`). They are
  random numbers made once; made op by op they took dozens of small programs, and as one
  program they compile faster without XLA's optimisations than with them.
  Unoptimised, a few percent of the weights differ from the optimised program's in the
  last bit, which no run depends on: a run's weights are made once and checkpointed.
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
