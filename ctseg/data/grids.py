"""Pure array functions: resampling to the grid and back, the box the network sees, the
HU window.

A scan's *grid* covers its whole field of view: every canonical axis of n voxels is
resampled onto g grid voxels, with the voxel-centre convention

    grid voxel i  <->  source voxel coordinate (i + 0.5) * n / g - 0.5

so the first and last voxel faces of the scan and the grid coincide, and the way back
(`ctseg.inference.scan.way_back`, by `linear_weights`) is the exact inverse coordinate map of
`to_grid`. Two grids (`data.grid`):

- ``cube``: g = R on every axis, the field of view stretched onto R³ (an anisotropic
  stretch, as the Mesh-TensorFlow LiTS U-Net did);
- ``spacing``: g = round(n · spacing / data.spacing), nnU-Net's resampling to a fixed
  voxel size: anatomy keeps its physical size whatever the scan covers.

The network sees a *box* of the grid: box voxel b is grid voxel b + offset, and box
voxels outside the grid are air (images) or background (labels). On the cube the
box is the grid. On the spacing grid, training takes R³ boxes of the stored grid
(validation the one around the liver, `training_offset`: inside the grid where the
grid is longer, padded where it is shorter), and prediction the whole grid padded
to the model's alignment (`inference_box`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import ndimage

from ctseg.config import DataConfig

AIR_HU = -1024  # what a box holds beyond the scan: the air around the patient
_INT16 = np.iinfo(np.int16)
Shape = tuple[int, int, int]
# Slices of the first axis handled at a time by `image_to_grid`: at
# 512 voxels a side, a slab's temporaries take tens of MiB instead of 512 MiB each.
_SLAB = 32


def as_shape(grid: int | Sequence[int]) -> Shape:
    """A grid's shape: R means R³."""
    return (grid,) * 3 if isinstance(grid, int) else tuple(int(n) for n in grid)


def _resample(
    array: np.ndarray,
    shape: Sequence[int],
    order: int,
    dtype: np.dtype,
    start: Sequence[int] = (0, 0, 0),
    size: Sequence[int] | None = None,
) -> np.ndarray:
    """Resample a 3-D array covering a field of view onto `shape` voxels covering the same one.

    `start` and `size` restrict the output to that region of the full result (inside it).
    """
    scale = np.array(array.shape, dtype=float) / np.array(shape, dtype=float)
    # Output voxel 0 of the region is voxel `start` of the full grid.
    offset = 0.5 * scale - 0.5 + scale * np.asarray(start, dtype=float)
    return ndimage.affine_transform(
        array,
        scale,  # a 1-D matrix means a diagonal one
        offset=offset,
        output_shape=tuple(shape if size is None else size),
        output=dtype,
        order=order,
        mode="nearest",
    )


def to_grid(array: np.ndarray, grid: int | Sequence[int], order: int) -> np.ndarray:
    """Resample a canonical 3-D array onto a grid of `grid` voxels (R: R³).

    order=1 (images) returns float32; the caller rounds to int16 HU (`hu_to_int16`).
    order=0 (labels) keeps the input dtype and takes only values present in the input.
    """
    dtype = np.float32 if order > 0 else array.dtype
    return _resample(array, as_shape(grid), order, dtype)


def image_to_grid(hu: np.ndarray, grid: int | Sequence[int]) -> np.ndarray:
    """Resample a canonical HU image onto a grid (R: R³) as int16 HU (`hu_to_int16`).

    Equal to `hu_to_int16(to_grid(hu, grid, order=1))`, but made one slab of the first
    axis at a time, so no whole float32 grid (or its rounding temporaries) is ever held.
    """
    shape = as_shape(grid)
    return to_box(hu, shape, (0, 0, 0), shape, order=1)


