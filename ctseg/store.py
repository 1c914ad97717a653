"""The prepared store: every case resampled to the R³ grid, memory-mappable, with a manifest.

Layout (the contract between `ctseg preprocess` and the commands after it)::

    PREP_DIR/manifest.json                 written last, atomically
    PREP_DIR/cases/<case_id>/image.npy     int16 HU, [R, R, R], canonical RAS order
    PREP_DIR/cases/<case_id>/label.npy     uint8 0/1/2, [R, R, R]; absent for label-free cases
    PREP_DIR/cases/<case_id>/case.json     the case's manifest entry (split left empty);
                                           written after the arrays, it marks the case done

manifest.json::

    {"format": "ctseg-store", "version": 1, "resolution": R,
     "cases": [{"id", "split": "train" | "val" | "test", "image_source", "label_source",
                "original_shape", "original_affine", "canonical_shape",
                "canonical_affine", "spacing", "label_counts": [n0, n1, n2]}]}

Sources are absolute, normalised paths (of a scan file, or of a DICOM series folder);
case ids hold only letters, digits and ``-`` (`data_prep.layouts`), so that no
manifest names a file outside the store's own folder;
affines are 4×4 voxel -> RAS mm lists; `spacing` is the canonical voxel size in
mm; `label_counts` counts the voxels of each class in label.npy. A case prepared
from a scan without a label (a predict-only store) has split "test" and
`label_source` and `label_counts` null. The manifest lists
only the cases that were prepared successfully. The grid's own affine is
`preprocess.grid_affine(canonical_affine, canonical_shape, R)`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import json
import math
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ctseg import lock, preprocess
from ctseg.atomic import claim_folder, write_json, write_npy
from ctseg.config import Config
from ctseg.errors import CtsegError
from ctseg.volume import Scan, read_scan
from data_prep.layouts import Layout, RawCase, find_cases, is_case_id

FORMAT = "ctseg-store"
VERSION = 1
SPLITS = ("train", "val", "test")
MANIFEST = "manifest.json"
# Image and label headers of one case may differ by float32 rounding; more is a mismatch.
GEOMETRY_TOLERANCE_MM = 1e-3
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

Progress = Callable[[int, int, str], None]
Status = Literal["prepared", "resumed", "failed"]


@dataclass(frozen=True)
class CaseEntry:
    """One case of the manifest."""

    id: str
    split: str
    image_source: str
    label_source: str | None
    original_shape: tuple[int, ...]
    original_affine: tuple[tuple[float, ...], ...]
    canonical_shape: tuple[int, ...]
    canonical_affine: tuple[tuple[float, ...], ...]
    spacing: tuple[float, ...]
    label_counts: tuple[int, ...] | None

    @property
    def labelled(self) -> bool:
        return self.label_source is not None

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> CaseEntry:
        def nested(value: Any) -> Any:
            return tuple(nested(v) for v in value) if isinstance(value, list) else value

        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{name: nested(raw[name]) for name in names})

    def to_json(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))  # tuples -> lists


@dataclass(frozen=True)
class Store:
    """A prepared store opened for reading."""

    path: Path
    resolution: int
    cases: list[CaseEntry]

    @classmethod
    def open(cls, path: str | Path) -> Store:
        """Open and check a store written by `prepare`."""
        path = Path(path)
        manifest = _read_manifest(path)
        if manifest is None:
            raise CtsegError(
                f"no prepared store at {path} ({MANIFEST} missing); run `ctseg preprocess` first"
            )
        try:
            cases = [CaseEntry.from_json(c) for c in manifest["cases"]]
            resolution = int(manifest["resolution"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CtsegError(
                f"{path / MANIFEST} is not a valid ctseg store manifest: {exc}"
            ) from None
        if not cases:
            raise CtsegError(f"the store at {path} holds no cases")
        _check_entries(path / MANIFEST, cases)
        for case in cases:
            for kind in ("image", "label") if case.labelled else ("image",):
                _check_array(path, case.id, kind, resolution)
        return cls(path=path, resolution=resolution, cases=cases)

    def split(self, name: str) -> list[CaseEntry]:
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; expected one of {SPLITS}")
        return [case for case in self.cases if case.split == name]

    def case(self, case_id: str) -> CaseEntry:
        for case in self.cases:
            if case.id == case_id:
                return case
        raise CtsegError(f"no case {case_id!r} in the store at {self.path}")

    def image(self, case_id: str) -> np.ndarray:
        """Read-only int16 HU memory map [R, R, R]; slicing it reads only that slab."""
        self.case(case_id)
        return self._load(case_id, "image")

    def label(self, case_id: str) -> np.ndarray:
        """Read-only uint8 label memory map [R, R, R]."""
        if not self.case(case_id).labelled:
            raise CtsegError(
                f"case {case_id!r} of the store at {self.path} has no label: it was prepared "
                "from a scan without one, for prediction only"
            )
        return self._load(case_id, "label")

    def _load(self, case_id: str, kind: str) -> np.ndarray:
        return np.load(_array_path(self.path, case_id, kind), mmap_mode="r", allow_pickle=False)


def _check_entries(manifest: Path, cases: list[CaseEntry]) -> None:
    """CtsegError naming the key of the first entry that could lead outside the store.

    Ids become paths below the store (and output names of `ctseg evaluate`); sources
    are read by `ctseg evaluate`, which checks that each is still the scan prepared.
    """
    seen: set[str] = set()
    for index, case in enumerate(cases):
        where = f"{manifest}: cases[{index}]"
        if not is_case_id(case.id):
            raise CtsegError(
                f"{where}.id = {case.id!r} is not a case id (letters, digits and '-' only)"
            )
        if case.id.lower() in seen:
            raise CtsegError(f"{where}.id = {case.id!r} appears twice")
        seen.add(case.id.lower())
        if case.split not in SPLITS:
            raise CtsegError(f"{where}.split = {case.split!r} is not one of {list(SPLITS)}")
        sources = {"image_source": case.image_source, "label_source": case.label_source}
        for key, source in sources.items():
            if not (source is None and key == "label_source") and not _is_source(source):
                raise CtsegError(
                    f"{where}.{key} = {source!r} is not an absolute, normalised path of a scan"
                )
        _check_numbers(where, case)


# Numeric fields of an entry: (shape, whole numbers, lowest allowed value, in words).
_NUMBERS = {
    "original_shape": ((3,), True, 1, "3 voxel counts"),
    "canonical_shape": ((3,), True, 1, "3 voxel counts"),
    "original_affine": ((4, 4), False, -math.inf, "a 4×4 matrix of finite numbers"),
    "canonical_affine": ((4, 4), False, -math.inf, "a 4×4 matrix of finite numbers"),
    "spacing": ((3,), False, math.ulp(0.0), "3 positive numbers (mm)"),
    "label_counts": ((3,), True, 0, "3 voxel counts"),
}


def _check_numbers(where: str, case: CaseEntry) -> None:
    """CtsegError naming the first numeric field of an entry that is not what it must be.

    `ctseg evaluate` compares shapes and affines with the scan's own header: a field
    edited into something else would fail there with a traceback, or match nothing.
    """
    for key, (shape, whole, lowest, words) in _NUMBERS.items():
        value = getattr(case, key)
        if key == "label_counts" and value is None and not case.labelled:
            continue
        array = np.array(value, dtype=object)
        items = array.ravel().tolist()
        kind = int if whole else (int, float)
        if not (
            array.shape == shape
            and all(isinstance(v, kind) and not isinstance(v, bool) for v in items)
            and all(math.isfinite(v) and v >= lowest for v in items)
        ):
            shown = json.dumps(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise CtsegError(
                f"{where}.{key} = {shown} is not {words}; re-run `ctseg preprocess --force`"
            )


def _is_source(value: object) -> bool:
    return isinstance(value, str) and os.path.isabs(value) and os.path.normpath(value) == value


def _check_array(root: Path, case_id: str, kind: str, resolution: int) -> None:
    """CtsegError unless the case's array is a readable [R, R, R] array of its dtype."""
    path = _array_path(root, case_id, kind)
    if not path.is_file():
        raise CtsegError(
            f"the store at {root} lacks {kind}.npy of case {case_id}; re-run `ctseg preprocess`"
        )
    expected = (np.dtype(np.int16) if kind == "image" else np.dtype(np.uint8), (resolution,) * 3)
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
        found = (array.dtype, array.shape)
    except (OSError, ValueError, EOFError) as exc:  # truncated, empty, not .npy, object dtype
        raise CtsegError(
            f"{path} cannot be read as an array ({exc}); re-run `ctseg preprocess --force`"
        ) from None
    if found != expected:
        raise CtsegError(
            f"{path} holds {found[0]} {list(found[1])}, not {expected[0]} {list(expected[1])}; "
            "re-run `ctseg preprocess --force`"
        )


