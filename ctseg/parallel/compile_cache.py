"""The persistent XLA compilation cache, and the clock of what compiling cost.

A second command with the same shapes compiles nothing when the cache is on
(`--compile-cache DIR|off`, else $CTSEG_COMPILE_CACHE, else the user's cache folder).
`CompileClock` listens to JAX's compile events, so that commands report compile time
apart from run time.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

# The persistent XLA compilation cache: `--compile-cache DIR|off`, else this variable,
# else the user's cache folder.
COMPILE_CACHE_ENV = "CTSEG_COMPILE_CACHE"


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
    # Every entry whatever its size (-1: no size left to the file system's choice), and
    # XLA's own caches beside them (the GPU autotuner's results: cuDNN algorithms, fusion
    # configurations), so that a program of a new shape does not autotune again what an
    # earlier one did.
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update(
        "jax_persistent_cache_enable_xla_caches", "xla_gpu_per_fusion_autotune_cache_dir"
    )
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
    `seconds` is wall time, each moment counted once however many programs compiled
    in it: programs compile in threads, and their summed durations (138 s for one
    cold lits512 prediction on an H100 that waited 35 s) would exceed the call's own.
    """

    def __init__(self) -> None:
        self._spans: list[tuple[float, float]] = []  # (start, end) of each compile phase
        self.programs = 0
        self.cache_hits = 0
        self.by_name: Counter[str] = Counter()  # programs by function name, e.g. train_step
        # Programs compile in threads (plans' candidates, window and driver programs), and
        # `+=` is a read and a write: without the lock, two events could count as one.
        self._lock = threading.Lock()

    @property
    def seconds(self) -> float:
        """Wall seconds during which at least one program was compiling."""
        return self.seconds_since(float("-inf"))

    def seconds_since(self, began: float) -> float:
        """Those of `seconds` after `began` (a `time.perf_counter()` reading): a compile
        begun in the background before it counts from there."""
        with self._lock:
            spans = sorted(self._spans)
        total, reached = 0.0, began
        for start, end in spans:
            total += max(end - max(start, reached), 0.0)
            reached = max(reached, end)
        return total

    def _duration(self, event: str, duration_secs: float, **kwargs: Any) -> None:
        ended = time.perf_counter()  # JAX reports a phase's duration as it ends
        with self._lock:
            if event in _COMPILE_EVENTS:
                self._spans.append((ended - duration_secs, ended))
            if event == _BACKEND_COMPILE:
                self.programs += 1
                self.by_name[str(kwargs.get("fun_name", "?"))] += 1

    def _event(self, event: str, **_: Any) -> None:
        with self._lock:
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
