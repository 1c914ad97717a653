"""Evaluation metrics for liver / tumour label maps: overlap, surface distances, lesion detection.

Plain numpy + scipy functions on label maps (0 background, 1 liver, 2 tumour) or
boolean masks, returning floats, ``None`` and dicts of them (JSON-ready: ``None``
stands for "undefined", never NaN). Structures: liver = label >= 1 (the whole
organ, tumour included), tumour = label == 2. Distances are in millimetres.

Surfaces and distances
    The surface of a mask is its voxels with at least one face (6-connected)
    background neighbour; the outside of the volume counts as background. For
    each surface voxel of one mask, its distance to the nearest surface voxel
    of the other (Euclidean, between voxel centres, with the voxel spacing)
    forms a directed set; the two directed sets are pooled. ASSD is the mean of
    the pool, HD95 its 95th percentile (numpy's linear interpolation), MSSD its
    maximum (the symmetric Hausdorff distance). Pooling before taking the
    percentile is the common "HD95 of all surface distances" definition; it is
    not the max of the two directed 95th percentiles.

Empty masks (applied to every structure of every case)
    both empty:            Dice 1, Jaccard 1, VOE 0, RVD 0,    distances None
    reference empty only:  Dice 0, Jaccard 0, VOE 1, RVD None, distances None
    prediction empty only: Dice 0, Jaccard 0, VOE 1, RVD -1,   distances None
    ``None`` values are skipped by the means of `summarize`; a case without
    tumour in either map therefore counts as a perfect tumour Dice.

Lesion detection
    Lesions are the 26-connected components of the tumour mask. For each
    reference lesion R, take the predicted components that overlap it and
    remove from their union the voxels lying in *other* reference lesions
    (those are judged with their own lesion); R is detected when the IoU of R
    with what remains exceeds 0.5. So a lesion split into several predicted
    pieces is judged against all its pieces together, and one predicted blob
    merging two lesions can detect both. A predicted component is a true
    positive when it overlaps a detected reference lesion and a false positive
    when it overlaps no reference lesion at all (one that only overlaps missed
    lesions is neither). Over a data set: recall = sum of detected lesions /
    sum of reference lesions, precision = sum of true-positive predicted
    components / sum of predicted components.

    Measurable lesions are also counted apart (`n_ref_measurable`,
    `n_detected_measurable`, and over a data set `detection_recall_measurable`):
    reference lesions at least `MEASURABLE_MM` across, as the diameter of a ball
    of their volume. RECIST 1.1 calls a lesion on CT measurable from 10 mm (its
    longest axial diameter, which is never shorter than the ball's); a smaller
    one may not be visible at all at a scan's resolution and noise.

Tumour burden
    Tumour volume / liver volume (liver including tumour), per map; the burden
    error is |burden_pred - burden_ref|, None when either liver is empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import ndimage

from ctseg.labels import bounding_box, dice_from_counts, liver_mask, tumour_burden, tumour_mask

DETECTION_IOU = 0.5  # the LiTS detection threshold
MEASURABLE_MM = 10.0  # a lesion's diameter (its volume's ball's) from which it is measurable
DETECTION_KEYS = (
    "n_ref", "n_detected", "n_pred", "n_pred_tp", "n_pred_fp",
    "n_ref_measurable", "n_detected_measurable",
)  # fmt: skip
SURFACE_DISTANCE_KEYS = ("assd", "hd95", "mssd")
OVERLAP_KEYS = ("dice", "jaccard", "voe", "rvd")

# Face neighbours only: a voxel touching background at an edge or corner is not surface.
_FACE_STRUCTURE = ndimage.generate_binary_structure(3, 1)
_FULL_STRUCTURE = ndimage.generate_binary_structure(3, 3)  # 26-connectivity for lesions

Spacing = Sequence[float]


# ---------------------------------------------------------------- overlap


def jaccard_from_counts(intersection: float, n_pred: float, n_ref: float) -> float:
    """Jaccard = |P∩R| / |P∪R|; 1 when both are empty."""
    union = float(n_pred) + float(n_ref) - float(intersection)
    return 1.0 if union == 0 else float(intersection) / union


def rvd_from_counts(n_pred: float, n_ref: float) -> float | None:
    """Relative volume difference (|P|-|R|)/|R|; 0 when both are empty, None when only R is."""
    if n_ref == 0:
        return 0.0 if n_pred == 0 else None
    return (float(n_pred) - float(n_ref)) / float(n_ref)


# ---------------------------------------------------------------- surface distances


def surface(mask: np.ndarray) -> np.ndarray:
    """Voxels of `mask` with a face neighbour in the background (outside the array counts)."""
    eroded = ndimage.binary_erosion(mask, structure=_FACE_STRUCTURE, border_value=0)
    return mask & ~eroded


def surface_distances(
    pred_mask: np.ndarray, ref_mask: np.ndarray, spacing: Spacing
) -> tuple[np.ndarray, np.ndarray]:
    """Directed surface distances in mm: (pred surface → ref surface, ref surface → pred surface).

    Both masks must be non-empty. Only the box around both masks (plus one
    background voxel, so that erosion sees the true border) is processed: every
    surface voxel lies inside it, and Euclidean distances to voxels inside the
    box do not depend on what lies outside, so the crop is exact.
    """
    box = bounding_box(pred_mask | ref_mask, pad=1)
    pred_surface = surface(pred_mask[box])
    ref_surface = surface(ref_mask[box])
    sampling = tuple(float(s) for s in spacing)
    to_ref = ndimage.distance_transform_edt(~ref_surface, sampling=sampling)
    to_pred = ndimage.distance_transform_edt(~pred_surface, sampling=sampling)
    return to_ref[pred_surface], to_pred[ref_surface]


def distance_metrics(pred_mask: np.ndarray, ref_mask: np.ndarray, spacing: Spacing) -> dict:
    """ASSD, HD95 and MSSD in mm; all None when either mask is empty (see module docstring)."""
    if not pred_mask.any() or not ref_mask.any():
        return dict.fromkeys(SURFACE_DISTANCE_KEYS)
    pooled = np.concatenate(surface_distances(pred_mask, ref_mask, spacing))
    return {
        "assd": float(pooled.mean()),
        "hd95": float(np.percentile(pooled, 95)),
        "mssd": float(pooled.max()),
    }


# ---------------------------------------------------------------- per structure


def structure_metrics(pred_mask: np.ndarray, ref_mask: np.ndarray, spacing: Spacing) -> dict:
    """Every overlap and distance metric of one structure, plus the raw voxel counts.

    The counts (`n_intersection`, `n_pred`, `n_ref`) let `summarize` compute the
    global Dice over a data set.
    """
    pred_mask = np.asarray(pred_mask, dtype=bool)
    ref_mask = np.asarray(ref_mask, dtype=bool)
    if pred_mask.shape != ref_mask.shape:
        raise ValueError(f"mask shapes differ: {pred_mask.shape} vs {ref_mask.shape}")
    n_pred = int(np.count_nonzero(pred_mask))  # Python ints: no overflow on 512³ volumes
    n_ref = int(np.count_nonzero(ref_mask))
    n_intersection = int(np.count_nonzero(pred_mask & ref_mask))
    jaccard = jaccard_from_counts(n_intersection, n_pred, n_ref)
    return {
        "dice": dice_from_counts(n_intersection, n_pred, n_ref),
        "jaccard": jaccard,
        "voe": 1.0 - jaccard,
        "rvd": rvd_from_counts(n_pred, n_ref),
        **distance_metrics(pred_mask, ref_mask, spacing),
        "n_intersection": n_intersection,
        "n_pred": n_pred,
        "n_ref": n_ref,
    }


# ---------------------------------------------------------------- lesions


def lesion_detection(pred_tumour: np.ndarray, ref_tumour: np.ndarray, spacing: Spacing) -> dict:
    """Lesion counts of one case under the rules in the module docstring (`spacing`: mm
    per axis, for the measurable lesions' sizes)."""
    pred_tumour = np.asarray(pred_tumour, dtype=bool)
    ref_tumour = np.asarray(ref_tumour, dtype=bool)
    box = bounding_box(pred_tumour | ref_tumour)
    if box is None:
        return dict.fromkeys(DETECTION_KEYS, 0)
    ref_labels, n_ref = ndimage.label(ref_tumour[box], structure=_FULL_STRUCTURE)
    pred_labels, n_pred = ndimage.label(pred_tumour[box], structure=_FULL_STRUCTURE)

    # Sparse overlap table: one entry per (reference lesion r, predicted component p) that
    # share voxels, 0 standing for background; a dense table could be huge for noisy output.
    n_columns = n_pred + 1
    codes, counts = np.unique(
        ref_labels.astype(np.int64) * n_columns + pred_labels, return_counts=True
    )
    r, p = codes // n_columns, codes % n_columns
    ref_size = np.bincount(r, weights=counts, minlength=n_ref + 1)
    outside_ref = np.zeros(n_columns)  # voxels of each predicted component in no lesion
    outside_ref[p[r == 0]] = counts[r == 0]

    shared = (r > 0) & (p > 0)
    r, p, counts = r[shared], p[shared], counts[shared]
    intersection = np.bincount(r, weights=counts, minlength=n_ref + 1)
    # The touching components' voxels that lie in this lesion or in no lesion at all.
    predicted = np.bincount(r, weights=counts + outside_ref[p], minlength=n_ref + 1)
    union = ref_size + predicted - intersection
    detected = intersection[1:] > DETECTION_IOU * union[1:]  # IoU > threshold, no 0/0

    touches_any = np.zeros(n_columns, dtype=bool)
    touches_any[p] = True
    touches_detected = np.zeros(n_columns, dtype=bool)
    touches_detected[p[detected[r - 1]]] = True
    measurable = _ball_diameters(ref_size[1:], spacing) >= MEASURABLE_MM
    return {
        "n_ref": int(n_ref),
        "n_detected": int(detected.sum()),
        "n_pred": int(n_pred),
        "n_pred_tp": int(touches_detected.sum()),
        "n_pred_fp": int(n_pred - touches_any.sum()),
        "n_ref_measurable": int(measurable.sum()),
        "n_detected_measurable": int((detected & measurable).sum()),
    }


def _ball_diameters(voxels: np.ndarray, spacing: Spacing) -> np.ndarray:
    """Diameters (mm) of the balls whose volumes are these voxel counts'."""
    return np.cbrt(6 * voxels * float(np.prod(spacing)) / np.pi)


# ---------------------------------------------------------------- per case


def burden_metrics(pred_labels: np.ndarray, ref_labels: np.ndarray) -> dict:
    ref, pred = tumour_burden(ref_labels), tumour_burden(pred_labels)
    error = None if ref is None or pred is None else abs(pred - ref)
    return {"ref": ref, "pred": pred, "error": error}


def case_metrics(pred_labels: np.ndarray, ref_labels: np.ndarray, spacing: Spacing) -> dict:
    """All metrics of one case from two label maps on the same grid (spacing in mm per axis)."""
    if pred_labels.shape != ref_labels.shape:
        raise ValueError(f"label map shapes differ: {pred_labels.shape} vs {ref_labels.shape}")
    pred_tumour, ref_tumour = tumour_mask(pred_labels), tumour_mask(ref_labels)
    return {
        "liver": structure_metrics(liver_mask(pred_labels), liver_mask(ref_labels), spacing),
        "tumour": structure_metrics(pred_tumour, ref_tumour, spacing),
        "detection": lesion_detection(pred_tumour, ref_tumour, spacing),
        "burden": burden_metrics(pred_labels, ref_labels),
    }


# ---------------------------------------------------------------- data set


def mean_defined(values: Sequence[float | None]) -> float | None:
    """Mean of the values that are not None; None if there are none."""
    defined = [v for v in values if v is not None]
    return float(np.mean(defined)) if defined else None


def _ratio(numerator: float, denominator: float) -> float | None:
    return float(numerator) / float(denominator) if denominator else None


def _summarize_structure(structure_cases: list[dict]) -> dict[str, Any]:
    totals = {k: sum(c[k] for c in structure_cases) for k in ("n_intersection", "n_pred", "n_ref")}
    summary: dict[str, Any] = {
        "dice_per_case": mean_defined([c["dice"] for c in structure_cases]),
        "dice_global": (
            dice_from_counts(totals["n_intersection"], totals["n_pred"], totals["n_ref"])
            if structure_cases
            else None
        ),
    }
    for key in (*OVERLAP_KEYS[1:], *SURFACE_DISTANCE_KEYS):
        summary[key] = mean_defined([c[key] for c in structure_cases])
    return summary


def summarize(cases: list[dict]) -> dict:
    """Data-set summary of `case_metrics` results: per-case means (None skipped) and global Dice.

    Detection precision and recall pool the lesion counts of all cases (see
    the module docstring); they are None when there is nothing to divide by.
    """
    tumour = _summarize_structure([c["tumour"] for c in cases])
    detection = [c["detection"] for c in cases]
    tumour["detection_precision"] = _ratio(
        sum(d["n_pred_tp"] for d in detection), sum(d["n_pred"] for d in detection)
    )
    tumour["detection_recall"] = _ratio(
        sum(d["n_detected"] for d in detection), sum(d["n_ref"] for d in detection)
    )
    tumour["detection_recall_measurable"] = _ratio(
        sum(d["n_detected_measurable"] for d in detection),
        sum(d["n_ref_measurable"] for d in detection),
    )
    tumour["burden_error"] = mean_defined([c["burden"]["error"] for c in cases])
    return {
        "n_cases": len(cases),
        "liver": _summarize_structure([c["liver"] for c in cases]),
        "tumour": tumour,
    }
