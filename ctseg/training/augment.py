"""The augmented training batch, drawn on the host and made on the devices.

`draw_sample` draws a sample's transforms from (seed, step, sample) alone, as the
flips and quarter turns are drawn (`ctseg.training.pipeline.draw_augmentation`), so a
resumed run and any mesh layout draw the same. `Augmenter` turns a step's draws into
the batch: the host reads, for each device, the store's voxels its slab needs (the
slab itself, rearranged by the flips, or, where boxes are rotated or zoomed, the slab's
preimage: `ctseg.training.warp`) as HU and label bytes; one program on the devices
scales the window, resamples, and applies the intensity transforms
(`ctseg.training.intensity`). The host does no per-voxel arithmetic.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ctseg.config import Config
from ctseg.data.grids import AIR_HU, hu_to_unit
from ctseg.data.store import Box, Store
from ctseg.errors import CtsegError
from ctseg.model.step import LABEL_SPEC
from ctseg.parallel.partition import ACTIVATION_SPEC, SPATIAL_AXES, halo_comm, make_global_array
from ctseg.training import intensity, warp

_ORIGIN_SPEC = P("data", "x", "y", "z", None)
_PER_SAMPLE = P("data")
_LEVELS = 4  # block sizes above the unwarped one (`Augmenter.block_extent`)


@dataclass(frozen=True)
class Augmentation:
    """A voxel-exact rearrangement plus an intensity change.

    Output axis k reads input axis ``source_axis[k]``, reversed where
    ``reverse[k]``; the group of in-plane 90° rotations and flips is exactly
    {swap x/y or not} × {reverse each axis or not}.
    """

    source_axis: tuple[int, int, int] = (0, 1, 2)
    reverse: tuple[bool, bool, bool] = (False, False, False)
    scale: float = 1.0
    shift: float = 0.0

    def matrix(self) -> np.ndarray:
        """The rearrangement as a map of offsets from the box's centre: output offset
        along axis k is source offset ±1 along `source_axis[k]` (−1 where reversed)."""
        matrix = np.zeros((3, 3))
        for k, (axis, rev) in enumerate(zip(self.source_axis, self.reverse, strict=True)):
            matrix[axis, k] = -1.0 if rev else 1.0
        return matrix

    def read(self, volume: np.ndarray, index: Sequence[slice]) -> np.ndarray:
        """Block `index` (slices over x, y, z) of the augmented volume; reads only that block."""
        n = volume.shape
        source = [slice(None)] * 3
        for sl, axis, rev in zip(index, self.source_axis, self.reverse, strict=True):
            start, stop, _ = sl.indices(n[axis])
            source[axis] = slice(n[axis] - stop, n[axis] - start) if rev else slice(start, stop)
        block = np.asarray(volume[tuple(source)])
        # Put the block's axes in output order, then reverse the flipped ones.
        block = np.transpose(block, self.source_axis)
        flips = tuple(k for k, rev in enumerate(self.reverse) if rev)
        return np.flip(block, flips) if flips else block


# In-plane rotation by k·90° as (source axes, reversed output axes):
# np.rot90(v, k, axes=(0, 1)) reads out[i, j] = v[j, n-1-i] for k = 1.
_ROTATIONS = (
    ((0, 1, 2), (False, False, False)),
    ((1, 0, 2), (True, False, False)),
    ((0, 1, 2), (True, True, False)),
    ((1, 0, 2), (False, True, False)),
)


def draw_augmentation(config: Config, step: int, sample: int) -> Augmentation:
    """The sample's augmentation: a rotation (if enabled), then flips (if enabled)."""
    t = config.train
    rng = np.random.default_rng([t.seed, step, sample, 1])
    source_axis, rotated = _ROTATIONS[int(rng.integers(4)) if t.rotate90 else 0]
    flips = [bool(t.flip and rng.random() < 0.5) for _ in range(3)]
    reverse = tuple(r != f for r, f in zip(rotated, flips, strict=True))  # flipping twice undoes it
    scale = 1.0 + rng.uniform(-t.intensity_scale, t.intensity_scale)
    shift = rng.uniform(-t.intensity_shift, t.intensity_shift)
    return Augmentation(source_axis, reverse, float(scale), float(shift))