def to_box(
    array: np.ndarray,
    grid: Sequence[int],
    offset: Sequence[int],
    box: Sequence[int],
    order: int,
) -> np.ndarray:
    """The box of `box` voxels whose voxel b is voxel b + `offset` of the scan's grid of
    `grid` voxels; outside the grid, air (order 1: an HU image, returned as int16 HU) or
    background (order 0: labels, their dtype). Only the box's part of the grid is
    resampled, one slab of the first axis at a time."""
    image = order > 0
    out = np.full(tuple(box), AIR_HU if image else 0, np.int16 if image else array.dtype)
    lo = [max(o, 0) for o in offset]
    hi = [min(o + b, g) for o, b, g in zip(offset, box, grid, strict=True)]
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return out  # the box lies outside the scan
    inside = [slice(low - o, h - o) for low, h, o in zip(lo, hi, offset, strict=True)]
    size = [h - low for low, h in zip(lo, hi, strict=True)]
    for first in range(0, size[0], _SLAB):
        rows = min(_SLAB, size[0] - first)
        region = _resample(
            array,
            grid,
            order,
            np.float32 if image else array.dtype,
            (lo[0] + first, lo[1], lo[2]),
            (rows, size[1], size[2]),
        )
        target = inside[0].start + first
        out[target : target + rows, inside[1], inside[2]] = hu_to_int16(region) if image else region
    return out


