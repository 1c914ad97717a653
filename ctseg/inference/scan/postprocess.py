"""Post-processing of predicted label maps and the clinical numbers reported per scan.

Label maps hold 0 background, 1 liver, 2 tumour; the liver is every voxel with
label ≥ 1 (tumour is part of the organ), as in `metrics`. Connected components
are 26-connected, the convention `metrics` uses for lesions.
"""

from __future__ import annotations

from typing import Any

import cc3d
import numpy as np
from scipy import spatial

from ctseg.labels import LIVER, bounding_box, liver_mask, tumour_mask

# Tumours (the largest by volume) whose largest diameter `scan_stats` measures: RECIST
# follows at most 5 target lesions, and a noisy prediction can have tens of thousands.
MEASURED_TUMOURS = 20
# A tumour given as more voxels than this is rebuilt as a mask to find its hull's candidates.
_CANDIDATES_FROM = 1000
# Rows of the distance matrix between hull vertices computed at once: 8 kB per vertex.
_CHUNK = 1024


def components(mask: np.ndarray) -> tuple[np.ndarray, int]:
    """The 26-connected components of a boolean mask, numbered 1 … count as
    `scipy.ndimage.label` numbers them (in C order of their first voxel), and their count.

    cc3d labels a mask several times faster than scipy (measured:
    docs/experiments/design-figures.md#components). It
    numbers a C-contiguous array's components in that order; a view is copied to one."""
    pieces = cc3d.connected_components(np.ascontiguousarray(mask), connectivity=26)
    return pieces, int(pieces.max(initial=0))


def largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 26-connected component of a boolean mask (all False if it is empty; of
    equal largest ones, the first in C order), found in the mask's bounding box."""
    box = bounding_box(mask)
    kept = np.zeros(mask.shape, dtype=bool)
    if box is None:
        return kept
    pieces, count = components(mask[box])
    if count > 1:
        # Counted over the mask's voxels only: a bincount of every voxel's uint32 takes 10×.
        sizes = np.bincount(pieces[mask[box]], minlength=count + 1)
        sizes[0] = 0
        kept[box] = pieces == sizes.argmax()
    else:
        kept[box] = pieces > 0
    return kept


def clean_labels(
    labels: np.ndarray, keep_largest_liver: bool, tumour_inside_liver: bool
) -> np.ndarray:
    """Post-processed copy of a label map, computed in the liver's bounding box.

    `keep_largest_liver`: only the largest connected piece of liver (tumour
    included) survives; tumour in the dropped pieces goes with them.
    `tumour_inside_liver`: pieces of liver-or-tumour that hold no liver voxel
    at all (tumour floating outside any liver) are dropped.
    """
    labels = np.array(labels, dtype=np.uint8)
    box = bounding_box(liver_mask(labels))
    if box is None:
        return labels
    inside = labels[box]  # a view: what changes here changes `labels`
    if keep_largest_liver:
        inside[~largest_component(inside >= LIVER)] = 0
        # One piece is left: with `tumour_inside_liver`, it stays only if it holds liver.
        if tumour_inside_liver and not np.any(inside == LIVER):
            inside[...] = 0
    elif tumour_inside_liver:
        pieces, count = components(inside >= LIVER)
        has_liver = np.bincount(pieces[inside == LIVER], minlength=count + 1) > 0
        has_liver[0] = True  # background stays what it is
        inside[~has_liver[pieces]] = 0
    return labels


def max_diameter_mm(voxels: np.ndarray, affine: np.ndarray) -> float:
    """Largest distance in mm between the centres of the given voxel indices [n, 3].

    The farthest pair lies on the convex hull, so only its vertices are compared. In
    bounded time and memory on any shape: a solid tumour is reduced to the voxels that
    may be hull vertices first (`_hull_candidates`), and a flat or straight one (one
    slice thick, say, where a 3-D hull does not exist) is measured in its plane or along
    its line.
    """
    voxels = np.asarray(voxels)
    if len(voxels) > _CANDIDATES_FROM:
        corner = voxels.min(axis=0).astype(np.int64)
        offsets = voxels.astype(np.int64) - corner
        mask = np.zeros(tuple(offsets.max(axis=0) + 1), dtype=bool)
        mask[tuple(offsets.T)] = True
        voxels = _hull_candidates(mask) + corner
    return _diameter_mm(voxels, affine)


def _diameter_mm(voxels: np.ndarray, affine: np.ndarray) -> float:
    """`max_diameter_mm` of voxels that hold every hull vertex of the tumour's."""
    points = voxels @ affine[:3, :3].T  # the translation cancels in differences
    if len(points) < 2:
        return 0.0
    return _farthest_pair(_hull_vertices(points))


