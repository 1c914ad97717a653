"""Geometry of exact level-wise tiled inference, and the first-guess memory model.

Pure functions of a config: no device is touched here. `ctseg.infer` runs what
this module plans.

Tiling the whole network would give every window a margin of the receptive-field
radius (56 voxels for depth 4), so at 512³ the windows would hold 6–15× the grid's
voxels. Instead the inference-mode U-Net of depth D is cut into 2D−1 stages whose
outputs are materialised whole, at their level's resolution R/2^l:

    down l (l = 0 … D−2):  a_{l+1} = max_pool(encoder_l(a_l)),  a_0 = the image
    bottom:                d_{D−1} = encoder_{D−1}(a_{D−1})
    up l (l = D−2 … 0):    d_l = decoder_l(encoder_l(a_l), d_{l+1}); up 0 ends with the head

Each stage runs window by window with only its own margin, in its level's voxels:
2·(k//2) for an encoder level's two convolutions, 4·(k//2) for an up stage, which
recomputes its skip encoder_l(a_l) before the decoder's two convolutions (storing
level 0's skip would take R³·base values: 8.6 GB in bfloat16 at 512³ base 32).
Cores and margins are even, so every window starts and ends on an even voxel:
pooling pairs the voxels the whole pass pairs, and an up stage reads d_{l+1}
through its own window halved.

Why it is exact: with inference-mode batch norm every stage is a local function of
its inputs (ARCHITECTURE.md, invariant 6) whose radius its margin covers. Windows
are shifted inwards at the volume's faces, never padded, so where a window stops at
a face each convolution's own SAME zero padding is what the whole pass sees there,
and everywhere else a core voxel is computed from the same values as in the whole
pass.

Cost, counted as window voxels × multiply-adds per voxel of each stage against one
whole pass: 512³, base 32, depth 4, cores of 128 — 147 windows in 7 stages, 1.47× the
whole pass (1.28× from recomputing the skips, the rest from the margins).

The memory model here is a hand formula: the first guess that picks the candidate
programs. `ctseg.infer` then decides from the compiled programs' own memory analysis.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ctseg.config import Config
from ctseg.unet import BOTTOM, DOWN, NUM_CLASSES, UP, level_widths

TileProgress = Callable[[int, int], None]  # (windows done, windows in total)

# Live activation bytes per voxel of a level, per channel of its width and per byte of
# the compute dtype: the level's input, its halo-padded copy, the convolution output and,
# in the decoder, the concatenated skip (twice the width).
_LIVE_BUFFERS_PER_CHANNEL = 6
# Per-voxel bytes that do not scale with the width: the input and its padded copies, the
# logits, and XLA:CPU's temporaries for few-channel convolutions. Measured: a base-2 model
# takes about 120 B per voxel at 128³, where the width term alone predicts 64.
_FIXED_BYTES_PER_VOXEL = 128
# Share of the available memory the first guess plans for; the rest is for the caller's
# arrays, the runtime's own buffers, the estimate's error and whatever else runs there.
# Measured at 512³ (lits512, ONNX, 23 GiB available): a share of 0.5 planned 11.4 GiB
# and the process peaked at 12.5 GiB.
MEMORY_SHARE = 0.4
# Automatic cores when not even the smallest fits the estimate: a usable size (4096
# windows at 512³) beats hundreds of thousands of windows.
MIN_AUTO_CORE = 32


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
                    slice(c.start - w.start, c.stop - w.start)
                    for w, c in zip(window, cores, strict=True)
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

    @property
    def scale(self) -> int:
        """Input voxels per output voxel along an axis: 2 for a down stage, else 1."""
        return 2 if self.kind == DOWN else 1

    def windows(self) -> list[Window]:
        return plan_windows(self.size, self.core, self.context)


def stitch_table(stage: Stage) -> np.ndarray:
    """Where each window is cut and what of its output is kept: int32 [windows, 4, 3].

    Per window and axis: the window's start in the stage's input; the start of a
    block of `stage.core // stage.scale` output voxels, inside the window's output
    and inside the grid, that holds the window's core (the last core along an
    axis may be shorter than the others: its block is shifted back to end at the
    grid's face, where the window ends too, so every voxel of it still has its
    whole margin); and the start and stop of the core, the voxels this window
    owns, in output voxels. Every block has one static shape, so one program cuts
    and stitches every window.
    """
    block = stage.core // stage.scale
    rows = []
    for w in stage.windows():
        starts = [s.start for s in w.window]
        core = [(c.start // stage.scale, c.stop // stage.scale) for c in w.core]
        blocks = [min(lo, stage.out_size - block) for lo, _ in core]
        rows.append([starts, blocks, [lo for lo, _ in core], [hi for _, hi in core]])
    return np.asarray(rows, np.int32)


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


# --------------------------------------------------------------------------- memory


def window_bytes(config: Config, level: int, extent: int, itemsize: int) -> float:
    """Estimated peak activation bytes of one stage window of `extent`³ voxels at `level`.

    The stage's level dominates (an up stage's input from below has 1/8 of the voxels):
    a fixed share per voxel plus the live buffers of the level's width in the compute
    dtype (`itemsize` bytes a value). Conservative for wide models: whole-network windows
    of the lits512 model (base 32, float32) measured about 440 B per voxel, where the
    level-0 term alone is 896.
    """
    width = level_widths(config.model)[level]
    per_voxel = _FIXED_BYTES_PER_VOXEL + _LIVE_BUFFERS_PER_CHANNEL * itemsize * width
    return extent**3 * per_voxel


def whole_volume_bytes(config: Config, itemsize: int) -> float:
    """Estimated peak bytes of a whole-volume pass: every level's buffers at once, plus
    the float32 image and logits."""
    resolution = config.data.resolution
    widths = level_widths(config.model)
    activations = resolution**3 * _FIXED_BYTES_PER_VOXEL + sum(
        _LIVE_BUFFERS_PER_CHANNEL * itemsize * width * (resolution >> level) ** 3
        for level, width in enumerate(widths)
    )
    return activations + resolution**3 * (1 + NUM_CLASSES) * 4


def resident_bytes(config: Config, kind: str, level: int, itemsize: int) -> int:
    """Bytes of the materialised levels alive while stage (`kind`, `level`) runs.

    The image (float32), the pooled inputs a_1 … a_m still needed, the stage's input
    from below and its output (float32 logits for the last stage); `itemsize`: bytes
    per value of the intermediates.
    """
    resolution = config.data.resolution
    widths = level_widths(config.model)

    def pooled(m: int) -> int:  # a_m = max_pool of level m−1's encoder output
        return (resolution >> m) ** 3 * widths[m - 1] * itemsize

    def decoded(m: int) -> int:  # d_m
        return (resolution >> m) ** 3 * widths[m] * itemsize

    logits = resolution**3 * NUM_CLASSES * 4
    total = resolution**3 * 4
    if kind == DOWN:
        return total + sum(pooled(m) for m in range(1, level + 2))
    total += sum(pooled(m) for m in range(1, level + 1))
    if kind == UP:
        total += decoded(level + 1)
    return total + (logits if level == 0 else decoded(level))


def fits_whole(config: Config, memory: float, itemsize: int) -> bool:
    """Whether the first guess expects a whole-volume pass to fit in `memory` bytes."""
    return whole_volume_bytes(config, itemsize) <= MEMORY_SHARE * memory


def choose_stages(config: Config, memory: float, itemsize: int) -> list[Stage]:
    """The first-guess tiles for `memory` bytes per device: each stage's largest core that fits.

    Each stage gets the largest core whose window fits in a share of what the
    materialised levels alive during the stage leave (`resident_bytes`). A device
    runs its windows one after another, so one window counts, however many devices
    share a stage's windows.
    """
    resolution = config.data.resolution
    stages = []
    for kind, level in stage_order(config.model.depth):
        room = MEMORY_SHARE * memory - resident_bytes(config, kind, level, itemsize)
        size = resolution >> level
        chosen = make_stage(config, kind, level, min(MIN_AUTO_CORE, size))
        for core in [size, *range(2 * ((size - 1) // 2), 0, -2)]:  # the grid, then even cores
            stage = make_stage(config, kind, level, core)
            if window_bytes(config, level, stage.extent, itemsize) <= room:
                chosen = stage
                break
        stages.append(chosen)
    return stages
