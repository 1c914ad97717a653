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
itself on the cube, around the liver on the spacing grid; `ctseg.data.grids`):
validation looks there, and training draws boxes around it and elsewhere
(`Store.box`, `ctseg.training.pipeline.draw_box_offset`). `CaseEntry.box_affine()`
is that box's affine. Manifests of earlier versions (no grid, no folds) are read
through `ctseg.compat`.

Cross-validation folds (`folds` = k ≥ 2; 0 = none) split the labelled cases (splits
train and val, never test) into k folds whose sizes differ by at most one, drawn
from the seed `fold_seed` (`ctseg.data_prep.splits.assign_folds`); each labelled case
names its `fold`, every other case null. They are independent of the train/val
split: `Store.for_fold(i)` is the store seen by a run of fold i (fold i validates,
the other folds train).

`ctseg.data_prep.build` builds a store from the `RawCase`s that a raw data set's
layout names (`ctseg.data_prep.raw` finds them) and `ctseg.data.manifest` writes its
manifest; this module reads it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ctseg import compat
from ctseg.config import DataConfig
from ctseg.data import grids
from ctseg.data.manifest import (
    GRIDS,
    MANIFEST,
    PREPARE_AGAIN,
    SPLITS,
    check_entries,
    check_folds,
    read_manifest,
)
from ctseg.errors import CtsegError
from ctseg.io.readers import check_extent
from ctseg.io.scans import canonical_geometry


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
    # The scan's grid (`ctseg.data.grids`: R³ on the cube, the scan at data.spacing on the
    # spacing grid) and where the stored R³ box lies on it (box voxel b = grid voxel
    # b + box_offset).
    grid_shape: tuple[int, ...]
    box_offset: tuple[int, ...]
    fold: int | None = None  # the cross-validation fold of a labelled case, if the store has folds

    @property
    def labelled(self) -> bool:
        return self.label_source is not None

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> CaseEntry:
        def nested(value: Any) -> Any:
            return tuple(nested(v) for v in value) if isinstance(value, list) else value

        fields = dataclasses.fields(cls)
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
        """Open and check a store written by `ctseg.data_prep.build.write_store`."""
        path = Path(path)
        manifest = read_manifest(path)
        if manifest is None:
            raise CtsegError(
                f"no prepared store at {path} ({MANIFEST} missing); run `ctseg preprocess` first"
            )
        manifest = compat.store_manifest(manifest)
        try:
            cases = [CaseEntry.from_json(c) for c in manifest["cases"]]
            resolution = int(manifest["resolution"])
            grid = manifest["grid"]
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
        check_entries(path / MANIFEST, cases)
        folds, fold_seed = manifest["folds"], manifest.get("fold_seed")
        check_folds(path, folds, fold_seed, cases)
        spec = grids.GridSpec(grid, resolution, spacing or (0.0, 0.0, 0.0))
        for index, case in enumerate(cases):
            for kind in ("image", "label") if case.labelled else ("image",):
                _check_array(path, case.id, kind, case.grid_shape)
            _check_geometry(path / MANIFEST, index, case, spec)
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

    def check_grid(self, data: DataConfig) -> None:
        """CtsegError unless the store holds the grid that a config's `data` section asks
        for (a run trains, validates and is evaluated on its own grid's boxes)."""
        wanted = grids.GridSpec.of(data)
        if self.grid_spec != wanted:
            raise CtsegError(
                f"{self.path} holds a store of {self.grid_spec.describe()} but the run's config "
                f"asks for {wanted.describe()} (data.grid, data.resolution, data.spacing); "
                "preprocess again with this config"
            )

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
                "ctseg folds (5, say), or preprocess with data.folds = 5"
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
        out = np.empty([b - a for a, b in ranges], self.grid.dtype)
        self._read(ranges, out)
        return out

    def read_into(self, out: np.ndarray) -> None:
        """The whole box written into `out` (of the box's shape): no array of its own,
        where a caller assembles boxes into a larger one."""
        self._read([(0, n) for n in self.shape], out)

    def _read(self, ranges: list[tuple[int, int]], out: np.ndarray) -> None:
        out.fill(self.fill)
        source, target = [], []
        for (start, stop), o, g in zip(ranges, self.offset, self.grid.shape, strict=True):
            lo, hi = max(start + o, 0), min(stop + o, g)
            if hi <= lo:
                return  # the slab lies wholly beyond the grid
            source.append(slice(lo, hi))
            target.append(slice(lo - o - start, hi - o - start))
        out[tuple(target)] = self.grid[tuple(source)]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[tuple(slice(None) for _ in self.shape)]
        return whole if dtype is None else whole.astype(dtype)


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
        raise CtsegError(f"{path} cannot be read as an array ({exc}); {PREPARE_AGAIN}") from None
    if found != expected:
        raise CtsegError(
            f"{path} holds {found[0]} {list(found[1])}, not {expected[0]} {list(expected[1])}; "
            + PREPARE_AGAIN
        )


def _check_geometry(manifest: Path, index: int, case: CaseEntry, spec: grids.GridSpec) -> None:
    """CtsegError unless the case's geometry is one scan's, whose grid is the arrays' on
    disk (`_check_array` read their shape from the .npy header): the original shape and
    affine give the canonical shape and spacing, those a CT's (`readers.check_extent`), and
    those the grid. A command sizes its canvases from the manifest before any scan is
    read (`Predictor.expect`): a field edited by hand would size them for every case."""
    where = f"{manifest}: cases[{index}] ({case.id})"
    shape, spacing = canonical_geometry(case.original_shape, case.original_affine)
    if shape != tuple(case.canonical_shape) or not np.allclose(spacing, case.spacing, rtol=1e-6):
        raise CtsegError(
            f"{where}: original_shape and original_affine give {list(shape)} voxels of "
            f"{[round(s, 4) for s in spacing]} mm, not its canonical_shape "
            f"{list(case.canonical_shape)} and spacing {list(case.spacing)}; {PREPARE_AGAIN}"
        )
    check_extent(Path(f"{where}: {case.image_source}"), shape, spacing, PREPARE_AGAIN)
    grid = spec.grid_of(shape, spacing)
    if grid != tuple(case.grid_shape):
        raise CtsegError(
            f"{where}: a scan of {list(shape)} voxels has the grid {list(grid)}, not its "
            f"grid_shape {list(case.grid_shape)} (its arrays' shape); {PREPARE_AGAIN}"
        )


def array_path(root: Path, case_id: str, kind: str) -> Path:
    return root / "cases" / case_id / f"{kind}.npy"


def case_json_path(root: Path, case_id: str) -> Path:
    return root / "cases" / case_id / "case.json"
