"""JAX plans of a box: the whole volume partitioned over the devices, or level-wise tiles.

Whole volume (no stages): one pass over the devices, the grid split over them when
they are several (`ctseg.parallel.layouts.fit_split`: halo exchange, exactly as in training),
whatever mesh trained the model.

Level-wise tiles (the geometry in `ctseg.inference.network.tiling`): everything stays on
the devices.
Each stage is one program that takes its whole input level(s), cuts its windows,
runs them and stitches their cores into its whole output level, a loop over the
windows inside the program (`_stage_program`). With several devices the windows are
dealt out over them, each device stitches the cores it computed into its own copy of
the level, and a sum over the devices (the cores are disjoint) gives every device the
whole level for the next stage. The levels kept for the up stages stay on the devices
while they fit, and are moved to the host whole (never per window) when they do not.
The levels' shapes and the window cut: `ctseg.inference.network.jax.levels`, shared with fixed
windows (`ctseg.inference.network.jax.windows`).

Planning (no stages given): the hand formula of `ctseg.inference.network.tile_memory`
proposes candidates
(the whole volume, then tiles); the candidates' programs are compiled, all of a plan
at once (XLA compiles them in parallel threads), and the compiler's own memory
analysis of each, with the levels alive beside it, decides against the devices' free
memory. A plan is compiled before the first scan, so every scan after it only runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ctseg.config import Config
from ctseg.data.grids import Shape
from ctseg.errors import CtsegError
from ctseg.inference.network import tile_memory, tiling
from ctseg.inference.network.jax.levels import (
    as_batch,
    below_level,
    cut,
    input_level,
    only_item,
    output_level,
    owned,
    post_bytes,
    stage_needs,
)
from ctseg.inference.network.tiling import Stage
from ctseg.memory import human_bytes
from ctseg.model import aot
from ctseg.model.step import make_predict
from ctseg.model.unet import BOTTOM, DOWN, UP
from ctseg.parallel import devices as dev
from ctseg.parallel.layouts import fit_split
from ctseg.parallel.partition import (
    REPLICATED,
    Comm,
    activation_sharding,
    make_mesh,
    partitioned,
    replicated_shapes,
)
from ctseg.progress import TileProgress
from ctseg.run.trained import TrainedModel

# Share of the devices' free memory a plan's compiled programs, with the levels alive
# beside them, may take. The compiler's figures are the programs' own, so the share
# only keeps room for the runtime's workspace and for fragmentation.
COMPILED_SHARE = 0.85


def _stage_program(
    graphdef: nnx.GraphDef, stage: Stage, config: Config, mesh: Mesh, params: Any, stats: Any
) -> jax.stages.Compiled:
    """Stage `stage` over all its windows, on the devices of `mesh`'s ``data`` axis.

    Arguments: params, stats, the window table (`tiling.stitch_table`, dealt out over
    the devices: [devices, steps, 4, 3]), how many of its steps each device runs
    ([devices]: a span's windows are fewer than the table holds) and the whole input
    level(s), replicated. Result: the whole output level, replicated.
    """
    devices = mesh.shape["data"]
    extent, block = stage.extent, stage.block
    out_shape, out_dtype = output_level(config, stage)
    in_shape, in_dtype = input_level(config, stage)

    def body(
        comm: Comm, params: Any, stats: Any, table: jax.Array, count: jax.Array, *levels: jax.Array
    ):
        # The mesh splits no spatial axis, so `comm` pads with zeros, as LOCAL does.
        net = nnx.merge(graphdef, params, stats, copy=True)

        def one(step: jax.Array, out: jax.Array) -> jax.Array:
            row = table[0, step]
            start, kept = row[0], row[1]
            y = net.stage(stage.kind, stage.level, cut(list(levels), row, extent), comm)
            into = (0, *kept, 0)
            size = (1, *block, out_shape[-1])
            result = jax.lax.dynamic_slice(y, (0, *(kept - start // stage.scale), 0), size)
            # Only the core's voxels: a shortened last core's block overlaps its neighbour's,
            # and on several devices the sum over them must see each voxel once.
            mask = owned(row, block)
            current = jax.lax.dynamic_slice(out, into, size)
            return jax.lax.dynamic_update_slice(
                out, jnp.where(mask[None, ..., None], result.astype(out_dtype), current), into
            )

        # Each device's copy of the level differs (its own cores): a device-varying carry.
        out = jax.lax.pcast(jnp.zeros(out_shape, out_dtype), ("data",), to="varying")
        out = jax.lax.fori_loop(0, count[0], one, out)
        return jax.lax.psum(out, "data")

    levels = 2 if stage.kind == UP else 1
    program = partitioned(
        body,
        mesh,
        "halo",
        in_specs=(
            REPLICATED,
            REPLICATED,
            PartitionSpec("data"),
            PartitionSpec("data"),
            *[REPLICATED] * levels,
        ),
        out_specs=REPLICATED,
    )
    replicated = NamedSharding(mesh, REPLICATED)
    inputs = [jax.ShapeDtypeStruct(in_shape, in_dtype, sharding=replicated)]
    if stage.kind == UP:
        below_shape, below_dtype = below_level(config, stage)
        inputs.append(jax.ShapeDtypeStruct(below_shape, below_dtype, sharding=replicated))
    steps = -(-len(stage.windows()) // devices)
    dealt = NamedSharding(mesh, PartitionSpec("data"))
    table = jax.ShapeDtypeStruct((devices, steps, 4, 3), jnp.int32, sharding=dealt)
    count = jax.ShapeDtypeStruct((devices,), jnp.int32, sharding=dealt)
    return jax.jit(program).lower(params, stats, table, count, *inputs).compile()


def _dealt_table(
    stage: Stage, devices: int, span: tiling.Span | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """`tiling.stitch_table` (of the stage, or of its `span`) dealt out round-robin over
    `devices`, in the compiled program's shape [devices, steps, 4, 3] (the whole stage's
    steps), and how many steps each device runs.

    A device with fewer windows than the others repeats the first window owning
    nothing (core start = stop), which writes no voxel.
    """
    table = tiling.stitch_table(stage, span)
    steps = -(-len(stage.windows()) // devices)
    idle = table[0].copy()
    idle[2:] = 0
    padded = np.concatenate([table, np.repeat(idle[None], steps * devices - len(table), 0)])
    dealt = np.ascontiguousarray(padded.reshape(steps, devices, 4, 3).transpose(1, 0, 2, 3))
    count = np.full(devices, -(-len(table) // devices), np.int32)
    return dealt, count


# --------------------------------------------------------------------------- JAX plans


@dataclass
class InferencePlan:
    """Compiled programs ready to run: the whole pass (no stages) or one per stage."""

    stages: list[Stage]
    programs: list[jax.stages.Compiled]
    mesh: Mesh
    spatial: tuple[int, int, int]  # the whole pass's split over the devices
    needed: int  # peak bytes per device: the largest program with the levels beside it
    spill: bool = False  # keep waiting levels on the host


def _compile_whole(model: TrainedModel, devices: Sequence[Any], shape: Shape) -> InferencePlan:
    spatial = fit_split(model.config, shape, len(devices))
    config = model.config  # its partitioner; the mesh below is the split that counts
    mesh = make_mesh(spatial, 1, devices)
    image = jax.ShapeDtypeStruct((1, *shape, 1), jnp.float32, sharding=activation_sharding(mesh))
    weights = replicated_shapes((model.params, model.stats), mesh)
    compiled = jax.jit(make_predict(model.graphdef, config, mesh)).lower(*weights, image).compile()
    needed = aot.memory_of(compiled).total + post_bytes(shape)
    return InferencePlan([], [compiled], mesh, spatial, needed)


def _compile_stages(
    model: TrainedModel, stages: list[Stage], mesh: Mesh
) -> list[jax.stages.Compiled]:
    """Every stage's program, compiled concurrently (XLA compiles in threads of its own)."""
    params, stats = replicated_shapes((model.params, model.stats), mesh)
    compile_one = partial(
        _stage_program, model.graphdef, config=model.config, mesh=mesh, params=params, stats=stats
    )
    with ThreadPoolExecutor(max(1, len(stages))) as pool:
        return list(pool.map(lambda stage: compile_one(stage=stage), stages))


