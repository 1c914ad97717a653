"""The label values of a segmentation and what they mean: the one definition every module uses.

LiTS's values: 0 background, 1 liver, 2 tumour. Tumours lie inside the liver, so the
liver as an organ (what the LiTS liver metrics score, what a liver volume measures) is
every voxel labelled liver or tumour: `liver_mask`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ctseg.errors import CtsegError

BACKGROUND, LIVER, TUMOUR = 0, 1, 2
LABEL_VALUES = (BACKGROUND, LIVER, TUMOUR)
NUM_CLASSES = len(LABEL_VALUES)

# Slices of the first axis checked at a time: at 512 voxels a side, a slab's boolean
# temporaries take tens of MiB instead of 512 MiB each.
_SLAB = 32


def liver_mask(labels: Any) -> Any:
    """The whole liver, tumours included (numpy or JAX arrays alike)."""
    return labels >= LIVER


def tumour_mask(labels: Any) -> Any:
    return labels == TUMOUR


# ---- Dice, below evaluation (which reports it) and training (which validates with it)


def dice_from_counts(intersection: float, n_pred: float, n_ref: float) -> float:
    """Dice = 2|P∩R| / (|P|+|R|); 1 when both are empty."""
    total = float(n_pred) + float(n_ref)
    return 1.0 if total == 0 else 2.0 * float(intersection) / total


def mask_dice(pred: np.ndarray, ref: np.ndarray) -> float:
    """Dice of two boolean masks; 1 when both are empty."""
    counts = np.count_nonzero(pred & ref), np.count_nonzero(pred), np.count_nonzero(ref)
    return dice_from_counts(*counts)


def grid_dice(pred_labels: np.ndarray, ref_labels: np.ndarray) -> dict[str, float]:
    """Liver and tumour Dice only: the cheap report on the training grid."""
    return {
        "liver": mask_dice(liver_mask(pred_labels), liver_mask(ref_labels)),
        "tumour": mask_dice(tumour_mask(pred_labels), tumour_mask(ref_labels)),
    }


def check_labels(labels: np.ndarray, name: str) -> np.ndarray:
    """The label map as uint8, or CtsegError naming the values other than 0, 1, 2 it holds
    (non-integer values such as 1.5 included: LiTS stores some segmentations as floats)."""
    # Comparisons, not np.unique: a full sort of a 512×512×500 map takes seconds.
    outside: set[float] = set()
    for start in range(0, labels.shape[0], _SLAB):
        slab = labels[start : start + _SLAB]
        bad = np.ones(slab.shape, dtype=bool)
        for value in LABEL_VALUES:
            bad &= slab != value
        outside.update(np.unique(slab[bad]).tolist())
    if outside:
        shown = ", ".join(f"{v:g}" for v in sorted(outside)[:10])
        raise CtsegError(
            f"{name} has label values outside 0 (background), 1 (liver), 2 (tumour): {shown}"
        )
    return labels.astype(np.uint8, copy=False)


def bounding_box(mask: np.ndarray, pad: int = 0) -> tuple[slice, ...] | None:
    """The smallest box holding every True voxel, grown by `pad` (clipped); None if empty."""
    box = []
    for axis in range(mask.ndim):
        other_axes = tuple(a for a in range(mask.ndim) if a != axis)
        present = np.flatnonzero(np.any(mask, axis=other_axes))
        if present.size == 0:
            return None
        box.append(slice(max(present[0] - pad, 0), min(present[-1] + 1 + pad, mask.shape[axis])))
    return tuple(box)


def tumour_burden(labels: np.ndarray) -> float | None:
    """Tumour volume / liver volume (liver including tumour); None without liver."""
    n_liver = np.count_nonzero(liver_mask(labels))
    return None if n_liver == 0 else float(np.count_nonzero(tumour_mask(labels))) / float(n_liver)
