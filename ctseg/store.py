"""The prepared store: every case resampled to the R³ grid, memory-mappable, with a manifest.

Layout (the contract between `ctseg preprocess` and the commands after it)::

    PREP_DIR/manifest.json                 written last, atomically
    PREP_DIR/cases/<case_id>/image.npy     int16 HU, [R, R, R], canonical RAS order
    PREP_DIR/cases/<case_id>/label.npy     uint8 0/1/2, [R, R, R]
    PREP_DIR/cases/<case_id>/case.json     the case's manifest entry (split left empty);
                                           written after the arrays, it marks the case done

manifest.json::

    {"format": "ctseg-store", "version": 1, "resolution": R,
     "cases": [{"id", "split": "train" | "val", "image_source", "label_source",
                "original_shape", "original_affine", "canonical_shape",
                "canonical_affine", "spacing", "label_counts": [n0, n1, n2]}]}

Sources are absolute paths; affines are 4×4 voxel -> RAS mm lists; `spacing` is
the canonical voxel size in mm; `label_counts` counts the voxels of each class
in label.npy. The grid's own affine is `preprocess.grid_affine(canonical_affine,
canonical_shape, R)`.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ctseg import preprocess
from ctseg.atomic import write_json, write_npy
from ctseg.config import Config
from ctseg.errors import CtsegError
from ctseg.volume import Scan, read_scan
from data_prep.layouts import CasePair, find_cases

FORMAT = "ctseg-store"
VERSION = 1
SPLITS = ("train", "val")
MANIFEST = "manifest.json"
# Image and label headers of one case may differ by float32 rounding; more is a mismatch.
GEOMETRY_TOLERANCE_MM = 1e-3

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class CaseEntry:
    """One case of the manifest."""

    id: str
    split: str
    image_source: str
    label_source: str
    original_shape: tuple[int, ...]
    original_affine: tuple[tuple[float, ...], ...]
    canonical_shape: tuple[int, ...]
    canonical_affine: tuple[tuple[float, ...], ...]
    spacing: tuple[float, ...]
    label_counts: tuple[int, ...]

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
        for case in cases:
            for kind in ("image", "label"):
                if not _array_path(path, case.id, kind).is_file():
                    raise CtsegError(
                        f"the store at {path} lacks {kind}.npy of case {case.id}; "
                        "re-run `ctseg preprocess`"
                    )
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
        return self._load(case_id, "image")

    def label(self, case_id: str) -> np.ndarray:
        """Read-only uint8 label memory map [R, R, R]."""
        return self._load(case_id, "label")

    def _load(self, case_id: str, kind: str) -> np.ndarray:
        self.case(case_id)
        return np.load(_array_path(self.path, case_id, kind), mmap_mode="r", allow_pickle=False)


def _array_path(root: Path, case_id: str, kind: str) -> Path:
    return root / "cases" / case_id / f"{kind}.npy"


def _case_json_path(root: Path, case_id: str) -> Path:
    return root / "cases" / case_id / "case.json"


def _read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest's content, None if there is none; CtsegError if it is not a store's."""
    file = path / MANIFEST
    if not file.is_file():
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
) -> Store:
    """Resample every case under `raw_dir` into a store at `out_dir`; resumable.

    Cases already prepared at this resolution from the same sources are skipped
    unless `force`. Images without labels are reported with `warnings.warn`.
    """
    out_dir = Path(out_dir)
    resolution = config.data.resolution
    layout = find_cases(raw_dir)
    if layout.unlabelled:
        names = ", ".join(p.name for p in layout.unlabelled)
        warnings.warn(
            f"skipped {len(layout.unlabelled)} image(s) without labels: {names}", stacklevel=2
        )
    _check_existing_store(out_dir, resolution, force)
    # A manifest must never describe arrays that are being rewritten.
    (out_dir / MANIFEST).unlink(missing_ok=True)

    splits = assign_splits(
        [p.case_id for p in layout.pairs], config.data.val_fraction, config.data.split_seed
    )
    entries = []
    for done, pair in enumerate(layout.pairs, start=1):
        entry = None if force else _finished_entry(out_dir, pair, resolution)
        if entry is None:
            entry = _prepare_case(out_dir, pair, resolution)
        entries.append(dataclasses.replace(entry, split=splits[pair.case_id]))
        if progress is not None:
            progress(done, len(layout.pairs), pair.case_id)

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
    manifest = None if force else _read_manifest(out_dir)
    if manifest is not None and manifest.get("resolution") != resolution:
        raise CtsegError(
            f"{out_dir} holds a store at resolution {manifest.get('resolution')}, "
            f"not {resolution}; use another folder or --force to rebuild it"
        )


def _finished_entry(out_dir: Path, pair: CasePair, resolution: int) -> CaseEntry | None:
    """The entry of a case already prepared from the same files at this resolution, else None."""
    case_json = _case_json_path(out_dir, pair.case_id)
    if not case_json.is_file():
        return None
    try:
        entry = CaseEntry.from_json(json.loads(case_json.read_text()))
        shapes = [
            np.load(_array_path(out_dir, pair.case_id, kind), mmap_mode="r").shape
            for kind in ("image", "label")
        ]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # damaged or from an older layout: prepare the case again
    same_sources = (entry.image_source, entry.label_source) == _sources(pair)
    if same_sources and shapes == [(resolution,) * 3] * 2:
        return entry
    return None


def _sources(pair: CasePair) -> tuple[str, str]:
    return str(pair.image.resolve()), str(pair.label.resolve())


def _prepare_case(out_dir: Path, pair: CasePair, resolution: int) -> CaseEntry:
    image = read_scan(pair.image)
    label = read_scan(pair.label)
    _check_same_geometry(image, label)
    labels = preprocess.check_labels(label.array, pair.label.name)

    image_grid = preprocess.hu_to_int16(preprocess.to_grid(image.array, resolution, order=1))
    label_grid = preprocess.to_grid(labels, resolution, order=0)
    write_npy(_array_path(out_dir, pair.case_id, "image"), image_grid)
    write_npy(_array_path(out_dir, pair.case_id, "label"), label_grid)

    image_source, label_source = _sources(pair)
    entry = CaseEntry(
        id=pair.case_id,
        split="",  # assigned over all cases in `prepare`
        image_source=image_source,
        label_source=label_source,
        original_shape=image.original_shape,
        original_affine=_rows(image.original_affine),
        canonical_shape=tuple(int(n) for n in image.array.shape),
        canonical_affine=_rows(image.affine),
        spacing=image.spacing,
        label_counts=tuple(int(n) for n in np.bincount(label_grid.ravel(), minlength=3)),
    )
    write_json(_case_json_path(out_dir, pair.case_id), entry.to_json())
    return entry


def _rows(affine: np.ndarray) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(float(v) for v in row) for row in affine)


def _check_same_geometry(image: Scan, label: Scan) -> None:
    what = f"{image.source.name} and {label.source.name} differ in geometry"
    if image.original_shape != label.original_shape:
        raise CtsegError(f"{what}: shape {image.original_shape} vs {label.original_shape}")
    difference = float(np.abs(image.original_affine - label.original_affine).max())
    if difference > GEOMETRY_TOLERANCE_MM:
        raise CtsegError(f"{what}: their affines differ by up to {difference:.4g} mm")
