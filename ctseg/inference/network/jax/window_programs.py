"""The window programs of fixed windows: each stage's convolutions one program on one
window whose extent does not depend on the box (`window_program`, `tiling.fixed_stages`),
compiled once per model, stage and device and kept by the backend (`WindowPrograms`), in
the background from when a member is made; and how many windows one dispatch runs
(`window_batch`). The driver that runs them over a box is `ctseg.inference.network.jax.windows`.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

from ctseg.config import Config
from ctseg.inference.network import tiling
from ctseg.inference.network.jax.levels import below_level, input_level, output_level, owned
from ctseg.inference.network.tiling import Stage
from ctseg.model.unet import UP
from ctseg.parallel.partition import LOCAL
from ctseg.run.trained import TrainedModel

# Fixed windows' cores chosen from (`JaxBackend.window_core`), largest first: up to 128, a
# window GPUs' convolutions run efficiently whose box floor (136 voxels a side at k = 3)
# pads few scans.
WINDOW_CORES = (128, 96, 64, 48, 32, 24, 16)

# Windows per dispatch, at most (`window_batch`): enough that a deep stage's small windows
# fill a GPU, few enough that a stage's last dispatch wastes little on windows that own
# nothing (each device's count is rounded up to a whole dispatch).
MAX_WINDOW_BATCH = 8

# A stage's windows run several to a dispatch where they hold at most this share of the
# plan's largest window's voxels: batched, the deep stages' small windows ran faster and
# windows of 1/8 of the largest no faster (measured:
# docs/experiments/design-figures.md#fixed-windows).
BATCHED_SHARE = 1 / 64


def window_batch(stage: Stage, stages: list[Stage], most: int = MAX_WINDOW_BATCH) -> int:
    """How many of `stage`'s windows one dispatch runs: 1, or for windows of at most
    `BATCHED_SHARE` of the plan's largest window's voxels, as many as that window holds
    (their channels are fewer: memory stays near one such window's), at most `most`. It
    depends on the windows' extents only, never the box."""
    largest = max(math.prod(s.extent) for s in stages)
    fits = largest // math.prod(stage.extent)
    return max(1, min(most, fits)) if fits * BATCHED_SHARE >= 1 else 1


class WindowPrograms:
    """The window programs of a backend's devices, by model, stage and device
    (`window_program`): every box shape reuses them. They compile in the background from
    when they are first asked for (`start`): a member knows its windows before its first
    scan, so their programs compile while that scan is read and brought to the grid."""

    def __init__(self) -> None:
        self._compiled: dict[tuple, Future] = {}
        self._lock = threading.Lock()

    def start(
        self, model: TrainedModel, stages: list[Stage], batches: list[int], devices: list[Any]
    ) -> None:
        """Begin compiling every stage's window program on every device where it is neither
        compiled nor compiling, concurrently (XLA compiles in threads of its own), and
        return. The first device's compile first: XLA keeps a GPU's autotuning results in
        the process by the GPU's kind, so the other devices' compiles of the same programs
        wait for them and should find them there rather than tune again (not yet measured
        on several GPUs)."""
        batched = list(zip(stages, batches, strict=True))
        firsts = self._submit(model, batched, devices[:1], [])
        self._submit(model, batched, devices[1:], firsts)

    def of(
        self, model: TrainedModel, stages: list[Stage], batches: list[int], devices: list[Any]
    ) -> list[list[jax.stages.Compiled]]:
        """Every stage's window program on every device ([stage][device]), waited for;
        those not asked for yet compiled now (`start`)."""
        self.start(model, stages, batches, devices)
        return [
            [self._result(_key(model, stage, batch, device)) for device in devices]
            for stage, batch in zip(stages, batches, strict=True)
        ]

    def _result(self, key: tuple) -> jax.stages.Compiled:
        """A program, waited for; one whose compile failed is forgotten, so that the next
        box asks again rather than meeting the same failure for every later scan."""
        future = self._compiled[key]
        try:
            return future.result()
        except BaseException:
            with self._lock:
                if self._compiled.get(key) is future:
                    del self._compiled[key]
            raise

    def _submit(
        self,
        model: TrainedModel,
        batched: list[tuple[Stage, int]],
        devices: list[Any],
        after: list[Future],
    ) -> list[Future]:
        """The programs' futures, those not yet asked for submitted to wait for `after`
        first (each waits only for work submitted before it: no deadlock in the pool)."""
        futures = []
        with self._lock:
            for stage, batch in batched:
                for device in devices:
                    key = _key(model, stage, batch, device)
                    if key not in self._compiled:
                        self._compiled[key] = _COMPILING.submit(
                            _compile_after, after, model, stage, batch, device
                        )
                    futures.append(self._compiled[key])
        return futures


# Where window programs compile: one pool for the process (backends come and go; their
# compiles are few, and long on a GPU).
_COMPILING = ThreadPoolExecutor(thread_name_prefix="ctseg-windows")


def _compile_after(
    after: list[Future], model: TrainedModel, stage: Stage, batch: int, device: Any
) -> jax.stages.Compiled:
    wait(after)
    weights = _single_shapes((model.params, model.stats), device)
    return window_program(model.graphdef, model.config, stage, batch, *weights)


def _key(model: TrainedModel, stage: Stage, batch: int, device: Any) -> tuple:
    # Weights are arguments: models of one config share the program.
    return (repr(model.config.model), *tiling.window_key(stage), batch, str(device))


def window_program(
    graphdef: nnx.GraphDef, config: Config, stage: Stage, batch: int, params: Any, stats: Any
) -> jax.stages.Compiled:
    """Stage `stage` on `batch` windows of its extent: the network's convolutions, and
    nothing that depends on the box (`WindowPlan`).

    Arguments: params, stats, the windows' rows of `tiling.stitch_table` [batch, 4, 3], the
    windows of the input level [batch, *extent, C] (and of d_{level+1}, halved, for an up
    stage). Result [batch, *stage.block, C]: each window's block of output voxels that
    holds its core, zero where the window does not own a voxel, so that adding the blocks
    into a zero level stitches it exactly. `params` and `stats` are shapes placed on one
    device.
    """
    block = stage.block
    out_shape, out_dtype = output_level(config, stage)
    channels = out_shape[-1]

    def kept_block(y: jax.Array, row: jax.Array) -> jax.Array:
        start, kept = row[0], row[1]
        at = (*(kept - start // stage.scale), 0)
        result = jax.lax.dynamic_slice(y, at, (*block, channels))
        return jnp.where(owned(row, block)[..., None], result, 0).astype(out_dtype)

    def run(params: Any, stats: Any, rows: jax.Array, *inputs: jax.Array) -> jax.Array:
        net = nnx.merge(graphdef, params, stats, copy=True)
        y = net.stage(stage.kind, stage.level, list(inputs), LOCAL)
        return jax.vmap(kept_block)(y, rows)

    run.__name__ = "window_program"  # as the compile clock counts it
    device = jax.tree.leaves(params)[0].sharding
    _, in_dtype = input_level(config, stage)
    inputs = [
        jax.ShapeDtypeStruct(
            (batch, *stage.extent, input_level(config, stage)[0][-1]), in_dtype, sharding=device
        )
    ]
    if stage.kind == UP:
        below_shape, below_dtype = below_level(config, stage)
        half = (batch, *(n // 2 for n in stage.extent), below_shape[-1])
        inputs.append(jax.ShapeDtypeStruct(half, below_dtype, sharding=device))
    rows = jax.ShapeDtypeStruct((batch, 4, 3), jnp.int32, sharding=device)
    return jax.jit(run).lower(params, stats, rows, *inputs).compile()


def _single_shapes(tree: Any, device: Any) -> Any:
    sharding = SingleDeviceSharding(device)
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=sharding), tree
    )