def linear_weights(size: int, out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Linear interpolation from `size` to `out` voxels covering one field of view, as
    `to_grid` does it (order 1): for each output voxel, the two source voxels it lies between and
    its weight towards the second (voxel centres; edge values beyond the last centre)."""
    coordinate = (np.arange(out) + 0.5) * (size / out) - 0.5
    lower = np.floor(coordinate)
    weight = (coordinate - lower).astype(np.float32)
    first = np.clip(lower, 0, size - 1).astype(np.int32)
    second = np.clip(lower + 1, 0, size - 1).astype(np.int32)
    return first, second, weight


def grid_affine(
    affine: np.ndarray,
    shape: Sequence[int],
    grid: int | Sequence[int],
    offset: Sequence[int] = (0, 0, 0),
) -> np.ndarray:
    """The voxel -> RAS affine of the grid (R: R³) made from a canonical array of `shape`,
    or of its box whose voxel 0 is grid voxel `offset`.

    Grid voxels are n·spacing/g wide along an axis of n voxels.
    """
    scale = np.array(shape, dtype=float) / np.array(as_shape(grid), dtype=float)
    grid_to_source = np.eye(4)
    grid_to_source[:3, :3] = np.diag(scale)
    grid_to_source[:3, 3] = 0.5 * scale - 0.5 + scale * np.asarray(offset, dtype=float)
    return affine @ grid_to_source


@dataclass(frozen=True)
class GridSpec:
    """How scans go onto the network's grid: `data.grid`, `data.resolution`, `data.spacing`."""

    kind: str  # "cube" or "spacing"
    resolution: int  # R: the cube's side, or the side of the spacing grid's training box
    spacing: tuple[float, float, float]  # mm, on the spacing grid; zeros on the cube

    @classmethod
    def of(cls, data: DataConfig) -> GridSpec:
        spacing = tuple(data.spacing) if data.grid == "spacing" else (0.0, 0.0, 0.0)
        return cls(data.grid, data.resolution, spacing)

    def grid_of(self, shape: Sequence[int], spacing: Sequence[float]) -> Shape:
        """The grid of a canonical scan of `shape` voxels of `spacing` mm."""
        if self.kind == "cube":
            return (self.resolution,) * 3
        return spacing_grid(shape, spacing, self.spacing)

    def describe(self) -> str:
        """`48³ cube` or `48³ boxes at 4 × 4 × 4 mm`."""
        if self.kind == "cube":
            return f"{self.resolution}³ cube"
        return f"{self.resolution}³ boxes at {self.voxel_size}"

    @property
    def voxel_size(self) -> str:
        """The spacing grid's voxel in words: `4 × 4 × 4 mm`."""
        return f"{' × '.join(f'{v:g}' for v in self.spacing)} mm"


def spacing_grid(shape: Sequence[int], spacing: Sequence[float], target: Sequence[float]) -> Shape:
    """The grid of a scan of `shape` voxels of `spacing` mm at `target` mm: round(n · spacing /
    target) voxels per axis (at least 1), covering the same field of view."""
    return tuple(max(1, round(n * s / t)) for n, s, t in zip(shape, spacing, target, strict=True))


def training_offset(
    grid: Sequence[int], box: int, liver: tuple[Sequence[int], Sequence[int]] | None
) -> Shape:
    """Where an R³ training box (`box` = R) goes on a scan's grid: per axis, centred on the
    liver's bounding box (`liver`: its first and last-plus-one grid voxels; None: the
    grid's centre) and kept inside the grid where the grid is longer than the box;
    centred (padded on both sides) where it is shorter."""
    offset = []
    for axis, size in enumerate(grid):
        if size <= box:
            offset.append(-((box - size) // 2))
            continue
        centre = size / 2 if liver is None else (liver[0][axis] + liver[1][axis]) / 2
        offset.append(int(min(max(round(centre - box / 2), 0), size - box)))
    return tuple(offset)


def inference_box(grid: Sequence[int], multiple: int, ladder: bool = True) -> Shape:
    """The box prediction runs the network on: the whole grid, each side rounded up to a
    rung of the `multiple`'s ladder (`ladder_rung`: every U-Net level pools evenly, and
    scans of different extents share one compiled program); box voxel b is grid voxel b.
    Without `ladder`, to the next multiple: the fewest voxels, where nothing is compiled
    per shape (ONNX Runtime's sessions take a second)."""
    if not ladder:
        return tuple(-(-n // multiple) * multiple for n in grid)
    return tuple(ladder_rung(n, multiple) for n in grid)


# Rungs per octave of `ladder_rung`: 4 gives sides of multiple × 1, 2, 3, 4, 5, 6, 7, 8,
# 10, 12, 14, 16, 20, … (each at most 1.25× the one below from 4 on). A box costs one
# compile per machine (the persistent cache keeps it); the padding costs network time on
# every scan. On LiTS-like scans, 4 rungs needed about a third of the boxes that rounding
# each side to the multiple needs, for little padding; fewer rungs pad far more
# (docs/experiments/design-figures.md#the-box-ladder).
LADDER_STEPS = 4


def ladder_rung(size: int, multiple: int) -> int:
    """The smallest side of the ladder multiple × ⌈2^k (1 + j / LADDER_STEPS)⌉ that holds
    `size` voxels: a few shapes cover sides of any length, from four multiples on each
    at most 1.25× the size it holds."""
    units = -(-max(int(size), 1) // multiple)
    octave = 1 << max(units.bit_length() - 1, 0)  # 2^k ≤ units
    step = -(-(units - octave) * LADDER_STEPS // octave)  # j, the first rung at or above
    return -(-octave * (LADDER_STEPS + step) // LADDER_STEPS) * multiple


@dataclass(frozen=True)
class AxisTable:
    """Linear resampling along one axis, as arrays a compiled program takes (so that its
    shapes are only the padded ones): output voxel i reads source voxels `first[i]` and
    `second[i]`, `weight[i]` of the way to the second; where `inside[i]` is False the
    output lies beyond the grid (air) or is padding."""

    first: np.ndarray  # int32
    second: np.ndarray  # int32
    weight: np.ndarray  # float32
    inside: np.ndarray  # bool


def axis_table(size: int, out: int, offset: int = 0, length: int | None = None) -> AxisTable:
    """`linear_weights(size, out)` for the output voxels offset … offset + length − 1 (default:
    all `out`), those outside [0, out) reading voxel 0 at weight 0, not `inside`."""
    length = out if length is None else length
    first, second, weight = linear_weights(size, out)
    wanted = np.arange(offset, offset + length)
    inside = (wanted >= 0) & (wanted < out)
    where = np.clip(wanted, 0, out - 1)
    return AxisTable(
        np.where(inside, first[where], 0).astype(np.int32),
        np.where(inside, second[where], 0).astype(np.int32),
        np.where(inside, weight[where], 0).astype(np.float32),
        inside,
    )


def hu_to_int16(hu: np.ndarray) -> np.ndarray:
    """Round Hounsfield units to the int16 the prepared store keeps."""
    return np.clip(np.rint(hu), _INT16.min, _INT16.max).astype(np.int16)


def hu_to_unit(hu: np.ndarray, window: Sequence[float], xp: Any = np) -> np.ndarray:
    """Clip HU to the window [low, high] and scale it to [-1, 1] (float32); `xp` numpy on
    the host, jax.numpy where the devices scale their own blocks (the same numbers)."""
    low, high = float(window[0]), float(window[1])
    clipped = xp.clip(xp.asarray(hu, dtype=np.float32), low, high)
    return (clipped - low) * np.float32(2.0 / (high - low)) - np.float32(1.0)
