"""The fingerprint of a run's training data: what new scans and their livers are held against.

A model trained on one kind of scan says nothing useful about another: a model of
synthetic phantoms put "liver" on a real abdomen's lumbar spine, and nothing said
so. As nnU-Net records a *dataset fingerprint* of its training data (spacings,
shapes, foreground intensities), `ctseg train` records this one when it starts a
run (`record`), from the prepared store's training cases, into
RUN_DIR/fingerprint.json (`ctseg.run.rundir.FINGERPRINT`)::

    {"format": "ctseg-fingerprint", "version": 1, "store": PREP_DIR, "resolution": R,
     "cases": N, "liver_cases": M,           # training cases; those of them with a liver
     "spacing_mm":      DISTRIBUTION,        # canonical voxel size, per axis (x, y, z)
     "extent_mm":       DISTRIBUTION,        # field of view = spacing × canonical shape
     "liver_volume_ml": DISTRIBUTION,        # label ≥ 1 on the grid × the grid voxel's mL
     "liver_extent_mm": DISTRIBUTION,        # the liver's bounding box on the grid, per axis
     "liver_hu": {"mean", "std", "min", "percentile_00_5", "median", "percentile_99_5",
                  "max", "voxels"},          # HU inside the livers (a deterministic sample)
     "liver_body_share": DISTRIBUTION}       # `liver_body_share`: of the body over its slices

    DISTRIBUTION = {"min", "p5", "median", "p95", "max"}: numbers, or lists of 3 per axis

The liver fields are null when no training case has a liver (`liver_body_share` is
absent from fingerprints made before it). At large grids only a
strided sample of each case is read (every `sample_step`-th voxel along each axis,
at most `_SAMPLED_GRID` per axis): the liver's bounding box is then good to a
stride, its volume stays exact (the manifest's `label_counts`).

`ctseg predict` compares each scan and its predicted liver with the fingerprint
(`ctseg.inference.quality.scan_checks`) and says, beside the other warnings, where they lie
far outside what the model was trained on. A run trained before the fingerprint
existed has none, and its scans are not compared.

NumPy only: no JAX.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ctseg import compat
from ctseg.data.store import Store
from ctseg.errors import CtsegError
from ctseg.labels import liver_mask
from ctseg.reading import Record
from ctseg.run import rundir

FORMAT = "ctseg-fingerprint"
VERSION = 1


_SAMPLED_GRID = 64  # the fingerprint reads at most this many voxels per axis of a case
BODY_HU = -500  # above it the body (fat, soft tissue, bone); below, air and lung
_HU_PER_CASE = 10_000  # liver voxels per case in the intensity sample (nnU-Net's number)
_PERCENTILES = {"min": 0, "p5": 5, "median": 50, "p95": 95, "max": 100}


def sample_step(shape: Sequence[int], most: int = _SAMPLED_GRID) -> int:
    """The stride that reads at most `most` voxels along every axis of `shape`."""
    return max(1, math.ceil(max(shape) / most))


def liver_body_share(liver: np.ndarray, hu: np.ndarray) -> float | None:
    """The liver's share of the body over the slices (the last axis) that hold it: its
    voxels over those above `BODY_HU` there. Unit-free, and so the same for a larger
    patient's larger liver (a 15 % larger body: a liver of 1.5× the volume, and as much
    more body over its slices) and whatever the scan covers beyond the liver. None without
    a liver or a body."""
    slices = np.flatnonzero(liver.any(axis=(0, 1)))
    if slices.size == 0:
        return None
    body = np.count_nonzero(np.asarray(hu[:, :, slices[0] : slices[-1] + 1]) > BODY_HU)
    return float(np.count_nonzero(liver)) / body if body else None


def compute(store: Store) -> dict[str, Any]:
    """The fingerprint of the store's training cases (the JSON of the module docstring)."""
    cases = store.split("train")
    if not cases:
        raise CtsegError(f"{store.path} has no training cases")
    resolution = store.resolution
    spacing = np.array([case.spacing for case in cases], dtype=float)
    extent = spacing * np.array([case.canonical_shape for case in cases], dtype=float)
    volumes, extents, intensities, shares = [], [], [], []
    for case in cases:
        liver_voxels = 0 if case.label_counts is None else sum(case.label_counts[1:])
        if not liver_voxels:
            continue  # no liver (or no label): nothing to say about livers
        affine = case.box_affine()  # the grid's voxels: the cube's, or data.spacing's
        volumes.append(liver_voxels * abs(float(np.linalg.det(affine[:3, :3]))) / 1000.0)
        step = sample_step(case.grid_shape, _SAMPLED_GRID)
        liver = liver_mask(np.asarray(store.label(case.id)[::step, ::step, ::step]))
        box = box_voxels(liver, step)
        if box is None:
            continue  # a liver too small for the sample
        extents.append(box * np.linalg.norm(affine[:3, :3], axis=0))
        hu = np.asarray(store.image(case.id)[::step, ::step, ::step])
        intensities.append(_thinned(hu[liver], _HU_PER_CASE))
        share = liver_body_share(liver, hu)
        if share is not None:
            shares.append(share)
    return {
        "format": FORMAT,
        "version": VERSION,
        "store": str(Path(store.path).absolute()),
        "resolution": resolution,
        "cases": len(cases),
        "liver_cases": len(volumes),
        "spacing_mm": _distribution(spacing),
        "extent_mm": _distribution(extent),
        "liver_volume_ml": _distribution(np.array(volumes)) if volumes else None,
        "liver_extent_mm": _distribution(np.array(extents)) if extents else None,
        "liver_hu": _intensities(np.concatenate(intensities)) if intensities else None,
        "liver_body_share": _distribution(np.array(shares)) if shares else None,
    }