def _array_path(root: Path, case_id: str, kind: str) -> Path:
    return root / "cases" / case_id / f"{kind}.npy"


def _case_json_path(root: Path, case_id: str) -> Path:
    return root / "cases" / case_id / "case.json"


def _manifest_file(path: Path) -> Path | None:
    """PATH/manifest.json, None if there is none; CtsegError if something else stands there."""
    file = path / MANIFEST
    if not file.exists():
        return None
    if not file.is_file():
        raise CtsegError(f"{file} is not a file; move it away (it is where the manifest goes)")
    return file


def _read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest's content, None if there is none; CtsegError if it is not a store's."""
    file = _manifest_file(path)
    if file is None:
        return None
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CtsegError(f"cannot read {file}: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CtsegError(f"{file} is not a ctseg store manifest")
    if manifest.get("version") != VERSION:
        raise CtsegError(
            f"{file} has store version {manifest.get('version')}; this ctseg reads version "
            f"{VERSION}; re-run `ctseg preprocess --force`"
        )
    return manifest


# --- writing -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CaseOutcome:
    """What `prepare` did with one case of the raw folder."""

    case_id: str
    split: str
    status: Status  # "resumed": already prepared by an earlier run, left as it was
    reason: str = ""  # the one-line error of a failed case


@dataclass(frozen=True)
class PrepareResult:
    store: Store | None  # None when no case could be prepared (then no manifest is written)
    outcomes: list[CaseOutcome]  # one per case found, in the raw folder's order

    @property
    def failures(self) -> list[CaseOutcome]:
        return [o for o in self.outcomes if o.status == "failed"]


def assign_splits(case_ids: list[str], val_fraction: float, seed: int) -> dict[str, str]:
    """Deterministic train/val split: at least one val case once there are two or more."""
    count = len(case_ids)
    n_val = round(count * val_fraction)
    if val_fraction > 0 and count >= 2:
        n_val = min(max(n_val, 1), count - 1)
    order = np.random.default_rng(seed).permutation(count)
    val = {case_ids[i] for i in order[:n_val]}
    return {cid: "val" if cid in val else "train" for cid in case_ids}


def prepare(
    raw_dir: str | Path,
    out_dir: str | Path,
    config: Config,
    progress: Progress | None = None,
    force: bool = False,
    workers: int = 1,
    warn: Callable[[str], None] | None = None,
) -> PrepareResult:
    """Resample every case under `raw_dir` into a store at `out_dir`; resumable.

    Cases already prepared at this resolution from the same sources are skipped
    unless `force`. A case that fails (bad file, missing label, ...) is recorded
    with its one-line reason and left out of the manifest; the others go on.
    `workers` > 1 prepares cases in that many processes at once. Problems that
    stop everything (no such folder, no cases, a store of another resolution,
    another command writing the store) raise CtsegError; `warn` hears of a lock taken
    over from a command that died.
    """
    workers = usable_workers(workers)
    out_dir = Path(out_dir)
    layout = find_cases(raw_dir)
    # One writer per store: two preprocesses at once would write one case's arrays twice.
    with lock.hold(out_dir, warn):
        return _prepare(layout, out_dir, config, progress, force, workers)


def _prepare(
    layout: Layout,
    out_dir: Path,
    config: Config,
    progress: Progress | None,
    force: bool,
    workers: int,
) -> PrepareResult:
    resolution = config.data.resolution
    _check_existing_store(out_dir, resolution, force)
    # A manifest must never describe arrays that are being rewritten.
    (out_dir / MANIFEST).unlink(missing_ok=True)

    splits = _splits(layout, config)
    entries: dict[str, CaseEntry] = {}
    outcomes: dict[str, CaseOutcome] = {}

    def record(case: RawCase, result: CaseEntry | str, resumed: bool = False) -> None:
        split = splits[case.case_id]
        if isinstance(result, str):
            outcomes[case.case_id] = CaseOutcome(case.case_id, split, "failed", result)
        else:
            entries[case.case_id] = dataclasses.replace(result, split=split)
            outcomes[case.case_id] = CaseOutcome(
                case.case_id, split, "resumed" if resumed else "prepared"
            )
        if progress is not None:
            progress(len(outcomes), len(layout.cases), case.case_id)

    todo = []
    for case in layout.cases:
        finished = None if force else _finished_entry(out_dir, case, resolution)
        if finished is not None:
            record(case, finished, resumed=True)
        elif case.label is None and not layout.predict_only:
            record(case, f"training case without its label: no label file for {case.image}")
        else:
            todo.append(case)
    for case, result in _prepare_all(todo, out_dir, resolution, workers):
        record(case, result)

    ordered = [c.case_id for c in layout.cases]
    good = [entries[i] for i in ordered if i in entries]
    store = _write_manifest(out_dir, resolution, good) if good else None
    return PrepareResult(store=store, outcomes=[outcomes[i] for i in ordered])


def usable_workers(requested: int) -> int:
    """`requested` worker processes, but at most one per CPU this process may run on.

    More would only share the CPUs (and multiply the memory): 1000 workers on 2 cores
    were 20× slower than 2. CtsegError below 1.
    """
    if requested < 1:
        raise CtsegError(f"--workers must be at least 1, got {requested}")
    try:
        cpus = len(os.sched_getaffinity(0))  # what taskset or a container's cpuset leaves
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return min(requested, cpus)


def _splits(layout: Layout, config: Config) -> dict[str, str]:
    """Case id -> split: "test" in a predict-only store, else a train/val split.

    The split is drawn over all training cases found, failed ones included, so that
    a case keeps its split when a failed neighbour is fixed and the store brought up to date.
    """
    case_ids = [c.case_id for c in layout.cases]
    if layout.predict_only:
        return dict.fromkeys(case_ids, "test")
    return assign_splits(case_ids, config.data.val_fraction, config.data.split_seed)


def _write_manifest(out_dir: Path, resolution: int, entries: list[CaseEntry]) -> Store:
    write_json(
        out_dir / MANIFEST,
        {
            "format": FORMAT,
            "version": VERSION,
            "resolution": resolution,
            "cases": [e.to_json() for e in entries],
        },
    )
    return Store.open(out_dir)


def _check_existing_store(out_dir: Path, resolution: int, force: bool) -> None:
    """Refuse a folder that is not a store (unless `force`), or a store of another grid."""
    # A killed first run leaves cases/ without a manifest: the folder is still the store's.
    claim_folder(out_dir, (MANIFEST, "cases"), force)
    _check_writable(out_dir)
    _manifest_file(out_dir)
    manifest = None if force else _read_manifest(out_dir)
    if manifest is not None and manifest.get("resolution") != resolution:
        raise CtsegError(
            f"{out_dir} holds a store at resolution {manifest.get('resolution')}, "
            f"not {resolution}; use another folder or --force to rebuild it"
        )


def _check_writable(folder: Path) -> None:
    """CtsegError naming the folder if no file can be created in it (read-only, not ours).

    Found here, before any case, rather than as the same failure for every case and
    then a traceback at the manifest.
    """
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise CtsegError(f"cannot write in {folder}: {exc.strerror or exc}") from None


def _write_array(path: Path, array: np.ndarray) -> None:
    """`write_npy`, with a full disk said as such.

    numpy writes arrays with fwrite, whose short write on a full disk reaches Python
    as "32768 requested and 6080 written", without an errno.
    """
    try:
        write_npy(path, array)
    except CtsegError as exc:
        cause = exc.__cause__
        short_write = isinstance(cause, OSError) and cause.errno is None
        if not (short_write or getattr(cause, "errno", None) in (errno.ENOSPC, errno.EDQUOT)):
            raise
        free = shutil.disk_usage(path.parent).free
        raise CtsegError(
            f"cannot write {path}: no space left on the device of {path.parent} "
            f"({array.nbytes / 2**20:.0f} MiB to write, {free / 2**20:.0f} MiB free); free "
            "some space and run the same command: finished cases are kept"
        ) from cause


def _finished_entry(out_dir: Path, case: RawCase, resolution: int) -> CaseEntry | None:
    """The entry of a case already prepared from the same sources at this resolution, else None.

    Sources are compared by path only (a DICOM series is a folder: nothing is hashed or
    stat-ed), so a scan changed in place needs --force.
    """
    case_json = _case_json_path(out_dir, case.case_id)
    if not case_json.is_file():
        return None
    kinds = ("image",) if case.label is None else ("image", "label")
    try:
        entry = CaseEntry.from_json(json.loads(case_json.read_text()))
        shapes = [
            np.load(_array_path(out_dir, case.case_id, kind), mmap_mode="r").shape for kind in kinds
        ]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # damaged or from an older layout: prepare the case again
    same_sources = (entry.image_source, entry.label_source) == _sources(case)
    if same_sources and shapes == [(resolution,) * 3] * len(kinds):
        return entry
    return None


def _sources(case: RawCase) -> tuple[str, str | None]:
    label = None if case.label is None else str(case.label.resolve())
    return str(case.image.resolve()), label


def _prepare_all(
    cases: list[RawCase], out_dir: Path, resolution: int, workers: int
) -> Iterator[tuple[RawCase, CaseEntry | str]]:
    """Prepare `cases`, in this process or in a pool; yield each with its entry or error."""
    if workers == 1 or len(cases) <= 1:
        for case in cases:
            yield case, _prepare_or_reason(out_dir, case, resolution)
        return
    # 'spawn': forking a parent that may have started JAX's threads can deadlock the child.
    pool = ProcessPoolExecutor(
        max_workers=min(workers, len(cases)),
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_end_with_parent,
        initargs=(os.getpid(),),
    )
    try:
        futures = {
            pool.submit(_prepare_or_reason, out_dir, case, resolution): case for case in cases
        }
        for future in as_completed(futures):
            yield futures[future], _worker_result(future)
    finally:
        # On Ctrl-C, start no further case; those running finish (their writes are atomic).
        pool.shutdown(wait=True, cancel_futures=True)


def _end_with_parent(parent: int) -> None:
    """Pool initializer: this worker ends when `parent` does, even killed by SIGKILL.

    A worker busy with a case outlives a killed parent otherwise, and keeps the
    multiprocessing resource tracker (which waits for every holder of its pipe) alive.
    """
    try:  # Linux: the kernel sends the signal, whatever the worker is doing
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (AttributeError, OSError):  # elsewhere: a thread watches for the parent
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # it died before the signal was asked for
        os._exit(1)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _worker_result(future: Future) -> CaseEntry | str:
    try:
        return future.result()
    except BrokenProcessPool:
        return "the worker process died (out of memory?); re-run with fewer --workers"


def _prepare_or_reason(out_dir: Path, case: RawCase, resolution: int) -> CaseEntry | str:
    """The case's entry, or the one-line reason it could not be prepared (runs in workers)."""
    try:
        return _prepare_case(out_dir, case, resolution)
    except CtsegError as exc:
        return str(exc)
    except MemoryError:
        return "out of memory; re-run with fewer --workers or more memory"


