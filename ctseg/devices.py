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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ctseg.config import Config, with_mesh
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


def prepare(request: str) -> None:
    """Before JAX starts: with ``--device cpu`` only the CPU backend starts.

    An accelerator backend that starts reserves most of its memory (JAX's
    preallocation), which a CPU-only run must not take from other users.
    """
    if request not in DEVICE_CHOICES:
        raise CtsegError(f"--device must be one of {', '.join(DEVICE_CHOICES)}, got {request!r}")
    if request == "cpu":
        import jax

        jax.config.update("jax_platforms", "cpu")


def visible(local: bool = True) -> dict[str, list[Any]]:
    """The devices JAX can start, by platform; `local`: only this process's own."""
    import jax

    found = {}
    for platform in (*ACCELERATORS, "cpu"):
        try:
            devices = jax.local_devices(backend=platform) if local else jax.devices(platform)
        except RuntimeError:  # no such backend here (or JAX_PLATFORMS leaves it out)
            continue
        found[platform] = devices
    return found


def choose(request: str, found: Mapping[str, Sequence[Device]]) -> list[Device]:
    """The devices for `request` (auto, cpu, gpu, tpu) among `found` (platform → devices)."""
    if request == "auto":
        for platform in ACCELERATORS:
            if found.get(platform):
                return list(found[platform])
        request = "cpu"
    devices = list(found.get(request, ()))
    if not devices:
        present = ", ".join(p for p in found if found[p]) or "none"
        raise CtsegError(
            f"--device {request}: JAX sees no {request.upper()} here (platforms: {present}); "
            "use --device auto to run on what there is"
        )
    return devices


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


def gib(count: float) -> str:
    return f"{count / 2**30:.1f} GiB"


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


# --------------------------------------------------------------------------- compilation cache


def compile_cache_dir(option: str | None) -> Path | None:
    """The persistent compilation cache folder: `option`, else $CTSEG_COMPILE_CACHE, else the
    user's cache folder; None when it is ``off``."""
    value = option or os.environ.get(COMPILE_CACHE_ENV)
    if value is None:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base) / "ctseg" / "xla"
    return None if value.lower() == "off" else Path(value).expanduser()


def use_compile_cache(directory: Path | None) -> None:
    """Keep every compiled program in `directory` (JAX's persistent cache), so that the
    next process with the same shapes compiles nothing. Call before the first compile."""
    if directory is None:
        return
    import jax

    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CtsegError(
            f"cannot use {directory} as the compilation cache ({exc.strerror}); "
            "give another --compile-cache DIR or --compile-cache off"
        ) from None
    jax.config.update("jax_compilation_cache_dir", str(directory))
    # Even the small programs: a stage of a tiny model compiles in under a second, but a
    # second `ctseg predict` should compile nothing at all.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


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

    def _duration(self, event: str, duration_secs: float, **_: Any) -> None:
        if event in _COMPILE_EVENTS:
            self.seconds += duration_secs
            self.programs += event == _BACKEND_COMPILE

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
