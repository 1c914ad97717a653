"""The inference engine: whole-volume partitioned inference and exact tiled inference.

Whole volume (`tile == 0`): the grid is split over the run's spatial mesh and
every convolution exchanges halos, exactly as in training.

Tiled (`tile > 0`): the grid is cut into cores of `tile` voxels a side
(multiples of the alignment 2^(depth−1)). Each core is computed from a window
that extends it by a margin ≥ the receptive-field radius, rounded up to the
alignment. Windows all have one shape, ``min(tile + 2·margin, R)`` a side, and
are shifted inwards at the volume's faces rather than padded: where a window
stops at the volume's boundary, the network's own SAME zero padding at every
layer sees the same zeros as in the whole-volume pass. Zero-padding the *input*
instead would not be exact, because deeper layers would then see non-zero
activations where the whole-volume pass pads with zeros. With inference-mode
batch norm the network is local (ARCHITECTURE.md, invariant 6), so the stitched
cores equal the whole-volume output; no overlap blending is needed. One window
shape means one compilation; windows run several at a time, as a batch sharded
over the devices along the mesh's ``data`` axis.

Backends: ``jax`` runs the jitted network over the mesh; ``onnx`` runs the same
inference-mode network, exported by `ctseg.onnx_export`, in ONNX Runtime on the
host's CPU cores (several times faster than XLA:CPU there), one window at a time.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from ctseg import unet
from ctseg.checkpoints import load_for_inference
from ctseg.config import Config
from ctseg.errors import CtsegError
from ctseg.partition import REPLICATED, make_mesh, shard_global
from ctseg.step import make_predict

TileProgress = Callable[[int, int], None]  # (windows done, windows in total)
# Image batch [b, x, y, z, 1] float32 -> logits [b, x, y, z, 3] float32, a writable array.
Forward = Callable[[np.ndarray], np.ndarray]
BACKENDS = ("jax", "onnx")

# Live activation bytes per voxel of a level, per channel of its width: the level's
# input, its halo-padded copy, the convolution output and, in the decoder, the
# concatenated skip (twice the width), all float32 in batch norm.
_LIVE_BUFFERS_PER_CHANNEL = 6
# Per-voxel bytes that do not scale with the width: the input and its padded copies, the
# logits, and XLA:CPU's temporaries for few-channel convolutions. Measured: a base-2 model
# takes about 120 B per voxel at 128³, where the width term alone predicts 64.
_FIXED_BYTES_PER_VOXEL = 128
# Share of the available memory the activations of one step may take; the rest is
# for the grid, the logits, XLA's own buffers and whatever else runs on the machine.
_MEMORY_SHARE = 0.5
_SOFTMAX_SLAB = 32


@dataclass(frozen=True)
class Model:
    """A network ready for inference: architecture, weights and the run's config."""

    config: Config
    graphdef: nnx.GraphDef
    params: nnx.State
    stats: nnx.State
    step: int  # the checkpoint's training step


def load_model(run_dir: Path, checkpoint: str) -> Model:
    """Restore a run's checkpoint (`best`, `latest` or a step number) for inference."""
    mesh = make_mesh((1, 1, 1))  # parameters are replicated; engines place them on their mesh
    config, graphdef, params, stats, step = load_for_inference(run_dir, checkpoint, mesh)
    return Model(config, graphdef, params, stats, step)


# --------------------------------------------------------------------------- tiles


def margin(config: Config) -> int:
    """Context each window adds on every side of its core: the radius, rounded up to alignment."""
    align = config.alignment
    return math.ceil(unet.receptive_field_radius(config.model) / align) * align


@dataclass(frozen=True)
class Window:
    """One tile: the window fed to the network and where its core goes in the output."""

    window: tuple[slice, slice, slice]  # in grid coordinates
    core: tuple[slice, slice, slice]  # in grid coordinates
    core_in_window: tuple[slice, slice, slice]