def _plan_tiles(
    model: TrainedModel, stages: list[Stage], mesh: Mesh, budget: float | None
) -> InferencePlan:
    """Compile `stages`; with a `budget`, shrink the cores of stages that do not fit it."""
    config = model.config
    programs = _compile_stages(model, stages, mesh)
    needs = stage_needs(config, stages, programs, spill=False)
    spill = False
    while budget is not None and max(needs) > budget:
        over = [
            i
            for i, (stage, need) in enumerate(zip(stages, needs, strict=True))
            if need > budget and stage.largest_core > 2
        ]
        if not over:
            if not spill:  # the cores are as small as they go: the waiting levels leave
                spill = True
                needs = stage_needs(config, stages, programs, spill=True)
                continue
            break
        for i in over:
            stage = stages[i]
            smaller = max(2, (stage.largest_core // 2) & ~1)
            shape = stages[0].size  # the grid: the first stage runs at level 0
            stages[i] = tiling.make_stage(config, shape, stage.kind, stage.level, smaller)
        recompiled = _compile_stages(model, [stages[i] for i in over], mesh)
        for i, program in zip(over, recompiled, strict=True):
            programs[i] = program
        needs = stage_needs(config, stages, programs, spill)
    return InferencePlan(stages, programs, mesh, (1, 1, 1), max(needs), spill)


def plan_inference(
    model: TrainedModel,
    shape: Shape,
    fixed: list[Stage] | None,
    devices: Sequence[Any],
    memory: int,
) -> InferencePlan:
    """The compiled plan for boxes of `shape` on `devices` with `memory` bytes each: `fixed`
    stages as asked ([] the whole volume), else chosen from the compiled programs' own memory
    figures. The model's weights may be abstract (shapes only): nothing is placed, so a
    plan can be made for devices that are not here (`ctseg.targets`)."""
    devices = list(devices)
    config = model.config
    budget = COMPILED_SHARE * memory
    tiles_mesh = make_mesh((1, 1, 1), len(devices), devices)
    if fixed is not None:
        if fixed:
            chosen = _plan_tiles(model, fixed, tiles_mesh, budget=None)
            largest = max(stage.largest_core for stage in fixed)
            what, advice = f"tiles ≤ {largest}³", "use smaller tiles"
        else:
            chosen = _compile_whole(model, devices, shape)
            what, advice = "a whole-volume pass", "use tiles"
        if chosen.needed > memory:
            raise CtsegError(
                f"{what} of the {tiling.shape_text(shape)} grid needs "
                f"{human_bytes(chosen.needed)} per device, more than the "
                f"{human_bytes(memory)} free on {dev.describe(devices)}; "
                f"{advice} (tile -1 chooses them, or e.g. tile 64)"
            )
        return chosen
    # The hand formula overestimates wide models severalfold
    # (docs/experiments/design-figures.md#whole-volume-plans), so the whole volume is
    # compiled to be measured whenever the formula is within that factor of fitting.
    itemsize = jnp.dtype(config.model.dtype).itemsize
    if tile_memory.whole_volume_bytes(config, itemsize, shape) <= 3 * budget:
        whole = _compile_whole(model, devices, shape)
        if whole.needed <= budget:
            return whole
    first_guess = tile_memory.choose_stages(config, memory, itemsize, shape)
    return _plan_tiles(model, first_guess, tiles_mesh, budget)


class JaxPlan:
    """A model's compiled inference plan on JAX devices, with its weights placed there."""

    def __init__(
        self,
        model: TrainedModel,
        shape: Shape,
        stages: list[Stage] | None,
        devices: Sequence[Any],
        memory: int,
    ):
        """The plan for grids of `shape`. `stages`: the level-wise tiles to run ([] the
        whole volume), or None to plan them from the compiled programs' memory against
        `memory` bytes per device."""
        self.model = model
        self.shape = shape
        self.devices = list(devices)
        self.dtype = jnp.dtype(model.config.model.dtype)  # of the materialised levels
        self._plan = plan_inference(model, shape, stages, self.devices, memory)
        self.stages = self._plan.stages
        self.needed = self._plan.needed
        self.spatial = self._plan.spatial
        mesh = self._plan.mesh
        self._params, self._stats = jax.device_put(
            (model.params, model.stats), NamedSharding(mesh, REPLICATED)
        )
        if self.stages:
            self._dealt = NamedSharding(mesh, PartitionSpec("data"))
            self._tables = [self._table(stage) for stage in self.stages]
            self._input_sharding = NamedSharding(mesh, REPLICATED)
        else:
            self._input_sharding = activation_sharding(mesh)

    @property
    def spills(self) -> bool:
        """Whether the levels waiting for their up stage are kept on the host."""
        return self._plan.spill

    def memory_words(self, memory: int) -> str:
        """What the plan needs of `memory` bytes per device, in words."""
        spill = "; levels wait on the host" if self.spills else ""
        return (
            f": {human_bytes(self.needed)} per device of {human_bytes(memory)} free "
            f"(compiled; plans take {COMPILED_SHARE:.0%}){spill}"
        )

    def place(self, image: np.ndarray | jax.Array) -> jax.Array:
        """A unit-scaled image [x, y, z] as the plan takes it: [1, x, y, z, 1] float32, on
        the devices (one transfer)."""
        return jax.device_put(as_batch(image), self._input_sharding)

    def _table(self, stage: Stage, span: tiling.Span | None = None) -> tuple[jax.Array, ...]:
        """A stage's window table and step counts on the devices (`_dealt_table`)."""
        return tuple(
            jax.device_put(part, self._dealt)
            for part in _dealt_table(stage, self._plan.mesh.shape["data"], span)
        )

    def logits(
        self, image: jax.Array, progress: TileProgress | None, need: tiling.Span | None = None
    ) -> jax.Array:
        """Logits [x, y, z, 3] float32 of a `place`d image, on the devices: everywhere, or
        exact on the voxels `need` (tiles compute only their cone, `tiling.stage_spans`)."""
        image = jax.device_put(image, self._input_sharding)  # a flipped copy may lie otherwise
        if not self.stages:
            out = self._plan.programs[0](self._params, self._stats, image)
            if progress is not None:
                out.block_until_ready()
                progress(1, 1)
            return only_item(out)
        spans: list[tiling.Span | None] = [None] * len(self.stages)
        tables = self._tables
        if need is not None:
            spans = list(tiling.stage_spans(self.stages, need))
            tables = [self._table(s, span) for s, span in zip(self.stages, spans, strict=True)]
        total = sum(len(s.windows(span)) for s, span in zip(self.stages, spans, strict=True))
        done = 0
        levels: list[Any] = [image]  # a_0 … a_l: inputs of the levels whose up stage is to come
        below = None  # d_{l+1}, the output of the stage that ran last
        run = zip(self.stages, self._plan.programs, tables, spans, strict=True)
        for stage, program, table, span in run:
            args = (self._params, self._stats, *table)
            if stage.kind == DOWN:
                pooled = program(*args, levels[-1])
                if self._plan.spill:  # the level waits for its up stage on the host, whole
                    levels[-1] = jax.device_get(levels[-1])
                levels.append(pooled)
            else:
                level = jax.device_put(levels.pop(), self._input_sharding)
                below = (
                    program(*args, level) if stage.kind == BOTTOM else program(*args, level, below)
                )
            if progress is not None:
                jax.block_until_ready(below if stage.kind != DOWN else levels[-1])
                done += len(stage.windows(span))
                progress(done, total)
        assert below is not None and below.dtype == jnp.float32
        return only_item(below)
