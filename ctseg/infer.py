"""The inference engine: whole-volume partitioned inference and exact level-wise tiled inference.

Whole volume (`tile == 0`): one pass over the engine's devices, the grid split
over them when they are several (`devices.fit_layout`: halo exchange, exactly as
in training), whatever mesh trained the model. XLA's memory analysis of the
compiled pass is checked against the devices' free memory first.

Level-wise tiles (`tile > 0`). Tiling the whole network would give every window
a margin of the receptive-field radius (56 voxels for depth 4), so at 512³ the
windows would hold 6–15× the grid's voxels. Instead the inference-mode U-Net of
depth D is cut into 2D−1 stages whose outputs are materialised whole, as host
arrays at their level's resolution R/2^l:

    down l (l = 0 … D−2):  a_{l+1} = max_pool(encoder_l(a_l)),  a_0 = the image
    bottom:                d_{D−1} = encoder_{D−1}(a_{D−1})
    up l (l = D−2 … 0):    d_l = decoder_l(encoder_l(a_l), d_{l+1}); up 0 ends with the head

Each stage runs window by window with only its own margin, in its level's voxels:
2·(k//2) for an encoder level's two convolutions, 4·(k//2) for an up stage, which
recomputes its skip encoder_l(a_l) before the decoder's two convolutions (storing
level 0's skip would take R³·base values: 8.6 GB in bfloat16, 17 GB in float32 at
512³ base 32). Windows come from `plan_windows` for every stage; cores and margins
are even, so every window starts and ends on an even voxel: pooling pairs the
voxels the whole pass pairs, and an up stage reads d_{l+1} through its own window
halved. a_{l+1} and d_{l+1} are freed as soon as the stage that reads them is done.

Why it is exact: with inference-mode batch norm every stage is a local function of
its inputs (ARCHITECTURE.md, invariant 6) whose radius its margin covers. Windows
are shifted inwards at the volume's faces, never padded, so where a window stops at
a face each convolution's own SAME zero padding is what the whole pass sees there,
and everywhere else a core voxel is computed from the same values as in the whole
pass. Materialised arrays keep the compute dtype (a bfloat16 model's activations are
bfloat16 in the whole pass too); ONNX Runtime stages keep float32.

Cost, counted as window voxels × multiply-adds per voxel of each stage against one
whole pass: 512³, base 32, depth 4, cores of 128 — 147 windows in 7 stages, 1.47× the
whole pass (1.28× from recomputing the skips, the rest from the margins); whole-network
windows with the 56-voxel margin need 6.6× (64 windows of 240³), 14.5× for cores of 96.
Each stage compiles once (all its windows have one shape); JAX runs one window per
device at a time, a batch sharded along the mesh's ``data`` axis. The device policy
(`ctseg.devices`, `predict.Predictor.from_run`) gives it all the accelerators, or one
CPU device (simulated devices share the cores, and larger windows repeat less margin).

Backends: ``jax`` runs the jitted network over the mesh; ``onnx`` runs the same
inference-mode network (whole, or one ONNX graph per stage), exported by
`ctseg.onnx_export`, in ONNX Runtime on the host's CPU cores (several times faster
than XLA:CPU there), one window at a time.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from ctseg import devices as dev
from ctseg import unet
from ctseg.checkpoints import load_for_inference
from ctseg.config import Config
from ctseg.errors import CtsegError
from ctseg.partition import (
    ACTIVATION_SPEC,
    REPLICATED,
    Comm,
    activation_sharding,
    make_mesh,
    partitioned,
    shard_global,
)
from ctseg.step import make_predict
from ctseg.unet import BOTTOM, DOWN, UP

TileProgress = Callable[[int, int], None]  # (windows done, windows in total)
# Batched windows of a network's or stage's inputs -> its output batch, a host array.
Forward = Callable[..., np.ndarray]
BACKENDS = ("jax", "onnx")

# Live activation bytes per voxel of a level, per channel of its width: the level's
# input, its halo-padded copy, the convolution output and, in the decoder, the
# concatenated skip (twice the width), all float32 in batch norm.
_LIVE_BUFFERS_PER_CHANNEL = 6
# Per-voxel bytes that do not scale with the width: the input and its padded copies, the
# logits, and XLA:CPU's temporaries for few-channel convolutions. Measured: a base-2 model
# takes about 120 B per voxel at 128³, where the width term alone predicts 64.
_FIXED_BYTES_PER_VOXEL = 128
# Share of the available memory a whole-volume pass, or one stage's materialised arrays
# and windows together, may take; the rest is for the caller's arrays, XLA's or ONNX
# Runtime's own buffers, the estimate's error and whatever else runs on the machine.
# Measured at 512³ (lits512, ONNX, 23 GiB available): a share of 0.5 planned 11.4 GiB
# and the process peaked at 12.5 GiB.
_MEMORY_SHARE = 0.4
# Automatic cores when not even the smallest fits the estimate: a usable size (4096
# windows at 512³) beats hundreds of thousands of windows.
_MIN_AUTO_CORE = 32
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
    """Restore a run's checkpoint (`best`, `latest` or a step number) for inference.

    Host arrays, whatever mesh trained them: each engine places them on its devices.
    """
    return Model(*load_for_inference(run_dir, checkpoint))


# --------------------------------------------------------------------------- tiles


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


def plan_windows(size: int, core: int, context: int) -> list[Window]:
    """Windows covering a `size`³ grid with cores of `core` voxels; all of one shape.

    With `size`, `core` and `context` even, every window and core starts and ends on
    an even voxel.
    """
    extent = min(core + 2 * context, size)
    axis = _axis_windows(size, core, extent, context)
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


@dataclass(frozen=True)
class Stage:
    """One stage of level-wise tiled inference: what it computes and how it is tiled."""

    kind: str  # DOWN, BOTTOM or UP
    level: int  # the U-Net level its convolutions run at
    size: int  # that level's grid, R / 2^level voxels a side
    core: int  # core side in the level's voxels; `size`: the stage runs as one window
    context: int  # margin in the level's voxels

    @property
    def extent(self) -> int:
        """Side of every window."""
        return min(self.core + 2 * self.context, self.size)

    @property
    def out_size(self) -> int:
        """Side of the stage's output grid (a down stage pools)."""
        return self.size // 2 if self.kind == DOWN else self.size

    def windows(self) -> list[Window]:
        return plan_windows(self.size, self.core, self.context)