def _axis_windows(size: int, core: int, extent: int, context: int) -> list[tuple[slice, slice]]:
    """(window, core) ranges along one axis; windows have `extent` voxels, shifted to fit."""
    ranges = []
    for start in range(0, size, core):
        stop = min(start + core, size)
        first = min(max(start - context, 0), size - extent)
        ranges.append((slice(first, first + extent), slice(start, stop)))
    return ranges


def plan_windows(resolution: int, core: int, context: int) -> list[Window]:
    """Windows covering an R³ grid with cores of `core` voxels; all of one shape."""
    extent = min(core + 2 * context, resolution)
    axis = _axis_windows(resolution, core, extent, context)
    windows = []
    for wx, cx in axis:
        for wy, cy in axis:
            for wz, cz in axis:
                window, cores = (wx, wy, wz), (cx, cy, cz)
                inner = tuple(
                    slice(c.start - w.start, c.stop - w.start) for w, c in zip(window, cores)
                )
                windows.append(Window(window, cores, inner))
    return windows


# --------------------------------------------------------------------------- memory


def activation_bytes_per_voxel(config: Config) -> float:
    """Estimated peak activation bytes per input voxel of one forward pass.

    Level l has base·2^l channels on 1/8^l of the voxels, so deeper levels add a
    geometric tail of about a third to the first level's share. Conservative for wide
    models: the lits512 model (base 32) measured about 440 B per voxel of a 208³ window.
    """
    model = config.model
    return _FIXED_BYTES_PER_VOXEL + sum(
        _LIVE_BUFFERS_PER_CHANNEL * model.base_filters * 2**level * 4 / 8**level
        for level in range(model.depth)
    )


def available_memory() -> int:
    """Bytes free for activations: the accelerator's free memory, else the host's available RAM."""
    device = jax.devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return host_memory()


def host_memory() -> int:
    """Bytes of the host's RAM available to new allocations."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def choose_tile(config: Config, windows_per_step: int, memory: int) -> int:
    """The largest core (0 = whole volume) whose activations fit in a share of `memory`."""
    resolution = config.data.resolution
    per_voxel = activation_bytes_per_voxel(config)
    # The grid itself (float32 input, 3 float32 logits) stays in memory throughout.
    budget = _MEMORY_SHARE * memory - resolution**3 * 16
    if resolution**3 * per_voxel <= budget:
        return 0
    align, context = config.alignment, margin(config)
    for core in range(resolution - align, 0, -align):
        extent = min(core + 2 * context, resolution)
        if windows_per_step * extent**3 * per_voxel <= budget:
            return core
    return align  # nothing fits the estimate: the smallest tiles are the best chance


def describe(tile: int, resolution: int, context: int) -> str:
    """A short description of the tiling for logs and progress bars."""
    if tile == 0:
        return f"whole volume {resolution}³"
    count = math.ceil(resolution / tile) ** 3
    extent = min(tile + 2 * context, resolution)
    return f"{count} tiles, core {tile}³ in windows of {extent}³"


# --------------------------------------------------------------------------- the engine


def _jax_forward(model: Model, mesh: Mesh) -> Forward:
    """The jitted network over `mesh`, its parameters replicated there."""
    predict = jax.jit(make_predict(model.graphdef, model.config, mesh))
    replicated = NamedSharding(mesh, REPLICATED)
    params = jax.device_put(model.params, replicated)
    stats = jax.device_put(model.stats, replicated)

    def forward(batch: np.ndarray) -> np.ndarray:
        # A writable copy: callers turn the logits into probabilities in place.
        return np.array(predict(params, stats, shard_global(mesh, batch)))

    return forward


def _onnx_forward(model: Model) -> Forward:
    """The exported inference-mode network in an ONNX Runtime session on the host's cores."""
    try:
        import onnxruntime as ort

        from ctseg import onnx_export
    except ImportError:
        raise CtsegError(
            "the onnx backend needs the onnx and onnxruntime packages: pip install 'ctseg[onnx]'"
        ) from None
    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count() or 1
    # All graph optimisations, including the blocked-channel (NCHWc) convolution layout.
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(
        onnx_export.export(model.graphdef, model.params, model.stats).SerializeToString(),
        options,
        providers=["CPUExecutionProvider"],
    )

    def forward(batch: np.ndarray) -> np.ndarray:
        return session.run([onnx_export.OUTPUT], {onnx_export.INPUT: batch})[0]

    return forward


