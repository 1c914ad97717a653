"""Fixed windows on JAX devices: level-wise tiles whose programs do not depend on the box.

The spacing grid's boxes follow the scans' extents, and every new box shape would compile
the whole-volume or stage programs anew (`ctseg.inference.network.jax.plans`; minutes for
lits512's whole volume, mostly XLA's autotuning of the convolutions:
docs/experiments/design-figures.md#fixed-windows). Here each stage's
convolutions are one program on one window whose extent does not depend on the box,
compiled once per model, stage and device (`ctseg.inference.network.jax.window_programs`); a driver
on the host cuts the windows out of the level and adds
their masked cores into the next one with small programs that follow the box's level
shapes and compile in milliseconds (`WindowPlan`).

A deep stage's windows are small (16³ voxels at level 3 of 128³ cores), too small to keep
a GPU busy one at a time: they run several to a dispatch, stacked on the batch axis
(`window_batch`), as many as hold the voxels of the plan's largest window.

On several devices the windows are dealt out over them, so the devices run side by side
and a new box shape still compiles no convolution on any of them; the cost is each
stage's level(s) copied from the first device to the others and the devices' partial
output levels summed back onto it (exact: the windows' blocks own disjoint voxels).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from ctseg.data.grids import Shape
from ctseg.errors import CtsegError
from ctseg.inference.network import tiling
from ctseg.inference.network.jax.levels import (
    as_batch,
    below_level,
    cut,
    input_level,
    level_bytes,
    only_item,
    output_level,
    stage_needs,
)
from ctseg.inference.network.jax.window_programs import (
    MAX_WINDOW_BATCH,
    WindowPrograms,
    window_batch,
)
from ctseg.inference.network.tiling import Stage
from ctseg.memory import human_bytes
from ctseg.model.unet import BOTTOM, DOWN, UP
from ctseg.parallel import devices as dev
from ctseg.progress import TileProgress
from ctseg.run.trained import TrainedModel


def _shaped(level: tuple[tuple[int, ...], Any], sharding: Any) -> jax.ShapeDtypeStruct:
    shape, dtype = level
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


# The driver's programs, between the window programs: they depend on the levels' shapes
# (so compile per box shape, in milliseconds: no convolution to tune) and on nothing of
# the network. Two per stage (and on several devices the sum of their levels, `_add`),
# and two dispatches per batch of windows (their program, then `_add_then_cut`).


def _cut_batch(levels: list[jax.Array], rows: jax.Array, extent: Shape) -> list[jax.Array]:
    """The windows of `rows` [batch, 4, 3] (`cut`), stacked on the batch axis."""
    windows = [cut(levels, row, extent) for row in rows]
    return [jnp.concatenate(parts, axis=0) for parts in zip(*windows, strict=True)]


@partial(jax.jit, static_argnums=(2, 3, 4))
def _begin(
    levels: list[jax.Array], rows: jax.Array, extent: Shape, shape: tuple[int, ...], dtype: Any
) -> tuple[jax.Array, list[jax.Array]]:
    """A zero output level of `shape` (on the levels' device), and the first windows."""
    return jnp.zeros(shape, dtype), _cut_batch(levels, rows, extent)


@partial(jax.jit, static_argnums=4, donate_argnums=0)
def _add_then_cut(
    out: jax.Array,
    blocks: jax.Array,
    rows: jax.Array,
    levels: list[jax.Array],
    extent: Shape,
    following: jax.Array,
) -> tuple[jax.Array, list[jax.Array]]:
    """`out` with each window's masked block added at its row's block start (in place:
    the blocks own disjoint voxels, and every other voxel of a block adds zero), and the
    `following` rows' windows."""
    for block, row in zip(blocks, rows, strict=True):
        at = (0, *row[1], 0)
        current = jax.lax.dynamic_slice(out, at, (1, *block.shape))
        out = jax.lax.dynamic_update_slice(out, current + block[None], at)
    return out, _cut_batch(levels, following, extent)


@partial(jax.jit, donate_argnums=0)
def _add(level: jax.Array, other: jax.Array) -> jax.Array:
    return level + other


def _summed(parts: list[jax.Array], devices: list[Any]) -> jax.Array:
    """The sum of the partial output levels `parts` (parts[i] on devices[i]), on the first
    device: pairwise in rounds, each device taking in one level per round, so none holds
    more than ⌈log2 n⌉ levels beside its own (n − 1 if all went to the first at once).
    Exact: the blocks own disjoint voxels, so each voxel adds zeros to its one value."""
    while len(parts) > 1:
        pairs = range(0, len(parts) - 1, 2)
        summed = [_add(parts[i], jax.device_put(parts[i + 1], devices[i])) for i in pairs]
        parts, devices = summed + parts[2 * len(summed) :], devices[::2]
    return parts[0]


def _batched(rows: np.ndarray, batch: int) -> np.ndarray:
    """`rows` [n, 4, 3] in batches [⌈n / batch⌉, batch, 4, 3], the last filled with copies
    of the first row that own nothing (stop = first): their blocks add zeros."""
    missing = -len(rows) % batch
    idle = np.repeat(rows[:1], missing, axis=0)
    idle[:, 3] = idle[:, 2]
    return np.concatenate([rows, idle]).reshape(-1, batch, *rows.shape[1:])


def _receives(devices: int) -> int:
    """How many partial levels the first of `devices` takes in (`_summed`): ⌈log2 n⌉."""
    return (devices - 1).bit_length()


class WindowPlan:
    """Level-wise tiles on the backend's devices whose window programs do not depend on the
    box.

    Each stage's convolutions are one program on one window of a fixed extent
    (`window_program`, `tiling.fixed_stages`), compiled once per model, stage and device
    and kept by the backend (`WindowPrograms`), so boxes of every later shape reuse them.
    A driver on the host cuts each window out of the level on a device, runs the stage's
    program on it and adds its masked core into that device's output level (`_begin`,
    `_add_then_cut`: two small programs per stage, device and box shape, compiled in
    milliseconds, all at once when the plan is made): nothing passes through the host but
    the dispatches. A deep stage's small windows run several to a dispatch
    (`window_batch`); each device's last dispatch of a stage is filled with windows that
    own nothing. The cost: two dispatches per batch, and windows of fixed cores (not
    balanced to the box; deeper levels' cores fit the box floor, `tiling.window_floor`),
    so more overlap than `JaxPlan`'s tiles: on the lits512 model at cores of 128, 2.1–3.1×
    the whole pass's multiply-adds against 1.4–1.5× for those tiles.

    On several devices the windows are dealt round-robin (window i on device i mod n),
    so the devices run side by side, every dispatch asynchronous: each stage's input
    level(s) are copied from the first device to every device that has windows, each
    device adds its blocks into a zero level of its own, and the partial levels are
    summed onto the first device (`_summed`; exact, the blocks own disjoint voxels). The
    cost on top of one device: each stage's level(s) copied to every device, and the
    partial levels summed; each device holds a stage's whole levels (and the first up to
    ⌈log2 n⌉ partial levels taken in), so the memory per device is one device's.
    """

    spatial = (1, 1, 1)
    spills = False

    def __init__(
        self,
        programs: WindowPrograms,
        model: TrainedModel,
        shape: Shape,
        stages: list[Stage],
        devices: list[Any],
        memory: int,
        most_batched: int = MAX_WINDOW_BATCH,
    ):
        self.model, self.shape, self.stages = model, shape, stages
        self.devices = list(devices)
        self.device = self.devices[0]  # the image, the levels between stages, the logits
        self.batches = [window_batch(stage, stages, most_batched) for stage in stages]
        self._programs = programs.of(model, stages, self.batches, self.devices)
        self.needed = self._needed(memory)
        self._compile_drivers()
        # The weights once per device, for every box this plan runs.
        self._weights = [jax.device_put((model.params, model.stats), d) for d in self.devices]
        self._dealt = [self._deal(s, b) for s, b in zip(stages, self.batches, strict=True)]

    def _needed(self, memory: int) -> int:
        """Peak bytes on a device (the first, which also sums the partial levels), checked
        against `memory` bytes per device."""
        config = self.model.config
        stages = self.stages
        firsts = [programs[0] for programs in self._programs]  # the same on every device
        # The window programs' own figures hold no level: each stage's levels are beside them.
        levels = []
        for stage in stages:
            out = level_bytes(*output_level(config, stage))
            busy = min(len(self.devices), len(stage.windows()))
            levels.append(
                level_bytes(*input_level(config, stage))
                + out * (1 + _receives(busy))
                + (level_bytes(*below_level(config, stage)) if stage.kind == UP else 0)
            )
        needs = stage_needs(config, stages, firsts, spill=False)
        needed = max(need + level for need, level in zip(needs, levels, strict=True))
        if needed > memory:
            raise CtsegError(
                f"fixed windows ≤ {max(s.largest_core for s in stages)}³ of the "
                f"{tiling.shape_text(self.shape)} grid need {human_bytes(needed)} per device, "
                f"more than the {human_bytes(memory)} free on {dev.describe(self.devices)}; "
                "use smaller tiles"
            )
        return needed

    def _compile_drivers(self) -> None:
        """The driver's programs of every stage on every device that has windows, compiled
        now, concurrently, into `jax.jit`'s own cache (the dispatches then find them there):
        compiled one after another as first dispatched, their count per box shape (two per
        stage and device, and the sums) would add up on several devices."""
        config = self.model.config
        lowerings = []
        for stage, batch in zip(self.stages, self.batches, strict=True):
            busy = self.devices[: len(stage.windows())]
            out_shape, out_dtype = output_level(config, stage)
            for index, device in enumerate(busy):
                sharding = SingleDeviceSharding(device)
                levels = [_shaped(input_level(config, stage), sharding)]
                if stage.kind == UP:
                    levels.append(_shaped(below_level(config, stage), sharding))
                rows = jax.ShapeDtypeStruct((batch, 4, 3), jnp.int32, sharding=sharding)
                out = _shaped((out_shape, out_dtype), sharding)
                blocks = _shaped(((batch, *stage.block, out_shape[-1]), out_dtype), sharding)
                lowerings.append(
                    partial(_begin.lower, levels, rows, stage.extent, out_shape, out_dtype)
                )
                lowerings.append(
                    partial(_add_then_cut.lower, out, blocks, rows, levels, stage.extent, rows)
                )
                if index % 2 == 0 and index + 1 < len(busy):  # a device `_summed` adds into
                    lowerings.append(partial(_add.lower, out, out))
        with ThreadPoolExecutor() as pool:
            list(pool.map(lambda lower: lower().compile(), lowerings))

    def _deal(
        self, stage: Stage, batch: int, span: tiling.Span | None = None
    ) -> list[list[jax.Array]]:
        """The stage's window rows (`tiling.stitch_table`, of its `span`) dealt round-robin
        over the devices, each device's in batches of `batch` rows [batch, 4, 3] placed on
        it ([] for a device with none)."""
        table = tiling.stitch_table(stage, span)
        count = len(self.devices)
        return [
            jax.device_put(list(_batched(table[i::count], batch)), device)
            if len(table[i::count])
            else []
            for i, device in enumerate(self.devices)
        ]

    def memory_words(self, memory: int) -> str:
        return f": {human_bytes(self.needed)} per device of {human_bytes(memory)} free (compiled)"

    def place(self, image: np.ndarray | jax.Array) -> jax.Array:
        return jax.device_put(as_batch(image), self.device)

    def _stage(self, stage: Stage, index: int, dealt: list[list[jax.Array]], *levels: jax.Array):
        """A stage's output level on the first device. Each device with windows gets its own
        copy of the levels (device to device) and a zero output level; the windows are
        dispatched round-robin, never waited for; a device's last window's following cut is
        its first's again, unused."""
        out_shape, out_dtype = output_level(self.model.config, stage)
        busy = [d for d, rows in enumerate(dealt) if rows]
        inputs = {d: list(jax.device_put(levels, self.devices[d])) for d in busy}
        state = {
            d: _begin(inputs[d], dealt[d][0], stage.extent, out_shape, out_dtype) for d in busy
        }
        for step in range(len(dealt[0])):  # the first device has the most windows
            for d in busy:
                rows = dealt[d]
                if step == len(rows):
                    break  # round-robin: the later devices have no more windows either
                out, window = state[d]
                block = self._programs[index][d](*self._weights[d], rows[step], *window)
                following = rows[(step + 1) % len(rows)]
                state[d] = _add_then_cut(out, block, rows[step], inputs[d], stage.extent, following)
        return _summed([state[d][0] for d in busy], [self.devices[d] for d in busy])

    def logits(
        self, image: jax.Array, progress: TileProgress | None, need: tiling.Span | None = None
    ) -> jax.Array:
        image = jax.device_put(image, self.device)
        dealt = self._dealt
        spans: list[tiling.Span | None] = [None] * len(self.stages)
        if need is not None:
            spans = list(tiling.stage_spans(self.stages, need))
            dealt = [
                self._deal(s, b, span)
                for s, b, span in zip(self.stages, self.batches, spans, strict=True)
            ]
        # Progress in windows, not dispatches (a batch's idle windows left out).
        counts = [len(s.windows(span)) for s, span in zip(self.stages, spans, strict=True)]
        done = 0
        levels: list[Any] = [image]
        below = None
        for index, (stage, stage_dealt) in enumerate(zip(self.stages, dealt, strict=True)):
            if stage.kind == DOWN:
                levels.append(self._stage(stage, index, stage_dealt, levels[-1]))
            elif stage.kind == BOTTOM:
                below = self._stage(stage, index, stage_dealt, levels.pop())
            else:
                below = self._stage(stage, index, stage_dealt, levels.pop(), below)
            if progress is not None:
                jax.block_until_ready(below if stage.kind != DOWN else levels[-1])
                done += counts[index]
                progress(done, sum(counts))
        assert below is not None and below.dtype == jnp.float32
        return only_item(below)
