"""Inference on JAX devices (`JaxBackend`): every array stays there, from the scan's HU
to the labels.

A box runs as the whole volume partitioned over the devices, or in level-wise tiles
(`ctseg.inference.network.jax.plans`), or in fixed windows whose programs do not depend on the
box (`ctseg.inference.network.jax.windows`, dealt out over the devices): the default for the
spacing grid on accelerators, where compiling per box shape costs minutes and the
windows' overlap milliseconds (the backend's `boxes`, `ctseg.inference.network.jax.boxes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ctseg.config import Config
from ctseg.data.grids import Shape
from ctseg.inference.network.backends import Backend
from ctseg.inference.network.boxes import Boxes
from ctseg.inference.network.jax.boxes import Windowed
from ctseg.inference.network.jax.plans import COMPILED_SHARE, JaxPlan
from ctseg.inference.network.jax.window_programs import MAX_WINDOW_BATCH
from ctseg.inference.network.tiling import Stage
from ctseg.parallel import devices as dev
from ctseg.run.trained import TrainedModel


class JaxBackend(Backend):
    """JAX (XLA) on its devices: every array stays there, from the scan's HU to the labels."""

    name, runtime = "jax", "XLA"

    def __init__(
        self,
        devices: Sequence[Any] | None = None,
        fixed_windows: bool | None = None,
        most_batched: int = MAX_WINDOW_BATCH,
    ):
        """`fixed_windows`: boxes whose shape varies (the spacing grid, a region's) run in
        fixed windows, every scan held in canvases (`ctseg.inference.network.jax.boxes`);
        default, on accelerators, one or several, where a program per box shape costs
        minutes of compiling (XLA's autotuning) and the windows' overlap milliseconds of
        running. On several devices the windows are dealt out over them and run side by
        side, at the cost of each stage's level(s) copied to every device and the devices'
        partial levels summed onto the first. Else boxes on a ladder of sizes. `most_batched`:
        the most windows one dispatch runs (`window_programs.window_batch`)."""
        self.devices = list(devices or jax.local_devices()[:1])
        if fixed_windows is None:
            fixed_windows = dev.is_accelerator(self.devices)
        self.boxes = (
            Windowed(self.devices, None, most_batched) if fixed_windows else Boxes(ladder=True)
        )

    def dtype(self, config: Config) -> np.dtype:
        return jnp.dtype(config.model.dtype)  # the compute dtype

    def free_memory(self) -> int:
        return dev.free_memory(self.devices)

    def memory_for(self, needed: int) -> int:
        return int(needed / COMPILED_SHARE)

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
