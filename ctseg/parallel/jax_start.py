"""Starting JAX: which backends may start, and what started or failed to.

Before JAX starts, `restrict_backends` (the commands) and `start_quietly` (the Python
API) keep an accelerator backend from starting where the device asked for, or the
machine, has no use for it, and apply `ctseg.parallel.xla_options`. `visible` asks JAX
which devices it started and reads, from JAX's words, why an accelerator installed here
failed to start; choosing among them is `ctseg.parallel.devices`' policy. What JAX's
plugins print while they start is held by `ctseg.parallel.held_output`.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ctseg.parallel.devices import ACCELERATORS
from ctseg.parallel.held_output import held_start_output
from ctseg.parallel.xla_options import add_options


def restrict_backends(request: str) -> None:
    """Before JAX starts: with ``--device cpu`` only the CPU backend starts, and so it does
    with ``--device auto`` on a Linux machine without any accelerator's device files.

    An accelerator backend that starts reserves most of its memory (JAX's
    preallocation), which a CPU-only run must not take from other users. And where no
    accelerator is attached, a backend installed for compiling only (the `targets`
    extra: JAX's CUDA plugin, libtpu) would fail to start and say so on every command.
    The XLA options of `ctseg.parallel.xla_options` are set here too.
    """
    _set_xla_options()
    unattended = request == "auto" and not os.environ.get("JAX_PLATFORMS") and no_accelerator()
    if request == "cpu" or unattended:
        import jax

        jax.config.update("jax_platforms", "cpu")


def _platforms_chosen() -> bool:
    """Whether the user (JAX_PLATFORMS, or `jax.config` in a notebook) or an earlier call
    chose JAX's platforms, or JAX already started its backends: then they stay as they are."""
    import jax

    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
        return True
    return _backends_started()


def _set_xla_options() -> None:
    # Only before the backends start: JAX's cache keys read XLA_FLAGS at each compile, so
    # a later change would file programs under options they were not compiled with.
    if not _backends_started():
        add_options(os.environ)


def _backends_started() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # another JAX: assume started, change nothing
        return True


def start_quietly(request: str = "auto") -> Found:
    """For the Python API, as `restrict_backends` and the commands' held output are for the
    commands: where the user chose no platforms and JAX has not started, only the CPU starts
    for `request` cpu, or auto on a machine without accelerators; the backends start with
    what JAX's plugins print held (logged at debug level). Returns what `visible` found."""
    with held_start_output():  # importing JAX imports its plugins, which speak too
        _set_xla_options()
        cpu_only = request == "cpu" or (request == "auto" and no_accelerator())
        if cpu_only and not _platforms_chosen():
            import jax

            jax.config.update("jax_platforms", "cpu")
        return visible()


# Device files of attached accelerators (Linux): NVIDIA's driver, AMD's (ROCm), TPUs.
_ACCELERATOR_FILES = (
    "/proc/driver/nvidia/version",
    "/dev/nvidia[0-9]*",
    "/dev/kfd",
    "/dev/accel[0-9]*",
    "/dev/vfio/[0-9]*",
)


def no_accelerator() -> bool:
    """True on a Linux machine where no accelerator's device file exists (elsewhere the
    files say nothing: False)."""
    if not sys.platform.startswith("linux"):
        return False
    return not any(glob.glob(pattern) for pattern in _ACCELERATOR_FILES)


# JAX's words for a backend that failed to start: a plugin (CUDA, ROCm) raises the first
# form once, from whichever call starts the backends; a quietly failing backend (TPU)
# answers every later request for it with the second.
_START_FAILED = (
    re.compile(
        r"Unable to initialize backend '(?P<platform>[^']+)': (?P<why>.*?)\.?"
        r"(?: \((?:you may|set JAX_PLATFORMS).*\))?$",
        re.S,
    ),
    re.compile(
        r"Backend '(?P<platform>[^']+)' failed to initialize: (?P<why>.*?)\. Available backends",
        re.S,
    ),
)
# Reasons that mean "not installed here", which is no fault: ctseg runs on what there is.
_NOT_INSTALLED = ("is not in the list of known backends", "Failed to open libtpu.so")
# Why accelerator backends failed to start in this process: JAX says it once only.
_faults: dict[str, str] = {}


class Found(dict):
    """What `visible` found: platform (gpu, tpu, cpu) → devices, as `choose` reads it.

    Beside the devices: `faults`, the accelerator backends installed here that failed to
    start (concrete platform → JAX's reason), and `platforms`, the user's JAX_PLATFORMS,
    which limits what JAX may start.
    """

    def __init__(
        self,
        devices: Mapping[str, Sequence[Any]] | None = None,
        faults: Mapping[str, str] | None = None,
        platforms: str | None = None,
    ):
        super().__init__(devices or {})
        self.faults = dict(faults or {})
        self.platforms = platforms
        self.startup_error: str | None = None  # JAX's error where it started nothing at all


def visible(local: bool = True) -> Found:
    """The devices JAX can start, by platform; `local`: only this process's own.

    A backend that is not installed here, or that JAX_PLATFORMS leaves out, is simply
    absent; one that is installed but failed to start is noted in `Found.faults`.
    """
    import jax

    listing = jax.local_devices if local else jax.devices
    found = Found(platforms=os.environ.get("JAX_PLATFORMS") or None)
    starting = not _backends_started()
    with held_start_output() if starting else contextlib.nullcontext():
        for platform in (*ACCELERATORS, "cpu"):
            # A plugin's start failure surfaces once; the backends started before it are
            # served from the next call on, so a failure is asked again once.
            for _ in range(2):
                try:
                    found[platform] = list(listing(backend=platform))
                    break
                except RuntimeError as exc:
                    if not _note_failure(str(exc), found):
                        break
    found.faults.update(_faults)
    return found


def _note_failure(message: str, found: Found) -> bool:
    """Record a backend's start failure named in JAX's `message`; True if it was one."""
    for pattern in _START_FAILED:
        match = pattern.search(message)
        if match:
            break
    else:
        return False  # "Unknown backend": not installed here, or left out by JAX_PLATFORMS
    platform, why = match["platform"], " ".join(match["why"].split())
    found.startup_error = found.startup_error or f"{platform}: {why}"
    if platform != "cpu" and not any(words in why for words in _NOT_INSTALLED):
        _faults[platform] = why
    return pattern is _START_FAILED[0]
