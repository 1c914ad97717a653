"""The inference engine: logits and class probabilities of whole boxes of the grid.

An `Engine` runs a trained model on one backend: ``jax`` (`ctseg.inference.jax_backend`: the
whole volume partitioned over the devices, or exact level-wise tiles, all on the
devices) or ``onnx`` (`ctseg.inference.onnx_backend`: ONNX Runtime on the host's CPU cores).
Level-wise tiles are cut as `ctseg.inference.tiling` plans them; stitched, they equal one
whole-volume pass.

Softmax and the mean of the mirrored passes (test-time augmentation) run where the
backend runs (`class_probabilities`), and so does the way back to the scan's voxels
(`ctseg.inference.scan_space`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ctseg.config import Config, tile_problem
from ctseg.errors import CtsegError
from ctseg.inference import tiling
from ctseg.inference.backends import BACKENDS
from ctseg.inference.jax_backend import COMPILED_SHARE, JaxBackend
from ctseg.inference.onnx_backend import OnnxBackend
from ctseg.inference.tiling import Shape, Span, Stage, TileProgress
from ctseg.memory import host_memory
from ctseg.parallel import devices as dev
from ctseg.run.trained import TrainedModel

_SOFTMAX_SLAB = 32
# nnU-Net's test-time augmentation: every subset of the three axes, the identity first.
MIRRORINGS = tuple(axes for n in range(4) for axes in itertools.combinations((0, 1, 2), n))


class Engine:
    """Logits of whole R³ grids: one pass over the devices, or exact level-wise tiles."""

    def __init__(
        self,
        model: TrainedModel,
        tile: int = -1,
        backend: str = "jax",
        devices: Sequence[Any] | None = None,
        memory: int | None = None,
        shape: Shape | None = None,
    ):
        """`tile`: core side (even) at every level, 0 whole volume, −1 automatic.

        `backend`: "jax" or "onnx" (ONNX Runtime on the host's CPU cores).
        `devices` (JAX): where the network runs, by default this process's first
        device (`ctseg.parallel.devices` chooses them for commands). A whole-volume pass
        is partitioned over them; a stage's windows are dealt out over them.
        `memory`: bytes per device to plan for; default, the devices' free memory
        (the host's available memory under ONNX Runtime). `shape`: the grids it takes
        (x, y, z voxels, each a multiple of the model's alignment); default the run's R³.
        """
        if backend not in BACKENDS:
            raise CtsegError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if problem := tile_problem(tile):
            raise CtsegError(f"tile {problem}")
        config = model.config
        self.model = model
        self.shape = tiling.grid_shape(config) if shape is None else tuple(shape)
        if any(n % config.alignment for n in self.shape):
            raise ValueError(f"grid {self.shape} is not a multiple of {config.alignment}")
        self.backend = backend
        self.tile_request = tile
        # A core as large as the grid is one window: the whole-volume pass does it better.
        fixed = plan_stages_for(config, tile, self.shape) if tile >= 0 else None
        if backend == "onnx":
            self.devices: list[Any] = []  # the host's CPU cores
            self.memory = host_memory() if memory is None else memory
            onnx = OnnxBackend(model, self.shape, fixed, self.memory)
            self._backend: JaxBackend | OnnxBackend = onnx
            self.needed, self.spatial, self.spills = 0, (1, 1, 1), False
        else:
            self.devices = list(devices or jax.local_devices()[:1])
            self.memory = dev.free_memory(self.devices) if memory is None else memory
            jax_backend = JaxBackend(model, self.shape, fixed, self.devices, self.memory)
            self._backend = jax_backend
            self.needed, self.spatial = jax_backend.needed, jax_backend.spatial
            self.spills = jax_backend.spills
        self.stages = self._backend.stages
        # Materialised activations: the compute dtype under JAX, float32 in ONNX Runtime.
        self.dtype = self._backend.dtype.name
        largest = max((stage.largest_core for stage in self.stages), default=0)
        self.tile = (tile if tile >= 0 else largest) if self.stages else 0

    @property
    def description(self) -> str:
        if not self.stages:
            split = "" if self.spatial == (1, 1, 1) else f" split {list(self.spatial)}"
            return f"whole volume {tiling.shape_text(self.shape)}{split}"
        windows = sum(len(stage.windows()) for stage in self.stages)
        at_once = f", {len(self.devices)} at a time" if len(self.devices) > 1 else ""
        return (
            f"level-wise tiles ≤ {self.tile}³ "
            f"({len(self.stages)} stages, {windows} windows{at_once})"
        )

    def place(self, image: np.ndarray | jax.Array) -> np.ndarray | jax.Array:
        """A unit-scaled image of the engine's shape [x, y, z] as the engine takes it:
        [1, x, y, z, 1] float32, on the devices under JAX (one transfer), on the host under
        ONNX Runtime."""
        if tuple(image.shape) != self.shape:
            raise ValueError(f"image shape {image.shape} is not the engine's grid {self.shape}")
        return self._backend.place(image)

    def logits(
        self,
        image: np.ndarray | jax.Array,
        progress: TileProgress | None = None,
        need: Span | None = None,
    ) -> np.ndarray | jax.Array:
        """Logits [x, y, z, 3] float32 of a unit-scaled image [x, y, z] (`hu_to_unit`) of the
        engine's shape, or of an image already `place`d; a device array under JAX.

        `need`: the voxels wanted, per axis [lo, hi) (a region's, `ctseg.inference.region`);
        level-wise tiles then compute only their cone (`tiling.stage_spans`), exact there,
        and leave zeros where nothing wanted depends on them. A whole pass computes all.
        """
        if image.ndim == 3:
            image = self.place(image)
        return self._backend.logits(image, progress, need)

    def smaller(self) -> Engine:
        """An automatic plan for half the memory this plan's programs need (after an
        out-of-memory on the accelerator)."""
        memory = int(self.needed / 2 / COMPILED_SHARE)
        return Engine(self.model, -1, self.backend, self.devices, memory, self.shape)


def plan_stages_for(config: Config, tile: int, shape: Shape) -> list[Stage]:
    """The stages of cores of `tile` voxels over a grid of `shape`; [] (the whole volume)
    for 0 or a tile as large as the grid."""
    return tiling.plan_stages(config, tile, shape) if 0 < tile < max(shape) else []


# --------------------------------------------------------------------------- probabilities


@jax.jit
def _softmax(logits: jax.Array) -> jax.Array:
    return jax.nn.softmax(logits, axis=-1)


@partial(jax.jit, static_argnums=1)
def _flip_batch(image: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    return jnp.flip(image, tuple(a + 1 for a in axes))


@partial(jax.jit, static_argnums=1)
def _unflipped(logits: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    return jnp.flip(jax.nn.softmax(logits, axis=-1), axes)


@partial(jax.jit, static_argnums=2)
def _add_unflipped(total: jax.Array, logits: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    return total + _unflipped(logits, axes)


@jax.jit
def _mean_of_mirrorings(total: jax.Array) -> jax.Array:
    return total / len(MIRRORINGS)


def class_probabilities(
    engine: Engine,
    image: np.ndarray | jax.Array,
    mirrored: bool,
    progress: TileProgress | None = None,
    need: Span | None = None,
) -> np.ndarray | jax.Array:
    """Class probabilities [x, y, z, 3] float32 of a unit-scaled image [x, y, z]; with
    `need`, on those voxels (`Engine.logits`), the rest of the box unspecified.

    `mirrored`: the mean of the probabilities of the 8 mirrorings of the image,
    each flipped back. Every pass is the engine's own (tiled passes equal the
    whole pass), so the mean is exact too. Under JAX a device array, computed on
    the devices from one transfer of the image.
    """
    if engine.backend == "onnx":
        return _host_probabilities(engine, np.asarray(image), mirrored, progress, need)
    placed = engine.place(image)
    if not mirrored:
        return _softmax(engine.logits(placed, progress, need))
    total = None
    for index, axes in enumerate(MIRRORINGS):

        def tick(done: int, count: int, index: int = index) -> None:
            if progress is not None:
                progress(index * count + done, len(MIRRORINGS) * count)

        logits = engine.logits(_flip_batch(placed, axes), tick, _mirrored(need, axes, engine.shape))
        total = _unflipped(logits, axes) if total is None else _add_unflipped(total, logits, axes)
    return _mean_of_mirrorings(total)


def _mirrored(need: Span | None, axes: tuple[int, ...], shape: Shape) -> Span | None:
    """The voxels `need` of a box of `shape` once the box is flipped along `axes`."""
    if need is None:
        return None
    return tuple(  # type: ignore[return-value]
        (shape[a] - hi, shape[a] - lo) if a in axes else (lo, hi) for a, (lo, hi) in enumerate(need)
    )


def _host_probabilities(
    engine: Engine,
    image: np.ndarray,
    mirrored: bool,
    progress: TileProgress | None,
    need: Span | None,
) -> np.ndarray:
    if not mirrored:
        logits = engine.logits(image, progress, need)
        # Only the voxels wanted: the rest of a region's box was never computed, and its
        # pages, never touched, take no memory.
        softmax_(logits if need is None else logits[tuple(slice(*ends) for ends in need)])
        return logits
    total: np.ndarray | None = None
    for index, axes in enumerate(MIRRORINGS):

        def tick(done: int, count: int, index: int = index) -> None:
            if progress is not None:
                progress(index * count + done, len(MIRRORINGS) * count)

        # The flips are views: the engine copies the image it reads, and `total` the first pass.
        logits = engine.logits(np.flip(image, axes), tick, _mirrored(need, axes, engine.shape))
        flipped = np.flip(softmax_(logits), axes)
        if total is None:
            total = np.array(flipped)
        else:
            total += flipped
    total /= len(MIRRORINGS)
    return total


def softmax_(logits: np.ndarray) -> np.ndarray:
    """Class probabilities from logits [..., C], in place, a slab at a time (no big temporaries)."""
    for start in range(0, logits.shape[0], _SOFTMAX_SLAB):
        slab = logits[start : start + _SOFTMAX_SLAB]
        slab -= slab.max(axis=-1, keepdims=True)
        np.exp(slab, out=slab)
        slab /= slab.sum(axis=-1, keepdims=True)
    return logits