@dataclass(frozen=True)
class SampleDraw:
    """One sample's spatial matrix (output offset -> source offset, voxel units) and its
    intensity parameters (`intensity.apply`'s names; flags are 1.0 or 0.0)."""

    matrix: np.ndarray
    params: dict[str, float] = field(default_factory=dict)


def _factor(rng: np.random.Generator, low: float, high: float) -> float:
    """nnU-Net's draw of a factor around 1: below or above 1 with even odds where the
    range spans 1, so shrinking and growing are equally likely."""
    if low < 1 < high and rng.random() < 0.5:
        return float(rng.uniform(low, 1.0))
    return float(rng.uniform(max(low, 1.0) if low < 1 < high else low, high))


def draw_sample(config: Config, step: int, sample: int, base: Augmentation) -> SampleDraw:
    """The sample's rotation and zoom (composed after `base`, its flips, quarter turns,
    intensity scale and shift) and its intensity transforms, from streams of their own, so
    that a probability of 0 leaves the other draws, and `base`, as they were."""
    a, t = config.augment, config.train
    rng = np.random.default_rng([t.seed, step, sample, 4])
    angles = np.zeros(3)
    if rng.random() < a.rotation_p:
        about = 3 if a.rotation_axes == "xyz" else 1
        angles[3 - about :] = rng.uniform(-a.rotation_degrees, a.rotation_degrees, about)
        angles = angles if about == 3 else np.array([0.0, 0.0, angles[2]])
    zoom = float(rng.uniform(*a.scaling)) if rng.random() < a.scaling_p else 1.0
    # Output offsets read source offsets: a patient zoomed by s reads 1/s as far out.
    matrix = base.matrix()
    spatial = matrix @ warp.rotation_matrix(angles) / zoom if a.warps else matrix

    rng = np.random.default_rng([t.seed, step, sample, 5])
    params = {"scale": base.scale, "shift": base.shift}

    def flag(p: float) -> float:
        return float(rng.random() < p)

    params["noise_on"] = flag(a.noise_p)
    params["noise_std"] = float(rng.uniform(*a.noise_std))
    params["blur_on"] = flag(a.blur_p)
    for axis in SPATIAL_AXES:
        params[f"blur_sigma_{axis}"] = float(rng.uniform(*a.blur_sigma))
    params["brightness_on"] = flag(a.brightness_p)
    params["brightness"] = float(rng.uniform(*a.brightness))
    params["contrast_on"] = flag(a.contrast_p)
    params["contrast"] = _factor(rng, *a.contrast)
    params["low_on"] = flag(a.low_resolution_p)
    zoom = float(rng.uniform(*a.low_resolution))  # one for every axis, as nnU-Net's
    for axis in SPATIAL_AXES:
        params[f"zoom_{axis}"] = zoom
    params["gamma_inverted_on"] = flag(a.gamma_inverted_p)
    params["gamma_inverted"] = _factor(rng, *a.gamma)
    params["gamma_on"] = flag(a.gamma_p)
    params["gamma"] = _factor(rng, *a.gamma)
    params["phase_on"] = flag(a.phase_p)
    liver_hu = rng.uniform(*a.phase_liver_hu)
    params["phase_liver"] = float(hu_to_unit(liver_hu, config.data.hu_window))
    params["phase_tumour_share"] = float(rng.uniform(*a.phase_tumour_share))
    return SampleDraw(warp.exact_matrix(spatial), params)


