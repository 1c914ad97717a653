"""The prepared store: every case on its grid, memory-mappable, with a manifest.

Layout (the contract between `ctseg preprocess` and the commands after it)::

    PREP_DIR/manifest.json                 written last, atomically
    PREP_DIR/cases/<case_id>/image.npy     int16 HU on the case's grid, canonical RAS order
    PREP_DIR/cases/<case_id>/label.npy     uint8 0/1/2 on the grid; absent for label-free cases
    PREP_DIR/cases/<case_id>/case.json     the case's manifest entry (split and fold left
                                           empty); written after the arrays, it marks the
                                           case done

manifest.json::

    {"format": "ctseg-store", "version": 1, "resolution": R,
     "grid": "cube" | "spacing", "spacing": [x, y, z] mm (spacing grid) | absent,
     "folds": k, "fold_seed": s | null,
     "cases": [{"id", "split": "train" | "val" | "test", "fold": 0 … k-1 | null,
                "image_source", "label_source",
                "original_shape", "original_affine", "canonical_shape",
                "canonical_affine", "spacing", "label_counts": [n0, n1, n2],
                "grid_shape", "box_offset"}]}

Sources are absolute, normalised paths (of a scan file, or of a DICOM series folder);
case ids hold only letters, digits and ``-`` (`is_case_id`), so that no
manifest names a file outside the store's own folder;
affines are 4×4 voxel -> RAS mm lists; `spacing` is the canonical voxel size in
mm; `label_counts` counts the voxels of each class in label.npy. A case prepared
from a scan without a label (a predict-only store) has split "test" and
`label_source` and `label_counts` null. The manifest lists
only the cases that were prepared successfully. `grid_shape` is the scan's whole
grid, the arrays' shape (R³ on the cube; the scan at the store's spacing on the
spacing grid), and `box_offset` where the case's own R³ box lies on it (the grid
itself on the cube, around the liver on the spacing grid; `ctseg.preprocess`):
validation looks there, and training draws boxes around it and elsewhere
(`Store.box`, `pipeline.draw_box_offset`). `CaseEntry.box_affine()` is that box's
affine. A manifest without "grid" is a cube store, and cases without
`grid_shape`/`box_offset` are their whole R³ grid.

Cross-validation folds (`folds` = k ≥ 2; 0 = none) split the labelled cases (splits
train and val, never test) into k folds whose sizes differ by at most one, drawn
from the seed `fold_seed` (`splits.assign_folds`); each labelled case names
its `fold`, every other case null. They are independent of the train/val split:
`Store.for_fold(i)` is the store seen by a run of fold i (fold i validates, the
other folds train). A manifest without these keys (written before folds existed)
reads as a store without folds, so the format's version is still 1; a reader that
predates them ignores them.

`ctseg.store_writer` builds a store from the `RawCase`s that a raw data set's
layout names (`data_prep.layouts` finds them); this module reads it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ctseg.data import grids
from ctseg.errors import CtsegError

FORMAT = "ctseg-store"
VERSION = 1
SPLITS = ("train", "val", "test")
GRIDS = ("cube", "spacing")
MANIFEST = "manifest.json"
_CASE_ID = re.compile(r"[A-Za-z0-9-]+")


def is_case_id(value: object) -> bool:
    """Whether `value` is a case id (letters, digits and '-': safe as a folder name)."""
    return isinstance(value, str) and _CASE_ID.fullmatch(value) is not None


@dataclass(frozen=True)
class RawCase:
    """A case of a raw data set, as a store is built from it."""

    case_id: str
    image: Path
    label: Path | None  # None: a predict-only case, or a training image whose label is missing


@dataclass(frozen=True)
class Layout:
    """The cases a raw data-set folder holds."""

    cases: list[RawCase]
    predict_only: bool  # the folder holds no labels at all: every case is label-free


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
    # The scan's grid (`preprocess`: R³ on the cube, the scan at data.spacing on the
    # spacing grid) and where the stored R³ box lies on it (box voxel b = grid voxel
    # b + box_offset). Absent from stores written before the spacing grid: R³ and 0.
    grid_shape: tuple[int, ...] | None = None
    box_offset: tuple[int, ...] | None = None
    fold: int | None = None  # the cross-validation fold of a labelled case, if the store has folds

    @property
    def labelled(self) -> bool:
        return self.label_source is not None

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> CaseEntry:
        def nested(value: Any) -> Any:
            return tuple(nested(v) for v in value) if isinstance(value, list) else value

        fields = dataclasses.fields(cls)
        # Keys with a default (`fold`, `grid_shape`, `box_offset`) are absent from
        # manifests written before them.
        return cls(
            **{
                f.name: nested(raw[f.name])
                for f in fields
                if f.name in raw or f.default is dataclasses.MISSING
            }
        )

    def box_affine(self) -> np.ndarray:
        """The voxel -> RAS affine of the case's own box (at `box_offset`)."""
        return grids.grid_affine(
            np.asarray(self.canonical_affine),
            self.canonical_shape,
            self.grid_shape,
            self.box_offset,
        )

    def to_json(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))  # tuples -> lists


