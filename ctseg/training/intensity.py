"""nnU-Net's intensity augmentations, and a contrast phase, on a device's slab of a
training batch.

Each runs inside `jax.shard_map` on a block [b, sx, sy, sz] and gives the numbers the
unpartitioned batch would hold: statistics of a box (its mean, standard deviation,
range) are sums and extremes over the spatial mesh axes, as batch norm's are; the blur
and the simulated low resolution read their neighbours through the halo exchange the
U-Net's convolutions use; the noise is drawn for the global batch (`jax.random` with
partitionable threefry gives each voxel its number whatever the sharding).

A transform is applied where its per-sample flag (1.0 or 0.0, drawn on the host) is
set, selected with `jnp.where`, so a sample that does not draw it keeps its numbers
exactly. Parameters follow nnU-Net's `get_training_transforms` (see `AugmentConfig`);
the contrast phase is ctseg's own (nnU-Net has none): it moves the liver by its label.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from ctseg.config import AugmentConfig
from ctseg.labels import LIVER, TUMOUR
from ctseg.parallel.partition import SPATIAL_AXES, exchange_halo

Params = Mapping[str, jax.Array]  # name -> [b] float32, this device's samples


def _per_sample(value: jax.Array) -> jax.Array:
    return value[:, None, None, None]


def _tree_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis in one fixed pairwise order, written out as additions: a
    reduction's order is the compiler's to choose, and it chooses by shape.

    One rolled loop of log2(n) passes, each adding to every element its partner `stride`
    further on (zeros past the end): element 0 ends as the sum of pairs of pairs. Written
    as slices, the passes were most of what a GPU compiler spent on the augmentation."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])  # zeros add exactly

    def add_partners(level: jax.Array, x: jax.Array) -> jax.Array:
        beyond = jnp.concatenate([x, jnp.zeros_like(x)], axis=-1)
        partners = jax.lax.dynamic_slice_in_dim(beyond, jnp.left_shift(1, level), width, -1)
        return x + partners

    return jax.lax.fori_loop(0, width.bit_length() - 1, add_partners, x)[..., 0]


def _box_sum(x: jax.Array, tile: int) -> jax.Array:
    """Each sample's sum over its whole box, [b], the same number on every layout: sums
    of `tile`³ cubes (which no layout splits: every partition is a multiple of the tile),
    gathered whole onto every device and summed there, all in one fixed order. A `psum`
    of partial sums would group them by the layout and differ in the last bits."""
    b, sx, sy, sz = x.shape
    n = (sx // tile, sy // tile, sz // tile)
    cubes = x.reshape(b, n[0], tile, n[1], tile, n[2], tile).transpose(0, 1, 3, 5, 2, 4, 6)
    sums = _tree_sum(cubes.reshape(b, *n, tile**3))
    for dim, axis in enumerate(SPATIAL_AXES, start=1):
        sums = jax.lax.all_gather(sums, axis, axis=dim, tiled=True)
    return _tree_sum(sums.reshape(b, -1))


def box_mean(x: jax.Array, count: int, tile: int) -> jax.Array:
    """Each sample's mean over its whole box: [b]; `count` the box's voxels."""
    return _box_sum(x, tile) / count


def box_range(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    low = jax.lax.pmin(jnp.min(x, axis=(1, 2, 3)), SPATIAL_AXES)
    high = jax.lax.pmax(jnp.max(x, axis=(1, 2, 3)), SPATIAL_AXES)
    return low, high


def box_std(x: jax.Array, mean: jax.Array, count: int, tile: int) -> jax.Array:
    return jnp.sqrt(_box_sum(jnp.square(x - _per_sample(mean)), tile) / count)


def _where(flag: jax.Array, changed: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.where(_per_sample(flag) > 0, changed, x)


# ------------------------------------------------------------------ neighbourhood operators


def halo_width(augment: AugmentConfig, box: int) -> int:
    """The halo the neighbourhood transforms read: the blur's kernel radius (3 sigma) and
    the reach of a simulated low resolution (a coarse voxel box/round(box·zoom) wide, its
    nearest box voxel half a voxel off, and the linear interpolation's neighbour)."""
    width = 0
    if augment.blur_p > 0:
        width = max(width, math.ceil(3 * augment.blur_sigma[1]))
    if augment.low_resolution_p > 0:
        coarse = max(round(box * augment.low_resolution[0]) - 1, 1)  # round() may go down
        width = max(width, math.ceil(box / coarse + 0.5))
    return width


def _along(x: jax.Array, axis: int, index: jax.Array) -> jax.Array:
    """x[b, …] read at `index` [b, n] along spatial `axis` (1, 2 or 3)."""
    shape = [1] * x.ndim
    shape[0], shape[axis] = index.shape
    full = list(x.shape)
    full[axis] = index.shape[1]
    return jnp.take_along_axis(x, jnp.broadcast_to(index.reshape(shape), full), axis=axis)


def _crop(x: jax.Array, axis: int, width: int, size: int) -> jax.Array:
    return jax.lax.slice_in_dim(x, width, width + size, axis=axis)


def blur(padded: jax.Array, sigma: jax.Array, width: int, size: Sequence[int]) -> jax.Array:
    """Separable Gaussian blur of a block padded by `width` on every spatial side.

    `sigma` [b, 3] in voxels; taps from −width to width, normalised. Each axis is
    convolved over the other axes' padding too, so the corners are right. The taps are
    one rolled loop, added in a fixed order: unrolled, each tap is a slice of the whole
    block that a GPU compiler fuses and tunes on its own."""
    taps = jnp.arange(-width, width + 1, dtype=jnp.float32)
    x = padded
    for axis in (1, 2, 3):
        s = sigma[:, axis - 1, None]
        kernel = jnp.exp(-jnp.square(taps)[None, :] / (2 * jnp.square(s)))
        kernel = kernel / jnp.sum(kernel, axis=1, keepdims=True)  # [b, taps]
        n = size[axis - 1]

        def tap(t, out, x=x, kernel=kernel, n=n, axis=axis):
            weight = jax.lax.dynamic_index_in_dim(kernel, t, axis=1, keepdims=False)
            weight = weight.reshape((-1,) + (1,) * (x.ndim - 1))
            return out + weight * jax.lax.dynamic_slice_in_dim(x, t, n, axis=axis)

        out = jnp.zeros_like(_crop(x, axis, width, n))
        x = jax.lax.fori_loop(0, 2 * width + 1, tap, out)
    return x


def low_resolution(
    padded: jax.Array,
    zoom: jax.Array,
    width: int,
    box: int,
    start: Sequence[jax.Array],
    size: Sequence[int],
) -> jax.Array:
    """A coarser scan simulated per axis: each axis sampled at round(box·zoom) voxels
    (nearest), then linearly interpolated back onto the box's voxels. Separable, so one
    axis at a time, each reading the block's halo. `zoom` [b, 3]."""
    x = padded
    for axis in (1, 2, 3):
        n, first = size[axis - 1], start[axis - 1]
        coarse = jnp.maximum(jnp.round(box * zoom[:, axis - 1]), 1.0)[:, None]  # [b, 1]
        p = (first + jnp.arange(n, dtype=jnp.int32)).astype(jnp.float32)[None, :]
        u = jnp.clip((p + 0.5) * coarse / box - 0.5, 0.0, coarse - 1)
        low = jnp.floor(u)
        high = jnp.minimum(low + 1, coarse - 1)

        def source(j: jax.Array, coarse: jax.Array = coarse, first: jax.Array = first):
            # The box voxel nearest to coarse voxel j's centre, as an index into the block.
            voxel = jnp.clip(jnp.round((j + 0.5) * box / coarse - 0.5), 0, box - 1)
            return voxel.astype(jnp.int32) - first + width

        w = (u - low).reshape(zoom.shape[0], *[n if a == axis else 1 for a in (1, 2, 3)])
        near, far = _along(x, axis, source(low)), _along(x, axis, source(high))
        # Products materialised before the sum: a fused multiply-add rounds once where
        # this rounds twice, and whether the compiler fuses depends on the block's shape.
        near, far = jax.lax.optimization_barrier((near * (1 - w), far * w))
        x = near + far
        # The other axes still carry their halos; this one is now the slab's own.
        x = jnp.pad(x, [(0, 0)] + [(width, width) if a == axis else (0, 0) for a in (1, 2, 3)])
    return x[:, width:-width, width:-width, width:-width] if width else x


# ------------------------------------------------------------------ the pipeline


def contrast_phase(x: jax.Array, label: jax.Array, params: Params, tile: int) -> jax.Array:
    """Another contrast phase: the liver's voxels shifted so that their mean over the
    box is `phase_liver` (window units), the tumours' by `phase_tumour_share` of that
    shift, clipped to the window as a scan's values are. The liver keeps its texture
    and its tumours their place; a box without liver is left as it is."""
    liver = label == LIVER
    count = _box_sum(liver.astype(x.dtype), tile)
    mean = _box_sum(jnp.where(liver, x, 0.0), tile) / jnp.maximum(count, 1.0)
    shift = jnp.where((params["phase_on"] > 0) & (count > 0), params["phase_liver"] - mean, 0.0)
    share = params["phase_tumour_share"]
    moved = jnp.where(liver, _per_sample(shift), 0.0)
    moved = jnp.where(label == TUMOUR, _per_sample(shift * share), moved)
    return jnp.clip(x + moved, -1.0, 1.0)


def apply(
    x: jax.Array,
    params: Params,
    noise: jax.Array | None,
    augment: AugmentConfig,
    halo: tuple,
    box: int,
    start: Sequence[jax.Array],
    tile: int,
) -> jax.Array:
    """nnU-Net's order: noise, blur, brightness, contrast, low resolution, inverted gamma,
    gamma. `x` [b, sx, sy, sz] in window units; `halo` as `Comm.halo`; `tile` divides
    every partition of the box (`_box_sum`)."""
    size = x.shape[1:]
    count = box**3
    width = halo_width(augment, box)
    if noise is not None:
        x = x + _per_sample(params["noise_on"] * params["noise_std"]) * noise
    if augment.blur_p > 0:
        # Beyond the box is air (−1): blur x + 1 with the exchange's zero padding.
        padded = exchange_halo((x + 1)[..., None], halo, width)[..., 0]
        sigma = jnp.stack([params[f"blur_sigma_{a}"] for a in SPATIAL_AXES], axis=1)
        x = _where(params["blur_on"], blur(padded, sigma, width, size) - 1, x)
    if augment.brightness_p > 0:
        x = _where(params["brightness_on"], x * _per_sample(params["brightness"]), x)
    if augment.contrast_p > 0:
        mean = _per_sample(box_mean(x, count, tile))
        low, high = box_range(x)
        changed = (x - mean) * _per_sample(params["contrast"]) + mean
        x = _where(params["contrast_on"], jnp.clip(changed, _per_sample(low), _per_sample(high)), x)
    if augment.low_resolution_p > 0:
        padded = exchange_halo((x + 1)[..., None], halo, width)[..., 0]
        zoom = jnp.stack([params[f"zoom_{a}"] for a in SPATIAL_AXES], axis=1)
        x = _where(params["low_on"], low_resolution(padded, zoom, width, box, start, size) - 1, x)
    if augment.gamma_inverted_p > 0:
        x = _where(
            params["gamma_inverted_on"], -_gamma(-x, params["gamma_inverted"], count, tile), x
        )
    if augment.gamma_p > 0:
        x = _where(params["gamma_on"], _gamma(x, params["gamma"], count, tile), x)
    return x


def _gamma(x: jax.Array, gamma: jax.Array, count: int, tile: int) -> jax.Array:
    """x on its box's range raised to `gamma`, then given back its mean and deviation."""
    mean = box_mean(x, count, tile)
    std = box_std(x, mean, count, tile)
    low, high = box_range(x)
    low, span = _per_sample(low), _per_sample(high - low)
    y = jnp.power((x - low) / (span + 1e-7), _per_sample(gamma)) * span + low
    y_mean = box_mean(y, count, tile)
    y_std = box_std(y, y_mean, count, tile)
    scale = _per_sample(std / (y_std + 1e-8))
    return (y - _per_sample(y_mean)) * scale + _per_sample(mean)
