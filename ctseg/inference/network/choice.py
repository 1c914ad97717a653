"""Which backend runs a prediction, decided once: where a command or the API starts JAX
(`backend_for`), beside the interface it builds (`ctseg.inference.network.backends`).

JAX on accelerators; on the CPU ONNX Runtime where it is installed (XLA:CPU's 3-D
convolutions are several times slower), else JAX. Whoever starts JAX chooses the devices
(`ctseg.parallel.devices.ChosenDevices`) and the backend here, once, and hands the built
backend down: nothing below reads a request string again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ctseg.config import InferenceOptions
from ctseg.errors import OptionError
from ctseg.inference.network.backends import BACKENDS, Backend
from ctseg.inference.network.jax.backend import JaxBackend
from ctseg.inference.network.onnx.backend import OnnxBackend
from ctseg.parallel.devices import ACCELERATORS, ChosenDevices, is_accelerator
from ctseg.parallel.jax_start import start_quietly


def onnx_available() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def backend_name(requested: str | None, chosen: ChosenDevices, have_onnx: bool) -> str:
    """The backend's name: the one asked for, else JAX on accelerators, else ONNX Runtime
    where installed. ONNX Runtime runs on the host's CPU cores: no choice for a call that
    asked for an accelerator."""
    if requested == "onnx" and chosen.request in ACCELERATORS:
        raise OptionError(
            f"`backend` onnx runs on the CPU, not on `device` {chosen.request}; leave "
            "`backend` out to run JAX on the accelerator"
        )
    if requested is not None:
        return requested
    return "onnx" if not is_accelerator(chosen.devices) and have_onnx else "jax"


def backend_for(requested: str | None, chosen: ChosenDevices) -> Backend:
    """The backend a call runs, built on its chosen devices (`backend_name`'s choice).
    Simulated CPU devices share the host's cores: JAX runs on the first of them, one
    window at a time with all the memory (side by side they ran barely faster, and with
    much smaller windows)."""
    name = backend_name(requested, chosen, onnx_available())
    devices = chosen.devices if is_accelerator(chosen.devices) else chosen.devices[:1]
    return backend_named(name, devices)


def backend_named(name: str, devices: Sequence[Any] | None = None) -> Backend:
    """The backend `name` ("jax" or "onnx"); JAX on `devices` (default: this process's
    first device), each of them used."""
    if name == "jax":
        return JaxBackend(devices)
    if name == "onnx":
        return OnnxBackend()
    raise OptionError(f"unknown `backend` {name!r}; choose one of {', '.join(BACKENDS)}")


def start_backend(options: InferenceOptions) -> Backend:
    """The API's start (the commands': `ctseg.cli.options.start_jax`, then `backend_for`):
    JAX started for the device asked for (`jax_start.start_quietly`: the CPU alone where
    nothing else is asked or attached, what JAX's plugins print held), its devices chosen,
    and the backend built on them."""
    found = start_quietly(options.device)
    return backend_for(options.backend, ChosenDevices.of(options.device, found))
