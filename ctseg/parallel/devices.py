"""Device policy: which devices a command runs on, and the line that says so.

ARCHITECTURE.md invariant 7: a config's mesh is a request, not a requirement.
Every command takes ``--device auto|cpu|gpu|tpu``; ``auto`` is the accelerators
this process sees, else the CPU. Simulated CPU devices exist for tests and for
CPU-only machines, and are never a silent fall-back when an accelerator exists.

The choices are pure functions of device lists (`choose`, `inference_backend`,
`describe`), so that they are tested with fake devices; `visible` asks JAX.
"""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ctseg.config import Config, split_problem, with_mesh
from ctseg.errors import CtsegError

DEVICE_CHOICES = ("auto", "cpu", "gpu", "tpu")
ACCELERATORS = ("gpu", "tpu")
# The persistent XLA compilation cache: `--compile-cache DIR|off`, else this variable,
# else the user's cache folder.
COMPILE_CACHE_ENV = "CTSEG_COMPILE_CACHE"


class Device(Protocol):
    """What the policy reads of a `jax.Device` (tests pass fakes)."""

    platform: str
    device_kind: str

    def memory_stats(self) -> dict[str, int] | None: ...


def restrict_backends(request: str) -> None:
    """Before JAX starts: with ``--device cpu`` only the CPU backend starts.

    An accelerator backend that starts reserves most of its memory (JAX's
    preallocation), which a CPU-only run must not take from other users.
    """
    if request not in DEVICE_CHOICES:
        raise CtsegError(f"--device must be one of {', '.join(DEVICE_CHOICES)}, got {request!r}")
    if request == "cpu":
        import jax

        jax.config.update("jax_platforms", "cpu")


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
        raise CtsegError(
            f"JAX_PLATFORMS={platforms} is set, and JAX started none of the platforms it "
            f"names{f' ({why})' if why else ''}; unset JAX_PLATFORMS and choose with "
            "--device auto|cpu|gpu|tpu (ctseg picks the devices itself), or use --device cpu"
        )
    faults = getattr(found, "faults", {})
    failed = [p for p in _PLATFORMS.get(request, ()) if p in faults]
    if failed:
        raise CtsegError(
            f"--device {request}: "
            + "; ".join(f"{_NAMES[p]} backend failed to start: {faults[p]}" for p in failed)
        )
    present = ", ".join(p for p in found if found[p]) or "none"
    message = f"--device {request}: JAX sees no {request.upper()} here (platforms: {present})"
    named = {request, *_PLATFORMS.get(request, ())}
    if platforms and not named & set(platforms.split(",")):
        message += f"; JAX_PLATFORMS={platforms} leaves it out: unset JAX_PLATFORMS"
    raise CtsegError(f"{message}; use --device auto to run on what there is")


def fallback_warning(request: str, found: Mapping[str, Sequence[Device]]) -> str | None:
    """Why `--device auto` runs on the CPU where an accelerator is installed but failed to
    start (invariant 7: never a silent fall-back); None where nothing failed."""
    faults = getattr(found, "faults", {})
    if request != "auto" or not faults or any(found.get(p) for p in ACCELERATORS):
        return None
    failures = "; ".join(
        f"{_NAMES.get(p, p)} backend failed to start: {why}" for p, why in faults.items()
    )
    return f"{failures}; running on the CPU"


def is_accelerator(devices: Sequence[Device]) -> bool:
    return bool(devices) and devices[0].platform in ACCELERATORS


