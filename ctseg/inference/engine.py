"""The inference engine: logits and class probabilities of whole R³ grids, and the way
back to a scan's own voxels.

An `Engine` runs a trained model on one backend: ``jax`` (`ctseg.jax_backend`: the
whole volume partitioned over the devices, or exact level-wise tiles, all on the
devices) or ``onnx`` (`ctseg.onnx_backend`: ONNX Runtime on the host's CPU cores).
Level-wise tiles are cut as `ctseg.tiling` plans them; stitched, they equal one
whole-volume pass.

Softmax, the mean of the mirrored passes (test-time augmentation), the resampling
back to the scan's own voxels and the argmax run where the backend runs
(`probabilities`, `scan_labels`): under JAX what comes back to the host is the uint8
label map, and probabilities only where a caller asks for them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ctseg.config import Config
from ctseg.data import grids as preprocess
from ctseg.errors import CtsegError
from ctseg.inference import tiling
from ctseg.inference.jax_backend import COMPILED_SHARE, JaxBackend
from ctseg.inference.onnx_backend import OnnxBackend
from ctseg.inference.tiling import Shape, Stage, TileProgress
from ctseg.parallel import devices as dev
from ctseg.run.checkpoints import TrainedModel

BACKENDS = ("jax", "onnx")
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
        device (`ctseg.devices` chooses them for commands). A whole-volume pass
        is partitioned over them; a stage's windows are dealt out over them.
        `memory`: bytes per device to plan for; default, the devices' free memory
        (the host's available memory under ONNX Runtime). `shape`: the grids it takes
        (x, y, z voxels, each a multiple of the model's alignment); default the run's R³.
        """
        if backend not in BACKENDS:
            raise CtsegError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if tile < -1:
            raise CtsegError(
                f"--tile must be -1 (automatic), 0 (whole volume) or an even size, got {tile}"
            )
        if tile >= 0 and tile % 2:
            raise CtsegError(
                f"--tile {tile} must be even: level-wise tiles are pooled in pairs of voxels"
            )
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
            self.memory = dev.host_memory() if memory is None else memory
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
        self, image: np.ndarray | jax.Array, progress: TileProgress | None = None
    ) -> np.ndarray | jax.Array:
        """Logits [x, y, z, 3] float32 of a unit-scaled image [x, y, z] (`hu_to_unit`) of the
        engine's shape, or of an image already `place`d; a device array under JAX."""
        if image.ndim == 3:
            image = self.place(image)
        return self._backend.logits(image, progress)

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


def probabilities(
    engine: Engine,
    image: np.ndarray | jax.Array,
    mirrored: bool,
    progress: TileProgress | None = None,
) -> np.ndarray | jax.Array:
    """Class probabilities [x, y, z, 3] float32 of a unit-scaled image [x, y, z].

    `mirrored`: the mean of the probabilities of the 8 mirrorings of the image,
    each flipped back. Every pass is the engine's own (tiled passes equal the
    whole pass), so the mean is exact too. Under JAX a device array, computed on
    the devices from one transfer of the image.
    """
    if engine.backend == "onnx":
        return _host_probabilities(engine, np.asarray(image), mirrored, progress)
    placed = engine.place(image)
    if not mirrored:
        return _softmax(engine.logits(placed, progress))
    total = None
    for index, axes in enumerate(MIRRORINGS):

        def tick(done: int, count: int, index: int = index) -> None:
            if progress is not None:
                progress(index * count + done, len(MIRRORINGS) * count)

        logits = engine.logits(_flip_batch(placed, axes), tick)
        total = _unflipped(logits, axes) if total is None else _add_unflipped(total, logits, axes)
    return _mean_of_mirrorings(total)


def _host_probabilities(
    engine: Engine, image: np.ndarray, mirrored: bool, progress: TileProgress | None
) -> np.ndarray:
    if not mirrored:
        return softmax_(engine.logits(image, progress))
    total: np.ndarray | None = None
    for index, axes in enumerate(MIRRORINGS):

        def tick(done: int, count: int, index: int = index) -> None:
            if progress is not None:
                progress(index * count + done, len(MIRRORINGS) * count)

        # The flips are views: the engine copies the image it reads, and `total` the first pass.
        flipped = np.flip(softmax_(engine.logits(np.flip(image, axes), tick)), axes)
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


# --------------------------------------------------------------------------- back to the scan


