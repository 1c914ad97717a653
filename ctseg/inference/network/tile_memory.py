"""The first-guess memory model of inference: how many bytes a whole-volume pass, a stage's
window and the levels it keeps alive take, and the tiles (`choose_stages`) that fit a
device's memory by it.

A hand formula, per voxel and channel of each level's width, in the compute dtype: it picks
the candidate programs; `ctseg.inference.network.engine` then decides from the compiled programs'
own memory analysis. The geometry it plans with is `ctseg.inference.network.tiling`'s.
"""

from __future__ import annotations

import math

from ctseg.config import Config
from ctseg.inference.network.tiling import (
    Shape,
    Stage,
    grid_shape,
    level_shape,
    make_stage,
    stage_order,
)
from ctseg.labels import NUM_CLASSES
from ctseg.model.unet import DOWN, UP, level_widths

# Live activation bytes per voxel of a level, per channel of its width and per byte of
# the compute dtype: the level's input, its halo-padded copy, the convolution output and,
# in the decoder, the concatenated skip (twice the width).
_LIVE_BUFFERS_PER_CHANNEL = 6
# Per-voxel bytes that do not scale with the width: the input and its padded copies, the
# logits, and XLA:CPU's temporaries for few-channel convolutions: a narrow model measured
# about twice what the width term alone predicts
# (docs/experiments/design-figures.md#tile-memory).
_FIXED_BYTES_PER_VOXEL = 128
# Share of the available memory the first guess plans for; the rest is for the caller's
# arrays, the runtime's own buffers, the estimate's error and whatever else runs there.
# A share of 0.5 left too little room where it was measured
# (docs/experiments/design-figures.md#tile-memory).
MEMORY_SHARE = 0.4
# Automatic cores when not even the smallest fits the estimate: a usable size (4096
# windows at 512³) beats hundreds of thousands of windows.
MIN_AUTO_CORE = 32


def window_bytes(config: Config, level: int, extent: Shape, itemsize: int) -> float:
    """Estimated peak activation bytes of one stage window of `extent` voxels at `level`.

    The stage's level dominates (an up stage's input from below has 1/8 of the voxels):
    a fixed share per voxel plus the live buffers of the level's width in the compute
    dtype (`itemsize` bytes a value). Conservative for wide models: the lits512 model's
    whole-network windows measured about half the level-0 term
    (docs/experiments/design-figures.md#tile-memory).
    """
    width = level_widths(config.model)[level]
    per_voxel = _FIXED_BYTES_PER_VOXEL + _LIVE_BUFFERS_PER_CHANNEL * itemsize * width
    return math.prod(extent) * per_voxel


def _voxels(shape: Shape, level: int = 0) -> int:
    return math.prod(level_shape(shape, level))


def whole_volume_bytes(config: Config, itemsize: int, shape: Shape | None = None) -> float:
    """Estimated peak bytes of a whole-volume pass over a grid of `shape` (default the
    config's R³): every level's buffers at once, plus the float32 image and logits."""
    shape = grid_shape(config) if shape is None else shape
    widths = level_widths(config.model)
    activations = _voxels(shape) * _FIXED_BYTES_PER_VOXEL + sum(
        _LIVE_BUFFERS_PER_CHANNEL * itemsize * width * _voxels(shape, level)
        for level, width in enumerate(widths)
    )
    return activations + _voxels(shape) * (1 + NUM_CLASSES) * 4


def resident_bytes(config: Config, shape: Shape, kind: str, level: int, itemsize: int) -> int:
    """Bytes of the materialised levels alive while stage (`kind`, `level`) runs.

    The image (float32), the pooled inputs a_1 … a_m still needed, the stage's input
    from below and its output (float32 logits for the last stage); `itemsize`: bytes
    per value of the intermediates.
    """
    widths = level_widths(config.model)

    def pooled(m: int) -> int:  # a_m = max_pool of level m−1's encoder output
        return _voxels(shape, m) * widths[m - 1] * itemsize

    def decoded(m: int) -> int:  # d_m
        return _voxels(shape, m) * widths[m] * itemsize

    logits = _voxels(shape) * NUM_CLASSES * 4
    total = _voxels(shape) * 4
    if kind == DOWN:
        return total + sum(pooled(m) for m in range(1, level + 2))
    total += sum(pooled(m) for m in range(1, level + 1))
    if kind == UP:
        total += decoded(level + 1)
    return total + (logits if level == 0 else decoded(level))


def fits_whole(config: Config, memory: float, itemsize: int, shape: Shape | None = None) -> bool:
    """Whether the first guess expects a whole-volume pass to fit in `memory` bytes."""
    return whole_volume_bytes(config, itemsize, shape) <= MEMORY_SHARE * memory


def choose_stages(
    config: Config, memory: float, itemsize: int, shape: Shape | None = None
) -> list[Stage]:
    """The first-guess tiles for `memory` bytes per device: each stage's largest core that fits.

    Each stage gets the largest core whose window fits in a share of what the
    materialised levels alive during the stage leave (`resident_bytes`). A device
    runs its windows one after another, so one window counts, however many devices
    share a stage's windows.
    """
    shape = grid_shape(config) if shape is None else shape
    stages = []
    for kind, level in stage_order(config.model.depth):
        room = MEMORY_SHARE * memory - resident_bytes(config, shape, kind, level, itemsize)
        size = max(level_shape(shape, level))
        chosen = make_stage(config, shape, kind, level, min(MIN_AUTO_CORE, size))
        for core in [size, *range(2 * ((size - 1) // 2), 0, -2)]:  # the grid, then even cores
            stage = make_stage(config, shape, kind, level, core)
            if window_bytes(config, level, stage.extent, itemsize) <= room:
                chosen = stage
                break
        stages.append(chosen)
    return stages
