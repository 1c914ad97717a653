"""The inference engine: whole-volume partitioned inference and exact level-wise tiles.

Whole volume (`tile == 0`): one pass over the engine's devices, the grid split
over them when they are several (`devices.fit_layout`: halo exchange, exactly as
in training), whatever mesh trained the model.

Level-wise tiles (`tile > 0`, the geometry in `ctseg.tiling`): the network is cut
into 2·depth − 1 stages whose outputs are materialised whole; each stage runs
window by window with only its own margin. Under JAX everything stays on the
devices: each stage is one program that takes its whole input level(s), cuts its
windows, runs them and stitches their cores into its whole output level, a loop
over the windows inside the program (`_stage_program`). With several devices the
windows are dealt out over them, each device stitches the cores it computed into
its own copy of the level, and a sum over the devices (the cores are disjoint)
gives every device the whole level for the next stage. The levels kept for the up
stages stay on the devices while they fit, and are moved to the host whole (never
per window) when they do not.

Planning (`tile < 0`): the hand formula of `ctseg.tiling` proposes candidates (the
whole volume, then tiles); the candidates' programs are compiled, all of a plan at
once (XLA compiles them in parallel threads), and the compiler's own memory
analysis of each, with the levels alive beside it, decides against the devices'
free memory. The plan is compiled before the first scan, so every scan after it
only runs.

Softmax, the mean of the mirrored passes (TTA), the resampling back to the scan's
own voxels and the argmax run on the devices too (`probabilities`, `scan_labels`):
what comes back to the host is the uint8 label map, and probabilities only where
a caller asks for them.

Backends: ``jax`` runs the jitted programs on the engine's devices; ``onnx`` runs the
same inference-mode network (whole, or one ONNX graph per stage), exported by
`ctseg.onnx_export`, in ONNX Runtime on the host's CPU cores (several times faster
than XLA:CPU there), one window at a time on host arrays (host memory is its device).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from ctseg import devices as dev
from ctseg import plan, preprocess, tiling, unet
from ctseg.checkpoints import load_for_inference
from ctseg.config import Config
from ctseg.errors import CtsegError
from ctseg.partition import (
    REPLICATED,
    Comm,
    activation_sharding,
    make_mesh,
    partitioned,
)
from ctseg.step import make_predict
from ctseg.tiling import Stage
from ctseg.unet import BOTTOM, DOWN, NUM_CLASSES, UP

TileProgress = Callable[[int, int], None]  # (windows done, windows in total)
BACKENDS = ("jax", "onnx")
# Share of the devices' free memory a plan's compiled programs, with the levels alive
# beside them, may take. The compiler's figures are the programs' own, so the share
# only keeps room for the runtime's workspace and for fragmentation.
COMPILED_SHARE = 0.85
_SOFTMAX_SLAB = 32
# nnU-Net's test-time augmentation: every subset of the three axes, the identity first.
MIRRORINGS = tuple(axes for n in range(4) for axes in itertools.combinations((0, 1, 2), n))


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


def is_out_of_memory(exc: BaseException) -> bool:
    """An accelerator's allocation failure, as XLA reports it."""
    return isinstance(exc, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(exc)


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


def _level_shape(config: Config, kind: str, level: int) -> tuple[tuple[int, ...], Any]:
    """Shape [1, s, s, s, C] and dtype of the output level of stage (`kind`, `level`)."""
    size = config.data.resolution >> (level + (kind == DOWN))
    if kind != DOWN and level == 0:
        return (1, size, size, size, NUM_CLASSES), jnp.float32
    width = unet.level_widths(config.model)[level]
    return (1, size, size, size, width), jnp.dtype(config.model.dtype)


def _bytes(shape: tuple[int, ...], dtype: Any) -> int:
    return int(np.prod(shape)) * jnp.dtype(dtype).itemsize


def _image_shape(config: Config) -> tuple[int, ...]:
    return (1, *(config.data.resolution,) * 3, 1)


def _stage_program(
    graphdef: nnx.GraphDef, stage: Stage, config: Config, mesh: Mesh, params: Any, stats: Any
) -> jax.stages.Compiled:
    """Stage `stage` over all its windows, on the devices of `mesh`'s ``data`` axis.

    Arguments: params, stats, the window table (`tiling.stitch_table`, dealt out over
    the devices: [devices, steps, 4, 3]) and the whole input level(s), replicated.
    Result: the whole output level, replicated.
    """
    devices = mesh.shape["data"]
    extent = stage.extent
    block = stage.core // stage.scale
    out_shape, out_dtype = _level_shape(config, stage.kind, stage.level)
    channels = 1 if stage.level == 0 else unet.level_widths(config.model)[stage.level - 1]

    def body(comm: Comm, params: Any, stats: Any, table: jax.Array, *levels: jax.Array):
        # The mesh splits no spatial axis, so `comm` pads with zeros, as LOCAL does.
        net = nnx.merge(graphdef, params, stats, copy=True)
        offsets = jax.lax.broadcasted_iota(jnp.int32, (block,), 0)

        def one(step: jax.Array, out: jax.Array) -> jax.Array:
            start, kept, first, stop = (table[0, step, i] for i in range(4))
            window = [
                jax.lax.dynamic_slice(levels[0], (0, *start, 0), (1, *(extent,) * 3, channels))
            ]
            if stage.kind == UP:
                below = levels[1]
                half = (1, *(extent // 2,) * 3, below.shape[-1])
                window.append(jax.lax.dynamic_slice(below, (0, *(start // 2), 0), half))
            y = stage_forward(net, stage.kind, stage.level, window, comm)
            into = (0, *kept, 0)
            size = (1, *(block,) * 3, out_shape[-1])
            result = jax.lax.dynamic_slice(y, (0, *(kept - start // stage.scale), 0), size)
            # Only the core's voxels: a shortened last core's block overlaps its neighbour's,
            # and on several devices the sum over them must see each voxel once.
            owned = [
                (kept[a] + offsets >= first[a]) & (kept[a] + offsets < stop[a]) for a in range(3)
            ]
            mask = owned[0][:, None, None] & owned[1][None, :, None] & owned[2][None, None, :]
            current = jax.lax.dynamic_slice(out, into, size)
            return jax.lax.dynamic_update_slice(
                out, jnp.where(mask[None, ..., None], result.astype(out_dtype), current), into
            )

        # Each device's copy of the level differs (its own cores): a device-varying carry.
        out = jax.lax.pcast(jnp.zeros(out_shape, out_dtype), ("data",), to="varying")
        out = jax.lax.fori_loop(0, table.shape[1], one, out)
        return jax.lax.psum(out, "data")

    count = 2 if stage.kind == UP else 1
    program = partitioned(
        body,
        mesh,
        "halo",
        in_specs=(
            REPLICATED,
            REPLICATED,
            jax.sharding.PartitionSpec("data"),
            *[REPLICATED] * count,
        ),
        out_specs=REPLICATED,
    )
    replicated = NamedSharding(mesh, REPLICATED)
    inputs = [jax.ShapeDtypeStruct(_image_shape(config), jnp.float32, sharding=replicated)]
    if stage.level > 0:
        width = unet.level_widths(config.model)[stage.level - 1]
        inputs = [
            jax.ShapeDtypeStruct(
                (1, *(stage.size,) * 3, width), jnp.dtype(config.model.dtype), sharding=replicated
            )
        ]
    if stage.kind == UP:
        below_shape, below_dtype = _level_shape(
            config, BOTTOM if stage.level + 1 == config.model.depth - 1 else UP, stage.level + 1
        )
        inputs.append(jax.ShapeDtypeStruct(below_shape, below_dtype, sharding=replicated))
    steps = -(-len(stage.windows()) // devices)
    table = jax.ShapeDtypeStruct(
        (devices, steps, 4, 3),
        jnp.int32,
        sharding=NamedSharding(mesh, jax.sharding.PartitionSpec("data")),
    )
    return jax.jit(program).lower(params, stats, table, *inputs).compile()


def _dealt_table(stage: Stage, devices: int) -> np.ndarray:
    """`tiling.stitch_table` dealt out round-robin over `devices`: [devices, steps, 4, 3].

    A device with fewer windows than the others repeats the first window owning
    nothing (core start = stop), which writes no voxel.
    """
    table = tiling.stitch_table(stage)
    steps = -(-len(table) // devices)
    idle = table[0].copy()
    idle[2:] = 0
    padded = np.concatenate([table, np.repeat(idle[None], steps * devices - len(table), 0)])
    return np.ascontiguousarray(padded.reshape(steps, devices, 4, 3).transpose(1, 0, 2, 3))


# --------------------------------------------------------------------------- JAX plans


@dataclass
class _Plan:
    """Compiled programs ready to run: the whole pass (no stages) or one per stage."""

    stages: list[Stage]
    programs: list[jax.stages.Compiled]
    mesh: Mesh
    spatial: tuple[int, int, int]  # the whole pass's split over the devices
    needed: int  # peak bytes per device: the largest program with the levels beside it
    spill: bool = False  # keep waiting levels on the host


def _compile_whole(model: Model, devices: Sequence[Any]) -> _Plan:
    config = dev.fit_layout(model.config, len(devices))
    mesh = make_mesh(config.mesh.spatial, 1, devices)
    image = jax.ShapeDtypeStruct(
        _image_shape(config), jnp.float32, sharding=activation_sharding(mesh)
    )
    weights = _abstract((model.params, model.stats), mesh)
    compiled = jax.jit(make_predict(model.graphdef, config, mesh)).lower(*weights, image).compile()
    needed = plan.memory_of(compiled).total + _post_bytes(config)
    return _Plan([], [compiled], mesh, config.mesh.spatial, needed)


def _post_bytes(config: Config) -> int:
    """Device bytes after the network: the probabilities and a TTA sum of them (float32)."""
    return 2 * config.data.resolution**3 * NUM_CLASSES * 4


def _compile_stages(model: Model, stages: list[Stage], mesh: Mesh) -> list[jax.stages.Compiled]:
    """Every stage's program, compiled concurrently (XLA compiles in threads of its own)."""
    params, stats = _abstract((model.params, model.stats), mesh)
    compile_one = partial(
        _stage_program, model.graphdef, config=model.config, mesh=mesh, params=params, stats=stats
    )
    with ThreadPoolExecutor(max(1, len(stages))) as pool:
        return list(pool.map(lambda stage: compile_one(stage=stage), stages))


def _stage_needs(config: Config, stages: list[Stage], programs: list, spill: bool) -> list[int]:
    """Peak bytes per device during each stage: its program (its input and output levels
    included) plus the other levels alive then (none on the device when `spill`)."""
    waiting: list[int] = []  # bytes of the levels kept for the up stages, a_0 … a_l
    image = _bytes(_image_shape(config), jnp.float32)
    needs = []
    for stage, program in zip(stages, programs, strict=True):
        if stage.kind == UP:
            waiting.pop()  # the level this stage reads is its argument now
        others = 0 if spill else sum(waiting)
        needs.append(plan.memory_of(program).total + others + _post_bytes(config))
        if stage.kind == DOWN:
            waiting.append(
                image if stage.level == 0 else _bytes(*_level_shape(config, DOWN, stage.level - 1))
            )
    return needs


def _plan_tiles(model: Model, stages: list[Stage], mesh: Mesh, budget: float | None) -> _Plan:
    """Compile `stages`; with a `budget`, shrink the cores of stages that do not fit it."""
    config = model.config
    programs = _compile_stages(model, stages, mesh)
    needs = _stage_needs(config, stages, programs, spill=False)
    spill = False
    while budget is not None and max(needs) > budget:
        over = [
            i
            for i, (stage, need) in enumerate(zip(stages, needs, strict=True))
            if need > budget and stage.core > 2
        ]
        if not over:
            if not spill:  # the cores are as small as they go: the waiting levels leave
                spill = True
                needs = _stage_needs(config, stages, programs, spill=True)
                continue
            break
        for i in over:
            stage = stages[i]
            smaller = max(2, (min(stage.core, stage.size) // 2) & ~1)
            stages[i] = tiling.make_stage(config, stage.kind, stage.level, smaller)
        recompiled = _compile_stages(model, [stages[i] for i in over], mesh)
        for i, program in zip(over, recompiled, strict=True):
            programs[i] = program
        needs = _stage_needs(config, stages, programs, spill)
    return _Plan(stages, programs, mesh, (1, 1, 1), max(needs), spill)


def _place(trees: Any, mesh: Mesh) -> Any:
    return jax.device_put(trees, NamedSharding(mesh, REPLICATED))


def _abstract(trees: Any, mesh: Mesh) -> Any:
    """Shapes of `trees` replicated on `mesh`: what a program is compiled for, with no
    transfer (the engine places the weights once, for the plan it chose)."""
    sharding = NamedSharding(mesh, REPLICATED)
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=sharding), trees
    )


# --------------------------------------------------------------------------- ONNX Runtime


def _halve(slices: tuple[slice, ...]) -> tuple[slice, ...]:
    """The same (even-aligned) region one level down."""
    return tuple(slice(s.start // 2, s.stop // 2) for s in slices)


def _run_stage_on_host(
    stage: Stage, forward: Callable[..., np.ndarray], inputs: list[np.ndarray]
) -> np.ndarray:
    """A stage's output on its whole grid, stitched on the host from its windows' cores."""
    out = None
    for w in stage.windows():
        batch = [inputs[0][w.window][None]]
        if stage.kind == UP:
            batch.append(inputs[1][_halve(w.window)][None])
        result = forward(*batch)[0]
        if out is None:
            out = np.empty((stage.out_size,) * 3 + result.shape[-1:], result.dtype)
        if stage.kind == DOWN:
            out[_halve(w.core)] = result[_halve(w.core_in_window)]
        else:
            out[w.core] = result[w.core_in_window]
    assert out is not None
    return out


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


def _onnx_forwards(model: Model, stages: list[Stage]) -> list[Callable[..., np.ndarray]]:
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

    def make(stage: Stage) -> Callable[..., np.ndarray]:
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
        memory: int | None = None,
    ):
        """`tile`: core side (even) at every level, 0 whole volume, −1 automatic.

        `backend`: "jax" or "onnx" (ONNX Runtime on the host's CPU cores).
        `devices` (JAX): where the network runs, by default this process's first
        device (`ctseg.devices` chooses them for commands). A whole-volume pass
        is partitioned over them; a stage's windows are dealt out over them.
        `memory`: bytes per device to plan for; default, the devices' free memory
        (the host's available memory under ONNX Runtime).
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
        self.resolution = config.data.resolution
        self.backend = backend
        self.devices = list(devices or jax.local_devices()[:1]) if backend == "jax" else []
        # Materialised activations: the compute dtype under JAX, float32 in ONNX Runtime.
        dtype = jnp.dtype(config.model.dtype) if backend == "jax" else np.dtype(np.float32)
        self.dtype = dtype.name
        if memory is None:
            memory = dev.free_memory(self.devices) if backend == "jax" else dev.host_memory()
        self.memory = memory
        # A core as large as the grid is one window: the whole-volume pass does it better.
        fixed = plan_stages_for(config, tile) if tile >= 0 else None
        if backend == "onnx":
            if fixed is None:
                fixed = (
                    []
                    if tiling.fits_whole(config, memory, dtype.itemsize)
                    else tiling.choose_stages(config, memory, dtype.itemsize)
                )
            self.stages = fixed
            self._plan = None
            self._forwards = _onnx_forwards(model, fixed)
            self.needed = 0
            self.spatial = (1, 1, 1)
        else:
            self._plan = self._plan_jax(fixed, memory, dtype.itemsize)
            self.stages = self._plan.stages
            self.needed = self._plan.needed
            self.spatial = self._plan.spatial
            self._params, self._stats = _place((model.params, model.stats), self._plan.mesh)
            if self._plan.stages:
                self._tables = [
                    jax.device_put(
                        _dealt_table(stage, self._plan.mesh.shape["data"]),
                        NamedSharding(self._plan.mesh, jax.sharding.PartitionSpec("data")),
                    )
                    for stage in self._plan.stages
                ]
                self._input_sharding = NamedSharding(self._plan.mesh, REPLICATED)
            else:
                self._input_sharding = activation_sharding(self._plan.mesh)
        self.tile = (tile if tile >= 0 else max(s.core for s in self.stages)) if self.stages else 0

    def _plan_jax(self, fixed: list[Stage] | None, memory: int, itemsize: int) -> _Plan:
        """Compile the plan: `fixed` stages as asked, else from the compiler's memory figures."""
        model, devices = self.model, self.devices
        budget = COMPILED_SHARE * memory
        tiles_mesh = make_mesh((1, 1, 1), len(devices), devices)
        if fixed is not None:
            if fixed:
                chosen = _plan_tiles(model, fixed, tiles_mesh, budget=None)
                what, advice = f"tiles ≤ {max(s.core for s in fixed)}³", "use smaller tiles"
            else:
                chosen = _compile_whole(model, devices)
                what, advice = "a whole-volume pass", "use tiles"
            if chosen.needed > memory:
                raise CtsegError(
                    f"{what} of the {self.resolution}³ grid needs "
                    f"{dev.human_bytes(chosen.needed)} per device, more than the "
                    f"{dev.human_bytes(memory)} free on {dev.describe(devices)}; "
                    f"{advice} (--tile -1 chooses them, or e.g. --tile 64)"
                )
            return chosen
        config = model.config
        # The hand formula overestimates wide models severalfold (lits512: 85 GB planned
        # in bfloat16, 48 GiB compiled), so the whole volume is compiled to be measured
        # whenever the formula is within that factor of fitting.
        if tiling.whole_volume_bytes(config, itemsize) <= 3 * budget:
            whole = _compile_whole(model, devices)
            if whole.needed <= budget:
                return whole
        first_guess = tiling.choose_stages(config, memory, itemsize)
        return _plan_tiles(model, first_guess, tiles_mesh, budget)

    @property
    def spills(self) -> bool:
        """Whether the levels waiting for their up stage are kept on the host."""
        return self._plan is not None and self._plan.spill

    @property
    def description(self) -> str:
        if not self.stages:
            split = "" if self.spatial == (1, 1, 1) else f" split {list(self.spatial)}"
            return f"whole volume {self.resolution}³{split}"
        windows = sum(len(stage.windows()) for stage in self.stages)
        at_once = f", {len(self.devices)} at a time" if len(self.devices) > 1 else ""
        return (
            f"level-wise tiles ≤ {self.tile}³ "
            f"({len(self.stages)} stages, {windows} windows{at_once})"
        )

    def place(self, image: np.ndarray | jax.Array) -> np.ndarray | jax.Array:
        """A unit-scaled image [R, R, R] as the engine takes it: [1, R, R, R, 1] float32, on
        the devices under JAX (one transfer), on the host under ONNX Runtime."""
        if image.shape != (self.resolution,) * 3:
            raise ValueError(f"image shape {image.shape} is not the run's grid {self.resolution}³")
        if self.backend == "onnx":
            return np.asarray(image, np.float32)[None, ..., None]
        return jax.device_put(_as_batch(image), self._input_sharding)

    def logits(
        self, image: np.ndarray | jax.Array, progress: TileProgress | None = None
    ) -> np.ndarray | jax.Array:
        """Logits [R, R, R, 3] float32 of a unit-scaled image [R, R, R] (`hu_to_unit`), or of
        an image already `place`d; a device array under JAX."""
        if image.ndim == 3:
            image = self.place(image)
        if self.backend == "onnx":
            return self._host_logits(image, progress)
        return _only_item(self._device_logits(image, progress))

    def _device_logits(self, image: jax.Array, progress: TileProgress | None) -> jax.Array:
        assert self._plan is not None
        image = jax.device_put(image, self._input_sharding)  # a flipped copy may lie otherwise
        if not self.stages:
            out = self._plan.programs[0](self._params, self._stats, image)
            if progress is not None:
                out.block_until_ready()
                progress(1, 1)
            return out
        total = sum(len(stage.windows()) for stage in self.stages)
        done = 0
        levels: list[Any] = [image]  # a_0 … a_l: inputs of the levels whose up stage is to come
        below = None  # d_{l+1}, the output of the stage that ran last
        run = zip(self.stages, self._plan.programs, self._tables, strict=True)
        for stage, program, table in run:
            args = (self._params, self._stats, table)
            if stage.kind == DOWN:
                pooled = program(*args, levels[-1])
                if self._plan.spill:  # the level waits for its up stage on the host, whole
                    levels[-1] = jax.device_get(levels[-1])
                levels.append(pooled)
            else:
                level = jax.device_put(levels.pop(), self._input_sharding)
                below = (
                    program(*args, level) if stage.kind == BOTTOM else program(*args, level, below)
                )
            if progress is not None:
                jax.block_until_ready(below if stage.kind != DOWN else levels[-1])
                done += len(stage.windows())
                progress(done, total)
        assert below is not None and below.dtype == jnp.float32
        return below

    def _host_logits(self, image: np.ndarray, progress: TileProgress | None) -> np.ndarray:
        if not self.stages:
            out = self._forwards[0](image)[0]
            if progress is not None:
                progress(1, 1)
            return out
        total = sum(len(stage.windows()) for stage in self.stages)
        done = 0
        levels = [image[0]]
        below = None
        for stage, forward in zip(self.stages, self._forwards, strict=True):
            if stage.kind == DOWN:
                levels.append(_run_stage_on_host(stage, forward, [levels[-1]]))
            elif stage.kind == BOTTOM:
                below = _run_stage_on_host(stage, forward, [levels.pop()])
            else:  # the list of inputs dies with the call: a_l and d_{l+1} are freed
                below = _run_stage_on_host(stage, forward, [levels.pop(), below])
            done += len(stage.windows())
            if progress is not None:
                progress(done, total)
        assert below is not None and below.dtype == np.float32
        return below


def plan_stages_for(config: Config, tile: int) -> list[Stage]:
    """The stages of cores of `tile` voxels; [] (the whole volume) for 0 or a tile as large
    as the grid."""
    return tiling.plan_stages(config, tile) if 0 < tile < config.data.resolution else []


# --------------------------------------------------------------------------- probabilities


@jax.jit
def _as_batch(image: jax.Array) -> jax.Array:
    return jnp.asarray(image, jnp.float32)[None, ..., None]


@jax.jit
def _only_item(batch: jax.Array) -> jax.Array:
    # Jitted: an eager index of a sharded array would send the index from the host.
    return batch[0]


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
    """Class probabilities [R, R, R, 3] float32 of a unit-scaled image [R, R, R].

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


@partial(jax.jit, static_argnums=(1, 2))
def _on_scan(
    probabilities: jax.Array, shape: tuple[int, ...], with_probabilities: bool
) -> tuple[jax.Array, jax.Array | None]:
    """Probabilities [R, R, R, C] resampled linearly onto `shape`, and their argmax (uint8)."""
    x = probabilities
    # Shrinking axes first keeps the intermediates small (a 512³ grid onto 63 slices).
    for axis in sorted(range(3), key=lambda a: shape[a] / x.shape[a]):
        if shape[axis] == x.shape[axis]:
            continue
        first, second, weight = _linear_weights(x.shape[axis], shape[axis])
        weight = weight.reshape([-1 if a == axis else 1 for a in range(x.ndim)])
        x = jnp.take(x, first, axis=axis) * (1 - weight) + jnp.take(x, second, axis=axis) * weight
    labels = jnp.argmax(x, axis=-1).astype(jnp.uint8)
    return labels, (x if with_probabilities else None)


def scan_labels(
    probabilities: np.ndarray | jax.Array, shape: Sequence[int], with_probabilities: bool = False
) -> tuple[np.ndarray, np.ndarray | None]:
    """Labels (uint8) on the scan's canonical voxels from grid probabilities [R, R, R, 3]:
    linear on the probabilities, then the argmax (smoother borders than resampling
    labels). With `with_probabilities`, the resampled probabilities too."""
    shape = tuple(int(n) for n in shape)
    if isinstance(probabilities, np.ndarray):
        on_scan = preprocess.from_grid(probabilities, shape, order=1)
        return on_scan.argmax(-1).astype(np.uint8), on_scan if with_probabilities else None
    labels, on_scan = jax.device_get(_on_scan(probabilities, shape, with_probabilities))
    return labels, on_scan


def grid_labels(probabilities: np.ndarray | jax.Array) -> np.ndarray:
    """The argmax on the grid (uint8), where training's validation Dice is measured."""
    if isinstance(probabilities, np.ndarray):
        return probabilities.argmax(-1).astype(np.uint8)
    return jax.device_get(_grid_argmax(probabilities))


@jax.jit
def _grid_argmax(probabilities: jax.Array) -> jax.Array:
    return jnp.argmax(probabilities, axis=-1).astype(jnp.uint8)
