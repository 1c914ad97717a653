"""Geometry of exact level-wise tiled inference.

Pure functions of a config and a grid's shape (x, y, z voxels): no device is
touched here. `ctseg.inference.network.engine` runs what this module plans.

Tiling the whole network would give every window a margin of the receptive-field
radius (56 voxels for depth 4), so at 512³ the windows would hold 6–15× the grid's
voxels. Instead the inference-mode U-Net of depth D is cut into 2D−1 stages whose
outputs are materialised whole, at their level's resolution (the grid's shape / 2^l;
a grid may be any box whose sides the alignment 2^(D−1) divides, not only a cube):

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

Fixed windows (`fixed_stages`): where every new box shape costs a compile (a GPU tunes
each convolution for minutes), each stage's windows keep one extent whatever the box:
cores of the asked size at level 0, deeper levels' cores as large as fit the level of the
smallest box they take (`window_floor`, boxes padded to it), the last window of an axis
shifted inwards. More overlap than balanced cores, but one program per stage for all boxes.

The tiles that fit a device's memory are chosen by `ctseg.inference.network.tile_memory`'s first
guess.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ctseg.config import Config
from ctseg.data.grids import Shape
from ctseg.model.unet import BOTTOM, DOWN, UP

# Per axis, the voxels [lo, hi) of a level that are needed (a region's cone, below).
Span = tuple[tuple[int, int], tuple[int, int], tuple[int, int]]


@dataclass(frozen=True)
class Tile:
    """One tile: the window fed to the network and where its core goes in the output."""

    window: tuple[slice, slice, slice]  # in grid coordinates
    core: tuple[slice, slice, slice]  # in grid coordinates
    core_in_window: tuple[slice, slice, slice]


def _axis_windows(
    size: int, core: int, extent: int, context: int, span: tuple[int, int]
) -> list[tuple[slice, slice]]:
    """(window, core) ranges along one axis whose cores cover `span`; windows have `extent`
    voxels, shifted to fit."""
    ranges = []
    lo, hi = span
    for start in range(lo, hi, core):
        stop = min(start + core, hi)
        first = min(max(start - context, 0), size - extent)
        ranges.append((slice(first, first + extent), slice(start, stop)))
    return ranges


def grid_shape(config: Config) -> Shape:
    """The config's training grid, R³ (`data.resolution`)."""
    return (config.data.resolution,) * 3


def level_shape(shape: Shape, level: int) -> Shape:
    """A grid's shape at U-Net level `level` (each level halves every side)."""
    return tuple(n >> level for n in shape)


def shape_text(shape: Shape) -> str:
    """`48³` for a cube, `320×320×160` for a box."""
    return f"{shape[0]}³" if len(set(shape)) == 1 else "×".join(str(n) for n in shape)


def plan_windows(size: Shape, core: Shape, context: int, span: Span | None = None) -> list[Tile]:
    """Windows covering a grid of `size` (or its `span`) with cores of `core` voxels; all
    of one shape.

    With `size`, `core`, `context` and the span's ends even, every window and core
    starts and ends on an even voxel.
    """
    extent = [min(c + 2 * context, n) for c, n in zip(core, size, strict=True)]
    span = whole_span(size) if span is None else span
    ax, ay, az = (
        _axis_windows(n, c, e, context, s)
        for n, c, e, s in zip(size, core, extent, span, strict=True)
    )
    windows = []
    for wx, cx in ax:
        for wy, cy in ay:
            for wz, cz in az:
                window, cores = (wx, wy, wz), (cx, cy, cz)
                inner = tuple(
                    slice(c.start - w.start, c.stop - w.start)
                    for w, c in zip(window, cores, strict=True)
                )
                windows.append(Tile(window, cores, inner))
    return windows