@dataclass(frozen=True)
class Store:
    """A prepared store opened for reading."""

    path: Path
    resolution: int
    cases: list[CaseEntry]
    grid: str = "cube"  # data.grid of the preprocess that wrote it
    spacing: tuple[float, ...] | None = None  # data.spacing on the spacing grid
    folds: int = 0  # cross-validation folds of the labelled cases; 0: none
    fold_seed: int | None = None  # the seed they were drawn from

    @classmethod
    def open(cls, path: str | Path) -> Store:
        """Open and check a store written by `ctseg.store_writer.write_store`."""
        path = Path(path)
        manifest = read_manifest(path)
        if manifest is None:
            raise CtsegError(
                f"no prepared store at {path} ({MANIFEST} missing); run `ctseg preprocess` first"
            )
        try:
            cases = [CaseEntry.from_json(c) for c in manifest["cases"]]
            resolution = int(manifest["resolution"])
            grid = manifest.get("grid", "cube")
            spacing = manifest.get("spacing")
            spacing = None if spacing is None else tuple(float(v) for v in spacing)
        except (KeyError, TypeError, ValueError) as exc:
            raise CtsegError(
                f"{path / MANIFEST} is not a valid ctseg store manifest: {exc}"
            ) from None
        if not cases:
            raise CtsegError(f"the store at {path} holds no cases")
        if grid not in GRIDS or (grid == "spacing") != (spacing is not None):
            raise CtsegError(f"{path / MANIFEST} names no valid grid ({grid!r}, spacing {spacing})")
        cases = [
            dataclasses.replace(
                case,
                grid_shape=case.grid_shape or (resolution,) * 3,
                box_offset=case.box_offset or (0, 0, 0),
            )
            for case in cases
        ]
        _check_entries(path / MANIFEST, cases)
        folds, fold_seed = manifest.get("folds", 0), manifest.get("fold_seed")
        _check_folds(path, folds, fold_seed, cases)
        for case in cases:
            for kind in ("image", "label") if case.labelled else ("image",):
                _check_array(path, case.id, kind, case.grid_shape)
        return cls(
            path=path,
            resolution=resolution,
            cases=cases,
            grid=grid,
            spacing=spacing,
            folds=folds,
            fold_seed=fold_seed,
        )

    @property
    def grid_spec(self) -> grids.GridSpec:
        """How this store's scans went onto its grid."""
        spacing = tuple(self.spacing) if self.spacing else (0.0, 0.0, 0.0)
        return grids.GridSpec(self.grid, self.resolution, spacing)

    def split(self, name: str) -> list[CaseEntry]:
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; expected one of {SPLITS}")
        return [case for case in self.cases if case.split == name]

    def fold_cases(self, fold: int) -> list[CaseEntry]:
        """The labelled cases of cross-validation fold `fold`; CtsegError if there is none."""
        self._check_fold(fold)
        return [case for case in self.cases if case.fold == fold]

    def for_fold(self, fold: int) -> Store:
        """This store as a run of fold `fold` sees it: the fold's cases are its "val"
        split, every other labelled case its "train" split, "test" cases stay as they are.

        Nothing is written: the training loop and the input pipeline read the view's
        splits as they read a store's own. CtsegError for a store without folds, or a
        fold it does not have.
        """
        self._check_fold(fold)
        cases = [
            dataclasses.replace(case, split="val" if case.fold == fold else "train")
            if case.labelled
            else case
            for case in self.cases
        ]
        return dataclasses.replace(self, cases=cases)

    def _check_fold(self, fold: int) -> None:
        if not self.folds:
            raise CtsegError(
                f"the store at {self.path} has no cross-validation folds; assign them with "
                f"`ctseg folds {self.path} --k 5` (or preprocess with data.folds = 5)"
            )
        if isinstance(fold, bool) or not isinstance(fold, int) or not 0 <= fold < self.folds:
            raise CtsegError(
                f"fold {fold} is not a fold of the store at {self.path}: it has "
                f"{self.folds} folds, 0–{self.folds - 1}"
            )

    def case(self, case_id: str) -> CaseEntry:
        for case in self.cases:
            if case.id == case_id:
                return case
        raise CtsegError(f"no case {case_id!r} in the store at {self.path}")

    def image(self, case_id: str) -> np.ndarray:
        """Read-only int16 HU memory map of the case's grid; slicing it reads only that slab."""
        self.case(case_id)
        return self._load(case_id, "image")

    def label(self, case_id: str) -> np.ndarray:
        """Read-only uint8 label memory map of the case's grid."""
        if not self.case(case_id).labelled:
            raise CtsegError(
                f"case {case_id!r} of the store at {self.path} has no label: it was prepared "
                "from a scan without one, for prediction only"
            )
        return self._load(case_id, "label")

    def box(self, case_id: str, kind: str, offset: Sequence[int] | None = None) -> Box:
        """The R³ box of the case's `kind` ("image" or "label") whose voxel b is grid voxel
        b + `offset` (default: the case's own `box_offset`, around the liver)."""
        array = self.image(case_id) if kind == "image" else self.label(case_id)
        offset = self.case(case_id).box_offset if offset is None else offset
        fill = grids.AIR_HU if kind == "image" else 0
        return Box(array, tuple(int(o) for o in offset), (self.resolution,) * 3, fill)

    def _load(self, case_id: str, kind: str) -> np.ndarray:
        return np.load(array_path(self.path, case_id, kind), mmap_mode="r", allow_pickle=False)