def _prepare_case(out_dir: Path, case: RawCase, resolution: int) -> CaseEntry:
    image = read_scan(case.image)
    label_counts = None
    if case.label is not None:
        label_grid = _label_grid(image, case.label, resolution)
        _write_array(_array_path(out_dir, case.case_id, "label"), label_grid)
        # Not np.bincount: it would first copy a 512³ grid into 1 GiB of int64.
        label_counts = tuple(
            int(np.count_nonzero(label_grid == v)) for v in preprocess.LABEL_VALUES
        )
    _write_array(
        _array_path(out_dir, case.case_id, "image"),
        preprocess.image_to_grid(image.array, resolution),
    )
    image_source, label_source = _sources(case)
    entry = CaseEntry(
        id=case.case_id,
        split="",  # assigned over all cases in `prepare`
        image_source=image_source,
        label_source=label_source,
        original_shape=image.original_shape,
        original_affine=_rows(image.original_affine),
        canonical_shape=tuple(int(n) for n in image.array.shape),
        canonical_affine=_rows(image.affine),
        spacing=image.spacing,
        label_counts=label_counts,
    )
    write_json(_case_json_path(out_dir, case.case_id), entry.to_json())
    return entry


def _label_grid(image: Scan, label_path: Path, resolution: int) -> np.ndarray:
    """The case's label map on the grid, after checking it against the image."""
    label = read_scan(label_path)
    _check_same_geometry(image, label)
    labels = preprocess.check_labels(label.array, label_path.name)
    return preprocess.to_grid(labels, resolution, order=0)


def _rows(affine: np.ndarray) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(float(v) for v in row) for row in affine)


def _check_same_geometry(image: Scan, label: Scan) -> None:
    what = f"{image.source.name} and {label.source.name} differ in geometry"
    if image.original_shape != label.original_shape:
        raise CtsegError(f"{what}: shape {image.original_shape} vs {label.original_shape}")
    difference = float(np.abs(image.original_affine - label.original_affine).max())
    if difference > GEOMETRY_TOLERANCE_MM:
        raise CtsegError(f"{what}: their affines differ by up to {difference:.4g} mm")