def record(run_dir: Path, store: Store) -> None:
    """Write RUN_DIR/fingerprint.json of the store's training cases, unless the run has one:
    a resumed run keeps the fingerprint of the data it started on (a run begun before
    fingerprints gets one of the data it resumes on)."""
    if not (Path(run_dir) / rundir.FINGERPRINT).exists():
        rundir.write_fingerprint(run_dir, compute(store))


def box_voxels(mask: np.ndarray, step: int) -> np.ndarray | None:
    """Voxels spanned by the bounding box of a (strided) mask, per axis, on the full grid."""
    if not mask.any():
        return None
    spans = []
    for axis in range(3):
        present = np.flatnonzero(mask.any(axis=tuple(a for a in range(3) if a != axis)))
        spans.append((int(present[-1]) - int(present[0]) + 1) * step)
    return np.array(spans, dtype=float)


def _thinned(values: np.ndarray, most: int) -> np.ndarray:
    """At most `most` of `values`, evenly spaced (deterministic)."""
    if len(values) <= most:
        return values
    return values[np.linspace(0, len(values) - 1, most).round().astype(int)]


def _distribution(values: np.ndarray) -> dict[str, Any]:
    """min, 5th percentile, median, 95th, max over cases (axis 0): numbers or per-axis lists."""
    found = np.percentile(values, list(_PERCENTILES.values()), axis=0)
    return {key: found[i].tolist() for i, key in enumerate(_PERCENTILES)}


def _intensities(hu: np.ndarray) -> dict[str, Any]:
    hu = hu.astype(np.float64)
    low, median, high = np.percentile(hu, (0.5, 50, 99.5))
    return {
        "mean": float(hu.mean()),
        "std": float(hu.std()),
        "min": float(hu.min()),
        "percentile_00_5": float(low),
        "median": float(median),
        "percentile_99_5": float(high),
        "max": float(hu.max()),
        "voxels": len(hu),
    }


ENDS = ("min", "max")  # a distribution's range


@dataclass(frozen=True)
class Fingerprint:
    """The ranges of a fingerprint the checks use: [lowest, highest] over the training cases."""

    spacing: tuple[np.ndarray, np.ndarray]  # mm per axis
    extent: tuple[np.ndarray, np.ndarray]  # mm per axis
    liver_volume: tuple[float, float] | None  # mL
    liver_extent: tuple[np.ndarray, np.ndarray] | None  # mm per axis
    liver_hu: tuple[float, float] | None  # the 0.5th and 99.5th percentiles

    @classmethod
    def from_json(cls, raw: Any, path: str | Path = rundir.FINGERPRINT) -> Fingerprint:
        """CtsegError (one line naming `path` and the key) when `raw` is not a fingerprint of
        `compute`."""
        what = "the fingerprint"
        record = Record(raw, path, what)
        if record.text("format", optional=True) != FORMAT or raw.get("version") != VERSION:
            raise CtsegError(f"{what} {path} is not a {FORMAT} version {VERSION}")

        def nullable(key: str) -> Record | None:
            """An object the fingerprint must hold, null where no training case has it."""
            if key not in record:
                record.record(key)  # its one line: the key is missing
            return record.record(key, optional=True)

        def span(key: str, per_axis: bool) -> Any:
            distribution = nullable(key)
            if distribution is None:
                return None
            if per_axis:
                low, high = (np.array(distribution.numbers(end, length=3)) for end in ENDS)
            else:
                low, high = (np.array(distribution.number(end)) for end in ENDS)
            if not (0 < low).all():
                raise CtsegError(f"{what} {path}: key {key!r} is not a range of positive numbers")
            if not (low <= high).all():
                raise CtsegError(f"{what} {path}: key {key!r}: its min exceeds its max")
            return (low, high) if per_axis else (float(low), float(high))

        hu = nullable("liver_hu")
        return cls(
            spacing=span("spacing_mm", True),
            extent=span("extent_mm", True),
            liver_volume=span("liver_volume_ml", False),
            liver_extent=span("liver_extent_mm", True),
            liver_hu=None
            if hu is None
            else (hu.number("percentile_00_5"), hu.number("percentile_99_5")),
        )


def load(run_dir: Path) -> Fingerprint | None:
    """The run's fingerprint; None for a run trained before fingerprints (`compat.fingerprint`:
    nothing to check). CtsegError (one line naming the file and the key) for a file that is
    not a regular file, not JSON or not a fingerprint of `compute`."""
    raw = compat.fingerprint(rundir.read_fingerprint(run_dir))
    if raw is None:
        return None
    path = Path(run_dir) / rundir.FINGERPRINT
    try:
        return Fingerprint.from_json(raw, path)
    except CtsegError as exc:
        raise CtsegError(
            f"{exc}; delete it to predict without comparing scans with the training data"
        ) from None