def stage_order(depth: int) -> list[tuple[str, int]]:
    """(kind, level) of every stage, in the order they run."""
    return (
        [(DOWN, level) for level in range(depth - 1)]
        + [(BOTTOM, depth - 1)]
        + [(UP, level) for level in reversed(range(depth - 1))]
    )


def stage_context(config: Config, kind: str) -> int:
    """A stage's margin: the radius of its convolutions, in its level's voxels (even)."""
    halo = config.model.kernel_size // 2
    # An up stage: the skip's two convolutions, then the decoder's two.
    return 4 * halo if kind == UP else 2 * halo


def make_stage(config: Config, kind: str, level: int, tile: int) -> Stage:
    """Stage (`kind`, `level`) with cores of at most `tile` voxels of its level (even).

    Cores are balanced: as many per axis as `tile` needs, all of one even size but the
    last (cores ≤ 192 on a 512 grid are 172, 172 and 168 rather than 192, 192 and 128:
    as many windows, smaller ones). A stage whose windows would span its whole grid
    anyway runs as one window.
    """
    size = config.data.resolution >> level
    context = stage_context(config, kind)
    per_axis = math.ceil(size / tile)
    core = 2 * math.ceil(size / per_axis / 2)
    if core + 2 * context >= size:
        core = size
    return Stage(kind, level, size, core, context)


def plan_stages(config: Config, tile: int) -> list[Stage]:
    """Every stage, with cores of `tile` voxels a side at every level."""
    return [
        make_stage(config, kind, level, tile) for kind, level in stage_order(config.model.depth)
    ]


