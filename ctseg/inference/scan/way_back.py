"""From the run's grid back to a scan's own voxels, where the backend runs.

(The way there, and the resampling on the devices both ways use: `ctseg.inference.scan.to_grid`.)
The way back: class probabilities of the box cropped to the scan's grid, resampled
linearly, argmax, an ensemble's mean, the model's uncertainty measured there, all on the
JAX device that holds the probabilities (`Space`, `ON_DEVICES`: the accelerators under the
JAX backend, the host CPU's device for ONNX Runtime's). What comes back to the host is the
uint8 label map, the uncertainty's sums, and probabilities only where a caller asks.

On the devices a scan is padded to a rung of a ladder of sizes (`to_grid.padded`), or held
in the backend's canvas (`ctseg.inference.scan.canvas`), and the resampling reads tables of
source voxels and weights as arguments, so every program depends on the padded shapes and
the box, not on the scan's extent: scans of other extents reuse the programs the first
one compiled. The crop is the host's view.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ctseg.data import grids
from ctseg.data.grids import linear_weights
from ctseg.inference.quality import uncertainty as unc
from ctseg.inference.quality.uncertainty import Uncertainty
from ctseg.inference.scan.to_grid import SLICES_FIRST, Tables, lerp, padded, resampled, tables_of


def axis_order(scan_shape: Sequence[int], grid: Sequence[int]) -> tuple[int, ...]:
    """The order of the axes the way back resamples: shrinking axes first keeps the
    intermediates small (a 512³ grid onto 63 slices). From the ladder's rungs, so that the
    scans one program serves share it, and the same in a window's way (`window_probabilities`)
    as in the whole scan's: the order changes the float32 rounding."""
    scan, box = padded(scan_shape), padded(grid)
    return tuple(sorted(range(3), key=lambda a: scan[a] / box[a]))


def _back_tables(grid: Sequence[int], shape: Sequence[int], scan_box: Sequence[int]) -> Tables:
    """From a box whose first voxels are the grid onto the scan held in `scan_box`: the
    crop is the tables' (they read grid voxels only), and the padding reads voxel 0."""
    return tables_of(
        grids.axis_table(g, n, 0, p) for g, n, p in zip(grid, shape, scan_box, strict=True)
    )


