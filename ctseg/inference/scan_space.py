"""Class probabilities on the run's grid brought back to a scan's own voxels: cropped to the
scan's grid, resampled linearly, argmax, an ensemble's mean, all where the backend runs
(under JAX on the devices: what comes back to the host is the uint8 label map, and
probabilities only where a caller asks for them).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from scipy import ndimage

from ctseg.data import grids
from ctseg.data.grids import linear_weights


@partial(jax.jit, static_argnums=1)
def _resampled(probabilities: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Grid probabilities [x, y, z, C] resampled linearly onto `shape` (the scan's voxels)."""
    x = probabilities
    # Shrinking axes first keeps the intermediates small (a 512³ grid onto 63 slices).
    for axis in sorted(range(3), key=lambda a: shape[a] / x.shape[a]):
        if shape[axis] == x.shape[axis]:
            continue
        x = _lerp(x, *linear_weights(x.shape[axis], shape[axis]), axis)
    return x


@partial(jax.jit, static_argnums=(1, 2))
def _on_scan(
    probabilities: jax.Array, shape: tuple[int, ...], with_probabilities: bool
) -> tuple[jax.Array, jax.Array | None]:
    """Grid probabilities [x, y, z, C] resampled linearly onto `shape`, and their argmax."""
    x = _resampled(probabilities, shape)
    labels = jnp.argmax(x, axis=-1).astype(jnp.uint8)
    return labels, (x if with_probabilities else None)


def scan_labels(
    probabilities: np.ndarray | jax.Array, shape: Sequence[int], with_probabilities: bool = False
) -> tuple[np.ndarray, np.ndarray | None]:
    """Labels (uint8) on the scan's canonical voxels from grid probabilities [x, y, z, 3]:
    linear on the probabilities, then the argmax (smoother borders than resampling
    labels). With `with_probabilities`, the resampled probabilities too."""
    shape = tuple(int(n) for n in shape)
    if isinstance(probabilities, np.ndarray):
        on_scan = grids.from_grid(probabilities, shape, order=1)
        return on_scan.argmax(-1).astype(np.uint8), on_scan if with_probabilities else None
    labels, on_scan = jax.device_get(_on_scan(probabilities, shape, with_probabilities))
    return labels, on_scan


def mean_scan_labels(
    probabilities: Sequence[np.ndarray | jax.Array],
    shape: Sequence[int],
    with_probabilities: bool = False,
) -> tuple[np.ndarray, np.ndarray | None]:
    """`scan_labels` of the mean of several grids' probabilities (an ensemble's members,
    each on its own grid), averaged on the scan's voxels, where the backend runs."""
    shape = tuple(int(n) for n in shape)
    if all(isinstance(p, np.ndarray) for p in probabilities):
        total = grids.from_grid(probabilities[0], shape, order=1)
        for member in probabilities[1:]:
            total += grids.from_grid(member, shape, order=1)
        total /= len(probabilities)
        return total.argmax(-1).astype(np.uint8), total if with_probabilities else None
    # Every member's probabilities onto one device (device to device), summed there.
    device = min(probabilities[0].devices(), key=lambda d: d.id)
    total = None
    for member in probabilities:
        on_scan = _resampled(jax.device_put(member, device), shape)
        total = on_scan if total is None else _sum(total, on_scan)
    labels, mean = _mean_labels(total, len(probabilities))
    return jax.device_get(labels), jax.device_get(mean) if with_probabilities else None


@jax.jit
def _sum(total: jax.Array, more: jax.Array) -> jax.Array:
    return total + more


