"""The inference engine: logits and class probabilities of whole boxes of the grid.

An `Engine` runs a trained model on one backend: ``jax`` (`ctseg.inference.network.jax.backend`,
its plans in `jax.plans` and `jax.windows`: the whole volume partitioned over the
devices, exact level-wise tiles or fixed windows, all on the devices) or ``onnx``
(`ctseg.inference.network.onnx.backend`: ONNX Runtime on the host's CPU cores). Level-wise tiles
are cut as `ctseg.inference.network.tiling` plans them; stitched, they equal one whole-volume
pass.

Softmax and the mean of the mirrored passes (test-time augmentation) run on JAX arrays
for both backends (`class_probabilities`, `ctseg.inference.network.probability_ops`): on the
devices under JAX, on the host CPU's device for ONNX Runtime's logits, adopted without a
copy. So does the way back to the scan's voxels (`ctseg.inference.scan.way_back`).
"""

from __future__ import annotations

import itertools

import jax
import numpy as np

from ctseg.config import Config, TileRequest
from ctseg.data.grids import Shape
from ctseg.errors import CtsegError
from ctseg.inference.network import probability_ops, tiling
from ctseg.inference.network.backends import Backend
from ctseg.inference.network.boxes import Windows
from ctseg.inference.network.tiling import Span, Stage
from ctseg.progress import TileProgress
from ctseg.run.trained import TrainedModel

AUTO = TileRequest.auto()
# nnU-Net's test-time augmentation: every subset of the three axes, the identity first.
MIRRORINGS = tuple(axes for n in range(4) for axes in itertools.combinations((0, 1, 2), n))