def stage_step(stage: Stage, devices: int) -> int:
    """Windows per step under JAX: one per device, fewer if the stage has fewer windows."""
    return min(devices, math.ceil(stage.size / stage.core) ** 3)


# --------------------------------------------------------------------------- memory


def _width(config: Config, level: int) -> int:
    return config.model.base_filters * 2**level


def window_bytes(config: Config, level: int, extent: int) -> float:
    """Estimated peak activation bytes of one stage window of `extent`³ voxels at `level`.

    The stage's level dominates (an up stage's input from below has 1/8 of the voxels):
    a fixed share per voxel plus the live buffers of the level's width. Conservative for
    wide models: whole-network windows of the lits512 model (base 32) measured about
    440 B per voxel, where the level-0 term alone is 896.
    """
    per_voxel = _FIXED_BYTES_PER_VOXEL + _LIVE_BUFFERS_PER_CHANNEL * 4 * _width(config, level)
    return extent**3 * per_voxel


def whole_volume_bytes(config: Config) -> float:
    """Estimated peak activation bytes of a whole-volume pass: every level's buffers at once."""
    resolution = config.data.resolution
    return resolution**3 * _FIXED_BYTES_PER_VOXEL + sum(
        _LIVE_BUFFERS_PER_CHANNEL * 4 * _width(config, level) * (resolution >> level) ** 3
        for level in range(config.model.depth)
    )


def resident_bytes(config: Config, kind: str, level: int, itemsize: int) -> int:
    """Bytes of the materialised arrays alive while stage (`kind`, `level`) runs.

    The image (float32, the caller's), the pooled inputs a_1 … a_m still needed, the
    stage's input from below and its output (float32 logits for the last stage);
    `itemsize`: bytes per value of the intermediates.
    """
    resolution = config.data.resolution

    def pooled(m: int) -> int:  # a_m = max_pool of level m−1's encoder output
        return (resolution >> m) ** 3 * _width(config, m - 1) * itemsize

    def decoded(m: int) -> int:  # d_m
        return (resolution >> m) ** 3 * _width(config, m) * itemsize

    logits = resolution**3 * unet.NUM_CLASSES * 4
    total = resolution**3 * 4
    if kind == DOWN:
        return total + sum(pooled(m) for m in range(1, level + 2))
    total += sum(pooled(m) for m in range(1, level + 1))
    if kind == UP:
        total += decoded(level + 1)
    return total + (logits if level == 0 else decoded(level))


