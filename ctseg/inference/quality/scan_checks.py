"""What a prediction says about its scan: lines that warn where a scan or its predicted liver
is not what the model can be trusted on.

Two kinds, side by side in each scan's output:

- *warnings* (`hu_warnings`, `geometry_warnings`, `volume_warnings`): outside what any CT
  scan or human liver can be (not Hounsfield units, voxels of 20 mm, a liver of 15 L);
- *checks* (`checks`): far outside the run's training data, its fingerprint
  (`ctseg.run.fingerprint`): a spacing, field of view, liver volume, extent or
  intensity more than `TOLERANCE`× beyond any the model trained on.

NumPy only: no JAX.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ctseg.io.scans import Scan
from ctseg.labels import liver_mask
from ctseg.run.fingerprint import Fingerprint, box_voxels, sample_step

# Percentiles of a CT scan in Hounsfield units lie within air (−1000) and dense bone or
# contrast (~3000); a little slack for noise. Outside, the image is probably not in HU.
_HU_RANGE = (-1100.0, 3100.0)


_HU_SAMPLE_STEP = 4  # every 4th voxel along each axis is plenty for percentiles


# CT voxels are 0.2–1 mm in-plane and 0.5–10 mm between slices; a scan of the
# abdomen is a few cm to 2 m long (a whole body) and has more than a handful of slices.
_SPACING_MM = (0.1, 10.0)


_EXTENT_MM = (20.0, 2000.0)


_MIN_VOXELS = 8


# Adult livers measure 1–3 L; the largest ever (polycystic) about 10 L.
_MAX_LIVER_ML = 12_000.0


def hu_warnings(hu: np.ndarray) -> list[str]:
    """Warnings when the intensities do not look like CT in Hounsfield units."""
    sample = hu[::_HU_SAMPLE_STEP, ::_HU_SAMPLE_STEP, ::_HU_SAMPLE_STEP]
    low, high = (float(v) for v in np.percentile(sample, (1, 99)))
    if float(sample.min()) >= 0:
        return [
            f"all intensities are ≥ 0 (1st–99th percentile {low:g}…{high:g}); the image may "
            "not be in Hounsfield units (missing rescale slope/intercept?)"
        ]
    if low < _HU_RANGE[0] or high > _HU_RANGE[1]:
        return [
            f"the 1st–99th intensity percentiles {low:g}…{high:g} lie outside "
            f"[{_HU_RANGE[0]:g}, {_HU_RANGE[1]:g}]; the image may not be CT in Hounsfield units"
        ]
    return []


def geometry_warnings(scan: Scan) -> list[str]:
    """Warnings when a scan's voxels or extent are outside what a CT scan can be."""
    spacing = np.array(scan.spacing)
    extent = spacing * np.array(scan.array.shape)
    warnings = []
    if spacing.min() < _SPACING_MM[0] or spacing.max() > _SPACING_MM[1]:
        warnings.append(
            f"voxel spacing {' × '.join(f'{v:g}' for v in spacing)} mm is outside "
            f"{_SPACING_MM[0]:g}–{_SPACING_MM[1]:g} mm: the header's geometry is probably wrong"
        )
    if min(scan.array.shape) < _MIN_VOXELS or not (
        _EXTENT_MM[0] <= extent.min() and extent.max() <= _EXTENT_MM[1]
    ):
        warnings.append(
            f"the scan is {' × '.join(str(n) for n in scan.array.shape)} voxels, "
            f"{' × '.join(f'{v:.4g}' for v in extent)} mm: not the volume of an abdominal CT"
        )
    return warnings


def volume_warnings(stats: dict[str, Any]) -> list[str]:
    """Warnings when the predicted liver volume is not that of a human liver."""
    liver = stats["liver_volume_ml"]
    if liver == 0:
        return ["no liver was found"]
    if liver > _MAX_LIVER_ML:
        return [f"a liver of {liver:,.0f} mL is larger than any human liver: check the geometry"]
    return []


# "Far" from the training data: more than 3× below the smallest or above the largest
# training value (per axis for spacings and extents). Why 3: ctseg stretches a scan's
# whole field of view onto the R³ grid, so a scan 3× larger or smaller than any it
# trained on shows the model anatomy at a scale it never learnt; a scan of 10× the
# training spacing is 10× the extent too, far beyond. And a training set is a small
# sample of its own distribution: with extents of 160–900 mm (5.6×, as the synthetic
# phantoms have), a new scan falls outside [min/3, 3·max] of 3 training scans drawn
# like it with a probability of about 1 % (with 2×, about 5 %). A liver's volume gets
# the same factor: adult livers measure 1–3 L, and a scan that holds only part of the
# liver is common, so a small liver alone is weak evidence.
TOLERANCE = 3.0