@partial(jax.jit, static_argnums=1)
def _mean_labels(total: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
    mean = total / count
    return jnp.argmax(mean, axis=-1).astype(jnp.uint8), mean


def crop(probabilities: np.ndarray | jax.Array, shape: Sequence[int]) -> np.ndarray | jax.Array:
    """The first `shape` voxels of a box's probabilities: the grid a padded box holds."""
    shape = tuple(int(n) for n in shape)
    if tuple(probabilities.shape[:3]) == shape:
        return probabilities
    if isinstance(probabilities, np.ndarray):
        return probabilities[: shape[0], : shape[1], : shape[2]]
    return _crop(probabilities, shape)


@partial(jax.jit, static_argnums=1)
def _crop(probabilities: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    # Jitted: an eager index of a sharded array would send the index from the host.
    return probabilities[: shape[0], : shape[1], : shape[2]]


def grid_labels(probabilities: np.ndarray | jax.Array) -> np.ndarray:
    """The argmax on the grid (uint8), where training's validation Dice is measured."""
    if isinstance(probabilities, np.ndarray):
        return probabilities.argmax(-1).astype(np.uint8)
    return jax.device_get(_grid_argmax(probabilities))


@jax.jit
def _grid_argmax(probabilities: jax.Array) -> jax.Array:
    return jnp.argmax(probabilities, axis=-1).astype(jnp.uint8)


def window_probabilities(
    probabilities: np.ndarray | jax.Array,
    grid: Sequence[int],
    offset: Sequence[int],
    scan_shape: Sequence[int],
    lo: Sequence[int],
    hi: Sequence[int],
) -> np.ndarray | jax.Array:
    """Probabilities [..., C] on the scan voxels [`lo`, `hi`) from a window's box (box voxel
    b = grid voxel b + `offset`), computed as `scan_labels` computes them from the whole
    grid: the same neighbours, weights and order of axes, so the labels are the same
    wherever the box holds what the whole pass holds (`ctseg.inference.region`)."""
    scan_shape = tuple(int(n) for n in scan_shape)
    grid = tuple(int(n) for n in grid)
    if isinstance(probabilities, np.ndarray):
        return _host_window(probabilities, grid, offset, scan_shape, lo, hi)
    x = probabilities
    for axis in sorted(range(3), key=lambda a: scan_shape[a] / grid[a]):
        if scan_shape[axis] == grid[axis]:  # the whole pass takes this axis as it is
            x = _take_slice(x, int(lo[axis] - offset[axis]), int(hi[axis] - lo[axis]), axis)
            continue
        first, second, weight = linear_weights(grid[axis], scan_shape[axis])
        part = slice(lo[axis], hi[axis])
        x = _interpolate(
            x, first[part] - offset[axis], second[part] - offset[axis], weight[part], axis
        )
    return x


@partial(jax.jit, static_argnums=(1, 2, 3))
def _take_slice(x: jax.Array, start: int, size: int, axis: int) -> jax.Array:
    return jax.lax.slice_in_dim(x, start, start + size, axis=axis)


def _lerp(x: jax.Array, first: Any, second: Any, weight: Any, axis: int) -> jax.Array:
    """`x` along `axis` at the voxels between `first` and `second`, `weight` of the way: the
    one blend of the whole path (`_resampled`) and of a window's (`window_probabilities`)."""
    weight = jnp.reshape(weight, [-1 if a == axis else 1 for a in range(x.ndim)])
    return jnp.take(x, first, axis=axis) * (1 - weight) + jnp.take(x, second, axis=axis) * weight


_interpolate = jax.jit(_lerp, static_argnums=4)


def _host_window(
    probabilities: np.ndarray,
    grid: tuple[int, ...],
    offset: Sequence[int],
    scan_shape: tuple[int, ...],
    lo: Sequence[int],
    hi: Sequence[int],
) -> np.ndarray:
    """`grids.from_grid`'s resampling of the scan voxels [lo, hi) from a box of the grid."""
    # Only the grid's part of the box: beyond the grid, `from_grid` holds the edge value.
    sides = zip(probabilities.shape[:3], grid, offset, strict=True)
    inside = tuple(slice(0, min(b, g - o)) for b, g, o in sides)
    box = probabilities[inside]
    scale = np.array(grid, dtype=float) / np.array(scan_shape, dtype=float)
    start = 0.5 * scale - 0.5 + scale * np.asarray(lo, dtype=float) - np.asarray(offset)
    size = tuple(int(h - low) for low, h in zip(lo, hi, strict=True))
    out = np.empty((*size, box.shape[3]), dtype=np.float32)
    for channel in range(box.shape[3]):
        out[..., channel] = ndimage.affine_transform(
            box[..., channel], scale, offset=start, output_shape=size, order=1, mode="nearest"
        )
    return out


def window_labels(
    probabilities: Sequence[np.ndarray | jax.Array],
    on_grids: Sequence[Any],
    shape: Sequence[int],
    with_probabilities: bool = False,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Labels (and probabilities) on the scan's voxels from each member's window box: the
    mean of the members on the scan voxels every window gives exactly; background (class
    0 certain) elsewhere."""
    shape = tuple(int(n) for n in shape)
    lo = tuple(max(g.window.lo[a] for g in on_grids) for a in range(3))
    hi = tuple(max(lo[a], min(g.window.hi[a] for g in on_grids)) for a in range(3))
    parts = [
        window_probabilities(p, g.grid, g.window.offset, shape, lo, hi)
        for p, g in zip(probabilities, on_grids, strict=True)
    ]
    if all(isinstance(part, np.ndarray) for part in parts):
        mean = (
            sum(parts[1:], parts[0].copy()) / np.float32(len(parts)) if len(parts) > 1 else parts[0]
        )
        inside = mean.argmax(-1).astype(np.uint8)
    else:
        mean = parts[0] if len(parts) == 1 else _mean_labels(_sum_all(parts), len(parts))[1]
        inside, mean = jax.device_get(_argmax_labels(mean)), jax.device_get(mean)
    labels = np.zeros(shape, np.uint8)
    where = tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))
    labels[where] = inside
    if not with_probabilities:
        return labels, None
    full = np.zeros((*shape, mean.shape[-1]), np.float32)
    full[..., 0] = 1.0
    full[where] = mean
    return labels, full


def _sum_all(parts: Sequence[jax.Array]) -> jax.Array:
    device = min(parts[0].devices(), key=lambda d: d.id)
    total = None
    for part in parts:
        part = jax.device_put(part, device)
        total = part if total is None else _sum(total, part)
    return total


@jax.jit
def _argmax_labels(probabilities: jax.Array) -> jax.Array:
    return jnp.argmax(probabilities, axis=-1).astype(jnp.uint8)