@dataclass(frozen=True)
class Box:
    """A box of a grid array, read lazily: `box[slices]` reads only the grid's voxels that
    the slices cover, and gives `fill` (air, background) where they lie beyond the grid."""

    grid: np.ndarray  # a memory map
    offset: tuple[int, ...]  # the grid voxel at box voxel 0 (negative: padding before)
    shape: tuple[int, ...]
    fill: int

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        ranges = [s.indices(n)[:2] for s, n in zip(index, self.shape, strict=True)]
        out = np.full([b - a for a, b in ranges], self.fill, self.grid.dtype)
        source, target = [], []
        for (start, stop), o, g in zip(ranges, self.offset, self.grid.shape, strict=True):
            lo, hi = max(start + o, 0), min(stop + o, g)
            if hi <= lo:
                return out  # the slab lies wholly beyond the grid
            source.append(slice(lo, hi))
            target.append(slice(lo - o - start, hi - o - start))
        out[tuple(target)] = self.grid[tuple(source)]
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[tuple(slice(None) for _ in self.shape)]
        return whole if dtype is None else whole.astype(dtype)


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


def _check_folds(path: Path, folds: Any, seed: Any, cases: list[CaseEntry]) -> None:
    """CtsegError naming the first fold key of the manifest that is not what it must be.

    With k folds every labelled case is in one of 0 … k-1 and no fold is empty; a
    label-free case, or any case of a store without folds, is in none.
    """
    where = path / MANIFEST
    redo = f"re-assign them with `ctseg folds {path} --k K --force`"

    def whole(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not whole(folds) or folds < 0 or folds == 1:
        raise CtsegError(f"{where}: folds = {folds!r} is not 0 (none) or a count ≥ 2; {redo}")
    if not (seed is None or (whole(seed) and seed >= 0)):
        raise CtsegError(f"{where}: fold_seed = {seed!r} is not a seed; {redo}")
    for index, case in enumerate(cases):
        allowed = folds > 0 and case.labelled
        if (case.fold is not None or allowed) and not (
            allowed and whole(case.fold) and 0 <= case.fold < folds
        ):
            should = f"one of 0–{folds - 1}" if allowed else "null"
            raise CtsegError(
                f"{where}: cases[{index}].fold = {json.dumps(case.fold)} should be {should}; "
                + redo
            )
    empty = sorted(set(range(folds)) - {case.fold for case in cases})
    if empty:
        raise CtsegError(f"{where}: fold {empty[0]} holds no case; {redo}")


# Numeric fields of an entry: (shape, whole numbers, lowest allowed value, in words).
_NUMBERS = {
    "original_shape": ((3,), True, 1, "3 voxel counts"),
    "canonical_shape": ((3,), True, 1, "3 voxel counts"),
    "original_affine": ((4, 4), False, -math.inf, "a 4×4 matrix of finite numbers"),
    "canonical_affine": ((4, 4), False, -math.inf, "a 4×4 matrix of finite numbers"),
    "spacing": ((3,), False, math.ulp(0.0), "3 positive numbers (mm)"),
    "label_counts": ((3,), True, 0, "3 voxel counts"),
    "grid_shape": ((3,), True, 1, "3 voxel counts"),
    "box_offset": ((3,), True, -math.inf, "3 whole numbers"),
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


def _check_array(root: Path, case_id: str, kind: str, grid: tuple[int, ...]) -> None:
    """CtsegError unless the case's array is a readable array of its grid and dtype."""
    path = array_path(root, case_id, kind)
    if not path.is_file():
        raise CtsegError(
            f"the store at {root} lacks {kind}.npy of case {case_id}; re-run `ctseg preprocess`"
        )
    expected = (np.dtype(np.int16) if kind == "image" else np.dtype(np.uint8), tuple(grid))
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


def array_path(root: Path, case_id: str, kind: str) -> Path:
    return root / "cases" / case_id / f"{kind}.npy"


def case_json_path(root: Path, case_id: str) -> Path:
    return root / "cases" / case_id / "case.json"


def manifest_file(path: Path) -> Path | None:
    """PATH/manifest.json, None if there is none; CtsegError if something else stands there."""
    file = path / MANIFEST
    if not file.exists():
        return None
    if not file.is_file():
        raise CtsegError(f"{file} is not a file; move it away (it is where the manifest goes)")
    return file


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest's content, None if there is none; CtsegError if it is not a store's."""
    file = manifest_file(path)
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