def choose_stages(config: Config, windows_per_step: int, memory: int, itemsize: int) -> list[Stage]:
    """The automatic plan for `memory` bytes: [] (whole volume) if it fits, else stages.

    The whole volume when its activations and the grid (float32 image and logits) fit in
    a share of `memory`. Otherwise each stage gets the largest core whose windows,
    `windows_per_step` at a time, fit in that share of what the materialised arrays
    alive during the stage leave (`resident_bytes`; on an accelerator they live in host
    RAM, so counting them against its memory is conservative).
    """
    resolution = config.data.resolution
    if whole_volume_bytes(config) + resolution**3 * 16 <= _MEMORY_SHARE * memory:
        return []
    stages = []
    for kind, level in stage_order(config.model.depth):
        room = _MEMORY_SHARE * memory - resident_bytes(config, kind, level, itemsize)
        size = resolution >> level
        chosen = make_stage(config, kind, level, min(_MIN_AUTO_CORE, size))
        for core in [size, *range(2 * ((size - 1) // 2), 0, -2)]:  # the grid, then even cores
            stage = make_stage(config, kind, level, core)
            step = stage_step(stage, windows_per_step)
            if step * window_bytes(config, level, stage.extent) <= room:
                chosen = stage
                break
        stages.append(chosen)
    return stages


# --------------------------------------------------------------------------- the stages


def stage_forward(
    net: unet.UNet, kind: str, level: int, inputs: Sequence[jax.Array], comm: Comm
) -> jax.Array:
    """Stage (`kind`, `level`) of the inference-mode network on windows [b, x, y, z, C].

    `inputs`: the level's activations a_level (the image at level 0) and, for an up
    stage, d_{level+1}. The stage that returns level 0's decoder output ends with the head.
    """
    x = net.prepare(inputs[0], comm) if level == 0 else inputs[0]
    h = net.encode(level, x, comm, train=False)
    if kind == DOWN:
        return unet.max_pool(h)
    if kind == UP:
        h = net.decode(level, h, inputs[1], comm, train=False)
    return net.classify(h) if level == 0 else h


def _halve(slices: tuple[slice, ...]) -> tuple[slice, ...]:
    """The same (even-aligned) region one level down."""
    return tuple(slice(s.start // 2, s.stop // 2) for s in slices)


def _run_stage(
    stage: Stage,
    forward: Forward,
    step: int,
    inputs: list[np.ndarray],
    tick: Callable[[int], None],
) -> np.ndarray:
    """A stage's output on its whole grid, stitched from the cores of its windows."""
    out = None
    for group in _batches(stage.windows(), step):
        # The last step is topped up by repeating a window: one shape, one compilation.
        padded = group + [group[-1]] * (step - len(group))
        batch = [np.stack([inputs[0][w.window] for w in padded])]
        if stage.kind == UP:
            batch.append(np.stack([inputs[1][_halve(w.window)] for w in padded]))
        result = forward(*batch)
        if out is None:
            out = np.empty((stage.out_size,) * 3 + result.shape[-1:], result.dtype)
        for w, y in zip(group, result):
            if stage.kind == DOWN:
                out[_halve(w.core)] = y[_halve(w.core_in_window)]
            else:
                out[w.core] = y[w.core_in_window]
        tick(len(group))
    assert out is not None
    return out


# --------------------------------------------------------------------------- backends


def _place(model: Model, mesh: Mesh) -> tuple[nnx.State, nnx.State]:
    """The model's parameters and statistics, replicated on `mesh`."""
    replicated = NamedSharding(mesh, REPLICATED)
    return jax.device_put(model.params, replicated), jax.device_put(model.stats, replicated)


def _jax_whole_forward(model: Model, devices: Sequence[Any]) -> tuple[Forward, Config, int]:
    """The whole network jitted over `devices`, the grid partitioned over them when several.

    Compiled at once, so that the program's own memory need (XLA's memory
    analysis, per device) can be checked before anything runs. Returns the
    forward, the layout it runs with and those bytes.
    """
    config = dev.fit_layout(model.config, len(devices))
    mesh = make_mesh(config.mesh.spatial, 1, devices)
    params, stats = _place(model, mesh)
    resolution = config.data.resolution
    image = jax.ShapeDtypeStruct(
        (1, resolution, resolution, resolution, 1), jnp.float32, sharding=activation_sharding(mesh)
    )
    compiled = jax.jit(make_predict(model.graphdef, config, mesh)).lower(params, stats, image)
    compiled = compiled.compile()
    memory = compiled.memory_analysis()
    needed = memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes

    def forward(batch: np.ndarray) -> np.ndarray:
        # A writable copy: callers turn the logits into probabilities in place.
        return np.array(compiled(params, stats, shard_global(mesh, batch)))

    return forward, config, needed


def _jax_stage_forwards(model: Model, stages: list[Stage], devices: Sequence[Any]) -> list[Forward]:
    """Each stage jitted over a mesh of `stage_step` devices (windows along ``data``)."""
    placed: dict[int, tuple[Mesh, nnx.State, nnx.State]] = {}  # per mesh size, shared
    forwards = []
    for stage in stages:
        step = stage_step(stage, len(devices))
        if step not in placed:
            mesh = make_mesh((1, 1, 1), step, devices)
            placed[step] = (mesh, *_place(model, mesh))
        forwards.append(_jax_stage_forward(model.graphdef, stage, *placed[step]))
    return forwards


def _jax_stage_forward(
    graphdef: nnx.GraphDef, stage: Stage, mesh: Mesh, params: nnx.State, stats: nnx.State
) -> Forward:
    """`stage_forward` jitted over `mesh`, with `params` and `stats` already placed there."""

    def body(comm: Comm, params: nnx.State, stats: nnx.State, *inputs: jax.Array) -> jax.Array:
        # The mesh splits no spatial axis, so `comm` pads with zeros, as LOCAL does.
        net = nnx.merge(graphdef, params, stats, copy=True)
        return stage_forward(net, stage.kind, stage.level, inputs, comm)

    count = 2 if stage.kind == UP else 1
    run = jax.jit(
        partitioned(
            body,
            mesh,
            "halo",
            in_specs=(REPLICATED, REPLICATED, *[ACTIVATION_SPEC] * count),
            out_specs=ACTIVATION_SPEC,
        )
    )

    def forward(*batch: np.ndarray) -> np.ndarray:
        return np.asarray(run(params, stats, *(shard_global(mesh, b) for b in batch)))

    return forward


def _onnx_session(proto: Any) -> Any:
    """An ONNX Runtime session of `proto` on all the host's cores."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count() or 1
    # All graph optimisations, including the blocked-channel (NCHWc) convolution layout.
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # No arena: a session's arena keeps its peak for the session's lifetime, and the
    # stages' sessions live together, so their arenas would add up (24 GB at 512³).
    options.enable_cpu_mem_arena = False
    return ort.InferenceSession(
        proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _onnx_forwards(model: Model, stages: list[Stage]) -> list[Forward]:
    """The exported network ([] stages: whole; else one graph per stage) in ONNX Runtime."""
    try:
        import onnxruntime  # noqa: F401

        from ctseg import onnx_export
    except ImportError:
        raise CtsegError(
            "the onnx backend needs the onnx and onnxruntime packages: pip install 'ctseg[onnx]'"
        ) from None
    weights = (model.graphdef, model.params, model.stats)
    if not stages:
        session = _onnx_session(onnx_export.export(*weights))
        return [lambda batch: session.run([onnx_export.OUTPUT], {onnx_export.INPUT: batch})[0]]

    def make(stage: Stage) -> Forward:
        session = _onnx_session(onnx_export.export_stage(*weights, stage.kind, stage.level))
        names = (onnx_export.STAGE_INPUT, onnx_export.STAGE_BELOW)

        def forward(*batch: np.ndarray) -> np.ndarray:
            return session.run([onnx_export.STAGE_OUTPUT], dict(zip(names, batch)))[0]

        return forward

    return [make(stage) for stage in stages]


# --------------------------------------------------------------------------- the engine


class Engine:
    """Logits of whole R³ grids: one pass over the devices, or exact level-wise tiles."""

    def __init__(
        self,
        model: Model,
        tile: int = -1,
        backend: str = "jax",
        devices: Sequence[Any] | None = None,
    ):
        """`tile`: core side (even) at every level, 0 whole volume, −1 automatic.

        `backend`: "jax" or "onnx" (ONNX Runtime on the host's CPU cores).
        `devices` (JAX): where the network runs, by default this process's first
        device (`ctseg.devices` chooses them for commands). A whole-volume pass
        is partitioned over them; tiles run one window per device at a time.
        """
        if backend not in BACKENDS:
            raise CtsegError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        config = model.config
        self.resolution = config.data.resolution
        self.backend = backend
        self.devices = list(devices or jax.local_devices()[:1]) if backend == "jax" else []
        # ONNX Runtime runs one window at a time on all host cores.
        per_step = len(self.devices) if backend == "jax" else 1
        self.windows_per_step = per_step
        # Materialised activations: the compute dtype under JAX, float32 in ONNX Runtime.
        dtype = jnp.dtype(config.model.dtype) if backend == "jax" else np.dtype(np.float32)
        self.dtype = dtype.name
        self.memory = dev.free_memory(self.devices) if backend == "jax" else dev.host_memory()
        if tile < 0:
            self.stages = choose_stages(config, per_step, self.memory, dtype.itemsize)
            tile = max((s.core for s in self.stages), default=0)
        elif tile % 2:
            raise CtsegError(
                f"--tile {tile} must be even: level-wise tiles are pooled in pairs of voxels"
            )
        else:
            # A core as large as the grid is one window: the whole-volume pass does it better.
            self.stages = plan_stages(config, tile) if 0 < tile < self.resolution else []
        self.tile = tile if self.stages else 0
        self.spatial = (1, 1, 1)  # the whole-volume pass's split over the devices
        self._forwards: list[tuple[Forward, int]] = []  # (forward, windows per step) per stage
        if backend == "onnx":
            forwards = _onnx_forwards(model, self.stages)
            self._forwards = [(forward, 1) for forward in forwards]
        elif not self.stages:
            forward, layout, needed = _jax_whole_forward(model, self.devices)
            if needed > self.memory:
                raise CtsegError(
                    f"a whole-volume pass of the {self.resolution}³ grid needs "
                    f"{dev.gib(needed)} per device, more than the {dev.gib(self.memory)} free "
                    f"on {dev.describe(self.devices)}; use tiles (--tile -1 chooses them, or "
                    "e.g. --tile 128)"
                )
            self.spatial = layout.mesh.spatial
            self._forwards = [(forward, 1)]
        else:
            # A stage with fewer windows than devices runs on a smaller mesh rather than
            # repeating windows.
            forwards = _jax_stage_forwards(model, self.stages, self.devices)
            steps = [stage_step(stage, per_step) for stage in self.stages]
            self._forwards = list(zip(forwards, steps))

    @property
    def description(self) -> str:
        if not self.stages:
            split = "" if self.spatial == (1, 1, 1) else f" split {list(self.spatial)}"
            return f"whole volume {self.resolution}³{split}"
        windows = sum(len(stage.windows()) for stage in self.stages)
        at_once = f", {self.windows_per_step} at a time" if self.windows_per_step > 1 else ""
        return (
            f"level-wise tiles ≤ {self.tile}³ "
            f"({len(self.stages)} stages, {windows} windows{at_once})"
        )

    def logits(self, image: np.ndarray, progress: TileProgress | None = None) -> np.ndarray:
        """Logits [R, R, R, 3] float32 of a unit-scaled image [R, R, R] (`hu_to_unit`)."""
        if image.shape != (self.resolution,) * 3:
            raise ValueError(f"image shape {image.shape} is not the run's grid {self.resolution}³")
        if not self.stages:
            forward, _ = self._forwards[0]
            out = forward(image[None, ..., None].astype(np.float32))[0]
            if progress is not None:
                progress(1, 1)
            return out
        total = sum(len(stage.windows()) for stage in self.stages)
        done = 0

        def tick(count: int) -> None:
            nonlocal done
            done += count
            if progress is not None:
                progress(done, total)

        # a_0 … a_l: the inputs of the levels whose up stage has not run yet.
        levels = [np.asarray(image, np.float32)[..., None]]
        below = None  # d_{l+1}, the output of the stage that ran last
        for stage, (forward, step) in zip(self.stages, self._forwards):
            if stage.kind == DOWN:
                levels.append(_run_stage(stage, forward, step, [levels[-1]], tick))
            elif stage.kind == BOTTOM:
                below = _run_stage(stage, forward, step, [levels.pop()], tick)
            else:  # the list of inputs dies with the call: a_l and d_{l+1} are freed
                below = _run_stage(stage, forward, step, [levels.pop(), below], tick)
        assert below is not None and below.dtype == np.float32
        return below


# nnU-Net's test-time augmentation: every subset of the three axes, the identity first.
MIRRORINGS = tuple(axes for n in range(4) for axes in itertools.combinations((0, 1, 2), n))


def probabilities(
    engine: Engine, image: np.ndarray, mirrored: bool, progress: TileProgress | None = None
) -> np.ndarray:
    """Class probabilities [R, R, R, 3] float32 of a unit-scaled image [R, R, R].

    `mirrored`: the mean of the probabilities of the 8 mirrorings of the image,
    each flipped back. Every pass is the engine's own (tiled passes equal the
    whole pass), so the mean is exact too.
    """
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
