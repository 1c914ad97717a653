"""Full resolution only where the liver is: a region of the scan, and the box of a run's grid
whose network output gives, inside the region, exactly the whole scan's labels.

The network is local at inference (batch norm is a per-voxel affine map then): an output
voxel depends only on input voxels within its receptive-field radius, and pooling only
on its position modulo the model's alignment. So a box of the grid that starts on the
alignment's lattice and reaches the radius beyond what the region needs computes, inside,
what the whole pass computes; the labels of a scan voxel need two grid voxels per axis
(linear resampling). Outside the region the scan is background.

A region comes from a liver mask (a locator run's coarse prediction, or a mask the user
has), as its bounding box plus a margin in millimetres (`check_margin`: finite, not
negative, and given only where a region is; a margin beyond the scan takes all of it).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ctseg.data.grids import Shape, linear_weights
from ctseg.errors import OptionError
from ctseg.labels import bounding_box, liver_mask


def check_margin(margin_mm: float | None, region: bool) -> None:
    """OptionError, before anything runs, unless `margin_mm` (None: not given) is a margin:
    a finite number of millimetres, not negative, given with a region to grow (`region`:
    a locator or a mask). The one check of `ctseg predict`, `ctseg evaluate` and
    `Segmenter`."""
    if margin_mm is None:
        return
    if isinstance(margin_mm, bool) or not isinstance(margin_mm, numbers.Real):
        raise OptionError(f"`margin_mm` must be a number of millimetres, got {margin_mm!r}")
    if not math.isfinite(margin_mm):
        raise OptionError(
            f"`margin_mm` must be a finite number of millimetres, got {margin_mm!r} (a margin "
            "beyond the scan, say 1e6, takes all of it)"
        )
    if margin_mm < 0:
        raise OptionError(f"`margin_mm` must not be negative, got {margin_mm:g} mm")
    if not region:
        raise OptionError("`margin_mm` applies only around a region: give `locate` or `roi`")


@dataclass(frozen=True)
class Region:
    """A box of the scan's canonical voxels, [lo, hi) per axis."""

    lo: Shape
    hi: Shape

    def to_json(self) -> dict[str, list[int]]:
        return {"lo": list(self.lo), "hi": list(self.hi)}


def region_of(
    labels: np.ndarray, spacing: Sequence[float], margin_mm: float, located: bool = True
) -> tuple[Region | None, str | None]:
    """The liver's box in `labels` (canonical, the scan's voxels) grown by `margin_mm`, or
    None with the reason to predict the whole scan instead: no liver, or (a `located`
    liver, a coarse model's) one whose box reaches the scan's top or bottom, where it may
    be cut and a coarse border is least sure."""
    box = bounding_box(liver_mask(labels))
    if box is None:
        return None, "no liver found" if located else "the region mask is empty"
    shape = labels.shape
    if located and (box[2].start == 0 or box[2].stop == shape[2]):
        return None, "the located liver reaches the scan's top or bottom slice (cut?)"
    # A margin beyond the scan (1e6 mm, or 1e308, whose voxels overflow a float) takes all.
    voxels = [float(margin_mm) / float(s) for s in spacing]
    grow = [n if v >= n else math.ceil(v) for v, n in zip(voxels, shape, strict=True)]
    lo = tuple(int(max(0, b.start - g)) for b, g in zip(box, grow, strict=True))
    hi = tuple(int(min(n, b.stop + g)) for b, n, g in zip(box, shape, grow, strict=True))
    return Region(lo, hi), None


@dataclass(frozen=True)
class GridWindow:
    """The box of a run's grid that a region needs: box voxel b is grid voxel b + `offset`;
    scan voxels [`lo`, `hi`) get exactly the whole pass's labels from its voxels `need`
    (per axis [lo, hi), the box's voxels their resampling reads)."""

    offset: Shape
    box: Shape
    lo: Shape
    hi: Shape
    need: tuple[tuple[int, int], tuple[int, int], tuple[int, int]]


def window_of(
    region: Region,
    scan_shape: Sequence[int],
    grid: Sequence[int],
    whole_box: Sequence[int],
    radius: int,
    multiple: int,
) -> GridWindow:
    """The grid box for `region` (scan voxels) on a grid of `grid` voxels whose whole pass
    runs on `whole_box` (the grid padded to the model's alignment): it starts on a multiple
    of `multiple` (the alignment, or more, so that boxes share compiled programs) and
    reaches `radius` (the receptive field) beyond the grid voxels the region's labels
    need, but never beyond the whole box, whose border padding it then shares."""
    offset, box, lo, hi, need = [], [], [], [], []
    for axis in range(3):
        n, g, whole = scan_shape[axis], grid[axis], whole_box[axis]
        first, second, _ = linear_weights(g, n)
        need_lo = int(first[region.lo[axis]])
        need_hi = int(second[region.hi[axis] - 1]) + 1
        start = max(0, need_lo - radius) // multiple * multiple
        stop = min(whole, -(-(need_hi + radius) // multiple) * multiple)
        # What the box computes exactly: all of it at the whole box's own borders.
        exact_lo = 0 if start == 0 else start + radius
        exact_hi = whole if stop == whole else stop - radius
        usable = np.flatnonzero((first >= exact_lo) & (second < exact_hi))
        inside = usable[(usable >= region.lo[axis]) & (usable < region.hi[axis])]
        offset.append(start)
        box.append(stop - start)
        lo.append(int(inside[0]) if inside.size else region.lo[axis])
        hi.append(int(inside[-1]) + 1 if inside.size else region.lo[axis])
        # No scan voxel to give: nothing narrows the box's computation either.
        reads = (int(first[lo[-1]]), int(second[hi[-1] - 1]) + 1) if inside.size else (start, stop)
        need.append((reads[0] - start, reads[1] - start))
    return GridWindow(tuple(offset), tuple(box), tuple(lo), tuple(hi), tuple(need))
