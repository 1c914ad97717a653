"""One run's model on the devices, predicting boxes of its grid: a `Member` of a
`ctseg.inference.predictor.Predictor` (alone, or one of an ensemble).

It brings a scan onto the run's grid exactly as training's preprocessing does, keeps one
inference engine per box shape (compiled when first needed), and retries a box once
with smaller tiles when an accelerator runs out of memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ctseg.config import TileRequest
from ctseg.data.grids import GridSpec, Shape
from ctseg.errors import CtsegError
from ctseg.inference.network import tiling
from ctseg.inference.network.backends import Backend
from ctseg.inference.network.boxes import Windows
from ctseg.inference.network.engine import Engine, class_probabilities
from ctseg.inference.network.tiling import Span
from ctseg.inference.scan import to_grid
from ctseg.inference.scan.region import GridWindow, Region, window_of
from ctseg.io.scans import Scan
from ctseg.memory import out_of_memory
from ctseg.model import unet
from ctseg.parallel import devices as dev
from ctseg.progress import TileProgress
from ctseg.run.trained import TrainedModel

# Engines (compiled programs, weights on the devices) kept for boxes of other shapes.
_ENGINES_KEPT = 4


@dataclass
class OnGrid:
    """A scan brought to the run's grid, ready for the network."""

    # The HU-windowed box [x, y, z], float32: the grid, padded on the spacing grid; on the
    # devices under JAX, a host array under ONNX Runtime.
    unit: np.ndarray | jax.Array
    grid: Shape  # the scan's grid, the box's first voxels
    window: GridWindow | None = None  # a region's box of the grid; None: the whole grid
    located: dict[str, Any] | None = None  # how the region was found, for the stats file
    # The box's voxels the network must compute exactly, per axis [lo, hi) (a region's, or
    # the grid within a canvas); None: all of them.
    need: Span | None = None
    # The shape the scan is held in on the devices, both ways (None: its rung of the ladder).
    scan_box: Shape | None = None


class Member:
    """One run's model on the devices: its grid, and one inference engine per box shape."""

    def __init__(
        self,
        model: TrainedModel,
        tile: TileRequest,
        backend: Backend,
        run_dir: Path | None = None,
    ):
        self.model = model
        self.config = model.config
        self.run_dir = run_dir
        self.grid = GridSpec.of(self.config.data)
        self.tile, self.backend = tile, backend
        # This grid's boxes, as the backend's policy makes them (`ctseg.inference.network.boxes`).
        self.boxes = backend.boxes.of_grid(model, tile)
        # One engine per box shape (scans of one grid share one). The cube's one box is
        # planned and compiled here, before the first scan; a spacing grid's boxes follow
        # the scans' extents, and each new one is planned when a scan first needs it.
        self._engines: OrderedDict[tuple[Shape, Windows | None], Engine] = OrderedDict()
        self.engine: Engine | None = None  # the one that ran (or will run) the latest scan
        self._radius = unet.receptive_field_radius(self.config.model)
        if self.grid.kind == "cube":
            self.engine_for(tiling.grid_shape(self.config))

    def engine_for(self, box: Shape) -> Engine:
        """The engine for boxes of `box` voxels, planned (and compiled) when first asked for:
        in fixed windows where the policy runs them for such a box."""
        key = (box, self.boxes.windows_for(box))
        if key in self._engines:
            self._engines.move_to_end(key)
        else:
            self._engines[key] = Engine(
                self.model, self.backend, self.tile, shape=box, windows=key[1]
            )
            # Each engine holds its programs and a copy of the weights on the devices: a
            # batch of scans of many extents keeps only the latest few.
            while len(self._engines) > _ENGINES_KEPT:
                self._engines.popitem(last=False)
        self.engine = self._engines[key]
        return self.engine

    @property
    def name(self) -> str:
        """`runs/fold0 (step 600)`, as the first line of an ensemble names its members."""
        where = "a model" if self.run_dir is None else str(self.run_dir)
        return f"{where} (step {self.model.step})"

    @property
    def plan(self) -> str:
        """The plan in words: the cube's one, or the latest box's on the spacing grid."""
        if self.engine is not None:
            return self.engine.description
        return f"the scan at {self.grid.voxel_size}, boxes of its extent"

    def to_grid(
        self, scan: Scan, region: Region | None = None, scan_box: Shape | None = None
    ) -> OnGrid:
        """The scan on the run's grid, HU-windowed: the training preprocessing, on the
        backend's grid device (`to_grid.unit_box`; the scan held in `scan_box`, default
        its rung), then as the backend reads it, in the box the policy gives the grid
        (`GridBoxes.box`); with a `region`, only the window of that box that gives the
        region's labels exactly (`ctseg.inference.scan.region`)."""
        grid = self.grid.grid_of(scan.array.shape, scan.spacing)
        (box, need), offset, window = self.boxes.box(grid), (0, 0, 0), None
        if region is not None:
            multiple = self.boxes.multiple
            window = window_of(region, scan.array.shape, grid, box, self._radius, multiple)
            box, offset, need = window.box, window.offset, window.need
        unit = to_grid.unit_box(
            scan.array,
            grid,
            offset,
            box,
            self.config.data.hu_window,
            self.backend.grid_device,
            scan_box,
            self.backend.boxes.order,
        )
        # Waited for here, off the network's thread: a failure is this scan's reading
        # failure, and its seconds are the resampling's, not the next program's.
        unit = jax.block_until_ready(unit)
        return OnGrid(self.backend.adopt(unit), grid, window, need=need, scan_box=scan_box)

    def expect(self, shape: Sequence[int], spacing: Sequence[float]) -> None:
        """Make room, before it comes, for a scan of `shape` voxels of `spacing` mm
        (`Predictor.expect`; a policy with canvases grows them)."""
        self.boxes.expect(self.grid.grid_of(shape, spacing))

    def infer(
        self,
        on_grid: OnGrid,
        tta: bool,
        progress: TileProgress,
        warnings: list[str] | None,
    ) -> Any:
        """Class probabilities [x, y, z, 3] of a box (`OnGrid.unit`), on the devices; with a
        region's window, exact on the voxels it needs (the rest of the box is not computed
        by tiles).

        An accelerator that runs out of memory is tried once more with smaller tiles
        (the engine is replaced for the scans after too), which `warnings` records;
        a second failure is this scan's `CtsegError`.
        """
        unit, box, need = on_grid.unit, tuple(on_grid.unit.shape), on_grid.need
        try:
            return self._probabilities(self.engine_for(box), unit, tta, progress, need)
        except Exception as exc:
            if not out_of_memory(exc):
                raise
        before = self.engine.description
        key = (box, self.boxes.windows_for(box))
        self.engine = self._engines[key] = self.engine.smaller()
        if warnings is not None:
            warnings.append(f"out of memory with {before}; retried with {self.engine.description}")
        try:
            return self._probabilities(self.engine, unit, tta, progress, need)
        except Exception as again:
            if not out_of_memory(again):
                raise
            raise CtsegError(
                f"out of memory on {dev.describe(self.engine.devices)}, also with "
                f"{self.engine.description}; try a smaller tile size"
            ) from None

    @staticmethod
    def _probabilities(
        engine: Engine, unit: np.ndarray, tta: bool, progress: TileProgress, need: Span | None
    ) -> Any:
        """The engine's probabilities, waited for: a device's failure surfaces here."""
        return jax.block_until_ready(class_probabilities(engine, unit, tta, progress, need))