@dataclass(frozen=True)
class Stage:
    """One stage of level-wise tiled inference: what it computes and how it is tiled."""

    kind: str  # DOWN, BOTTOM or UP
    level: int  # the U-Net level its convolutions run at
    size: Shape  # that level's grid, the grid's shape / 2^level
    core: Shape  # core sides in the level's voxels; an axis's `size`: one window along it
    context: int  # margin in the level's voxels

    @property
    def extent(self) -> Shape:
        """Sides of every window."""
        return tuple(
            min(c + 2 * self.context, n) for c, n in zip(self.core, self.size, strict=True)
        )

    @property
    def out_size(self) -> Shape:
        """The stage's output grid (a down stage pools)."""
        return tuple(n // self.scale for n in self.size)

    @property
    def block(self) -> Shape:
        """Sides of a core in output voxels: every window writes a block of this shape."""
        return tuple(c // self.scale for c in self.core)

    @property
    def largest_core(self) -> int:
        return max(self.core)

    @property
    def scale(self) -> int:
        """Input voxels per output voxel along an axis: 2 for a down stage, else 1."""
        return 2 if self.kind == DOWN else 1

    def windows(self, span: Span | None = None) -> list[Tile]:
        """The windows whose cores cover the stage's input level, or its `span` there."""
        return plan_windows(self.size, self.core, self.context, span)

    def fitted(self, span: Span) -> Stage:
        """The stage with its cores balanced over `span` instead of the level, none larger
        than its own: a region's cone in as few and as small windows as it takes. For a
        backend whose windows may change shape (ONNX Runtime); a compiled program keeps
        its one window shape and runs its own windows that cover the span."""
        core = tuple(_balanced(hi - lo, c) for (lo, hi), c in zip(span, self.core, strict=True))
        return dataclasses.replace(self, core=core)


def whole_span(size: Sequence[int]) -> Span:
    """Every voxel of a level of `size`."""
    return tuple((0, n) for n in size)  # type: ignore[return-value]


def stitch_table(stage: Stage, span: Span | None = None) -> np.ndarray:
    """Where each window is cut and what of its output is kept: int32 [windows, 4, 3].

    Per window and axis: the window's start in the stage's input; the start of a
    block of `stage.block` output voxels, inside the window's output
    and inside the grid, that holds the window's core (the last core along an
    axis may be shorter than the others: its block is shifted back to end at the
    grid's face, where the window ends too, so every voxel of it still has its
    whole margin); and the start and stop of the core, the voxels this window
    owns, in output voxels. Every block has one static shape, so one program cuts
    and stitches every window. With a `span` (`stage_spans`), only its windows.
    """
    rows = []
    for w in stage.windows(span):
        starts = [s.start for s in w.window]
        core = [(c.start // stage.scale, c.stop // stage.scale) for c in w.core]
        blocks = [
            min(lo, out - block)
            for (lo, _), out, block in zip(core, stage.out_size, stage.block, strict=True)
        ]
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


def _balanced(size: int, tile: int) -> int:
    """Cores along `size` voxels: as many as cores of `tile` (even) need, all of one even
    size but the last."""
    per_axis = math.ceil(size / tile)
    return 2 * math.ceil(size / per_axis / 2)


def _axis_core(size: int, tile: int, context: int) -> int:
    """Balanced cores along an axis of `size` voxels (`_balanced`); `size` when the
    windows would span the axis anyway."""
    core = _balanced(size, tile)
    return size if core + 2 * context >= size else core


def make_stage(config: Config, shape: Shape, kind: str, level: int, tile: int) -> Stage:
    """Stage (`kind`, `level`) of a grid of `shape`, with cores of at most `tile` voxels
    of its level (even) along every axis.

    Cores are balanced: as many per axis as `tile` needs, all of one even size but the
    last (cores ≤ 192 on a 512 grid are 172, 172 and 168 rather than 192, 192 and 128:
    as many windows, smaller ones). Along an axis whose windows would span it whole
    anyway, the stage runs as one window.
    """
    size = level_shape(shape, level)
    context = stage_context(config, kind)
    core = tuple(_axis_core(n, tile, context) for n in size)
    return Stage(kind, level, size, core, context)


def plan_stages(config: Config, tile: int, shape: Shape | None = None) -> list[Stage]:
    """Every stage of a grid of `shape` (default the config's R³), with cores of `tile`
    voxels a side at every level."""
    shape = grid_shape(config) if shape is None else shape
    return [
        make_stage(config, shape, kind, level, tile)
        for kind, level in stage_order(config.model.depth)
    ]


# --------------------------------------------------------------------------- fixed windows


# The smallest box of fixed windows, in level-0 windows a side: deeper levels get the
# cores whose windows fit that box's level, so a larger floor means fewer windows there
# (less overlap) but more padding for boxes smaller than it.
FLOOR_WINDOWS = 1


def window_floor(config: Config, core: int) -> int:
    """The smallest box side that fixed windows of `core` voxels take (`fixed_stages`):
    level 0's widest window (an up stage's core and margins), raised where a deeper level's
    smallest window (a core of 2) would not fit, and aligned to 2^(depth−1)."""
    side = FLOOR_WINDOWS * (core + 2 * stage_context(config, UP))
    for kind, level in stage_order(config.model.depth):
        side = max(side, (2 + 2 * stage_context(config, kind)) << level)
    return -(-side // config.alignment) * config.alignment


def windows_box(config: Config, core: int, grid: Shape) -> Shape:
    """The box fixed windows of `core` voxels run a spacing grid of `grid` in: each side
    rounded up to a multiple of the core (and of the alignment), at least `window_floor`.

    Free at level 0: a side's windows are as many as cores it takes either way (the last
    window of an axis is shifted inwards), so a box between two multiples runs as many
    level-0 windows as the larger multiple. And it makes fewer box shapes than
    `grids.ladder_rung`'s rungs (512×512 scans: sides of 384, 512 or 640 voxels at
    0.8 mm, where the ladder has six); each new shape compiles the driver's small
    programs and the scan↔grid ones."""
    multiple = math.lcm(core, config.alignment)
    floor = window_floor(config, core)
    return tuple(max(-(-n // multiple) * multiple, floor) for n in grid)


def fixed_core(config: Config, core: int, kind: str, level: int) -> int:
    """The core of stage (`kind`, `level`) among fixed windows of `core` voxels: `core`,
    or the largest even core whose window fits the level of a `window_floor` box."""
    room = (window_floor(config, core) >> level) - 2 * stage_context(config, kind)
    return min(core, room // 2 * 2)


def fixed_stages(config: Config, core: int, shape: Shape) -> list[Stage]:
    """Every stage of a box of `shape` with windows whose extents do not depend on the box:
    cores of `fixed_core` along every axis (not balanced to it), the last window of an
    axis shifted inwards, so one compiled program per stage serves boxes of any shape
    (`ctseg.inference.network.jax.backend`). The box must be at least `window_floor` a side."""
    floor = window_floor(config, core)
    if min(shape) < floor:
        raise ValueError(f"box {shape_text(shape)} is below fixed windows' {floor} a side")
    stages = []
    for kind, level in stage_order(config.model.depth):
        side = fixed_core(config, core, kind, level)
        size = level_shape(shape, level)
        stages.append(Stage(kind, level, size, (side,) * 3, stage_context(config, kind)))
    return stages


def window_key(stage: Stage) -> tuple[str, int, Shape, Shape]:
    """What a stage's window program depends on, besides the model: its kind, level,
    window extent and core."""
    return (stage.kind, stage.level, stage.extent, stage.core)


def stage_spans(stages: list[Stage], need: Span) -> list[Span]:
    """Each stage's span, the voxels of its input level whose outputs it computes, when
    only the last stage's outputs `need` (level-0 voxels) are wanted: the cone of the
    network's dependencies, traced from the head back to the image.

    A stage's output voxel reads its inputs within the stage's context, so each level is
    needed over what its readers' spans grown by their contexts hold: a_l by its up
    stage (the skip) and by the down stage below it; d_{l+1} by the up stage above, through
    its windows halved. Spans are even at both ends, like cores. Every voxel of a span is
    computed from the same values as in the whole pass, so the `need` voxels are exact;
    the rest of each level is never computed, and no span voxel reads it. Around a liver's
    box, the image's cone is the box grown by the receptive field, but the up stages,
    the dearest, shrink back to the box.
    """
    sizes = {stage.level: stage.size for stage in stages}
    by_kind = {(stage.kind, stage.level): stage for stage in stages}
    depth = len(sizes)
    wanted = {0: _even(need, sizes[0])}  # d_l: an up stage's (or the bottom's) outputs
    read: dict[int, Span] = {}  # a_l: the level-l inputs the stages read
    for level in range(depth - 1):
        read[level] = _grown(wanted[level], by_kind[UP, level].context, sizes[level])
        wanted[level + 1] = _even(
            tuple((lo // 2, -(-hi // 2)) for lo, hi in read[level]), sizes[level + 1]
        )
    bottom = depth - 1
    read[bottom] = _grown(wanted[bottom], by_kind[BOTTOM, bottom].context, sizes[bottom])
    for level in reversed(range(depth - 1)):
        doubled = tuple((2 * lo, 2 * hi) for lo, hi in read[level + 1])
        down = _grown(doubled, by_kind[DOWN, level].context, sizes[level])
        read[level] = tuple(  # type: ignore[assignment]
            (min(a[0], b[0]), max(a[1], b[1])) for a, b in zip(read[level], down, strict=True)
        )
    return [
        tuple((2 * lo, 2 * hi) for lo, hi in read[stage.level + 1])  # type: ignore[misc]
        if stage.kind == DOWN
        else wanted[stage.level]
        for stage in stages
    ]


def _even(span: Sequence[tuple[int, int]], size: Shape) -> Span:
    """`span` widened to even ends, inside a level of `size`."""
    return tuple(  # type: ignore[return-value]
        (max(0, lo // 2 * 2), min(n, -(-hi // 2) * 2))
        for (lo, hi), n in zip(span, size, strict=True)
    )


def _grown(span: Span, by: int, size: Shape) -> Span:
    return _even([(lo - by, hi + by) for lo, hi in span], size)


# --------------------------------------------------------------------------- memory
