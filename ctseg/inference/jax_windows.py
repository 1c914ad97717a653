"""Fixed windows on one JAX device: level-wise tiles whose programs do not depend on the box.

The spacing grid's boxes follow the scans' extents, and every new box shape would compile
the whole-volume or stage programs anew (`ctseg.inference.jax_backend`; lits512's whole
volume: ~107 s on an H200, mostly XLA's autotuning of the convolutions). Here each stage's
convolutions are one program on one window whose extent does not depend on the box
(`window_program`, `tiling.fixed_stages`), compiled once per model and stage and kept in
`WindowPrograms`; a driver on the host cuts the windows out of the level and adds their
masked cores into the next one with small programs that follow the box's level shapes
and compile in milliseconds (`WindowPlan`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

from ctseg.config import Config
from ctseg.errors import CtsegError
from ctseg.inference import tiling
from ctseg.inference.levels import (
    as_batch,
    below_level,
    cut,
    input_level,
    level_bytes,
    only_item,
    output_level,
    owned,
    stage_needs,
)
from ctseg.inference.tiling import Shape, Stage, TileProgress
from ctseg.memory import human_bytes
from ctseg.model.unet import BOTTOM, DOWN, UP
from ctseg.parallel import devices as dev
from ctseg.parallel.partition import LOCAL
from ctseg.run.trained import TrainedModel

# Fixed windows' cores chosen from (`JaxBackend.window_core`), largest first: up to 128, a
# window GPUs' convolutions run efficiently whose box floor (136 voxels a side at k = 3)
# pads few scans.
WINDOW_CORES = (128, 96, 64, 48, 32, 24, 16)


class WindowPrograms:
    """The window programs of one device, by model and stage (`window_program`): every box
    shape reuses them."""

    def __init__(self, device: Any):
        self.device = device
        self._compiled: dict[tuple, jax.stages.Compiled] = {}

    def of(self, model: TrainedModel, stage: Stage, params: Any, stats: Any) -> jax.stages.Compiled:
        """Stage `stage`'s window program for `model`'s network, compiled when first asked
        for (weights are arguments: models of one config share it)."""
        key = (repr(model.config.model), *tiling.window_key(stage), str(self.device))
        if key not in self._compiled:
            self._compiled[key] = window_program(model.graphdef, model.config, stage, params, stats)
        return self._compiled[key]


def window_program(
    graphdef: nnx.GraphDef, config: Config, stage: Stage, params: Any, stats: Any
) -> jax.stages.Compiled:
    """Stage `stage` on one window of its extent: the network's convolutions, and nothing
    that depends on the box (`WindowPlan`).

    Arguments: params, stats, the window's row of `tiling.stitch_table` [4, 3], the window
    of the input level [1, *extent, C] (and of d_{level+1}, halved, for an up stage).
    Result: the block of `stage.block` output voxels that holds the window's core, zero
    where the window does not own a voxel, so that adding the blocks into a zero level
    stitches it exactly. `params` and `stats` are shapes placed on one device.
    """
    block = stage.block
    out_shape, out_dtype = output_level(config, stage)
    channels = out_shape[-1]

    def run(params: Any, stats: Any, row: jax.Array, *inputs: jax.Array) -> jax.Array:
        net = nnx.merge(graphdef, params, stats, copy=True)
        start, kept = row[0], row[1]
        y = net.stage(stage.kind, stage.level, list(inputs), LOCAL)
        at = (0, *(kept - start // stage.scale), 0)
        result = jax.lax.dynamic_slice(y, at, (1, *block, channels))
        return jnp.where(owned(row, block)[None, ..., None], result, 0).astype(out_dtype)

    run.__name__ = "window_program"  # as the compile clock counts it
    device = jax.tree.leaves(params)[0].sharding
    _, in_dtype = input_level(config, stage)
    inputs = [
        jax.ShapeDtypeStruct(
            (1, *stage.extent, input_level(config, stage)[0][-1]), in_dtype, sharding=device
        )
    ]
    if stage.kind == UP:
        below_shape, below_dtype = below_level(config, stage)
        half = (1, *(n // 2 for n in stage.extent), below_shape[-1])
        inputs.append(jax.ShapeDtypeStruct(half, below_dtype, sharding=device))
    row = jax.ShapeDtypeStruct((4, 3), jnp.int32, sharding=device)
    return jax.jit(run).lower(params, stats, row, *inputs).compile()


def _single_shapes(tree: Any, device: Any) -> Any:
    sharding = SingleDeviceSharding(device)
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=sharding), tree
    )


# The driver's programs, between the window programs: they depend on the levels' shapes
# (so compile per box shape, in milliseconds: no convolution to tune) and on nothing of
# the network. Two per stage, and two dispatches per window (its program, then this).


@partial(jax.jit, static_argnums=(2, 3, 4))
def _begin(
    levels: list[jax.Array], row: jax.Array, extent: Shape, shape: tuple[int, ...], dtype: Any
) -> tuple[jax.Array, list[jax.Array]]:
    """A zero output level of `shape` (on the levels' device), and the first window."""
    return jnp.zeros(shape, dtype), cut(levels, row, extent)


@partial(jax.jit, static_argnums=4, donate_argnums=0)
def _add_then_cut(
    out: jax.Array,
    block: jax.Array,
    row: jax.Array,
    levels: list[jax.Array],
    extent: Shape,
    following: jax.Array,
) -> tuple[jax.Array, list[jax.Array]]:
    """`out` with a window's masked block added at its row's block start (in place: the
    blocks own disjoint voxels, and every other voxel of the block adds zero), and the
    `following` row's window."""
    at = (0, *row[1], 0)
    current = jax.lax.dynamic_slice(out, at, block.shape)
    return jax.lax.dynamic_update_slice(out, current + block, at), cut(levels, following, extent)


class WindowPlan:
    """Level-wise tiles on one device whose window programs do not depend on the box.

    Each stage's convolutions are one program on one window of a fixed extent
    (`window_program`, `tiling.fixed_stages`), compiled once per model and stage and kept
    by the backend, so boxes of every later shape reuse them. A driver on the host cuts
    each window out of the level on the device, runs the stage's program on it and adds
    its masked core into the output level (`_begin`, `_add_then_cut`: two small programs
    per stage and box shape, compiled in milliseconds): nothing passes through the host
    but the dispatches. The cost: two dispatches per window, and windows of fixed cores
    (not balanced to the box; deeper levels' cores fit the box floor,
    `tiling.window_floor`), so more overlap than `JaxPlan`'s tiles: on the lits512 model
    at cores of 128, 2.1–3.1× the whole pass's multiply-adds against 1.4–1.5× for those
    tiles. On the backend's first device only: the automatic choice (`JaxBackend`) runs
    them only where it has one device; on several it plans as before (`JaxPlan`).
    """

    spatial = (1, 1, 1)
    spills = False

    def __init__(
        self,
        programs: WindowPrograms,
        model: TrainedModel,
        shape: Shape,
        stages: list[Stage],
        memory: int,
    ):
        self.model, self.shape, self.stages = model, shape, stages
        self.device = programs.device
        config = model.config
        weights = _single_shapes((model.params, model.stats), self.device)
        self._programs = [programs.of(model, stage, *weights) for stage in stages]
        # The window programs' own figures hold no level: each stage's levels are beside them.
        levels = [
            level_bytes(*input_level(config, stage))
            + level_bytes(*output_level(config, stage))
            + (level_bytes(*below_level(config, stage)) if stage.kind == UP else 0)
            for stage in stages
        ]
        needs = stage_needs(config, stages, self._programs, spill=False)
        self.needed = max(need + level for need, level in zip(needs, levels, strict=True))
        if self.needed > memory:
            raise CtsegError(
                f"fixed windows ≤ {max(s.largest_core for s in stages)}³ of the "
                f"{tiling.shape_text(shape)} grid need {human_bytes(self.needed)}, more than the "
                f"{human_bytes(memory)} free on {dev.describe([self.device])}; use smaller tiles"
            )
        self._params, self._stats = jax.device_put((model.params, model.stats), self.device)
        self._rows = [self._place_rows(stage) for stage in stages]

    def _place_rows(self, stage: Stage, span: tiling.Span | None = None) -> list[jax.Array]:
        table = tiling.stitch_table(stage, span)
        return list(jax.device_put(list(table), self.device))

    def memory_words(self, memory: int) -> str:
        return f": {human_bytes(self.needed)} of {human_bytes(memory)} free (compiled)"

    def place(self, image: np.ndarray | jax.Array) -> jax.Array:
        return jax.device_put(as_batch(image), self.device)

    def _stage(self, stage: Stage, program: Any, rows: list[jax.Array], *levels: jax.Array):
        """A stage's output level: its windows run one after another (dispatched, not waited
        for); the last window's following cut is the first's again, unused."""
        out_shape, out_dtype = output_level(self.model.config, stage)
        levels_ = list(levels)
        out, window = _begin(levels_, rows[0], stage.extent, out_shape, out_dtype)
        for row, following in zip(rows, [*rows[1:], rows[0]], strict=True):
            block = program(self._params, self._stats, row, *window)
            out, window = _add_then_cut(out, block, row, levels_, stage.extent, following)
        return out

    def logits(
        self, image: jax.Array, progress: TileProgress | None, need: tiling.Span | None = None
    ) -> jax.Array:
        image = jax.device_put(image, self.device)
        spans: list[tiling.Span | None] = [None] * len(self.stages)
        rows = self._rows
        if need is not None:
            spans = list(tiling.stage_spans(self.stages, need))
            rows = [self._place_rows(s, span) for s, span in zip(self.stages, spans, strict=True)]
        total = sum(len(r) for r in rows)
        done = 0
        levels: list[Any] = [image]
        below = None
        for stage, program, stage_rows in zip(self.stages, self._programs, rows, strict=True):
            if stage.kind == DOWN:
                levels.append(self._stage(stage, program, stage_rows, levels[-1]))
            elif stage.kind == BOTTOM:
                below = self._stage(stage, program, stage_rows, levels.pop())
            else:
                below = self._stage(stage, program, stage_rows, levels.pop(), below)
            if progress is not None:
                jax.block_until_ready(below if stage.kind != DOWN else levels[-1])
                done += len(stage_rows)
                progress(done, total)
        assert below is not None and below.dtype == jnp.float32
        return only_item(below)