def onnx_available() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def inference_backend(
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


def host_memory() -> int:
    """Bytes of the host's RAM available to new allocations."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def human_bytes(count: float) -> str:
    """Binary units, the largest that keeps the number ≥ 1: `512 B`, `3.4 MiB`, `48.0 GiB`."""
    unit = "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if count < 1024:
            break
        count, unit = count / 1024, bigger
    return f"{count:.0f} B" if unit == "B" else f"{count:.1f} {unit}"


# --------------------------------------------------------------------------- layouts


def auto_spatial(partitions: int) -> tuple[int, int, int]:
    """Split `partitions` over x, y, z: 1→[1,1,1], 2→[2,1,1], 4→[2,2,1], 8→[2,2,2], 16→[4,4,1].

    The largest per-axis split is made as small as possible, which keeps the
    local blocks thick and the halo a small share of them; among those, the
    fewest partitions go to z (x and y first, as Google's 4×4 TPU layout
    splits the in-plane axes), and x gets at least as many as y.
    """
    if partitions < 1:
        raise CtsegError(f"a partition count must be positive, got {partitions}")
    splits = [
        (x, y, partitions // (x * y))
        for x in range(1, partitions + 1)
        for y in range(1, x + 1)
        if partitions % (x * y) == 0
    ]
    return min(splits, key=lambda s: (max(s), s[2], -s[0]))


def fit_layout(config: Config, devices: int, data: int = 1) -> Config:
    """`config` on as many of `devices` as its grid allows, with `data` replicas.

    The `auto_spatial` split of the most partitions, at most `devices // data`, that
    passes the config's own mesh check (invariant 3: every level's blocks even,
    thicker than the halo).
    """
    for count in range(devices // data, 1, -1):
        try:
            return with_mesh(config, auto_spatial(count), data=data)
        except CtsegError:
            continue
    return with_mesh(config, (1, 1, 1), data=data)


def fit_split(config: Config, shape: Sequence[int], devices: int) -> tuple[int, int, int]:
    """The `auto_spatial` split of a grid of `shape` over the most of `devices` whose blocks
    every U-Net level can work on (`config.split_problem`); [1, 1, 1] when none can."""
    for count in range(devices, 1, -1):
        spatial = auto_spatial(count)
        if split_problem(config, spatial, shape) is None:
            return spatial
    return (1, 1, 1)


# --------------------------------------------------------------------------- compilation cache


def compile_cache_dir(option: str | None) -> Path | None:
    """The persistent compilation cache folder: `option`, else $CTSEG_COMPILE_CACHE, else the
    user's cache folder; None when it is ``off``.

    An empty value counts as unset: ``CTSEG_COMPILE_CACHE=`` would otherwise name the
    current folder and fill it with cache files.
    """
    value = (option or os.environ.get(COMPILE_CACHE_ENV) or "").strip()
    if not value:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base) / "ctseg" / "xla"
    return None if value.lower() == "off" else Path(value).expanduser()


def use_compile_cache(directory: Path | None) -> str | None:
    """Keep every compiled program in `directory` (JAX's persistent cache), so that the
    next process with the same shapes compiles nothing. Call before the first compile.

    A cache only saves time, so one that cannot be used is no reason to stop: the
    returned line says why it is not used (the command prints it), and JAX compiles
    without it. Otherwise None.
    """
    if directory is None:
        return None
    problem = _cache_problem(directory)
    if problem is not None:
        return f"compilation cache {directory} {problem}; compiling without it"
    import jax

    jax.config.update("jax_compilation_cache_dir", str(directory))
    # Even the small programs: a stage of a tiny model compiles in under a second, but a
    # second `ctseg predict` should compile nothing at all.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # An entry that cannot be read (cut short, from another build) or written (a full
    # disk) is a cache miss: JAX compiles and goes on, and says so in a library warning
    # that would come back on every run. The run's outcome is the same; keep it quiet.
    warnings.filterwarnings(
        "ignore", message="Error (reading|writing) persistent compilation cache entry"
    )
    return None


def _cache_problem(directory: Path) -> str | None:
    """Why `directory` cannot hold the compilation cache, or None where it can."""
    if directory.exists() and not directory.is_dir():
        return "is a file, not a folder"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot be created ({exc.strerror or exc})"
    # Permissions alone do not tell (root, read-only mounts): try what JAX will do.
    try:
        handle, probe = tempfile.mkstemp(dir=directory, prefix=".ctseg-probe-")
    except OSError:
        return "is not writable"
    os.close(handle)
    os.unlink(probe)
    return None


# Events JAX records for every program it compiles (`jax.monitoring`): the time of
# tracing, lowering and the backend compile (a cache hit included), and cache hits.
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_BACKEND_COMPILE = _COMPILE_EVENTS[-1]
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


class CompileClock:
    """What JAX spent on compiling in this process: seconds, programs, cache hits.

    Compilation happens lazily, inside the first call of each program, so a
    caller reads the clock before and after a call to tell compiling from running.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.programs = 0
        self.cache_hits = 0
        self.by_name: Counter[str] = Counter()  # programs by function name, e.g. train_step

    def _duration(self, event: str, duration_secs: float, **kwargs: Any) -> None:
        if event in _COMPILE_EVENTS:
            self.seconds += duration_secs
        if event == _BACKEND_COMPILE:
            self.programs += 1
            self.by_name[str(kwargs.get("fun_name", "?"))] += 1

    def _event(self, event: str, **_: Any) -> None:
        self.cache_hits += event == _CACHE_HIT


_clock: CompileClock | None = None


def compile_clock() -> CompileClock:
    """The process's compile clock (listening from the first call on)."""
    global _clock
    if _clock is None:
        import jax

        _clock = CompileClock()
        jax.monitoring.register_event_duration_secs_listener(_clock._duration)
        jax.monitoring.register_event_listener(_clock._event)
    return _clock


def plan_devices(
    request: str, found: Mapping[str, Sequence[Device]], need: int
) -> tuple[list[Device], str]:
    """Where `ctseg plan` compiles a layout of `need` devices, and the line that says so.

    On the devices `request` chooses when there are enough of them; else on simulated
    CPU devices (the CLI makes as many as the config's mesh needs), so that a layout
    for 16 devices can be planned on a machine with one GPU.
    """
    chosen = choose(request, found)
    if len(chosen) >= need:
        return chosen[:need], f"planning on {describe(chosen[:need], simulated=True)}"
    cpus = list(found.get("cpu", ()))
    here = f"{describe(chosen, simulated=True)} here"
    if len(cpus) < need:
        raise CtsegError(
            f"the config's mesh needs {need} devices but only {len(chosen)} are here "
            f"({describe(chosen)}) and JAX offers no CPU devices to simulate them; "
            "use --device cpu"
        )
    return cpus[:need], (
        f"planning on {need} simulated CPU devices: the config's mesh needs {need}, "
        f"{here} has {len(chosen)}"
    )


@dataclass(frozen=True)
class Layout:
    """Where a training run runs: the config with the mesh it gets, its devices, and why."""

    config: Config
    devices: list[Any]
    line: str  # the command's first line


def _mesh_words(config: Config) -> str:
    spatial, data = list(config.mesh.spatial), config.mesh.data
    if config.num_devices == 1:
        return "unpartitioned"
    split = f"{spatial} ({config.num_partitions} partitions)"
    return split if data == 1 else f"{split} × {data} data replicas"


def fit_training(config: Config, devices: Sequence[Device], exact: bool = False) -> Layout:
    """The layout to train `config` on `devices` (invariant 7: the mesh is a request).

    Enough devices: the config's own mesh, on the first of them. Fewer: the grid
    split over as many as it allows, with data replicas where the batch divides
    among them and the grid alone cannot use every device (`fit_layout`;
    partitioned training equals unpartitioned training, so the model is the
    same), unless `exact`, which makes it an error. Memory is checked when the
    step is compiled (`ctseg.train`).
    """
    need = config.num_devices
    simulated = not is_accelerator(devices)
    here = f"{describe(devices, simulated)} here"
    asked = f"config asks {list(config.mesh.spatial)}"
    asked += f" × data {config.mesh.data}" if config.mesh.data > 1 else ""
    asked += f" ({need} device{'s' if need > 1 else ''})"
    if len(devices) >= need:
        return Layout(config, list(devices[:need]), f"{here}: training {_mesh_words(config)}")
    if exact:
        raise CtsegError(
            f"{asked} but only {len(devices)} are here ({describe(devices, simulated)}) and "
            "--exact-mesh keeps the config's mesh; leave --exact-mesh out to fit the layout "
            "to this machine, or use --device cpu to simulate the devices"
        )
    # The most devices the grid and the batch allow: data replicas where the grid alone
    # cannot use them all (the batch must divide among them); spatial splits first.
    replicas = [d for d in range(1, len(devices) + 1) if config.train.batch_size % d == 0]
    fitted = max(
        (fit_layout(config, len(devices), data) for data in replicas),
        key=lambda layout: layout.num_devices,
    )
    return Layout(
        fitted,
        list(devices[: fitted.num_devices]),
        f"{asked}; {here}: training {_mesh_words(fitted)}",
    )
