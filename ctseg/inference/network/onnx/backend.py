"""Inference in ONNX Runtime on the host's CPU cores (several times faster than XLA:CPU).

The same inference-mode network as under JAX, exported by `ctseg.inference.network.onnx.export`:
whole, or one ONNX graph per level-wise stage (the geometry in `ctseg.inference.network.tiling`),
run one window at a time on host arrays and stitched on the host (host memory is
this backend's device). The logits equal the JAX pass's to float32 rounding. From them
on, JAX on the host CPU's device (`OnnxBackend.adopt_logits`, no copy): the class
probabilities and the way back to the scan are the JAX backend's programs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ctseg.config import Config
from ctseg.data.grids import Shape
from ctseg.errors import CtsegError
from ctseg.inference.network import tile_memory, tiling
from ctseg.inference.network.backends import Backend
from ctseg.inference.network.boxes import Boxes
from ctseg.inference.network.tiling import Span, Stage
from ctseg.memory import aligned_zeros, host_memory, human_bytes
from ctseg.model.unet import BOTTOM, DOWN, UP
from ctseg.progress import TileProgress
from ctseg.run.trained import TrainedModel


def _halve(slices: tuple[slice, ...]) -> tuple[slice, ...]:
    """The same (even-aligned) region one level down."""
    return tuple(slice(s.start // 2, s.stop // 2) for s in slices)


def _run_stage_on_host(
    stage: Stage, forward: Callable[..., np.ndarray], inputs: list[np.ndarray], span: Span | None
) -> np.ndarray:
    """A stage's output on its whole grid, stitched on the host from its windows' cores:
    all of them, or those of its `span` (zeros elsewhere, pages never touched)."""
    out = None
    for w in stage.windows(span):
        batch = [inputs[0][w.window][None]]
        if stage.kind == UP:
            batch.append(inputs[1][_halve(w.window)][None])
        result = forward(*batch)[0]
        if out is None:
            out = aligned_zeros((*stage.out_size, result.shape[-1]), result.dtype)
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
    # stages' sessions live together, so their arenas would add up (measured:
    # docs/experiments/design-figures.md#onnx-runtime-sessions).
    options.enable_cpu_mem_arena = False
    return ort.InferenceSession(
        proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _onnx_forwards(model: TrainedModel, stages: list[Stage]) -> list[Callable[..., np.ndarray]]:
    """The exported network ([] stages: whole; else one graph per stage) in ONNX Runtime."""
    try:
        import onnxruntime  # noqa: F401

        from ctseg.inference.network.onnx import export as onnx_export
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
            # A down stage or the bottom takes one input: the second name goes unused.
            inputs = dict(zip(names, batch, strict=False))
            return session.run([onnx_export.STAGE_OUTPUT], inputs)[0]

        return forward

    return [make(stage) for stage in stages]


class OnnxPlan:
    """A model's stages (or whole network) as ONNX Runtime sessions on the host."""

    # Nothing measured, nothing split, nothing spilled: host memory is the one memory.
    needed, spatial, spills = 0, (1, 1, 1), False

    def __init__(self, model: TrainedModel, shape: Shape, stages: list[Stage] | None, memory: int):
        """For grids of `shape`. `stages`: the level-wise tiles to run ([] the whole
        volume), or None to choose them by the memory formula against `memory` bytes of
        host RAM."""
        config = model.config
        self.dtype = np.dtype(np.float32)  # a bfloat16 model runs in float32 here
        if stages is None:
            itemsize = self.dtype.itemsize
            stages = (
                []
                if tile_memory.fits_whole(config, memory, itemsize, shape)
                else tile_memory.choose_stages(config, memory, itemsize, shape)
            )
        self.stages = stages
        self._forwards = _onnx_forwards(model, stages)

    def memory_words(self, memory: int) -> str:
        return f" in ONNX Runtime, {human_bytes(memory)} of RAM free"

    def place(self, image: np.ndarray) -> np.ndarray:
        """A unit-scaled image [x, y, z] as the sessions take it: [1, x, y, z, 1] float32."""
        return np.asarray(image, np.float32)[None, ..., None]

    def logits(
        self, image: np.ndarray, progress: TileProgress | None, need: Span | None = None
    ) -> np.ndarray:
        """Logits [x, y, z, 3] float32 of a `place`d image: everywhere, or exact on the
        voxels `need` (tiles compute only their cone, `tiling.stage_spans`)."""
        if not self.stages:
            out = self._forwards[0](image)[0]
            if progress is not None:
                progress(1, 1)
            return out
        stages, spans = self.stages, [None] * len(self.stages)
        if need is not None:  # windows of any shape: cores balanced over each span
            spans = tiling.stage_spans(self.stages, need)
            stages = [stage.fitted(span) for stage, span in zip(stages, spans, strict=True)]
        total = sum(len(s.windows(span)) for s, span in zip(stages, spans, strict=True))
        done = 0
        levels = [image[0]]
        below = None
        run = zip(stages, self._forwards, spans, strict=True)
        for stage, forward, span in run:
            if stage.kind == DOWN:
                levels.append(_run_stage_on_host(stage, forward, [levels[-1]], span))
            elif stage.kind == BOTTOM:
                below = _run_stage_on_host(stage, forward, [levels.pop()], span)
            else:  # the list of inputs dies with the call: a_l and d_{l+1} are freed
                below = _run_stage_on_host(stage, forward, [levels.pop(), below], span)
            done += len(stage.windows(span))
            if progress is not None:
                progress(done, total)
        assert below is not None and below.dtype == np.float32
        return below


class OnnxBackend(Backend):
    """ONNX Runtime on the host's CPU cores: host arrays from the grid to the logits; from
    there JAX on the host CPU's device, as under the JAX backend."""

    name, runtime = "onnx", "ONNX Runtime"
    # Nothing compiles per box shape: the fewest voxels; the way back on the host CPU's
    # JAX device.
    boxes = Boxes(ladder=False)

    def __init__(self) -> None:
        self.devices: list[Any] = []  # the host's CPU cores, no JAX device

    def dtype(self, config: Config) -> np.dtype:
        return np.dtype(np.float32)  # a bfloat16 model runs in float32 here

    def free_memory(self) -> int:
        return host_memory()

    def memory_for(self, needed: int) -> int:
        # Nothing measured (`OnnxPlan.needed` is 0): the plan for the smallest tiles.
        return int(needed / tile_memory.MEMORY_SHARE)

    def plan(
        self, model: TrainedModel, shape: Shape, stages: list[Stage] | None, memory: int
    ) -> OnnxPlan:
        return OnnxPlan(model, shape, stages, memory)

    @property
    def grid_device(self) -> Any:
        # The host's CPU, also where JAX has started an accelerator beside it (`--device
        # auto` on a GPU machine): ONNX Runtime's arrays are host arrays.
        return jax.local_devices(backend="cpu")[0]

    def adopt(self, unit: jax.Array) -> np.ndarray:
        return np.asarray(jax.device_get(unit))  # ONNX Runtime reads host arrays

    def adopt_logits(self, logits: np.ndarray) -> jax.Array:
        # No copy where the buffer is aligned as XLA:CPU wants: ONNX Runtime's outputs, the
        # stitched stages' (`memory.aligned_zeros`). Nothing writes to the logits afterwards.
        return jax.device_put(logits, self.grid_device)

    def flip(self, placed: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        # A view: the sessions copy the windows they read.
        return np.flip(placed, tuple(a + 1 for a in axes))
