"""Device policy: which devices a command runs on, and the line that says so.

ARCHITECTURE.md invariant 8: a config's mesh is a request, not a requirement.
Every command takes ``--device auto|cpu|gpu|tpu``; ``auto`` is the accelerators
this process sees, else the CPU. Simulated CPU devices exist for tests and for
CPU-only machines, and are never a silent fall-back when an accelerator exists.

The choices are pure functions of device lists (`choose`, `describe`,
`free_memory`), so that they are tested with fake devices; `visible` asks JAX. A
command chooses once, when it starts JAX (`ctseg.cli.options.start_jax` returns the
`ChosenDevices`), and hands the choice down. What runs on the chosen devices is decided
elsewhere: the layout of a training run in `ctseg.parallel.layouts`, the inference
backend in `ctseg.inference.network.backends`.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ctseg.errors import OptionError
from ctseg.memory import host_memory
from ctseg.parallel.xla_options import add_options

DEVICE_CHOICES = ("auto", "cpu", "gpu", "tpu")
ACCELERATORS = ("gpu", "tpu")
_log = logging.getLogger(__name__)
# Whether `visible` holds what JAX's plugins print while the backends start (the library's
# way); a command holds it itself, to show it with --verbose (`commands_hold_output`).
_hold_start_output = True
# One holder of the stderr descriptor at a time (API calls from several threads); nested
# holds in one thread are each other's.
_holding = threading.RLock()


class Device(Protocol):
    """What the policy reads of a `jax.Device` (tests pass fakes)."""

    platform: str
    device_kind: str

    def memory_stats(self) -> dict[str, int] | None: ...


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


def commands_hold_output() -> None:
    """Called by the commands before JAX starts: they hold what libraries print themselves
    (`ctseg.cli.library_output`), and show it with --verbose."""
    global _hold_start_output
    _hold_start_output = False


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


@contextlib.contextmanager
def held_start_output() -> Iterator[None]:
    """While JAX imports its plugins and starts its backends: what they print on the stderr
    file descriptor (the CUDA plugin's "Could not find cuda drivers" on a machine without a
    GPU, libtpu's TPU_WORKER_HOSTNAMES errors) and log without a handler of their own (JAX's
    "Jax plugin configuration error" traceback) is held, then logged at debug level here.

    The library's counterpart of the commands' `ctseg.cli.library_output.held`; a no-op
    where a command holds the output itself (`commands_hold_output`)."""
    if not _hold_start_output:
        yield
        return
    with _holding:
        yield from _held()


def _held() -> Iterator[None]:
    try:
        terminal = os.dup(2)
    except OSError:  # no stderr to hold
        yield
        return
    last_resort = logging.lastResort
    with tempfile.TemporaryFile() as held:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(held.fileno(), 2)
        log = open(os.dup(2), "w", encoding="utf-8", errors="replace")  # noqa: SIM115
        logging.lastResort = logging.StreamHandler(log)
        logging.lastResort.setLevel(logging.WARNING)
        try:
            yield
        finally:
            logging.lastResort = last_resort
            log.close()
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(terminal, 2)
            os.close(terminal)
            held.seek(0)
            text = held.read().decode("utf-8", "replace").strip()
    if text:
        _log.debug("what JAX and its plugins printed on starting:\n%s", text)


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


# Concrete JAX platforms behind `--device gpu|tpu`, and their names in messages.
_PLATFORMS = {"gpu": ("cuda", "rocm", "oneapi"), "tpu": ("tpu",)}
_NAMES = {"cuda": "CUDA", "rocm": "ROCm", "oneapi": "oneAPI", "tpu": "TPU"}
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
