"""JAX's policy of boxes on accelerators (`Windowed`): fixed windows, and canvases.

A compiled program takes arrays of one shape, and on an accelerator each new shape costs
XLA's autotuning. Fixed windows make the network's programs independent of the box
(`ctseg.inference.network.jax.windows`): they compile once per model, stage and device,
while the first scan is read. The programs around them follow the scan's and the box's
shapes; so every scan is held in one canvas, and every box of a spacing grid in another
(`ctseg.inference.scan.canvas`), each box reaching the network's receptive field beyond
its grid, so that its labels do not depend on the canvas around it. A batch then
compiles nothing after its first scan's programs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp

from ctseg.config import TileRequest
from ctseg.config.tile import SIZE, WHOLE
from ctseg.data.grids import GridSpec, Shape
from ctseg.inference.network import tile_memory, tiling
from ctseg.inference.network.boxes import Boxes, GridBoxes, Windows
from ctseg.inference.network.jax.window_programs import WINDOW_CORES, WindowPrograms, window_batch
from ctseg.inference.network.jax.windows import WindowPlan
from ctseg.inference.network.tiling import Span, Stage
from ctseg.inference.scan import to_grid, way_back
from ctseg.inference.scan.canvas import Canvas
from ctseg.model import unet
from ctseg.model.unet import UP
from ctseg.parallel import devices as dev
from ctseg.run.trained import TrainedModel

if TYPE_CHECKING:
    from ctseg.config import Config


class JaxWindows(Windows):
    """Fixed windows of `core` voxels on JAX devices, run by `WindowPlan`s over the window
    programs compiled once per model, stage and device (`WindowPrograms`)."""

    def __init__(
        self, core: int, programs: WindowPrograms, devices: Sequence[Any], most_batched: int
    ) -> None:
        self.core, self.programs = core, programs
        self.devices, self.most_batched = list(devices), most_batched

    def plan(
        self, model: TrainedModel, shape: Shape, stages: list[Stage], memory: int
    ) -> WindowPlan:
        return WindowPlan(
            self.programs, model, shape, stages, self.devices, memory, self.most_batched
        )

    def prepare(self, model: TrainedModel) -> None:
        """Begin compiling the window programs every box at least the floor a side runs, in
        the background, and return."""
        config = model.config
        floor = tiling.window_floor(config, self.core)
        stages = tiling.fixed_stages(config, self.core, (floor,) * 3)
        batches = [window_batch(stage, stages, self.most_batched) for stage in stages]
        self.programs.start(model, stages, batches, self.devices)


class WindowedGrid(GridBoxes):
    """A run's grid whose boxes run in fixed windows where they hold them: a spacing
    grid's in a canvas (each box reaching the receptive field beyond its grid), a region's
    box at least the windows' floor a side; the cube's own box is its plan."""

    def __init__(self, model: TrainedModel, windows: JaxWindows) -> None:
        config = model.config
        super().__init__(GridSpec.of(config.data), config.alignment, ladder=True)
        self.config, self.windows = config, windows
        self.radius = unet.receptive_field_radius(config.model)
        self.floor = tiling.window_floor(config, windows.core)
        if self.spec.kind == "spacing":
            self.canvas = Canvas()
            # Their programs do not depend on the box: compiled while the first scan is read.
            windows.prepare(model)

    def box(self, grid: Shape) -> tuple[Shape, Span | None]:
        if self.canvas is None:
            return super().box(grid)
        return self.canvas.holding(self.canvas_box(grid)), tuple((0, n) for n in grid)

    def canvas_box(self, grid: Shape) -> Shape:
        """The smallest box of fixed windows (`tiling.windows_box`) that reaches the
        network's receptive field beyond `grid`: every voxel of the grid then sees air
        wherever the grid ends, however large the canvas around it, so its probabilities
        do not depend on the canvas (the grid starts at the box's first voxel, on the
        pooling's lattice, in every box)."""
        reach = tuple(n + self.radius for n in grid)
        return tiling.windows_box(self.config, self.windows.core, reach)

    def windows_for(self, box: Shape) -> JaxWindows | None:
        if self.spec.kind == "cube" and box == tiling.grid_shape(self.config):
            return None  # the cube's one box: its own plan, compiled before the first scan
        if min(box) < self.floor:
            return None  # a region's box too small for them: the box's own plan
        return self.windows

    def expect(self, grid: Shape) -> None:
        if self.canvas is not None:
            self.canvas.holding(self.canvas_box(grid))


class Windowed(Boxes):
    """Fixed windows and canvases (see the module): JAX's policy on accelerators."""

    # One order of axes for every scan both ways: an order from the padded shapes would
    # change as the canvas grows, and round a voxel's HU the other way now and then.
    order = to_grid.SLICES_LAST
    space = way_back.CANVAS_SPACE

    def __init__(self, devices: Sequence[Any], memory: int | None, most_batched: int) -> None:
        """`memory`: bytes per device the windows' core is chosen for (None: the devices'
        free memory when a run's grid asks)."""
        super().__init__(ladder=True)
        self.scan_canvas = Canvas()
        self.devices, self.memory, self.most_batched = list(devices), memory, most_batched
        # Window programs by model, stage and device: every box shape reuses them.
        self.programs = WindowPrograms()

    def of_grid(self, model: TrainedModel, tile: TileRequest) -> GridBoxes:
        core = self.core(model.config, tile)
        if core is None:  # the whole volume asked for: each box its own plan, on the ladder
            return super().of_grid(model, tile)
        return WindowedGrid(model, self.windows(core))

    def windows(self, core: int) -> JaxWindows:
        """Fixed windows of `core` voxels on this policy's devices."""
        return JaxWindows(core, self.programs, self.devices, self.most_batched)

    def core(self, config: Config, tile: TileRequest) -> int | None:
        """The windows' core as `tile` asks: its size; automatic, the largest of
        `WINDOW_CORES` whose widest window the first-guess formula fits in a quarter of the
        planning share of the devices' memory (the rest for the box's levels; the compiled
        programs' figures then check the plan); None for the whole volume."""
        if tile.kind == WHOLE:
            return None
        if tile.kind == SIZE:
            return tile.core
        itemsize = jnp.dtype(config.model.dtype).itemsize
        memory = dev.free_memory(self.devices) if self.memory is None else self.memory
        budget = tile_memory.MEMORY_SHARE * memory / 4
        for core in WINDOW_CORES:
            extent = (core + 2 * tiling.stage_context(config, UP),) * 3
            if tile_memory.window_bytes(config, 0, extent, itemsize) <= budget:
                return core
        return WINDOW_CORES[-1]