# The median HU inside a predicted liver is unlike the training livers' when it lies
# outside their [0.5th, 99.5th] percentiles (nnU-Net's clipping range for CT) widened
# by 50 HU on each side: the median averages the noise away, so a liver like those
# trained on lies well inside; 50 HU is about what contrast adds to a liver in the
# portal-venous phase; beyond it lie fat (-100), air and bone (> 200): no liver.
HU_MARGIN = 50.0


_SAMPLED_SCAN = 128  # the checks look at this many voxels per axis of a prediction


def checks(fingerprint: Fingerprint | None, scan: Scan, labels: np.ndarray) -> list[str]:
    """Where a scan and its predicted canonical labels lie far
    outside the training data; [] without a fingerprint."""
    if fingerprint is None:
        return []
    return geometry_checks(fingerprint, scan.spacing, scan.array.shape) + liver_checks(
        fingerprint, labels, scan.array, scan.affine
    )


def geometry_checks(
    fingerprint: Fingerprint, spacing: Sequence[float], shape: Sequence[int]
) -> list[str]:
    """A scan's voxel spacing and field of view (mm per canonical axis) against the training
    scans'."""
    spacing = np.array(spacing, dtype=float)
    extent = spacing * np.array(shape, dtype=float)
    found = []
    if _far(spacing, fingerprint.spacing):
        found.append(
            f"voxel spacing {_each(spacing)} mm lies more than {TOLERANCE:g}× outside the "
            f"training scans' ({_ranges(fingerprint.spacing)} mm)"
        )
    if _far(extent, fingerprint.extent):
        found.append(
            f"field of view {_each(extent)} mm lies more than {TOLERANCE:g}× outside the "
            f"training scans' ({_ranges(fingerprint.extent)} mm)"
        )
    return found


def liver_checks(
    fingerprint: Fingerprint, labels: np.ndarray, hu: np.ndarray, affine: np.ndarray
) -> list[str]:
    """A predicted liver (labels ≥ 1, canonical, voxel → mm `affine`) against the training
    livers: its volume, its extent, the median HU inside it. No liver: nothing here
    (`volume_warnings` says so)."""
    liver_voxels = int(np.count_nonzero(liver_mask(labels)))
    if not liver_voxels:
        return []
    found = []
    volume = liver_voxels * abs(float(np.linalg.det(affine[:3, :3]))) / 1000.0
    if fingerprint.liver_volume is not None and _far(volume, fingerprint.liver_volume):
        low, high = fingerprint.liver_volume
        found.append(
            f"the predicted liver's volume, {_number(volume)} mL, lies more than {TOLERANCE:g}× "
            f"outside the training livers' ({_number(low)}–{_number(high)} mL)"
        )
    step = sample_step(labels.shape, _SAMPLED_SCAN)
    liver = liver_mask(labels[::step, ::step, ::step])
    box = box_voxels(liver, step)
    if box is None:
        return found  # a liver too small for the sample
    extent = np.minimum(box, labels.shape) * np.linalg.norm(affine[:3, :3], axis=0)
    if fingerprint.liver_extent is not None and _far(extent, fingerprint.liver_extent):
        found.append(
            f"the predicted liver's extent, {_each(extent)} mm, lies more than {TOLERANCE:g}× "
            f"outside the training livers' ({_ranges(fingerprint.liver_extent)} mm)"
        )
    if fingerprint.liver_hu is not None:
        low, high = fingerprint.liver_hu
        median = float(np.median(np.asarray(hu[::step, ::step, ::step])[liver]))
        if not low - HU_MARGIN <= median <= high + HU_MARGIN:
            found.append(
                f"the median intensity inside the predicted liver, {median:.0f} HU, is unlike "
                f"the training livers' (0.5th–99.5th percentile {low:.0f}…{high:.0f} HU, "
                f"± {HU_MARGIN:g})"
            )
    return found


def _far(value: Any, span: tuple[Any, Any]) -> bool:
    """Whether `value` lies (on any axis) more than `TOLERANCE`× below or above `span`."""
    low, high = span
    value = np.asarray(value, dtype=float)
    return bool(np.any(value < np.asarray(low) / TOLERANCE) or np.any(value > high * TOLERANCE))


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _each(values: np.ndarray) -> str:
    return " × ".join(_number(float(v)) for v in values)


def _ranges(span: tuple[np.ndarray, np.ndarray]) -> str:
    return " × ".join(
        f"{_number(float(a))}–{_number(float(b))}" for a, b in zip(*span, strict=True)
    )