class Augmenter:
    """Makes a step's augmented batch for one (config, mesh, box): `inputs` on the host,
    then `__call__` on the devices; the device program is compiled once."""

    def __init__(self, config: Config, mesh: Mesh, box: int):
        self.config, self.mesh, self.box = config, mesh, box
        self.slab = tuple(box // mesh.shape[a] for a in SPATIAL_AXES)
        augment = config.augment
        # A warped batch's blocks come in a few sizes, from the unwarped slab's preimage
        # to the bound over every draw: each size is a program compiled once, and a batch
        # of small rotations sends small blocks (most samples are not warped at all).
        rotate90 = config.train.rotate90
        self.smallest = warp.preimage_extent(
            dataclasses.replace(augment, rotation_p=0.0, scaling_p=0.0), rotate90, self.slab
        )
        self.extent = warp.preimage_extent(augment, rotate90, self.slab)
        width = intensity.halo_width(augment, box)
        if width > min(self.slab):
            raise CtsegError(
                f"the blur and simulated low resolution of [augment] read {width} voxels "
                f"around each voxel, more than a partition's {min(self.slab)}: use fewer "
                "partitions (mesh.spatial), a larger data.resolution, or lower "
                "augment.blur_sigma / raise augment.low_resolution"
            )
        self._names = tuple(draw_sample(config, 0, 0, Augmentation()).params)
        self._program = jax.jit(self._program_fn())

    # ------------------------------------------------------------------ host

    def inputs(
        self,
        store: Store,
        case_ids: Sequence[str],
        offsets: Sequence[Sequence[int]],
        read_slabs: Sequence[Augmentation],
        draws: Sequence[SampleDraw],
    ) -> tuple[jax.Array, ...]:
        """(hu, label, origins, drawn) placed on the mesh, each device's block
        read from the memory-mapped store for that device only. `read_slabs[b]`: the
        sample's flips and quarter turns where boxes are not
        warped; warped boxes read preimages and carry the flips in their matrix."""
        batch = len(case_ids)
        grids = [(store.image(c), store.label(c)) for c in case_ids]
        mx, my, mz = (self.mesh.shape[a] for a in SPATIAL_AXES)
        warps = self.config.augment.warps

        cells = list(itertools.product(range(mx), range(my), range(mz)))
        spans = {
            (b, cell): warp.preimage(
                draws[b].matrix,
                self.box,
                [c * s for c, s in zip(cell, self.slab, strict=True)],
                self.slab,
            )
            for b in range(batch)
            for cell in (cells if warps else [])
        }
        needed = np.max([high - low for low, high in spans.values()], axis=0) if warps else 0
        extent = self.block_extent(needed) if warps else self.slab

        def preimage(b: int, cell: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
            return spans[(b, tuple(int(c) for c in cell))]

        def read(kind: int, fill: int) -> object:
            def block(index: tuple[slice, ...]) -> np.ndarray:
                rows = []
                for b in range(*index[0].indices(batch)):
                    cell = [(s.start or 0) // n for s, n in zip(index[1:4], extent, strict=True)]
                    grid, offset = grids[b][kind], offsets[b]
                    if warps:
                        # Only the sample's own preimage is read; the rest of the
                        # block (the batch's largest preimage, by level) is filled.
                        low, high = preimage(b, cell)
                        origin = tuple(int(o + lo) for o, lo in zip(offset, low, strict=True))
                        region = np.asarray(Box(grid, origin, tuple(high - low), fill))
                        pad = [(0, e - n) for e, n in zip(extent, region.shape, strict=True)]
                        rows.append(np.pad(region, pad, constant_values=fill))
                    else:
                        box = Box(grid, tuple(offset), (self.box,) * 3, fill)
                        rows.append(read_slabs[b].read(box, index[1:4]))
                return np.stack(rows)

            return block

        shape = (batch, mx * extent[0], my * extent[1], mz * extent[2])
        hu = make_global_array(self.mesh, shape, np.int16, read(0, AIR_HU), LABEL_SPEC)
        label = make_global_array(self.mesh, shape, np.uint8, read(1, 0), LABEL_SPEC)

        def origins(index: tuple[slice, ...]) -> np.ndarray:
            cells = [s.start or 0 for s in index[1:4]]
            rows = [preimage(b, cells)[0] for b in range(*index[0].indices(batch))]
            return np.asarray(rows, np.int32).reshape(-1, 1, 1, 1, 3)

        placed_origins = (
            make_global_array(self.mesh, (batch, mx, my, mz, 3), np.int32, origins, _ORIGIN_SPEC)
            if warps
            else None
        )
        # Every sample's matrix and parameters in one array: one transfer, not twenty.
        rows = [[*d.matrix.ravel(), *(d.params[n] for n in self._names)] for d in draws]
        drawn = jax.device_put(np.asarray(rows, np.float32), NamedSharding(self.mesh, _PER_SAMPLE))
        return hu, label, placed_origins, drawn

    def block_extent(self, needed: np.ndarray) -> tuple[int, ...]:
        """The smallest of `_LEVELS` + 1 block sizes, evenly between the unwarped and the
        largest, that holds a preimage of extent `needed`."""
        low, high = np.asarray(self.smallest), np.asarray(self.extent)
        if np.any(needed > high):
            raise AssertionError(  # a bug in the bound, never a user's error
                f"preimage {list(needed)} exceeds its bound {list(self.extent)}"
            )
        share = np.max((np.asarray(needed) - low) / np.maximum(high - low, 1))
        level = math.ceil(max(share, 0.0) * _LEVELS - 1e-9) / _LEVELS
        return tuple(int(v) for v in np.minimum(high, low + np.ceil(level * (high - low))))

    # ------------------------------------------------------------------ device

    def compile_largest(self, batch: int) -> jax.stages.Compiled:
        """The devices' program for a batch of the largest blocks, compiled without data
        (`ctseg plan --target`: what augmenting a batch takes on devices not here)."""
        mesh, shape = self.mesh, [self.mesh.shape[a] for a in SPATIAL_AXES]

        def abstract(dims: Sequence[int], dtype: Any, spec: P) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(tuple(dims), dtype, sharding=NamedSharding(mesh, spec))

        block = [batch, *(m * e for m, e in zip(shape, self.extent, strict=True))]
        inputs = (
            abstract(block, jnp.int16, LABEL_SPEC),
            abstract(block, jnp.uint8, LABEL_SPEC),
            abstract([batch, *shape, 3], jnp.int32, _ORIGIN_SPEC),
            abstract([batch, 9 + len(self._names)], jnp.float32, _PER_SAMPLE),
        )
        return self._program.lower(jax.ShapeDtypeStruct((), jnp.int32), *inputs).compile()

    def __call__(self, step: int, inputs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        """The augmented (image [B, R, R, R, 1] float32, label [B, R, R, R] int32)."""
        return self._program(jnp.int32(step), *inputs)

    def _program_fn(self):
        config, mesh, box, slab = self.config, self.mesh, self.box, self.slab
        augment, window = config.augment, config.data.hu_window
        halo = halo_comm(mesh).halo
        noisy = augment.noise_p > 0

        names = self._names

        def body(hu, label, origin, drawn, *noise):
            matrix = drawn[:, :9].reshape(-1, 3, 3)
            params = {name: drawn[:, 9 + i] for i, name in enumerate(names)}
            start = [jax.lax.axis_index(a) * n for a, n in zip(SPATIAL_AXES, slab, strict=True)]

            def to_unit(values: jax.Array) -> jax.Array:
                return hu_to_unit(values, window, jnp)

            if augment.warps:  # scaled after the gather: the slab's voxels, not the block's
                unit, label = warp.warp_slab(
                    hu, label, to_unit, origin[:, 0, 0, 0], matrix, box, start, slab
                )
            else:
                unit = to_unit(hu)
            if augment.phase_p > 0:  # the patient's own contrast, before the scan's changes
                unit = intensity.contrast_phase(unit, label, params, config.alignment)
            unit = (
                unit * params["scale"][:, None, None, None] + params["shift"][:, None, None, None]
            )
            unit = intensity.apply(
                unit, params, *noise or (None,), augment, halo, box, start, config.alignment
            )
            return unit[..., None], label.astype(jnp.int32)

        shard = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(LABEL_SPEC, LABEL_SPEC, _ORIGIN_SPEC, _PER_SAMPLE)
            + ((LABEL_SPEC,) if noisy else ()),
            out_specs=(ACTIVATION_SPEC, LABEL_SPEC),
            check_vma=True,
        )

        def program(step, hu, label, origin, drawn):
            batch = drawn.shape[0]
            noise = ()
            if noisy:
                key = jax.random.fold_in(jax.random.key(config.train.seed), step)
                keys = jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(batch))
                normal = jax.vmap(lambda k: jax.random.normal(k, (box,) * 3))(keys)
                noise = (jax.lax.with_sharding_constraint(normal, NamedSharding(mesh, LABEL_SPEC)),)
            if origin is None:  # unwarped: a placeholder the body ignores
                origin = jnp.zeros((batch, *(mesh.shape[a] for a in SPATIAL_AXES), 3), jnp.int32)
            return shard(hu, label, origin, drawn, *noise)

        return program
