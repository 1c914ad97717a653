"""Which inference backend runs a prediction, and what every backend does.

JAX (XLA) runs on the chosen devices; ONNX Runtime on the host's CPU cores, where XLA:CPU's
3-D convolutions are several times slower. Both are a `Backend`
(`ctseg.inference.network.jax.backend.JaxBackend`,
`ctseg.inference.network.onnx.backend.OnnxBackend`):
its name, dtype and exactness class, its policy of boxes (`ctseg.inference.network.boxes`),
where the scan is brought to the grid and how the backend reads it, a compiled `Plan` per
box shape (logits, whole or tiled), the mirrored
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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from ctseg.config import Config
    from ctseg.data.grids import Shape
    from ctseg.inference.network.boxes import Boxes
    from ctseg.inference.network.plan import Plan
    from ctseg.inference.network.tiling import Stage
    from ctseg.run.trained import TrainedModel

BACKENDS = ("jax", "onnx")


class Backend(ABC):
    """One inference backend: where the network runs, on whose arrays, and how back."""

    name: str  # "jax" or "onnx", as options and records spell it
    runtime: str  # in words: "XLA", "ONNX Runtime"
    devices: list[Any]  # where the network runs ([]: the host's CPU cores)
    # Where scans are held, the box each run's grid runs in, and the way back to the
    # scan's voxels on this backend's arrays: its one policy of boxes.
    boxes: Boxes

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

    @abstractmethod
    def memory_for(self, needed: int) -> int:
        """The free memory (bytes per device) whose automatic plan needs about `needed`
        bytes: a plan takes a share of the memory it is given (a scan that ran out of
        memory is tried again on the plan for half of what it needed)."""
