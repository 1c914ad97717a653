"""Class probabilities on the run's grid brought back to a scan's own voxels: cropped to the
scan's grid, resampled linearly, argmax, an ensemble's mean, all where the backend runs
(under JAX on the devices: what comes back to the host is the uint8 label map, and
probabilities only where a caller asks for them).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ctseg.data import grids


def _linear_weights(size: int, out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Linear interpolation from `size` to `out` voxels covering one field of view, as
    `grids.from_grid` does it (voxel centres, edge values beyond the last centre)."""
    coordinate = (np.arange(out) + 0.5) * (size / out) - 0.5
    lower = np.floor(coordinate)
    weight = (coordinate - lower).astype(np.float32)
    first = np.clip(lower, 0, size - 1).astype(np.int32)
    second = np.clip(lower + 1, 0, size - 1).astype(np.int32)
    return first, second, weight


@partial(jax.jit, static_argnums=1)
def _resampled(probabilities: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Grid probabilities [x, y, z, C] resampled linearly onto `shape` (the scan's voxels)."""
    x = probabilities
    # Shrinking axes first keeps the intermediates small (a 512³ grid onto 63 slices).
    for axis in sorted(range(3), key=lambda a: shape[a] / x.shape[a]):
        if shape[axis] == x.shape[axis]:
            continue
        first, second, weight = _linear_weights(x.shape[axis], shape[axis])
        weight = weight.reshape([-1 if a == axis else 1 for a in range(x.ndim)])
        x = jnp.take(x, first, axis=axis) * (1 - weight) + jnp.take(x, second, axis=axis) * weight
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
