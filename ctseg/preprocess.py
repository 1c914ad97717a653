"""Pure array functions: resampling to the R³ grid and back, the HU window, label checks.

The grid covers the scan's whole field of view: every canonical axis of n voxels
is stretched onto R grid voxels (an anisotropic stretch, as the Mesh-TensorFlow
LiTS U-Net did), with the voxel-centre convention

    grid voxel i  <->  source voxel coordinate (i + 0.5) * n / R - 0.5

so the first and last voxel faces of the scan and the grid coincide and
`from_grid` is the exact inverse coordinate map of `to_grid`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import ndimage

from ctseg.errors import CtsegError

LABEL_VALUES = (0, 1, 2)  # background, liver, tumour
_INT16 = np.iinfo(np.int16)
# Slices of the first axis handled at a time by `image_to_grid` and `check_labels`: at
# 512 voxels a side, a slab's temporaries take tens of MiB instead of 512 MiB each.
_SLAB = 32


def _resample(
    array: np.ndarray,
    shape: Sequence[int],
    order: int,
    dtype: np.dtype,
    rows: slice = slice(None),
) -> np.ndarray:
    """Resample a 3-D array covering a field of view onto `shape` voxels covering the same one.

    `rows` restricts the output to that range of the first axis (a slab of the full result).
    """
    scale = np.array(array.shape, dtype=float) / np.array(shape, dtype=float)
    start, stop, _ = rows.indices(shape[0])
    offset = 0.5 * scale - 0.5
    offset[0] += scale[0] * start  # output row 0 of the slab is row `start` of the full grid
    return ndimage.affine_transform(
        array,
        scale,  # a 1-D matrix means a diagonal one
        offset=offset,
        output_shape=(stop - start, *shape[1:]),
        output=dtype,
        order=order,
        mode="nearest",
    )


def to_grid(array: np.ndarray, resolution: int, order: int) -> np.ndarray:
    """Resample a canonical 3-D array onto an R×R×R grid.

    order=1 (images) returns float32; the caller rounds to int16 HU (`hu_to_int16`).
    order=0 (labels) keeps the input dtype and takes only values present in the input.
    """
    dtype = np.float32 if order > 0 else array.dtype
    return _resample(array, (resolution,) * 3, order, dtype)


def image_to_grid(hu: np.ndarray, resolution: int) -> np.ndarray:
    """Resample a canonical HU image onto the R×R×R grid as int16 HU (`hu_to_int16`).

    Equal to `hu_to_int16(to_grid(hu, resolution, order=1))`, but made one slab of
    the first axis at a time, so no whole float32 grid (or its rounding
    temporaries) is ever held.
    """
    grid = np.empty((resolution,) * 3, dtype=np.int16)
    for start in range(0, resolution, _SLAB):
        rows = slice(start, min(start + _SLAB, resolution))
        grid[rows] = hu_to_int16(_resample(hu, grid.shape, 1, np.float32, rows))
    return grid


def from_grid(grid_array: np.ndarray, shape: Sequence[int], order: int = 1) -> np.ndarray:
    """Map an [R,R,R] or [R,R,R,C] grid array back onto the canonical scan shape.

    Channels (e.g. class probabilities) are resampled one at a time into a
    preallocated output, so a 512×512×500×3 float32 result needs no second copy.
    """
    dtype = np.float32 if order > 0 else grid_array.dtype
    if grid_array.ndim == 3:
        return _resample(grid_array, shape, order, dtype)
    out = np.empty((*shape, grid_array.shape[3]), dtype=dtype)
    for channel in range(grid_array.shape[3]):
        out[..., channel] = _resample(grid_array[..., channel], shape, order, dtype)
    return out


def grid_affine(affine: np.ndarray, shape: Sequence[int], resolution: int) -> np.ndarray:
    """The voxel -> RAS affine of the R³ grid made from a canonical array of `shape`.

    Grid voxels are n·spacing/R wide along an axis of n voxels.
    """
    scale = np.array(shape, dtype=float) / resolution
    grid_to_source = np.eye(4)
    grid_to_source[:3, :3] = np.diag(scale)
    grid_to_source[:3, 3] = 0.5 * scale - 0.5
    return affine @ grid_to_source


def hu_to_int16(hu: np.ndarray) -> np.ndarray:
    """Round Hounsfield units to the int16 the prepared store keeps."""
    return np.clip(np.rint(hu), _INT16.min, _INT16.max).astype(np.int16)


def hu_to_unit(hu: np.ndarray, window: Sequence[float]) -> np.ndarray:
    """Clip HU to the window [low, high] and scale it to [-1, 1] (float32)."""
    low, high = float(window[0]), float(window[1])
    clipped = np.clip(np.asarray(hu, dtype=np.float32), low, high)
    return (clipped - low) * np.float32(2.0 / (high - low)) - np.float32(1.0)


def check_labels(labels: np.ndarray, name: str) -> np.ndarray:
    """Return the label map as uint8, or raise if it holds values other than 0, 1, 2."""
    # Comparisons, not np.unique: a full sort of a 512×512×500 map takes seconds. Slab by
    # slab, so the boolean temporaries stay small next to the label map itself.
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
