"""Rotation and zoom of a training box, resampled on the devices, slab by slab.

A box of side R is warped about its centre c = (R − 1)/2: output voxel p reads the
source point q = c + A (p − c) of the box's grid (A: rotation, zoom, and the flips and
in-plane quarter turns of `train.flip` / `train.rotate90`, all in voxel units).
The host does no per-voxel work. For each device's slab of the output box it reads
the *preimage* of that slab, the grid voxels the warp can read for it (`preimage`),
from the memory-mapped store, into a block of one static size for every sample
(`preimage_extent`: a bound over every transform the config allows). The device
interpolates its slab from its block (`warp_slab`): linear for the image, nearest for
the labels, so no label is ever a mix of classes.

Both sides compute q from the same global voxel indices in the same order, and the
device reads absolute grid indices (floor(q), its neighbour) offset by its block's
integer origin; so a slab's voxels are the same numbers whichever device, and
whichever mesh, computes them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ctseg.config import AugmentConfig

# The host's float64 corners and the device's float32 points may floor to neighbouring
# integers; a voxel of slack on each side, beyond the one linear interpolation reads.
_SLACK = 1


def rotation_matrix(angles_degrees: Sequence[float]) -> np.ndarray:
    """Rotation about x, then y, then z by these angles (degrees)."""
    ax, ay, az = np.radians(np.asarray(angles_degrees, dtype=np.float64))
    rx = np.array([[1, 0, 0], [0, np.cos(ax), -np.sin(ax)], [0, np.sin(ax), np.cos(ax)]])
    ry = np.array([[np.cos(ay), 0, np.sin(ay)], [0, 1, 0], [-np.sin(ay), 0, np.cos(ay)]])
    rz = np.array([[np.cos(az), -np.sin(az), 0], [np.sin(az), np.cos(az), 0], [0, 0, 1]])
    return rz @ ry @ rx


# Matrix entries are multiples of 2^-11: their products with the half-integer offsets
# from the centre (|p − c| < 2^9) and the sums of three such products are exact in
# float32 (at most 23 bits), so every device computes the same source points whether
# or not its compiler fuses a multiply into an add.
_MATRIX_QUANTUM = 2.0**-11


def exact_matrix(matrix: np.ndarray) -> np.ndarray:
    """`matrix` rounded to multiples of `_MATRIX_QUANTUM` (float64; exact in float32)."""
    return np.round(np.asarray(matrix, np.float64) / _MATRIX_QUANTUM) * _MATRIX_QUANTUM


def source_points(matrix: np.ndarray, centre: float, points: np.ndarray) -> np.ndarray:
    """q = c + A (p − c) for points [..., 3] of the output box (host, float64)."""
    return centre + (np.asarray(points, np.float64) - centre) @ np.asarray(matrix).T


def preimage(
    matrix: np.ndarray, box: int, start: Sequence[int], size: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """(low, high): the box-coordinate range [low, high) of grid voxels that output voxels
    `start` … `start + size − 1` read, with `_SLACK` on each side. An affine map takes its
    extremes over a box at the box's corners."""
    centre = (box - 1) / 2
    corners = np.array(
        [
            [s + (n - 1) * c for s, n, c in zip(start, size, corner, strict=True)]
            for corner in itertools.product((0, 1), repeat=3)
        ],
        dtype=np.float64,
    )
    q = source_points(matrix, centre, corners)
    low = np.floor(q.min(axis=0)).astype(int) - _SLACK
    high = np.floor(q.max(axis=0)).astype(int) + 2 + _SLACK  # floor + 1 is read, exclusive
    return low, high


