"""A scan brought to the run's grid on the devices, and the resampling both ways share.

The way there (`unit_box`): the scan's int16 HU sent to the devices once, resampled
linearly onto a box of the grid, rounded to int16 HU and HU-windowed, as training's
preprocessing does on the host (`ctseg.data.grids`). The way back is
`ctseg.inference.scan.way_back`'s.

On the devices a scan is padded to a rung of a ladder of sizes (`padded`), or held in the
backend's canvas (`ctseg.inference.scan.canvas`), and the resampling (`resampled`) reads
tables of source voxels and weights (`grids.axis_table`) as arguments, so every program
depends on the padded shapes and the box, not on the scan's extent: scans of other
extents reuse the programs the first one compiled.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ctseg.data import grids
from ctseg.data.grids import Shape
from ctseg.memory import aligned_zeros

_INT16 = np.iinfo(np.int16)

# Scans are padded to a rung of this multiple's ladder (`grids.ladder_rung`) on the devices,
# so that the programs between a scan and a grid depend on the rungs, not on the extents.
SCAN_MULTIPLE = 16
Tables = tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]  # per axis: first, second, weight
# The orders of axes where scans are held in a canvas, one for every scan each way: an order
# from the padded shapes would change as the canvas grows (and on the way there round a
# voxel's HU the other way now and then). The way there resamples the slices last, the way
# back (`way_back`) first: their count changes the most from scan to grid and back (a
# 512×512×63 scan from a 560×560×320 grid).
SLICES_LAST = (0, 1, 2)
SLICES_FIRST = (2, 0, 1)


def padded(shape: Sequence[int]) -> Shape:
    """A scan's shape padded to the ladder, as the devices hold it."""
    return tuple(grids.ladder_rung(n, SCAN_MULTIPLE) for n in shape)


def tables_of(tables: Sequence[grids.AxisTable]) -> Tables:
    """Axis tables as the resampling programs take them (arguments, not constants)."""
    return tuple((t.first, t.second, t.weight) for t in tables)


@partial(jax.jit, static_argnums=2)
def resampled(x: jax.Array, tables: Tables, order: tuple[int, ...]) -> jax.Array:
    """`x` [x, y, z, ...] resampled linearly along each axis, in `order`, by its table."""
    for axis in order:
        x = lerp(x, *tables[axis], axis)
    return x


def lerp(x: jax.Array, first: Any, second: Any, weight: Any, axis: int) -> jax.Array:
    """`x` along `axis` at the voxels between `first` and `second`, `weight` of the way: the
    one blend of every path (`resampled`, and a window's way back,
    `way_back.Space.window_probabilities`)."""
    weight = jnp.reshape(weight, [-1 if a == axis else 1 for a in range(x.ndim)])
    return jnp.take(x, first, axis=axis) * (1 - weight) + jnp.take(x, second, axis=axis) * weight


def unit_box(
    hu: np.ndarray,
    grid: Sequence[int],
    offset: Sequence[int],
    box: Sequence[int],
    window: Sequence[float],
    device: Any,
    scan_box: Sequence[int] | None = None,
    order: tuple[int, ...] | None = None,
) -> jax.Array:
    """`grids.hu_to_unit(grids.to_box(hu, grid, offset, box, order=1), window)` on `device`:
    the scan's HU sent once (int16 where they fit, padded to `scan_box`: default the
    ladder's rung, `padded`), resampled linearly there in float32, rounded to int16 HU as
    training's store holds them, and HU-windowed. `order`: the axes resampled in (default
    the most shrinking first, from the padded shapes).

    scipy's resampling runs in float64: a voxel whose value lies within ~1e-4 HU of a
    rounding boundary may round the other way (1 HU apart). The program depends on the
    padded scan's shape, the box's and the window only."""
    scan_box = padded(hu.shape) if scan_box is None else tuple(scan_box)
    scan = aligned_zeros(scan_box, _sent_dtype(hu))  # sent to the CPU without a copy
    scan[: hu.shape[0], : hu.shape[1], : hu.shape[2]] = hu
    axes = [
        grids.axis_table(n, g, o, b) for n, g, o, b in zip(hu.shape, grid, offset, box, strict=True)
    ]
    inside = tuple(t.inside for t in axes)
    order = order or tuple(sorted(range(3), key=lambda a: box[a] / scan.shape[a]))
    window = (float(window[0]), float(window[1]))
    return _unit_box(jax.device_put(scan, device), tables_of(axes), inside, order, window)


def _sent_dtype(hu: np.ndarray) -> np.dtype:
    """int16 for integer HU that fit it (CT as stored: half the bytes), else float32."""
    if hu.dtype.kind in "biu" and (
        hu.dtype.itemsize <= 1 or (hu.size and _INT16.min <= hu.min() and hu.max() <= _INT16.max)
    ):
        return np.dtype(np.int16)
    return np.dtype(np.float32)


@partial(jax.jit, static_argnums=(3, 4))
def _unit_box(
    scan: jax.Array,
    tables: Tables,
    inside: tuple[np.ndarray, ...],
    order: tuple[int, ...],
    window: tuple[float, float],
) -> jax.Array:
    hu = resampled(scan.astype(jnp.float32), tables, order)
    hu = jnp.clip(jnp.rint(hu), _INT16.min, _INT16.max)
    mask = inside[0][:, None, None] & inside[1][None, :, None] & inside[2][None, None, :]
    return grids.hu_to_unit(jnp.where(mask, hu, grids.AIR_HU), window, jnp)