def _linear_weights(size: int, out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Linear interpolation from `size` to `out` voxels covering one field of view, as
    `preprocess.from_grid` does it (voxel centres, edge values beyond the last centre)."""
    coordinate = (np.arange(out) + 0.5) * (size / out) - 0.5
    lower = np.floor(coordinate)
    weight = (coordinate - lower).astype(np.float32)
    first = np.clip(lower, 0, size - 1).astype(np.int32)
    second = np.clip(lower + 1, 0, size - 1).astype(np.int32)
    return first, second, weight


@partial(jax.jit, static_argnums=1)
def _resampled(probabilities: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Grid probabilities [x, y, z, C] resampled linearly onto `shape` (the scan's voxels)."""
    x = probabilities
    # Shrinking axes first keeps the intermediates small (a 512³ grid onto 63 slices).
    for axis in sorted(range(3), key=lambda a: shape[a] / x.shape[a]):
        if shape[axis] == x.shape[axis]:
            continue
        first, second, weight = _linear_weights(x.shape[axis], shape[axis])
        weight = weight.reshape([-1 if a == axis else 1 for a in range(x.ndim)])
        x = jnp.take(x, first, axis=axis) * (1 - weight) + jnp.take(x, second, axis=axis) * weight
    return x


@partial(jax.jit, static_argnums=(1, 2))
def _on_scan(
    probabilities: jax.Array, shape: tuple[int, ...], with_probabilities: bool
) -> tuple[jax.Array, jax.Array | None]:
    """Grid probabilities [x, y, z, C] resampled linearly onto `shape`, and their argmax."""
    x = _resampled(probabilities, shape)
    labels = jnp.argmax(x, axis=-1).astype(jnp.uint8)
    return labels, (x if with_probabilities else None)


def scan_labels(
    probabilities: np.ndarray | jax.Array, shape: Sequence[int], with_probabilities: bool = False
) -> tuple[np.ndarray, np.ndarray | None]:
    """Labels (uint8) on the scan's canonical voxels from grid probabilities [x, y, z, 3]:
    linear on the probabilities, then the argmax (smoother borders than resampling
    labels). With `with_probabilities`, the resampled probabilities too."""
    shape = tuple(int(n) for n in shape)
    if isinstance(probabilities, np.ndarray):
        on_scan = preprocess.from_grid(probabilities, shape, order=1)
        return on_scan.argmax(-1).astype(np.uint8), on_scan if with_probabilities else None
    labels, on_scan = jax.device_get(_on_scan(probabilities, shape, with_probabilities))
    return labels, on_scan


def mean_scan_labels(
    probabilities: Sequence[np.ndarray | jax.Array],
    shape: Sequence[int],
    with_probabilities: bool = False,
) -> tuple[np.ndarray, np.ndarray | None]:
    """`scan_labels` of the mean of several grids' probabilities (an ensemble's members,
    each on its own grid), averaged on the scan's voxels, where the backend runs."""
    shape = tuple(int(n) for n in shape)
    if all(isinstance(p, np.ndarray) for p in probabilities):
        total = preprocess.from_grid(probabilities[0], shape, order=1)
        for member in probabilities[1:]:
            total += preprocess.from_grid(member, shape, order=1)
        total /= len(probabilities)
        return total.argmax(-1).astype(np.uint8), total if with_probabilities else None
    # Every member's probabilities onto one device (device to device), summed there.
    device = min(probabilities[0].devices(), key=lambda d: d.id)
    total = None
    for member in probabilities:
        on_scan = _resampled(jax.device_put(member, device), shape)
        total = on_scan if total is None else _sum(total, on_scan)
    labels, mean = _mean_labels(total, len(probabilities))
    return jax.device_get(labels), jax.device_get(mean) if with_probabilities else None


@jax.jit
def _sum(total: jax.Array, more: jax.Array) -> jax.Array:
    return total + more


@partial(jax.jit, static_argnums=1)
def _mean_labels(total: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
    mean = total / count
    return jnp.argmax(mean, axis=-1).astype(jnp.uint8), mean


def crop(probabilities: np.ndarray | jax.Array, shape: Sequence[int]) -> np.ndarray | jax.Array:
    """The first `shape` voxels of a box's probabilities: the grid a padded box holds."""
    shape = tuple(int(n) for n in shape)
    if tuple(probabilities.shape[:3]) == shape:
        return probabilities
    if isinstance(probabilities, np.ndarray):
        return probabilities[: shape[0], : shape[1], : shape[2]]
    return _crop(probabilities, shape)


@partial(jax.jit, static_argnums=1)
def _crop(probabilities: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    # Jitted: an eager index of a sharded array would send the index from the host.
    return probabilities[: shape[0], : shape[1], : shape[2]]


def grid_labels(probabilities: np.ndarray | jax.Array) -> np.ndarray:
    """The argmax on the grid (uint8), where training's validation Dice is measured."""
    if isinstance(probabilities, np.ndarray):
        return probabilities.argmax(-1).astype(np.uint8)
    return jax.device_get(_grid_argmax(probabilities))


@jax.jit
def _grid_argmax(probabilities: jax.Array) -> jax.Array:
    return jnp.argmax(probabilities, axis=-1).astype(jnp.uint8)
