"""The persistent XLA compilation cache, and the clock of what compiling cost.

A second command with the same shapes compiles nothing when the cache is on
(`--compile-cache DIR|off`, else $CTSEG_COMPILE_CACHE, else the user's cache folder).
`CompileClock` listens to JAX's compile events, so that commands report compile time
apart from run time.

The cache serves wherever it lives and whatever is in it:
- its entries' keys do not depend on its folder: JAX hashes XLA's options into each key,
  among them the folder of XLA's autotuning cache (a path inside this one), so a cache
  reached through a link, copied, or mounted elsewhere would serve nothing and double.
  The key is taken without that path (`_keys_without_the_folder`), and the folder is
  used resolved;
- each entry carries its key and its bytes' digest (`_CheckedEntries`): an entry cut
  short, another program's (entries swapped, a cache shared with another build) or
  anything else is compiled again with one warning naming the cache, never loaded as
  this program (JAX would run it, and fail far from the cause: "safe_zip() …");
- an entry that is not a regular file (a FIFO waits for a writer for ever) is passed over
  (`ctseg.reading.open_regular`); the cache is never a folder inside one ctseg writes
  (a run, whose checkpoints/ orbax reads; a prediction's outputs, a store, an evaluation).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import tempfile
import threading
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from ctseg.errors import CtsegError
from ctseg.reading import read_bytes

_log = logging.getLogger(__name__)

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

    resolved = directory.resolve()
    _check_entries(directory, resolved)
    _keys_without_the_folder()
    _entries_checked()
    jax.config.update("jax_compilation_cache_dir", str(resolved))
    # Even the small programs: a stage of a tiny model compiles in under a second, but a
    # second `ctseg predict` should compile nothing at all.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # Every entry whatever its size (-1: no size left to the file system's choice), and
    # XLA's own caches beside them (the GPU autotuner's results: cuDNN algorithms, fusion
    # configurations), so that a program of a new shape does not autotune again what an
    # earlier one did. XLA reads that folder's files itself: where one is not a regular
    # file, it is left out (`_check_entries`).
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    autotune = resolved / AUTOTUNE_FOLDER
    xla_caches = "none" if _irregular(autotune) else AUTOTUNE_FOLDER
    jax.config.update("jax_persistent_cache_enable_xla_caches", xla_caches)
    # An entry that cannot be written (a full disk) is a cache miss: JAX compiles and goes
    # on, and says so in a library warning that would come back on every run. The run's
    # outcome is the same; keep it quiet. (One that cannot be read is `_CheckedEntries`'.)
    warnings.filterwarnings(
        "ignore", message="Error (reading|writing) persistent compilation cache entry"
    )
    return None


# XLA's per-fusion autotuning cache: JAX places it in this folder of the cache.
AUTOTUNE_FOLDER = "xla_gpu_per_fusion_autotune_cache_dir"

# Files that make a folder one that ctseg writes and owns (`ctseg.run.rundir.CONFIG` and
# `CHECKPOINTS`, `ctseg.inference.inputs.OUTPUTS_RECORD`, `ctseg.data.manifest.MANIFEST`
# beside `cases/`, `ctseg.run.evaluations.EVALUATED`): a cache there would be taken for
# its contents (a checkpoint, a case) or cleared with them.
_OWNED_BY_CTSEG = (
    ("config.toml", "checkpoints"),
    (".ctseg-outputs.json",),
    ("manifest.json", "cases"),
    ("evaluated.json",),
)


def _inside_ctseg_folder(resolved: Path) -> Path | None:
    """The nearest folder of `resolved` (itself or above) that ctseg writes, or None."""
    for folder in (resolved, *resolved.parents):
        if any(all((folder / name).exists() for name in names) for names in _OWNED_BY_CTSEG):
            return folder
    return None


def _cache_problem(directory: Path) -> str | None:
    """Why `directory` cannot hold the compilation cache, or None where it can."""
    owner = _inside_ctseg_folder(directory.resolve())
    if owner is not None:
        return (
            f"lies in {owner}, a folder ctseg writes (a run, a prediction's outputs, a store or "
            "an evaluation); give a folder of its own"
        )
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


def _irregular(folder: Path) -> list[Path]:
    """The entries of `folder` that are neither files nor folders (FIFOs, devices, sockets)."""
    try:
        entries = list(folder.iterdir())
    except OSError:
        return []
    return [p for p in entries if p.exists() and not (p.is_file() or p.is_dir())]


def _check_entries(directory: Path, resolved: Path) -> None:
    """One warning naming the cache where it holds entries that are not regular files:
    ctseg passes over them (`_CheckedEntries`), and leaves XLA's autotuning cache off where
    one lies in its folder (XLA would open it, and wait for ever on a FIFO)."""
    odd = _irregular(resolved) + _irregular(resolved / AUTOTUNE_FOLDER)
    if odd:
        names = ", ".join(p.name for p in odd[:2]) + (", …" if len(odd) > 2 else "")
        _log.warning(
            "compilation cache %s: %d of its entries are not regular files (%s): passed over",
            directory,
            len(odd),
            names,
        )


def _keys_without_the_folder() -> None:
    """JAX's cache keys taken without the folder of XLA's autotuning cache, a path inside
    the cache's own: with it, the keys change wherever the cache moves (a link, a copy, a
    container's mount). The folder does not change what XLA compiles: the results read
    from it are keyed by the fusion and the device, not by where they lie."""
    from jax._src import cache_key

    if getattr(cache_key.get, "_ctseg", False):
        return
    hashed = cache_key.get

    def get(module: Any, devices: Any, compile_options: Any, *args: Any, **kwargs: Any) -> str:
        options = copy.deepcopy(compile_options)
        options.executable_build_options.debug_options.xla_gpu_per_fusion_autotune_cache_dir = ""
        return hashed(module, devices, options, *args, **kwargs)

    get._ctseg = True  # type: ignore[attr-defined]
    cache_key.get = get


# Each entry ctseg writes: this line, then the SHA-256 of its key and JAX's bytes, then them.
_ENTRY_STAMP = b"ctseg compilation cache entry 1\n"


def _digest(key: str, value: bytes) -> bytes:
    return hashlib.sha256(key.encode() + b"\0" + value).digest()


def _entries_checked() -> None:
    """JAX's file cache made a `_CheckedEntries` when JAX first opens it."""
    from jax._src import compilation_cache

    made = compilation_cache.get_file_cache
    if getattr(made, "_ctseg", False):
        return

    def get_file_cache(path: str) -> Any:
        found = made(path)
        return None if found is None else (_CheckedEntries(found[0], Path(path)), found[1])

    get_file_cache._ctseg = True  # type: ignore[attr-defined]
    compilation_cache.get_file_cache = get_file_cache


