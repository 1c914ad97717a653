"""Building a prepared store (`ctseg preprocess`): every case of a raw data set resampled
to its grid, in worker processes, resumable. The store's layout is `ctseg.data.store`'s.

Every write is atomic and a case counts as done only once its ``case.json`` is
written (after its arrays), so a killed run is simply run again: finished cases are
skipped. The manifest is written last and lists only the cases that were prepared.

Which cases validate (the train/val split, cross-validation folds) is
`ctseg.data_prep.splits`'s to decide.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import math
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ctseg import compat, lock
from ctseg.atomic import claim_folder, write_json, write_npy
from ctseg.config import Config, grid_problem
from ctseg.data import grids, store
from ctseg.data.grids import GridSpec
from ctseg.data.manifest import MANIFEST, grid_keys, manifest_file, read_manifest, write_manifest
from ctseg.data.store import CaseEntry, Store
from ctseg.data_prep import splits
from ctseg.data_prep.raw import RawCase, RawLayout
from ctseg.data_prep.workers import each_in_workers, usable_workers
from ctseg.errors import CtsegError, OptionError
from ctseg.io.scans import Scan, geometry_difference, read_scan
from ctseg.labels import LABEL_VALUES, check_labels
from ctseg.memory import host_memory, human_bytes
from ctseg.progress import Progress

Status = Literal["prepared", "resumed", "failed"]
_WORKER_DIED = "the worker process died (out of memory?); re-run with fewer worker processes"
# Bytes a case's grid takes while it is made: the int16 image, the uint8 labels and one
# boolean temporary of the grid's size (the source scan comes on top).
GRID_BYTES_PER_VOXEL = 4


@dataclass(frozen=True)
class CaseOutcome:
    """What `write_store` did with one case of the raw folder."""

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


def write_store(
    layout: RawLayout,
    out_dir: str | Path,
    config: Config,
    progress: Progress | None = None,
    force: bool = False,
    workers: int = 1,
    warn: Callable[[str], None] | None = None,
) -> PrepareResult:
    """Resample every case of `layout` into a store at `out_dir`; resumable.

    Cases already prepared on this grid from the same sources are skipped
    unless `force`. A case that fails (bad file, missing label, ...) is recorded
    with its one-line reason and left out of the manifest; the others go on.
    `workers` > 1 prepares cases in that many processes at once. Problems that
    stop everything (a store of another grid, another command writing the
    store, folds other than the store's without `force`) raise CtsegError; `warn`
    hears of a lock taken over from a command that died, and of folds drawn again
    or left out (`splits.with_folds`).
    """
    workers = usable_workers(workers)
    out_dir = Path(out_dir)
    grid = GridSpec.of(config.data)
    if grid.kind == "cube":  # every case's grid is known: refused before anything is written
        check_grid_size(grid, (grid.resolution,) * 3, "every case's grid")
    # One writer per store: two preprocesses at once would write one case's arrays twice.
    with lock.hold(out_dir, warn):
        return _write(layout, out_dir, config, progress, force, workers, warn)


def _write(
    layout: RawLayout,
    out_dir: Path,
    config: Config,
    progress: Progress | None,
    force: bool,
    workers: int,
    warn: Callable[[str], None] | None,
) -> PrepareResult:
    grid = GridSpec.of(config.data)
    _check_existing_store(out_dir, grid, force)
    earlier = splits.earlier_folds(out_dir)
    folds, fold_seed = splits.fold_plan(layout, out_dir, config, earlier, force)
    # A manifest must never describe arrays that are being rewritten.
    (out_dir / MANIFEST).unlink(missing_ok=True)

    split_of = splits.of_layout(layout, config)
    entries: dict[str, CaseEntry] = {}
    outcomes: dict[str, CaseOutcome] = {}

    def record(case: RawCase, result: CaseEntry | str, resumed: bool = False) -> None:
        split = split_of[case.case_id]
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
        finished = None if force else _finished_entry(out_dir, case, grid)
        if finished is not None:
            record(case, finished, resumed=True)
        elif case.label is None and not layout.predict_only:
            record(case, f"training case without its label: no label file for {case.image}")
        else:
            todo.append(case)
    prepare = functools.partial(_prepare_or_reason, out_dir, grid=grid)
    for case, result in each_in_workers(prepare, todo, workers, died=_WORKER_DIED):
        record(case, result)

    ordered = [c.case_id for c in layout.cases]
    good = [entries[i] for i in ordered if i in entries]
    if not good:
        return PrepareResult(store=None, outcomes=[outcomes[i] for i in ordered])
    good, folds = splits.with_folds(out_dir, good, folds, fold_seed, earlier, warn)
    write_manifest(out_dir, grid, [e.to_json() for e in good], folds, fold_seed if folds else None)
    return PrepareResult(store=Store.open(out_dir), outcomes=[outcomes[i] for i in ordered])


def _check_existing_store(out_dir: Path, grid: GridSpec, force: bool) -> None:
    """Refuse a folder that is not a store (unless `force`), or a store of another grid."""
    # A killed first run leaves cases/ without a manifest: the folder is still the store's.
    claim_folder(out_dir, (MANIFEST, "cases"), force)
    _check_writable(out_dir)
    manifest_file(out_dir)
    manifest = None if force else read_manifest(out_dir)
    if manifest is None:
        return
    manifest = compat.store_manifest(manifest)
    written = {key: manifest[key] for key in ("resolution", "grid", "spacing") if key in manifest}
    if written != grid_keys(grid):
        raise OptionError(
            f"{out_dir} holds a store of {_described(written)}, not {grid.describe()}; use "
            "another folder or `force` to rebuild it"
        )


def _described(keys: dict[str, Any]) -> str:
    spacing = tuple(keys.get("spacing") or (0.0, 0.0, 0.0))
    return GridSpec(keys["grid"], keys["resolution"], spacing).describe()


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


def _finished_entry(out_dir: Path, case: RawCase, grid: GridSpec) -> CaseEntry | None:
    """The entry of a case already prepared from the same sources on this grid, else None.

    Sources are compared by path only (a DICOM series is a folder: nothing is hashed or
    stat-ed), so a scan changed in place needs `force`.
    """
    case_json = store.case_json_path(out_dir, case.case_id)
    if not case_json.is_file():
        return None
    kinds = ("image",) if case.label is None else ("image", "label")
    try:
        raw = json.loads(case_json.read_text())
        entry = CaseEntry.from_json(compat.case_entry(raw, grid.resolution))
        shapes = [
            np.load(store.array_path(out_dir, case.case_id, kind), mmap_mode="r").shape
            for kind in kinds
        ]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # damaged or from an older layout: prepare the case again
    same_sources = (entry.image_source, entry.label_source) == _sources(case)
    expected = grid.grid_of(entry.canonical_shape, entry.spacing)
    same_grid = tuple(entry.grid_shape) == expected
    if same_sources and same_grid and shapes == [expected] * len(kinds):
        return entry
    return None


def _sources(case: RawCase) -> tuple[str, str | None]:
    label = None if case.label is None else str(case.label.resolve())
    return str(case.image.resolve()), label


def _prepare_or_reason(out_dir: Path, case: RawCase, grid: GridSpec) -> CaseEntry | str:
    """The case's entry, or the one-line reason it could not be prepared (runs in workers)."""
    try:
        return _prepare_case(out_dir, case, grid)
    except CtsegError as exc:
        return str(exc)
    except MemoryError:
        return "out of memory; re-run with fewer worker processes or more memory"


def check_grid_size(grid: GridSpec, shape: Sequence[int], what: str) -> None:
    """CtsegError naming the config key when `what`'s grid of `shape` voxels is more than JAX
    can index or more than this machine's memory holds, before it is allocated."""
    key = (
        f"data.resolution = {grid.resolution}"
        if grid.kind == "cube"
        else f"data.spacing = {list(grid.spacing)} mm"
    )
    remedy = "a smaller data.resolution" if grid.kind == "cube" else "a coarser data.spacing"
    problem = grid_problem(shape)
    if problem is not None:
        raise CtsegError(f"{what} at {key} would be {problem}; use {remedy}")
    needed, available = math.prod(shape) * GRID_BYTES_PER_VOXEL, host_memory()
    if needed > available:
        sides = "×".join(str(int(n)) for n in shape)
        raise CtsegError(
            f"{what} at {key} would be {sides} voxels, {human_bytes(needed)} to prepare, more "
            f"than the {human_bytes(available)} of memory available here; use {remedy}"
        )


def _prepare_case(out_dir: Path, case: RawCase, grid: GridSpec) -> CaseEntry:
    image = read_scan(case.image)
    grid_shape = grid.grid_of(image.array.shape, image.spacing)
    check_grid_size(grid, grid_shape, f"the grid of {case.image.name}")
    label_counts = None
    labels = None if case.label is None else _labels(image, case.label)
    # The whole grid is stored; the case's box is where validation looks: on the cube the
    # grid itself, on the spacing grid an R³ box around the liver (training draws others).
    offset = grids.training_offset(
        grid_shape, grid.resolution, None if labels is None else _liver_on_grid(labels, grid_shape)
    )
    if grid.kind == "cube":
        offset = (0, 0, 0)
    if labels is not None:
        label_grid = grids.to_grid(labels, grid_shape, order=0)
        _write_array(store.array_path(out_dir, case.case_id, "label"), label_grid)
        # Not np.bincount: it would first copy a 512³ grid into 1 GiB of int64.
        label_counts = tuple(int(np.count_nonzero(label_grid == v)) for v in LABEL_VALUES)
        del label_grid
    _write_array(
        store.array_path(out_dir, case.case_id, "image"),
        grids.image_to_grid(image.array, grid_shape),
    )
    image_source, label_source = _sources(case)
    entry = CaseEntry(
        id=case.case_id,
        split="",  # assigned over all cases by `_write`; the fold too (`splits.with_folds`)
        image_source=image_source,
        label_source=label_source,
        original_shape=image.original_shape,
        original_affine=_rows(image.original_affine),
        canonical_shape=tuple(int(n) for n in image.array.shape),
        canonical_affine=_rows(image.affine),
        spacing=image.spacing,
        label_counts=label_counts,
        grid_shape=tuple(int(n) for n in grid_shape),
        box_offset=tuple(int(n) for n in offset),
    )
    write_json(store.case_json_path(out_dir, case.case_id), entry.to_json())
    return entry


def _labels(image: Scan, label_path: Path) -> np.ndarray:
    """The case's label map (canonical voxels), after checking it against the image."""
    label = read_scan(label_path)
    _check_same_geometry(image, label)
    return check_labels(label.array, label_path.name)


def _liver_on_grid(
    labels: np.ndarray, grid_shape: Sequence[int]
) -> tuple[list[int], list[int]] | None:
    """The liver's bounding box on the grid (first, last + 1 grid voxels), None without one."""
    low, high = [], []
    for axis, (n, g) in enumerate(zip(labels.shape, grid_shape, strict=True)):
        others = tuple(a for a in range(3) if a != axis)
        present = np.flatnonzero(np.any(labels > 0, axis=others))
        if not len(present):
            return None
        # Source voxel i's centre is grid coordinate (i + 0.5)·g/n − 0.5.
        low.append(int(np.floor((present[0] + 0.5) * g / n - 0.5)))
        high.append(int(np.ceil((present[-1] + 0.5) * g / n - 0.5)) + 1)
    return low, high


def _rows(affine: np.ndarray) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(float(v) for v in row) for row in affine)


def _check_same_geometry(image: Scan, label: Scan) -> None:
    difference = geometry_difference(
        image.original_shape, image.original_affine, label.original_shape, label.original_affine
    )
    if difference:
        raise CtsegError(
            f"{image.source.name} and {label.source.name} differ in geometry: {difference}"
        )