def preimage_extent(augment: AugmentConfig, rotate90: bool, slab: Sequence[int]) -> tuple[int, ...]:
    """A bound, over every transform `augment` allows, on the preimage of a slab of this shape.

    Along source axis k the preimage spans Σ_j |A_kj| (n_j − 1) + 2 + 2·slack. The
    rotations are searched on a grid of angles; between grid points each |A_kj| moves
    by at most 3·δ/2 (a rotation's partial derivatives are bounded by 1), which the
    bound adds. Quarter turns swap x and y, so both orders are bounded.
    """
    theta = augment.rotation_degrees if augment.rotation_p > 0 else 0.0
    zoom = augment.scaling[0] if augment.scaling_p > 0 else 1.0
    zoom = min(zoom, 1.0)
    steps = 12
    grid = np.linspace(-theta, theta, steps + 1)
    about = (grid, grid, grid) if augment.rotation_axes == "xyz" else ([0.0], [0.0], grid)
    spans = np.asarray(slab, np.float64) - 1
    orders = [np.eye(3)] + ([np.eye(3)[[1, 0, 2]]] if rotate90 else [])
    worst = np.zeros(3)
    for angles in itertools.product(*about):
        rotation = np.abs(rotation_matrix(angles))
        for order in orders:
            worst = np.maximum(worst, (order @ rotation) @ spans)
    delta = math.radians(2 * theta / steps) if theta else 0.0
    worst = (worst + 1.5 * delta * spans.sum()) / zoom
    return tuple(int(math.ceil(w)) + 2 + 2 * _SLACK for w in worst)


# ------------------------------------------------------------------------------ device


def source_grid(matrix: jax.Array, centre: float, start: Sequence[jax.Array], size: Sequence[int]):
    """The three coordinates of q [b, sx, sy, sz] for a slab, float32, in a fixed order."""
    p = [
        (s + jnp.arange(n, dtype=jnp.int32)).astype(jnp.float32) - jnp.float32(centre)
        for s, n in zip(start, size, strict=True)
    ]
    px, py, pz = p[0][:, None, None], p[1][None, :, None], p[2][None, None, :]
    a = matrix[:, :, :, None, None, None]  # [b, 3, 3, 1, 1, 1]
    return [
        a[:, k, 0] * px + a[:, k, 1] * py + a[:, k, 2] * pz + jnp.float32(centre) for k in range(3)
    ]


def _gather(block: jax.Array, index: Sequence[jax.Array]) -> jax.Array:
    """block[b, i, j, k] at integer points [b, sx, sy, sz] (clamped into the block)."""
    b, nx, ny, nz = block.shape
    i, j, k = (jnp.clip(ix, 0, n - 1) for ix, n in zip(index, (nx, ny, nz), strict=True))
    flat = (i * ny + j) * nz + k
    return jnp.take_along_axis(block.reshape(b, -1), flat.reshape(b, -1), axis=1).reshape(i.shape)


def warp_slab(
    image: jax.Array,
    label: jax.Array,
    to_unit: Callable[[jax.Array], jax.Array],
    origin: jax.Array,
    matrix: jax.Array,
    box: int,
    start: Sequence[jax.Array],
    size: Sequence[int],
) -> tuple[jax.Array, jax.Array]:
    """One device's slab of the warped box: (image [b, sx, sy, sz] linear, label nearest).

    `image`/`label` [b, Px, Py, Pz]: the slab's preimage blocks, whose voxel 0 is box
    voxel `origin` [b, 3]; `to_unit` maps the image's values (as gathered) to what is
    interpolated; `matrix` [b, 3, 3]; `start`: the slab's first output voxel.
    """
    q = source_grid(matrix, (box - 1) / 2, start, size)
    floor = [jnp.floor(c) for c in q]
    weight = [c - f for c, f in zip(q, floor, strict=True)]
    base = [f.astype(jnp.int32) - origin[:, k, None, None, None] for k, f in enumerate(floor)]
    nearest = [b + (w >= 0.5).astype(jnp.int32) for b, w in zip(base, weight, strict=True)]
    warped_label = _gather(label, nearest)

    def corner(dx: int, dy: int, dz: int) -> jax.Array:
        return to_unit(_gather(image, [base[0] + dx, base[1] + dy, base[2] + dz]))

    def lerp(low: jax.Array, high: jax.Array, w: jax.Array) -> jax.Array:
        return low * (1 - w) + high * w

    wx, wy, wz = weight
    along_z = {
        (dx, dy): lerp(corner(dx, dy, 0), corner(dx, dy, 1), wz) for dx in (0, 1) for dy in (0, 1)
    }
    along_y = [lerp(along_z[(dx, 0)], along_z[(dx, 1)], wy) for dx in (0, 1)]
    return lerp(along_y[0], along_y[1], wx), warped_label
