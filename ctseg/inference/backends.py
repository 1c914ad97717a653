"""Which inference backend runs a prediction: JAX (XLA) on the chosen devices, or ONNX
Runtime on the host's CPU cores, where XLA:CPU's 3-D convolutions are several times
slower."""

from __future__ import annotations

from collections.abc import Sequence

from ctseg.errors import CtsegError
from ctseg.parallel.devices import ACCELERATORS, Device, is_accelerator

BACKENDS = ("jax", "onnx")


def onnx_available() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def choose_backend(
    requested: str | None, device: str, devices: Sequence[Device], have_onnx: bool
) -> str:
    """The inference backend: the one asked for, else JAX on accelerators, else ONNX if installed.

    ONNX Runtime runs on the host's CPU cores (several times faster than XLA:CPU
    there); it is no choice for a run that asked for an accelerator.
    """
    if requested == "onnx" and device in ACCELERATORS:
        raise CtsegError(
            f"--backend onnx runs on the CPU, not on --device {device}; "
            "leave --backend out to run JAX on the accelerator"
        )
    if requested is not None:
        return requested
    return "onnx" if not is_accelerator(devices) and have_onnx else "jax"