def _on_scan(
    probabilities: jax.Array,
    tables: Tables,
    shape: jax.Array,
    order: tuple[int, ...],
    with_probabilities: bool,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """Box probabilities [x, y, z, C] resampled onto the padded scan, their argmax, and the
    uncertainty's sums on the scan's own voxels (`shape`, traced: one program per rung).

    Two programs, with the same results as one and measured faster
    (docs/experiments/design-figures.md#way-back)."""
    return _measured_on_scan(resampled(probabilities, tables, order), shape, with_probabilities)


@partial(jax.jit, static_argnums=2)
def _measured_on_scan(
    x: jax.Array, shape: jax.Array, with_probabilities: bool
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    labels = jnp.argmax(x, axis=-1).astype(jnp.uint8)
    sums = unc.probability_sums(x, jnp, _scan_voxels(x.shape, shape))
    return labels, (x if with_probabilities else None), sums


def _scan_voxels(padded_shape: Sequence[int], shape: jax.Array) -> jax.Array:
    """The scan's own voxels of its padded array."""
    return unc.box_inside(padded_shape, jnp.zeros(3, jnp.int32), shape, jnp)


def _cropped(array: np.ndarray | None, shape: Sequence[int]) -> np.ndarray | None:
    """The scan's voxels of an array of its padded shape (a view)."""
    return None if array is None else array[: shape[0], : shape[1], : shape[2]]


def _cropped_labels(labels: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """The scan's labels of its padded label map, contiguous: cc3d and the writers read a
    contiguous map faster (docs/experiments/design-figures.md#way-back)."""
    return np.ascontiguousarray(_cropped(labels, shape))


@dataclass(frozen=True)
class OnScan:
    """A prediction brought back to the scan's canonical voxels."""

    labels: np.ndarray  # uint8, the scan's shape
    probabilities: np.ndarray | None  # [..., C] float32, where asked for
    # The model's uncertainty, measured on the scan's voxels (on a region's, for a window).
    uncertainty: Uncertainty


class Space:
    """The way back from a box of the grid to the scan's voxels, on the JAX device that
    holds the probabilities, by programs that depend on the box and the padded scan's shape
    only; a backend holds it (`ctseg.inference.network.backends.Backend.space`). Each way back
    measures the model's uncertainty there (`ctseg.inference.quality.uncertainty`)."""

    def __init__(self, order: tuple[int, ...] | None = None):
        """`order`: the axes every way back resamples in (`to_grid.SLICES_FIRST`); None: each
        scan's own (`axis_order`). The whole scan's way and a window's take the same."""
        self.order = order

    def _order(self, scan_shape: Sequence[int], grid: Sequence[int]) -> tuple[int, ...]:
        return self.order or axis_order(scan_shape, grid)

    def scan_labels(
        self,
        probabilities: Any,
        shape: Sequence[int],
        with_probabilities: bool = False,
        grid: Sequence[int] | None = None,
        scan_box: Sequence[int] | None = None,
    ) -> OnScan:
        """Labels (uint8) on the scan's canonical voxels from probabilities [x, y, z, 3] of
        a box whose first voxels are the `grid` (default: the box is the grid): linear on
        the probabilities, then the argmax (smoother borders than resampling labels). With
        `with_probabilities`, the resampled probabilities too. `scan_box`: the shape the
        scan is held in on the devices (default its rung, `to_grid.padded`)."""
        shape = tuple(int(n) for n in shape)
        grid = tuple(probabilities.shape[:3]) if grid is None else tuple(int(n) for n in grid)
        scan_box = padded(shape) if scan_box is None else scan_box
        tables, order = _back_tables(grid, shape, scan_box), self._order(shape, grid)
        found = _on_scan(probabilities, tables, _shape_array(shape), order, with_probabilities)
        labels, on_scan, sums = jax.device_get(found)
        uncertainty = Uncertainty.of(sums, unc.smoothing(shape, grid))
        return OnScan(_cropped_labels(labels, shape), _cropped(on_scan, shape), uncertainty)

    def mean_scan_labels(
        self,
        probabilities: Sequence[Any],
        shape: Sequence[int],
        with_probabilities: bool = False,
        grids_of: Sequence[Sequence[int]] | None = None,
        scan_box: Sequence[int] | None = None,
    ) -> OnScan:
        """`scan_labels` of the mean of several boxes' probabilities (an ensemble's members,
        each on its own grid, `grids_of`: default the boxes), averaged on the scan's voxels;
        the members' agreement measured there too."""
        shape = tuple(int(n) for n in shape)
        scan_box = padded(shape) if scan_box is None else scan_box
        if grids_of is None:
            grids_of = [p.shape[:3] for p in probabilities]
        grids_of = [tuple(int(n) for n in g) for g in grids_of]
        # Every member's probabilities onto one device (device to device), summed there.
        device = min(probabilities[0].devices(), key=lambda d: d.id)
        members = None
        for member, grid in zip(probabilities, grids_of, strict=True):
            tables, order = _back_tables(grid, shape, scan_box), self._order(shape, grid)
            on_scan = resampled(jax.device_put(member, device), tables, order)
            members = _device_members(members, on_scan)
        scan = jax.device_put(_shape_array(shape), device)
        labels, mean, sums, agreement = _measured_mean_of(*members, scan, len(probabilities))
        labels, sums, agreement = jax.device_get((labels, sums, agreement))
        mean = jax.device_get(mean) if with_probabilities else None
        smooth = unc.smoothing(shape, grids_of[0])
        uncertainty = Uncertainty.of(sums, smooth, agreement, len(probabilities))
        return OnScan(_cropped_labels(labels, shape), _cropped(mean, shape), uncertainty)

    def grid_labels(self, probabilities: Any, grid: Sequence[int] | None = None) -> np.ndarray:
        """The argmax on the grid (uint8), where training's validation Dice is measured: of
        a box whose first voxels are the `grid` (default: the box is the grid)."""
        grid = tuple(probabilities.shape[:3]) if grid is None else tuple(int(n) for n in grid)
        labels = jax.device_get(_grid_argmax(probabilities))
        return np.ascontiguousarray(labels[: grid[0], : grid[1], : grid[2]])

    def window_probabilities(
        self,
        probabilities: Any,
        grid: Sequence[int],
        offset: Sequence[int],
        scan_shape: Sequence[int],
        lo: Sequence[int],
        hi: Sequence[int],
    ) -> Any:
        """Probabilities [..., C] on the scan voxels [`lo`, `hi`) from a window's box (box
        voxel b = grid voxel b + `offset`), computed as `scan_labels` computes them from the
        whole grid: the same neighbours, weights and order of axes, so the labels are the
        same wherever the box holds what the whole pass holds (`ctseg.inference.scan.region`)."""
        scan_shape = tuple(int(n) for n in scan_shape)
        grid = tuple(int(n) for n in grid)
        x = probabilities
        for axis in self._order(scan_shape, grid):
            if scan_shape[axis] == grid[axis]:  # the whole pass's weights are 0 there: as it is
                x = _take_slice(x, int(lo[axis] - offset[axis]), int(hi[axis] - lo[axis]), axis)
                continue
            first, second, weight = linear_weights(grid[axis], scan_shape[axis])
            part = slice(lo[axis], hi[axis])
            x = _interpolate(
                x, first[part] - offset[axis], second[part] - offset[axis], weight[part], axis
            )
        return x

    def window_labels(
        self,
        probabilities: Sequence[Any],
        on_grids: Sequence[Any],
        shape: Sequence[int],
        with_probabilities: bool = False,
    ) -> OnScan:
        """Labels (and probabilities) on the scan's voxels from each member's window box:
        the mean of the members on the scan voxels every window gives exactly; background
        (class 0 certain) elsewhere. The uncertainty is measured on those voxels."""
        shape = tuple(int(n) for n in shape)
        lo = tuple(max(g.window.lo[a] for g in on_grids) for a in range(3))
        hi = tuple(max(lo[a], min(g.window.hi[a] for g in on_grids)) for a in range(3))
        parts = [
            self.window_probabilities(p, g.grid, g.window.offset, shape, lo, hi)
            for p, g in zip(probabilities, on_grids, strict=True)
        ]
        inside, mean, sums, agreement = _measured_mean(parts)
        smooth = unc.smoothing(shape, on_grids[0].grid)
        uncertainty = Uncertainty.of(sums, smooth, agreement, len(parts))
        labels = np.zeros(shape, np.uint8)
        where = tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))
        labels[where] = inside
        if not with_probabilities:
            return OnScan(labels, None, uncertainty)
        full = np.zeros((*shape, mean.shape[-1]), np.float32)
        full[..., 0] = 1.0
        full[where] = mean
        return OnScan(labels, full, uncertainty)


ON_DEVICES = Space()
CANVAS_SPACE = Space(SLICES_FIRST)  # where a backend holds its scans in a canvas


def _measured_mean(
    parts: Sequence[jax.Array],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Window parts of the members: the argmax (uint8) of their mean, the mean, its
    uncertainty's sums and the members' agreement's (None for one member), on the host."""
    device = min(parts[0].devices(), key=lambda d: d.id)
    whole = jax.device_put(_shape_array(parts[0].shape[:3]), device)
    members = None
    for part in parts:
        members = _device_members(members, jax.device_put(part, device))
    found = _measured_mean_of(*members, whole, len(parts))
    labels, mean, sums, agreement = jax.device_get(found)
    return labels, mean, sums, agreement if len(parts) > 1 else None


def _shape_array(shape: Sequence[int]) -> np.ndarray:
    """A scan's shape as a traced argument: programs depend on its rung, not on it."""
    return np.asarray(shape, np.int32)


Members = tuple[jax.Array, jax.Array]  # the members' Σ probabilities and Σ votes


def _device_members(members: Members | None, part: jax.Array) -> Members:
    """`members` (None: none yet) with one more member's probabilities on the scan."""
    return _first_member(part) if members is None else _add_member(*members, part)


@jax.jit
def _first_member(part: jax.Array) -> Members:
    return part, unc.votes(part, jnp)


@partial(jax.jit, donate_argnums=(0, 1))
def _add_member(total: jax.Array, counts: jax.Array, part: jax.Array) -> Members:
    return total + part, counts + unc.votes(part, jnp)


@partial(jax.jit, static_argnums=3)
def _measured_mean_of(
    total: jax.Array, counts: jax.Array, shape: jax.Array, members: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The members' mean of their summed probabilities, its argmax, its uncertainty's sums
    and the members' agreement's, on the voxels below `shape` (the scan's own, of a padded
    array)."""
    mean = total / members
    inside = _scan_voxels(mean.shape, shape)
    labels = jnp.argmax(mean, axis=-1).astype(jnp.uint8)
    sums = unc.probability_sums(mean, jnp, inside)
    return labels, mean, sums, unc.vote_sums(counts, jnp, inside)


@jax.jit
def _grid_argmax(probabilities: jax.Array) -> jax.Array:
    return jnp.argmax(probabilities, axis=-1).astype(jnp.uint8)


@partial(jax.jit, static_argnums=(1, 2, 3))
def _take_slice(x: jax.Array, start: int, size: int, axis: int) -> jax.Array:
    return jax.lax.slice_in_dim(x, start, start + size, axis=axis)


_interpolate = jax.jit(lerp, static_argnums=4)