class Engine:
    """Logits of whole R³ grids, computed whole over the run's mesh or in exact tiles."""

    def __init__(self, model: Model, tile: int = -1, backend: str = "jax"):
        """`tile`: core size in voxels (a multiple of the alignment), 0 whole, −1 automatic.

        `backend`: "jax" (the run's mesh and devices) or "onnx" (ONNX Runtime on the CPU).
        """
        if backend not in BACKENDS:
            raise CtsegError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        config = model.config
        self.resolution = config.data.resolution
        self.context = margin(config)
        self.backend = backend
        # ONNX Runtime runs one window at a time on all host cores; JAX one per device.
        devices = config.num_devices if backend == "jax" else 1
        if tile < 0:
            memory = available_memory() if backend == "jax" else host_memory()
            tile = choose_tile(config, devices, memory)
        elif tile % config.alignment:
            raise CtsegError(
                f"--tile {tile} must be a multiple of 2^(model.depth-1) = {config.alignment}"
            )
        # A core as large as the grid is one window: the whole-volume pass does it better.
        self.tile = 0 if tile >= self.resolution else tile
        self.windows_per_step = 1 if self.tile == 0 else devices
        if backend == "onnx":
            self.forward = _onnx_forward(model)
        elif self.tile == 0:
            self.forward = _jax_forward(model, make_mesh(config.mesh.spatial, 1))
        else:
            self.forward = _jax_forward(model, make_mesh((1, 1, 1), devices))

    @property
    def description(self) -> str:
        return describe(self.tile, self.resolution, self.context)

    def logits(self, image: np.ndarray, progress: TileProgress | None = None) -> np.ndarray:
        """Logits [R, R, R, 3] float32 of a unit-scaled image [R, R, R] (`hu_to_unit`)."""
        if image.shape != (self.resolution,) * 3:
            raise ValueError(f"image shape {image.shape} is not the run's grid {self.resolution}³")
        if self.tile == 0:
            out = self.forward(image[None, ..., None].astype(np.float32))[0]
            if progress is not None:
                progress(1, 1)
            return out
        windows = plan_windows(self.resolution, self.tile, self.context)
        out = np.empty((*image.shape, unet.NUM_CLASSES), np.float32)
        done = 0
        for group in _batches(windows, self.windows_per_step):
            # The last step is topped up by repeating a window: one shape, one compilation.
            padded = group + [group[-1]] * (self.windows_per_step - len(group))
            batch = np.stack([image[w.window] for w in padded])[..., None].astype(np.float32)
            for w, logits in zip(group, self.forward(batch)):
                out[w.core] = logits[w.core_in_window]
            done += len(group)
            if progress is not None:
                progress(done, len(windows))
        return out


def _batches(windows: list[Window], size: int) -> Iterator[list[Window]]:
    for start in range(0, len(windows), size):
        yield windows[start : start + size]


def softmax_(logits: np.ndarray) -> np.ndarray:
    """Class probabilities from logits [..., C], in place, a slab at a time (no big temporaries)."""
    for start in range(0, logits.shape[0], _SOFTMAX_SLAB):
        slab = logits[start : start + _SOFTMAX_SLAB]
        slab -= slab.max(axis=-1, keepdims=True)
        np.exp(slab, out=slab)
        slab /= slab.sum(axis=-1, keepdims=True)
    return logits