def _hull_candidates(mask: np.ndarray) -> np.ndarray:
    """The voxels [n, 3] of a 3-D mask that may be vertices of its convex hull: those first
    or last of their row along every axis. A voxel with others of its row on both sides
    lies on the segment between them, never a vertex; a solid tumour keeps a few of its
    surface voxels, a sprawling one of thousands its tips."""
    kept = mask.copy()
    for axis in range(3):
        ends = np.zeros_like(mask)
        last = mask.shape[axis] - 1
        for index in (np.argmax(mask, axis=axis), last - np.argmax(np.flip(mask, axis), axis=axis)):
            # Rows without a voxel mark their first; `kept` holds only the mask's voxels.
            np.put_along_axis(ends, np.expand_dims(index, axis), True, axis)
        kept &= ends
    return np.argwhere(kept)


def _hull_vertices(points: np.ndarray) -> np.ndarray:
    """The points on the convex hull, found in the points' own dimension (3-D, a plane
    or a line): Qhull refuses a 3-D hull of coplanar points."""
    centred = points - points.mean(axis=0)
    # Principal axes from the 3×3 scatter matrix (an SVD would hold n × 3 more numbers).
    variances, axes = np.linalg.eigh(centred.T @ centred)
    spread = np.sqrt(np.clip(variances[::-1], 0.0, None))
    axes = axes[:, ::-1].T  # rows, largest spread first
    # Flatter than this, the points are measured in their plane: what is lost (a voxel
    # or so off it, among a million in it) changes the diameter by far less than a voxel.
    rank = int(np.count_nonzero(spread > 1e-6 * max(float(spread[0]), 1e-300)))
    if rank <= 1:  # a line (or one point): its two ends
        along = centred @ axes[0]
        return points[[int(along.argmin()), int(along.argmax())]]
    if len(points) <= rank + 1:
        return points
    flat = centred @ axes[:rank].T  # the points in their own plane or space
    try:
        return points[spatial.ConvexHull(flat).vertices]
    except spatial.QhullError:  # nearly degenerate beyond the rank's tolerance: joggled
        return points[spatial.ConvexHull(flat, qhull_options="QJ").vertices]


def _farthest_pair(points: np.ndarray) -> float:
    """The largest distance between two of the points, a block of rows at a time."""
    best = 0.0
    for start in range(0, len(points), _CHUNK):
        block = spatial.distance.cdist(points[start : start + _CHUNK], points[start:])
        best = max(best, float(block.max()))
    return best


def scan_stats(labels: np.ndarray, affine: np.ndarray) -> dict[str, Any]:
    """Volumes (mL), tumours (count, each one's volume and place, diameters), burden (%).

    `affine` maps the label map's voxel indices to mm; oblique and sheared
    voxels are measured exactly through it. Every tumour is listed, largest
    first; the largest diameter is measured for the `MEASURED_TUMOURS` largest
    (a noisy prediction has tens of thousands of specks, and a diameter costs a
    convex hull each), and `largest_tumour_diameter_mm` is the longest of those.
    """
    voxel_ml = abs(float(np.linalg.det(affine[:3, :3]))) / 1000.0
    liver_voxels = int(np.count_nonzero(liver_mask(labels)))
    tumour = tumour_mask(labels)
    tumour_voxels = int(np.count_nonzero(tumour))
    tumours = _tumours(tumour, affine, voxel_ml)
    return {
        "liver_volume_ml": liver_voxels * voxel_ml,
        "tumour_volume_ml": tumour_voxels * voxel_ml,
        "tumour_count": len(tumours),
        "largest_tumour_diameter_mm": max(
            (t["diameter_mm"] for t in tumours[:MEASURED_TUMOURS]), default=0.0
        ),
        # `labels.tumour_burden`, from the counts at hand.
        "tumour_burden_percent": 100.0 * (tumour_voxels / liver_voxels) if liver_voxels else 0.0,
        "tumours": tumours,
    }


def _tumours(tumour: np.ndarray, affine: np.ndarray, voxel_ml: float) -> list[dict[str, Any]]:
    """Each tumour's volume, place and (the `MEASURED_TUMOURS` largest) diameter, largest
    first; found in the tumours' bounding box, each measured in its own."""
    box = bounding_box(tumour)
    if box is None:
        return []
    origin = np.array([s.start for s in box])
    pieces, _ = components(tumour[box])
    # Sizes and bounding boxes in one pass over the pieces (index 0: the background).
    statistics = cc3d.statistics(pieces)
    sizes = statistics["voxel_counts"][1:].astype(np.int64)  # unsigned: negated below
    objects = statistics["bounding_boxes"][1:]
    # Where each tumour is: the centre of its bounding box, in mm.
    centres = np.array([[(s.start + s.stop - 1) / 2 for s in o] for o in objects]) + origin
    centres_mm = centres @ affine[:3, :3].T + affine[:3, 3]
    tumours = []
    for rank, piece in enumerate(np.argsort(-sizes, kind="stable")):
        entry = {
            "volume_ml": float(sizes[piece] * voxel_ml),
            "box_centre_mm": [round(float(c), 2) for c in centres_mm[piece]],
        }
        if rank < MEASURED_TUMOURS:
            where = objects[piece]
            corner = np.array([s.start for s in where]) + origin
            voxels = _hull_candidates(pieces[where] == piece + 1) + corner
            entry["diameter_mm"] = _diameter_mm(voxels.astype(float), affine)
        tumours.append(entry)
    return tumours
