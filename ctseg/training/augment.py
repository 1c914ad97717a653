"""The augmented training batch, made on the devices from the host's draws.

`Augmenter` turns a step's draws (`ctseg.training.draws`: from (seed, step, sample)
alone, so a resumed run and any mesh layout draw the same) into the batch: the host
reads, for each device, the store's voxels its slab needs (the slab itself, rearranged
by the flips, or, where boxes are rotated or zoomed, the slab's preimage:
`ctseg.training.warp`) as HU and label bytes; one program on the devices scales the
window, resamples, and applies the intensity transforms (`ctseg.training.intensity`).
The host does no per-voxel arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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
from ctseg.parallel.xla_options import compile_untuned
from ctseg.training import intensity, warp
from ctseg.training.draws import Augmentation, SampleDraw, draw_sample

_PER_SAMPLE = P("data")


class Augmenter:
    """Makes a step's augmented batch for one (config, mesh, box): `inputs` on the host,
    then `__call__` on the devices. Its programs have one input shape each and are
    compiled when the augmenter is made, before the first step, never during the run.

    A batch of which no sample is rotated or zoomed is read slab by slab, each device's
    own (the flips and quarter turns by index arithmetic). Where a sample is, each
    sample's source is one block of a fixed shape (`block`), the box's preimage clipped
    to its case's grid, sent to every device of the sample's replica; each device cuts
    its own slab's points from it. The block is bounded by the case's grid as well as by
    the warp (`block_extent`): a warp that reads beyond the grid reads air there, which
    one voxel of fill around the grid gives as well. Two programs, then, where the
    config warps (one where it does not): most batches are not warped (64 % of samples
    at nnU-Net's probabilities), and their slabs cost the host a third of a block.
    """

    def __init__(
        self,
        config: Config,
        mesh: Mesh,
        box: int,
        largest_grid: Sequence[int] | None = None,
    ):
        """`largest_grid`: the largest extent, per axis, of the grids the run reads (the
        store's training cases); None bounds the blocks by the warps alone."""
        self.config, self.mesh, self.box = config, mesh, box
        self.slab = tuple(box // mesh.shape[a] for a in SPATIAL_AXES)
        augment = config.augment
        width = intensity.halo_width(augment, box)
        if width > min(self.slab):
            raise CtsegError(
                f"the blur and simulated low resolution of [augment] read {width} voxels "
                "around each voxel, more than a partition's "
                f"{min(self.slab)}: use fewer "
                "partitions (mesh.spatial), a larger data.resolution, or lower "
                "augment.blur_sigma / raise augment.low_resolution"
            )
        self.block = block_extent(config, box, largest_grid) if augment.warps else None
        self._names = tuple(draw_sample(config, 0, 0, Augmentation()).params)
        blocks = (None,) if self.block is None else (None, self.block)
        self._programs = {b is not None: self._compile(b) for b in blocks}

    @property
    def compiled(self) -> jax.stages.Compiled:
        """The program of the largest inputs (blocks where the config warps): what the
        augmentation takes on the devices (`ctseg plan --target`)."""
        return self._programs[self.block is not None]

    # ------------------------------------------------------------------ host

    def inputs(
        self,
        store: Store,
        case_ids: Sequence[str],
        offsets: Sequence[Sequence[int]],
        read_slabs: Sequence[Augmentation],
        draws: Sequence[SampleDraw],
    ) -> tuple[jax.Array | None, ...]:
        """(hu, label, origins, drawn) placed on the mesh. Unwarped, each device's slab is
        read from the memory-mapped store for that device only, rearranged by
        `read_slabs[b]` (the sample's flips and quarter turns); warped, each sample's block
        is read once for its replica, and its matrix carries the flips."""
        if not any(d.warped for d in draws):
            hu, label = self._slabs(store, case_ids, offsets, read_slabs)
            origins = None
        else:
            hu, label, origins = self._blocks(store, case_ids, offsets, draws)
        # Every sample's matrix and parameters in one array: one transfer, not twenty.
        rows = [[*d.matrix.ravel(), *(d.params[n] for n in self._names)] for d in draws]
        drawn = jax.device_put(np.asarray(rows, np.float32), NamedSharding(self.mesh, _PER_SAMPLE))
        return hu, label, origins, drawn

    def _slabs(
        self,
        store: Store,
        case_ids: Sequence[str],
        offsets: Sequence[Sequence[int]],
        read_slabs: Sequence[Augmentation],
    ) -> tuple[jax.Array, jax.Array]:
        def read(kind: str) -> Any:
            def block(index: tuple[slice, ...]) -> np.ndarray:
                rows = range(*index[0].indices(len(case_ids)))
                return np.stack(
                    [
                        read_slabs[b].read(store.box(case_ids[b], kind, offsets[b]), index[1:4])
                        for b in rows
                    ]
                )

            return block

        shape = (len(case_ids), *(self.box,) * 3)
        hu = make_global_array(self.mesh, shape, np.int16, read("image"), LABEL_SPEC)
        label = make_global_array(self.mesh, shape, np.uint8, read("label"), LABEL_SPEC)
        return hu, label

    def _blocks(
        self,
        store: Store,
        case_ids: Sequence[str],
        offsets: Sequence[Sequence[int]],
        draws: Sequence[SampleDraw],
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        block = self.block
        starts = [
            self._block_start(store.case(c).grid_shape, o, d.matrix)
            for c, o, d in zip(case_ids, offsets, draws, strict=True)
        ]
        read_once: dict[tuple[str, int, int], np.ndarray] = {}

        def read(kind: str, dtype: Any, fill: int) -> Any:
            def rows(index: tuple[slice, ...]) -> np.ndarray:
                first, last, _ = index[0].indices(len(case_ids))
                key = (kind, first, last)  # the same rows for every device of a replica
                if key not in read_once:
                    out = np.empty((last - first, *block), dtype)
                    for row, b in enumerate(range(first, last)):
                        grid = self._grid(store, case_ids[b], kind)
                        Box(grid, starts[b], block, fill).read_into(out[row])
                    read_once[key] = out
                return read_once[key]

            return rows

        shape = (len(case_ids), *block)
        hu = make_global_array(
            self.mesh, shape, np.int16, read("image", np.int16, AIR_HU), _PER_SAMPLE
        )
        label = make_global_array(
            self.mesh, shape, np.uint8, read("label", np.uint8, 0), _PER_SAMPLE
        )
        origins = np.asarray(
            [np.subtract(s, o) for s, o in zip(starts, offsets, strict=True)], np.int32
        )
        placed = jax.device_put(origins, NamedSharding(self.mesh, _PER_SAMPLE))
        return hu, label, placed

    @staticmethod
    def _grid(store: Store, case_id: str, kind: str) -> np.ndarray:
        return store.image(case_id) if kind == "image" else store.label(case_id)

    def _block_start(
        self, grid: Sequence[int], offset: Sequence[int], matrix: np.ndarray
    ) -> tuple[int, ...]:
        """The grid voxel at a sample's block voxel 0: its preimage's first voxel, or one
        voxel before the grid where the preimage starts further out."""
        low, high = warp.preimage(matrix, self.box, (0, 0, 0), (self.box,) * 3)
        start = np.maximum(np.add(offset, low), -1)
        stop = np.minimum(np.add(offset, high), np.add(grid, 1))
        if np.any(stop - start > np.asarray(self.block)):
            raise AssertionError(  # a bug in the bound, never a user's error
                f"preimage {list(stop - start)} exceeds its block {list(self.block)}"
            )
        return tuple(int(s) for s in start)

    # ------------------------------------------------------------------ device

    def _compile(self, block: tuple[int, ...] | None) -> jax.stages.Compiled:
        """The devices' program for slabs (`block` None) or for blocks of that shape, compiled
        without tuning its fusions (with it, the blocks' program compiled for far longer:
        docs/experiments/design-figures.md#xla-options)."""
        lowered = jax.jit(self._program_fn(block)).lower(*self._abstract_inputs(block))
        return compile_untuned(lowered)

    def _abstract_inputs(
        self, block: tuple[int, ...] | None
    ) -> tuple[jax.ShapeDtypeStruct | None, ...]:
        """The program's arguments as shapes: (step, hu, label, origins, drawn)."""
        mesh, batch = self.mesh, self.config.train.batch_size

        def abstract(dims: Sequence[int], dtype: Any, spec: P) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(tuple(dims), dtype, sharding=NamedSharding(mesh, spec))

        if block is None:
            spec, extent, origins = LABEL_SPEC, (self.box,) * 3, None
        else:
            spec, extent = _PER_SAMPLE, block
            origins = abstract([batch, 3], jnp.int32, _PER_SAMPLE)
        return (
            jax.ShapeDtypeStruct((), jnp.int32),
            abstract([batch, *extent], jnp.int16, spec),
            abstract([batch, *extent], jnp.uint8, spec),
            origins,
            abstract([batch, 9 + len(self._names)], jnp.float32, _PER_SAMPLE),
        )

    def __call__(
        self, step: int, inputs: tuple[jax.Array | None, ...]
    ) -> tuple[jax.Array, jax.Array]:
        """The augmented (image [B, R, R, R, 1] float32, label [B, R, R, R] int32)."""
        return self._programs[inputs[2] is not None](jnp.int32(step), *inputs)

    def _program_fn(self, block: tuple[int, ...] | None):
        config, mesh, box, slab = self.config, self.mesh, self.box, self.slab
        augment, window = config.augment, config.data.hu_window
        halo = halo_comm(mesh).halo
        noisy = augment.noise_p > 0
        source_spec = LABEL_SPEC if block is None else _PER_SAMPLE
        names = self._names

        def body(hu, label, origin, drawn, *noise):
            matrix = drawn[:, :9].reshape(-1, 3, 3)
            params = {name: drawn[:, 9 + i] for i, name in enumerate(names)}
            start = [jax.lax.axis_index(a) * n for a, n in zip(SPATIAL_AXES, slab, strict=True)]

            def to_unit(values: jax.Array) -> jax.Array:
                return hu_to_unit(values, window, jnp)

            if origin is not None:  # scaled after the gather: the slab's voxels, not the block's
                unit, label = warp.warp_slab(hu, label, to_unit, origin, matrix, box, start, slab)
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

        def program(step, hu, label, origin, drawn):
            noise = ()
            if noisy:
                key = jax.random.fold_in(jax.random.key(config.train.seed), step)
                keys = jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(drawn.shape[0]))
                normal = jax.vmap(lambda k: jax.random.normal(k, (box,) * 3))(keys)
                noise = (jax.lax.with_sharding_constraint(normal, NamedSharding(mesh, LABEL_SPEC)),)
            shard = jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(source_spec, source_spec, _PER_SAMPLE if origin is not None else None)
                + (_PER_SAMPLE,)
                + ((LABEL_SPEC,) if noisy else ()),
                out_specs=(ACTIVATION_SPEC, LABEL_SPEC),
                check_vma=True,
            )
            return shard(hu, label, origin, drawn, *noise)

        return program


def block_extent(config: Config, box: int, largest_grid: Sequence[int] | None) -> tuple[int, ...]:
    """The fixed shape of a warped sample's block: the bound over every warp the config
    allows on the box's preimage (`warp.preimage_extent`), and no more than the largest
    grid read plus a voxel of fill on each side. CtsegError where its voxels could not
    be indexed in int32, as the devices' gather indexes them."""
    extent = warp.preimage_extent(config.augment, config.train.rotate90, (box,) * 3)
    if largest_grid is not None:
        extent = tuple(min(e, int(g) + 2) for e, g in zip(extent, largest_grid, strict=True))
    if math.prod(extent) >= 2**31:
        raise CtsegError(
            f"a rotated or zoomed {box}³ box reads blocks of up to {'×'.join(map(str, extent))} "
            "voxels, more than the devices can index: lower augment.rotation_degrees or raise "
            "augment.scaling's lower bound"
        )
    return tuple(int(e) for e in extent)
