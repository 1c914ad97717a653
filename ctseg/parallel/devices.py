"""Device policy: which devices a command runs on, and the line that says so.

ARCHITECTURE.md invariant 8: a config's mesh is a request, not a requirement.
Every command takes ``--device auto|cpu|gpu|tpu``; ``auto`` is the accelerators
this process sees, else the CPU. Simulated CPU devices exist for tests and for
CPU-only machines, and are never a silent fall-back when an accelerator exists.

The choices here are pure functions of device lists (`choose`, `describe`,
`free_memory`), so that they are tested with fake devices; asking JAX what it started
is `ctseg.parallel.jax_start`'s (`visible`). A command chooses once, when it starts JAX
(`ctseg.cli.options.start_jax` returns the `ChosenDevices`), and hands the choice down.
What runs on the chosen devices is decided elsewhere: the layout of a training run in
`ctseg.parallel.layouts`, the inference backend in `ctseg.inference.network.backends`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ctseg.errors import OptionError
from ctseg.memory import host_memory

DEVICE_CHOICES = ("auto", "cpu", "gpu", "tpu")
ACCELERATORS = ("gpu", "tpu")
# Concrete JAX platforms behind `--device gpu|tpu`, and their names in messages.
_PLATFORMS = {"gpu": ("cuda", "rocm", "oneapi"), "tpu": ("tpu",)}
_NAMES = {"cuda": "CUDA", "rocm": "ROCm", "oneapi": "oneAPI", "tpu": "TPU"}


class Device(Protocol):
    """What the policy reads of a `jax.Device` (tests pass fakes)."""

    platform: str
    device_kind: str

    def memory_stats(self) -> dict[str, int] | None: ...


def choose(request: str, found: Mapping[str, Sequence[Device]]) -> list[Device]:
    """The devices for `request` (auto, cpu, gpu, tpu) among `found` (platform → devices,
    as `visible` gives it: its faults and JAX_PLATFORMS make the messages)."""
    if request == "auto":
        for platform in ACCELERATORS:
            if found.get(platform):
                return list(found[platform])
        request = "cpu"
    devices = list(found.get(request, ()))
    if devices:
        return devices
    platforms = getattr(found, "platforms", None)
    if platforms and not any(found.values()):
        why = getattr(found, "startup_error", None)
        raise OptionError(
            f"JAX_PLATFORMS={platforms} is set, and JAX started none of the platforms it "
            f"names{f' ({why})' if why else ''}; unset JAX_PLATFORMS and choose with "
            "`device` auto, cpu, gpu or tpu (ctseg picks the devices itself), or `device` cpu"
        )
    faults = getattr(found, "faults", {})
    failed = [p for p in _PLATFORMS.get(request, ()) if p in faults]
    if failed:
        raise OptionError(
            f"`device` {request}: "
            + "; ".join(f"{_NAMES[p]} backend failed to start: {faults[p]}" for p in failed)
        )
    present = ", ".join(p for p in found if found[p]) or "none"
    message = f"`device` {request}: JAX sees no {request.upper()} here (platforms: {present})"
    named = {request, *_PLATFORMS.get(request, ())}
    if platforms and not named & set(platforms.split(",")):
        message += f"; JAX_PLATFORMS={platforms} leaves it out: unset JAX_PLATFORMS"
    raise OptionError(f"{message}; use `device` auto to run on what there is")


@dataclass(frozen=True)
class ChosenDevices:
    """A command's devices, chosen once (`of`) and handed down to the work it calls.

    `request`: what was asked (auto, cpu, gpu, tpu); `devices`: the devices it chose, of
    every process; `found`: everything `visible` found, of which `plan_devices` takes the
    CPU's devices to simulate a mesh larger than the chosen devices.
    """

    request: str
    devices: tuple[Device, ...]
    found: Mapping[str, Sequence[Device]]

    @classmethod
    def of(cls, request: str, found: Mapping[str, Sequence[Device]]) -> ChosenDevices:
        """`choose`'s devices for `request` among `found`; its CtsegError where there are none."""
        return cls(request, tuple(choose(request, found)), found)

    @property
    def line(self) -> str:
        """What runs where, e.g. `2 × NVIDIA H100 80GB HBM3` or `16 simulated CPU devices …`."""
        return describe(self.devices, simulated=True)


def fallback_warning(request: str, found: Mapping[str, Sequence[Device]]) -> str | None:
    """Why `--device auto` runs on the CPU where an accelerator is installed but failed to
    start (invariant 8: never a silent fall-back); None where nothing failed."""
    faults = getattr(found, "faults", {})
    if request != "auto" or not faults or any(found.get(p) for p in ACCELERATORS):
        return None
    failures = "; ".join(
        f"{_NAMES.get(p, p)} backend failed to start: {why}" for p, why in faults.items()
    )
    return f"{failures}; running on the CPU"


def is_accelerator(devices: Sequence[Device]) -> bool:
    return bool(devices) and devices[0].platform in ACCELERATORS


def describe(devices: Sequence[Device], simulated: bool = False) -> str:
    """`2 × NVIDIA H100 80GB HBM3`, `CPU (2 cores)` or `16 simulated CPU devices (2 cores)`."""
    if not is_accelerator(devices):
        cores = f"{os.cpu_count() or 1} cores"
        if simulated and len(devices) > 1:
            return f"{len(devices)} simulated CPU devices ({cores})"
        return f"CPU ({cores})"
    kinds = sorted({d.device_kind for d in devices})
    return f"{len(devices)} × {' / '.join(kinds)}"


def free_memory(devices: Sequence[Device]) -> int:
    """Bytes free on the least free of `devices`; the host's available RAM for CPU devices."""
    free = []
    for device in devices:
        if device.platform == "cpu":
            continue  # simulated CPU devices share the host's RAM
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            free.append(int(stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
    return min(free) if free else host_memory()


def plan_devices(devices: ChosenDevices, need: int) -> tuple[list[Device], str]:
    """Where `ctseg plan` compiles a layout of `need` devices, and the line that says so.

    On the chosen devices when there are enough of them; else on simulated CPU devices
    (the CLI makes as many as the config's mesh needs), so that a layout for 16 devices
    can be planned on a machine with one GPU.
    """
    chosen, found = list(devices.devices), devices.found
    if len(chosen) >= need:
        return chosen[:need], f"planning on {describe(chosen[:need], simulated=True)}"
    cpus = list(found.get("cpu", ()))
    here = f"{describe(chosen, simulated=True)} here"
    if len(cpus) < need:
        raise OptionError(
            f"the config's mesh needs {need} devices but only {len(chosen)} are here "
            f"({describe(chosen)}) and JAX offers no CPU devices to simulate them; "
            "use `device` cpu"
        )
    return cpus[:need], (
        f"planning on {need} simulated CPU devices: the config's mesh needs {need}, "
        f"{here} has {len(chosen)}"
    )