class _CheckedEntries:
    """JAX's file cache, each entry stamped with its key and digest when written and checked
    when read: a corrupt or foreign entry is a miss (removed, so that the program compiled
    again takes its place), said once per process in a warning naming the cache."""

    def __init__(self, files: Any, directory: Path):
        self._files, self.directory = files, directory
        self._warned = False

    @property
    def _path(self) -> Any:  # what JAX's own messages name
        return self._files._path

    def get(self, key: str) -> bytes | None:
        from jax._src import lru_cache

        path = Path(self._files._path) / f"{key}{lru_cache._CACHE_SUFFIX}"
        try:
            entry = read_bytes(path, "compilation cache entry")
        except FileNotFoundError:
            return None
        except (OSError, CtsegError):  # a FIFO, a folder, unreadable: passed over
            return None
        head = len(_ENTRY_STAMP)
        stamp, digest, value = entry[:head], entry[head : head + 32], entry[head + 32 :]
        if stamp == _ENTRY_STAMP and digest == _digest(key, value):
            return value
        self._warn(key)
        path.unlink(missing_ok=True)
        return None

    def put(self, key: str, value: bytes) -> None:
        self._files.put(key, _ENTRY_STAMP + _digest(key, value) + value)

    def _warn(self, key: str) -> None:
        if not self._warned:
            self._warned = True
            _log.warning(
                "compilation cache %s: entry %s… is not this program's (cut short, corrupt, "
                "another program's or an earlier version's): compiling it again",
                self.directory,
                key[:24],
            )


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
    in it: programs compile in threads, and their summed durations would exceed the
    call's own several times (docs/experiments/design-figures.md#the-compile-clock).
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