class Engine:
    """Logits of whole R³ grids: one pass over the devices, or exact level-wise tiles."""

    def __init__(
        self,
        model: TrainedModel,
        backend: Backend,
        tile: TileRequest | int = AUTO,
        memory: int | None = None,
        shape: Shape | None = None,
        windows: Windows | None = None,
    ):
        """`tile`: automatic, the whole volume, or cores of a size at every level (an int
        is read by `TileRequest.from_int`: −1, 0 or an even size).

        `backend`: where the network runs (`ctseg.inference.network.choice` builds it): JAX
        on its devices, a whole-volume pass partitioned over them and a stage's windows dealt
        out over them; or ONNX Runtime on the host's CPU cores.
        `memory`: bytes per device to plan for; default, the devices' free memory
        (the host's available memory under ONNX Runtime). `shape`: the grids it takes
        (x, y, z voxels, each a multiple of the model's alignment); default the run's R³.
        `windows`: fixed windows (the backend's policy of boxes gives them,
        `GridBoxes.windows_for`), whose compiled programs serve boxes of every shape
        (`tiling.fixed_stages`; the box at least `tiling.window_floor` a side); the tile
        request is then read as their core.
        """
        tile = TileRequest.of(tile)
        config = model.config
        self.model = model
        self.shape = tiling.grid_shape(config) if shape is None else tuple(shape)
        if any(n % config.alignment for n in self.shape):
            raise ValueError(f"grid {self.shape} is not a multiple of {config.alignment}")
        self.backend = backend
        self.devices = backend.devices  # [] under ONNX Runtime: the host's CPU cores
        self.tile_request = tile
        self.memory = backend.free_memory() if memory is None else memory
        self.windows = windows
        if windows is not None:
            fixed = tiling.fixed_stages(config, windows.core, self.shape)
            try:
                self._plan = windows.plan(model, self.shape, fixed, self.memory)
            except CtsegError:
                if not tile.is_auto:
                    raise
                self.windows = None  # a box too large for them beside its levels: as planned
        if self.windows is None:
            # A core as large as the grid is one window: the whole-volume pass does it better.
            fixed = None if tile.is_auto else plan_stages_for(config, tile, self.shape)
            self._plan = backend.plan(model, self.shape, fixed, self.memory)
        self.stages = self._plan.stages
        self.needed, self.spatial = self._plan.needed, self._plan.spatial
        self.spills = self._plan.spills
        # Materialised activations: the compute dtype under JAX, float32 in ONNX Runtime.
        self.dtype = backend.dtype(config).name
        largest = max((stage.largest_core for stage in self.stages), default=0)
        self.tile = (largest if tile.is_auto else tile.to_int()) if self.stages else 0
        if self.windows is not None:
            self.tile = self.windows.core

    @property
    def description(self) -> str:
        if not self.stages:
            split = "" if self.spatial == (1, 1, 1) else f" split {list(self.spatial)}"
            return f"whole volume {tiling.shape_text(self.shape)}{split}"
        windows = sum(len(stage.windows()) for stage in self.stages)
        at_once = f", {len(self.devices)} at a time" if len(self.devices) > 1 else ""
        if self.windows is not None:
            return (
                f"fixed windows ≤ {self.tile}³ of {tiling.shape_text(self.shape)} "
                f"({len(self.stages)} stages, {windows} windows{at_once})"
            )
        return (
            f"level-wise tiles ≤ {self.tile}³ "
            f"({len(self.stages)} stages, {windows} windows{at_once})"
        )

    @property
    def plan_line(self) -> str:
        """The plan and what it needs, e.g. `whole volume 512³: 51.2 GiB per device of
        78.1 GiB free (compiled; plans take 85 %)`."""
        return self.description + self._plan.memory_words(self.memory)

    def place(self, image: np.ndarray | jax.Array) -> np.ndarray | jax.Array:
        """A unit-scaled image of the engine's shape [x, y, z] as the engine takes it:
        [1, x, y, z, 1] float32, on the devices under JAX (one transfer), on the host under
        ONNX Runtime."""
        if tuple(image.shape) != self.shape:
            raise ValueError(f"image shape {image.shape} is not the engine's grid {self.shape}")
        return self._plan.place(image)

    def logits(
        self,
        image: np.ndarray | jax.Array,
        progress: TileProgress | None = None,
        need: Span | None = None,
    ) -> np.ndarray | jax.Array:
        """Logits [x, y, z, 3] float32 of a unit-scaled image [x, y, z] (`hu_to_unit`) of the
        engine's shape, or of an image already `place`d; a device array under JAX.

        `need`: the voxels wanted, per axis [lo, hi) (a region's, `ctseg.inference.scan.region`);
        level-wise tiles then compute only their cone (`tiling.stage_spans`), exact there,
        and leave zeros where nothing wanted depends on them. A whole pass computes all.
        """
        if image.ndim == 3:
            image = self.place(image)
        return self._plan.logits(image, progress, need)

    def smaller(self) -> Engine:
        """An automatic plan for half the memory this plan's programs need (after an
        out-of-memory on the accelerator)."""
        memory = self.backend.memory_for(self.needed // 2)
        return Engine(self.model, self.backend, AUTO, memory, self.shape)


def plan_stages_for(config: Config, tile: TileRequest, shape: Shape) -> list[Stage]:
    """The stages of cores of the `tile` request's size over a grid of `shape`; [] (the
    whole volume) for the whole volume or a core as large as the grid."""
    core = tile.to_int()
    return tiling.plan_stages(config, core, shape) if 0 < core < max(shape) else []


# --------------------------------------------------------------------------- probabilities


def class_probabilities(
    engine: Engine,
    image: np.ndarray | jax.Array,
    mirrored: bool,
    progress: TileProgress | None = None,
    need: Span | None = None,
) -> jax.Array:
    """Class probabilities [x, y, z, 3] float32 of a unit-scaled image [x, y, z]; with
    `need`, on those voxels (`Engine.logits`), the rest of the box unspecified.

    `mirrored`: the mean of the probabilities of the 8 mirrorings of the image,
    each flipped back. Every pass is the engine's own (tiled passes equal the
    whole pass), so the mean is exact too. The image is flipped where the backend reads
    it (`Backend.flip`: under JAX on the devices, from one transfer of the image); the
    probabilities are JAX arrays (`Backend.adopt_logits`).
    """
    backend = engine.backend
    placed = engine.place(image)
    if not mirrored:
        return probability_ops.softmax(backend.adopt_logits(engine.logits(placed, progress, need)))
    total = None
    for index, axes in enumerate(MIRRORINGS):

        def tick(done: int, count: int, index: int = index) -> None:
            if progress is not None:
                progress(index * count + done, len(MIRRORINGS) * count)

        flipped = backend.flip(placed, axes)
        need_flipped = _mirrored(need, axes, engine.shape)
        logits = backend.adopt_logits(engine.logits(flipped, tick, need_flipped))
        if total is None:
            total = probability_ops.unflipped(logits, axes)
        else:
            total = probability_ops.add_unflipped(total, logits, axes)
    return probability_ops.mean(total, len(MIRRORINGS))


def _mirrored(need: Span | None, axes: tuple[int, ...], shape: Shape) -> Span | None:
    """The voxels `need` of a box of `shape` once the box is flipped along `axes`."""
    if need is None:
        return None
    return tuple(  # type: ignore[return-value]
        (shape[a] - hi, shape[a] - lo) if a in axes else (lo, hi) for a, (lo, hi) in enumerate(need)
    )
