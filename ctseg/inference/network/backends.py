"""Which inference backend runs a prediction, and what every backend does.

JAX (XLA) runs on the chosen devices; ONNX Runtime on the host's CPU cores, where XLA:CPU's
3-D convolutions are several times slower. Both are a `Backend`
(`ctseg.inference.network.jax_backend.JaxBackend`,
`ctseg.inference.network.onnx_backend.OnnxBackend`):
its name, dtype and exactness class, where the scan is brought to the grid and how the
backend reads it, a compiled `Plan` per box shape (logits, whole or tiled), the mirrored
passes' flips, and the logits handed to JAX (on the host CPU's device for ONNX Runtime,
without a copy), where the class probabilities (`ctseg.inference.network.probability_ops`, the one
loop `ctseg.inference.network.engine.class_probabilities`) and the way back to the scan's voxels
(`ctseg.inference.scan.way_back`) run for both. Callers hold a backend, never ask which.

This module imports no JAX (the options are checked before JAX starts): the two backends
are chosen and built once by `ctseg.inference.network.choice`, above them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

    from ctseg.config import Config
    from ctseg.inference.network.tiling import Shape, Span, Stage, TileProgress
    from ctseg.inference.scan.canvas import Canvas
    from ctseg.inference.scan.way_back import Space
    from ctseg.run.trained import TrainedModel

BACKENDS = ("jax", "onnx")


class Plan(Protocol):
    """A backend's programs for boxes of one shape: the whole volume, or level-wise stages."""

    stages: list[Stage]  # [] the whole volume
    needed: int  # bytes per device the programs need (0: not measured)
    spatial: tuple[int, int, int]  # the whole volume's split over the devices
    spills: bool  # levels waiting for their up stage are kept on the host

    def place(self, image: Any) -> Any:
        """A unit-scaled image [x, y, z] as the programs take it: [1, x, y, z, 1] float32."""

    def logits(self, image: Any, progress: TileProgress | None, need: Span | None = None) -> Any:
        """Logits [x, y, z, 3] float32 of a `place`d image (exact on `need` if given)."""

    def memory_words(self, memory: int) -> str:
        """What the plan needs of `memory`, in words following its description."""


class Backend(ABC):
    """One inference backend: where the network runs, on whose arrays, and how back."""

    name: str  # "jax" or "onnx", as options and records spell it
    runtime: str  # in words: "XLA", "ONNX Runtime"
    # Spacing-grid boxes rounded up to a rung of a ladder (`grids.inference_box`): the
    # compiled programs of one box serve scans of other extents.
    ladder: bool
    devices: list[Any]  # where the network runs ([]: the host's CPU cores)
    space: Space  # the way back to the scan's voxels, on this backend's arrays

    # Boxes whose shape varies from scan to scan run in windows of extents that do not
    # depend on the box (`tiling.fixed_stages`, `window_plan`): where a compiled program per
    # box shape costs more than the windows' overlap (JAX on one accelerator).
    fixed_windows: bool = False
    # Where every scan is held in one canvas on the devices (`ctseg.inference.scan.canvas`):
    # with fixed windows, whose programs already serve every box; None elsewhere.
    scan_canvas: Canvas | None = None

    def window_core(self, model: TrainedModel, memory: int) -> int:
        """Fixed windows' core for `memory` bytes (a backend with `fixed_windows`)."""
        raise NotImplementedError(f"{self.name} runs no fixed windows")

    def prepare_windows(self, model: TrainedModel, core: int) -> None:
        """Begin compiling the programs of fixed windows of `core` voxels, which every box
        at least their floor a side runs, in the background, and return (a backend with
        `fixed_windows`)."""
        raise NotImplementedError(f"{self.name} runs no fixed windows")

    def window_plan(
        self, model: TrainedModel, shape: Shape, stages: list[Stage], memory: int
    ) -> Plan:
        """The programs for boxes of `shape` in the fixed windows of `stages`."""
        raise NotImplementedError(f"{self.name} runs no fixed windows")

    @abstractmethod
    def dtype(self, config: Config) -> np.dtype:
        """The dtype of the materialised activations of a model of `config`."""

    def exactness(self, configs: Sequence[Config]) -> str:
        """The exactness class of the models of `configs` here: the backend and the dtypes
        of its activations (`jax bfloat16`, `onnx float32`). Devices, partitions and tiles
        change no label (tested); another class may, by a rounding."""
        dtypes = sorted({self.dtype(config).name for config in configs})
        return f"{self.name} {'/'.join(dtypes)}"

    @abstractmethod
    def free_memory(self) -> int:
        """Bytes to plan for by default: per device, or the host's available memory."""

    @abstractmethod
    def plan(
        self, model: TrainedModel, shape: Shape, stages: list[Stage] | None, memory: int
    ) -> Plan:
        """The programs for boxes of `shape`: of `stages` ([] the whole volume), or chosen
        for `memory` bytes (None)."""

    @property
    @abstractmethod
    def grid_device(self) -> Any:
        """The JAX device a scan is brought to the grid on (`to_grid.unit_box`)."""

    @abstractmethod
    def adopt(self, unit: Any) -> Any:
        """A box brought to the grid on `grid_device`, as the backend reads it."""

    @abstractmethod
    def adopt_logits(self, logits: Any) -> Any:
        """A plan's logits as a JAX array, where the class probabilities' operations
        (`ctseg.inference.network.probability_ops`) and the way back to the scan run."""

    @abstractmethod
    def flip(self, placed: Any, axes: tuple[int, ...]) -> Any:
        """A `place`d image mirrored along the grid's `axes` (a mirrored pass's input)."""
