"""The boxes a backend runs, decided in one place: how a scan is held on the devices, the
box each run's grid is brought into, and whether a box runs in fixed windows.

A backend holds one policy (`Backend.boxes`), and `member`, `predictor` and `to_grid` ask
it for a box and nothing else:

- `Boxes(ladder=False)`, ONNX Runtime's: nothing compiles per box shape, so a spacing
  grid's box is rounded up to the next multiple of `BOX_MULTIPLE` (at most 15 voxels of
  air a side);
- `Boxes(ladder=True)`, JAX's on the CPU: a spacing grid's box on a ladder of sizes
  (`grids.inference_box`), so that scans of nearby extents share one compiled program;
- `ctseg.inference.network.jax.boxes.Windowed`, JAX's on accelerators: fixed windows
  whose programs serve boxes of every shape, every scan held in one canvas and every box
  of a spacing grid in another, so that a batch compiles nothing after its first scan.

A cube grid's box is its cube under every policy. Each run's grid has its own
`GridBoxes` (`Boxes.of_grid`), as each run has its own grid.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ctseg.config import TileRequest
from ctseg.data import grids
from ctseg.data.grids import GridSpec, Shape
from ctseg.inference.scan import to_grid, way_back
from ctseg.inference.scan.canvas import Canvas

if TYPE_CHECKING:
    from ctseg.inference.network.plan import Plan
    from ctseg.inference.network.tiling import Span, Stage
    from ctseg.run.trained import TrainedModel

# Spacing-grid boxes are rounded up to a multiple of this (or the alignment, if larger):
# on the ladder of its multiples where programs compile per shape, else to the next one.
BOX_MULTIPLE = 16


class Windows:
    """Fixed windows of one core whose programs serve every box at least their floor a
    side (`tiling.fixed_stages`), and the plans that run them (a policy that has them)."""

    core: int

    def plan(self, model: TrainedModel, shape: Shape, stages: list[Stage], memory: int) -> Plan:
        """The programs for boxes of `shape` in the fixed windows of `stages`."""
        raise NotImplementedError


class GridBoxes:
    """The boxes of one run's grid: the whole grid's box, and a box's fixed windows."""

    windows: Windows | None = None  # where boxes of this grid may run in fixed windows
    canvas: Canvas | None = None  # where every box of this grid is held in one shape

    def __init__(self, spec: GridSpec, alignment: int, ladder: bool) -> None:
        self.spec, self.ladder = spec, ladder
        # A region's window of the grid is cut on this lattice too (`region.window_of`).
        self.multiple = max(alignment, BOX_MULTIPLE)

    def box(self, grid: Shape) -> tuple[Shape, Span | None]:
        """The box the grid of a scan runs in, and the voxels of it the network must
        compute exactly (None: all). A cube's box is the cube; a spacing grid's holds the
        scan's whole grid, padded with air."""
        if self.spec.kind == "cube":
            return grid, None
        return grids.inference_box(grid, self.multiple, ladder=self.ladder), None

    def windows_for(self, box: Shape) -> Windows | None:
        """The fixed windows a box of `box` voxels runs in; None: its own plan."""
        return None

    def expect(self, grid: Shape) -> None:
        """Make room, before it comes, for a scan whose grid is `grid`."""


class Boxes:
    """A backend's policy of boxes (see the module): where scans are held, and each run's
    grid's boxes."""

    # Where every scan is held in one canvas on the devices (None: each in its own rung).
    scan_canvas: Canvas | None = None
    # The order of axes the way to the grid resamples in (None: the most shrinking first,
    # scan by scan), and the way back to the scan's voxels.
    order: tuple[int, ...] | None = None
    space: way_back.Space = way_back.ON_DEVICES

    def __init__(self, ladder: bool) -> None:
        self.ladder = ladder

    def of_grid(self, model: TrainedModel, tile: TileRequest) -> GridBoxes:
        """The boxes of `model`'s run's grid, as `tile` asks."""
        config = model.config
        return GridBoxes(GridSpec.of(config.data), config.alignment, self.ladder)

    def scan_box(self, shape: Sequence[int]) -> Shape:
        """The shape the devices hold a scan of `shape` in, both ways: its rung of the
        ladder (`to_grid.padded`), within the scan canvas where the policy has one."""
        padded = to_grid.padded(shape)
        return padded if self.scan_canvas is None else self.scan_canvas.holding(padded)
