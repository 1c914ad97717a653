"""Inference on JAX devices (`JaxBackend`): every array stays there, from the scan's HU
to the labels.

A box runs as the whole volume partitioned over the devices, or in level-wise tiles
(`ctseg.inference.network.jax_plans`), or in fixed windows whose programs do not depend on the
box (`ctseg.inference.network.jax_windows`, dealt out over the devices): the default for the
spacing grid on accelerators, where compiling per box shape costs minutes and the
windows' overlap milliseconds (`JaxBackend.fixed_windows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ctseg.config import Config
from ctseg.inference.network import tile_memory, tiling
from ctseg.inference.network.backends import Backend
from ctseg.inference.network.jax_plans import JaxPlan
from ctseg.inference.network.jax_windows import WindowPlan
from ctseg.inference.network.tiling import Shape, Stage
from ctseg.inference.network.window_programs import (
    MAX_WINDOW_BATCH,
    WINDOW_CORES,
    WindowPrograms,
    window_batch,
)
from ctseg.inference.scan import way_back
from ctseg.inference.scan.canvas import Canvas
from ctseg.model.unet import UP
from ctseg.parallel import devices as dev
from ctseg.run.trained import TrainedModel


class JaxBackend(Backend):
    """JAX (XLA) on its devices: every array stays there, from the scan's HU to the labels."""

    name, runtime, ladder = "jax", "XLA", True
    space = way_back.ON_DEVICES

    def __init__(
        self,
        devices: Sequence[Any] | None = None,
        fixed_windows: bool | None = None,
        most_batched: int = MAX_WINDOW_BATCH,
    ):
        """`fixed_windows`: boxes whose shape varies (the spacing grid) run in fixed windows
        (`WindowPlan`); default, on accelerators, one or several, where a program per box
        shape costs minutes of compiling (XLA's autotuning) and the windows' overlap
        milliseconds of running. The window programs compile once per model, stage and
        device; on several devices the windows are dealt out over them and run side by
        side, at the cost of each stage's level(s) copied to every device and the devices'
        partial levels summed onto the first. `most_batched`: the most windows one dispatch
        runs (`window_programs.window_batch`)."""
        self.devices = list(devices or jax.local_devices()[:1])
        if fixed_windows is None:
            fixed_windows = dev.is_accelerator(self.devices)
        self.fixed_windows = fixed_windows
        if fixed_windows:
            # Every scan in one canvas, every box of a grid in another (`Member`), so that a
            # batch compiles nothing after its first scan; the way back in one order of axes.
            self.scan_canvas = Canvas()
            self.space = way_back.CANVAS_SPACE
        self.most_batched = most_batched
        # Window programs by model, stage and device: every box shape reuses them.
        self.window_programs = WindowPrograms()

    def window_core(self, model: TrainedModel, memory: int) -> int:
        """Fixed windows' core chosen for `memory` bytes: the largest of `WINDOW_CORES` whose
        widest window the first-guess formula fits in a quarter of the planning share (the
        rest for the box's levels); the compiled programs' figures then check the plan."""
        config = model.config
        itemsize = jnp.dtype(config.model.dtype).itemsize
        for core in WINDOW_CORES:
            extent = (core + 2 * tiling.stage_context(config, UP),) * 3
            budget = tile_memory.MEMORY_SHARE * memory / 4
            if tile_memory.window_bytes(config, 0, extent, itemsize) <= budget:
                return core
        return WINDOW_CORES[-1]

    def prepare_windows(self, model: TrainedModel, core: int) -> None:
        config = model.config
        floor = tiling.window_floor(config, core)
        # Any box at least the floor a side has these windows' extents, hence these programs.
        stages = tiling.fixed_stages(config, core, (floor,) * 3)
        batches = [window_batch(stage, stages, self.most_batched) for stage in stages]
        self.window_programs.start(model, stages, batches, self.devices)

    def window_plan(
        self, model: TrainedModel, shape: Shape, stages: list[Stage], memory: int
    ) -> WindowPlan:
        return WindowPlan(
            self.window_programs, model, shape, stages, self.devices, memory, self.most_batched
        )

    def dtype(self, config: Config) -> np.dtype:
        return jnp.dtype(config.model.dtype)  # the compute dtype

    def free_memory(self) -> int:
        return dev.free_memory(self.devices)

    def plan(
        self, model: TrainedModel, shape: Shape, stages: list[Stage] | None, memory: int
    ) -> JaxPlan:
        return JaxPlan(model, shape, stages, self.devices, memory)

    @property
    def grid_device(self) -> Any:
        return self.devices[0]

    def adopt(self, unit: jax.Array) -> jax.Array:
        return unit

    def adopt_logits(self, logits: jax.Array) -> jax.Array:
        return logits

    def flip(self, placed: jax.Array, axes: tuple[int, ...]) -> jax.Array:
        return _flip_batch(placed, axes)


@partial(jax.jit, static_argnums=1)
def _flip_batch(image: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    return jnp.flip(image, tuple(a + 1 for a in axes))
