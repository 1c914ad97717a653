"""Geometry of level-wise tiles and the first-guess memory model (pure, no devices)."""

import dataclasses
import math

import numpy as np
import pytest
from helpers import REPO, tiny_config

from ctseg import config as cfg
from ctseg.data import grids
from ctseg.inference.network import tile_memory, tiling


@pytest.mark.parametrize(
    ("shape", "depth", "tile"),
    [
        ((32,) * 3, 2, 6),
        ((32,) * 3, 3, 12),
        ((64,) * 3, 4, 10),
        ((512,) * 3, 4, 128),
        ((48,) * 3, 4, 8),
        ((48, 32, 80), 3, 12),  # a box of the spacing grid: longer along z
        ((16, 64, 24), 2, 10),
    ],
)
def test_stage_windows_cover_each_level_once_with_enough_context(shape, depth, tile):
    config = tiny_config(f"model.depth={depth}")
    for stage in tiling.plan_stages(config, tile, shape):
        size = tuple(n >> stage.level for n in shape)
        assert stage.size == size
        # Cores of at most `tile`, but a stage in one window along an axis may be larger.
        assert all(c <= tile or c == n for c, n in zip(stage.core, size, strict=True))
        covered = np.zeros(size, np.int8) if max(size) <= 80 else None
        for w in stage.windows():
            if covered is not None:
                covered[w.core] += 1
            # One window shape per stage: one compile.
            assert tuple(s.stop - s.start for s in w.window) == stage.extent
            for window, core, n in zip(w.window, w.core, size, strict=True):
                assert window.start <= core.start and core.stop <= window.stop
                # Context on each side, unless the window stops at the level's face.
                assert window.start == 0 or core.start - window.start >= stage.context
                assert window.stop == n or window.stop - core.stop >= stage.context
                if stage.kind != tiling.BOTTOM:  # pooled or read through halved windows
                    assert window.start % 2 == core.start % 2 == core.stop % 2 == 0
        if covered is not None:
            assert (covered == 1).all(), (stage, np.unique(covered))
        else:  # 512³: count per axis
            per_axis = [math.ceil(n / c) for n, c in zip(size, stage.core, strict=True)]
            assert sum(1 for _ in stage.windows()) == math.prod(per_axis)


@pytest.mark.parametrize(
    ("size", "core", "context"), [(32, 12, 24), (32, 4, 10), (64, 16, 8), (16, 6, 2)]
)
def test_windows_cover_the_grid_once_with_enough_context(size, core, context):
    windows = tiling.plan_windows((size,) * 3, (core,) * 3, context)
    covered = np.zeros((size,) * 3, int)
    extent = min(core + 2 * context, size)
    for w in windows:
        covered[w.core] += 1
        assert all(s.stop - s.start == extent for s in w.window)  # one shape: one compile
        for window, c in zip(w.window, w.core, strict=True):
            assert window.start <= c.start and c.stop <= window.stop
            assert window.start == 0 or c.start - window.start >= context
            assert window.stop == size or window.stop - c.stop >= context
    assert (covered == 1).all()


def test_stage_margins_cover_the_receptive_field():
    """Down/bottom stages: two convolutions; up: the skip's two and the decoder's two."""
    config = cfg.from_dict({"model": {"kernel_size": 5, "depth": 3}})
    assert tiling.stage_context(config, tiling.DOWN) == 4
    assert tiling.stage_context(config, tiling.BOTTOM) == 4
    assert tiling.stage_context(config, tiling.UP) == 8


LITS512 = cfg.from_dict({"data": {"resolution": 512}, "model": {"base_filters": 32, "depth": 4}})


def test_automatic_plan_from_memory():
    config = LITS512
    assert tile_memory.fits_whole(config, memory=2**50, itemsize=2)
    assert not tile_memory.fits_whole(config, memory=16 * 2**30, itemsize=2)
    stages = tile_memory.choose_stages(config, memory=16 * 2**30, itemsize=2)
    assert [(s.kind, s.level) for s in stages] == tiling.stage_order(4)
    level0 = [s.largest_core for s in stages if s.level == 0]
    assert all(0 < core < 512 and core % 2 == 0 for core in level0)
    for stage in stages:  # every stage's step fits what its materialised arrays leave
        resident = tile_memory.resident_bytes(config, (512,) * 3, stage.kind, stage.level, 2)
        room = tile_memory.MEMORY_SHARE * 16 * 2**30 - resident
        assert tile_memory.window_bytes(config, stage.level, stage.extent, 2) <= room
    # Less memory or float32 intermediates: smaller cores (however many devices share them).
    for smaller in (
        tile_memory.choose_stages(config, memory=8 * 2**30, itemsize=2),
        tile_memory.choose_stages(config, memory=16 * 2**30, itemsize=4),
    ):
        pairs = list(zip(smaller, stages, strict=True))
        assert all(a.largest_core <= b.largest_core for a, b in pairs)
        assert any(a.largest_core < b.largest_core for a, b in pairs)
    # Nothing fits: small cores are the best chance.
    tiny = tile_memory.choose_stages(config, memory=2**20, itemsize=2)
    assert max(s.largest_core for s in tiny) == 32
    # A box twice as long along z needs about twice the memory of its cube.
    box = (512, 512, 1024)
    cube = tile_memory.whole_volume_bytes(config, 2)
    assert tile_memory.whole_volume_bytes(config, 2, box) == 2 * cube


def test_memory_estimates():
    small = cfg.from_dict({"model": {"base_filters": 16}})
    large = dataclasses.replace(small, model=dataclasses.replace(small.model, base_filters=32))
    none = dataclasses.replace(small, model=dataclasses.replace(small.model, base_filters=0))
    ten = (10, 10, 10)
    fixed = tile_memory.window_bytes(none, 0, ten, 4)
    assert tile_memory.window_bytes(large, 0, ten, 4) - fixed == 2 * (
        tile_memory.window_bytes(small, 0, ten, 4) - fixed
    )
    wider = tile_memory.window_bytes(small, 1, ten, 4)
    assert wider > tile_memory.window_bytes(small, 0, ten, 4)
    assert tile_memory.whole_volume_bytes(large, 4) > tile_memory.whole_volume_bytes(small, 4)
    # The compute dtype counts: bfloat16 activations take half the width term of float32.
    assert (
        tile_memory.window_bytes(large, 0, ten, 2) - fixed
        == (tile_memory.window_bytes(large, 0, ten, 4) - fixed) / 2
    )
    assert tile_memory.whole_volume_bytes(large, 2) < tile_memory.whole_volume_bytes(large, 4)
    # bfloat16 intermediates halve everything but the float32 image and logits.
    for kind, level in tiling.stage_order(LITS512.model.depth):
        f32 = tile_memory.resident_bytes(LITS512, (512,) * 3, kind, level, 4)
        bf16 = tile_memory.resident_bytes(LITS512, (512,) * 3, kind, level, 2)
        assert bf16 < f32 < 2 * bf16


@pytest.mark.parametrize(
    ("shape", "depth", "tile"),
    [
        ((32,) * 3, 2, 6),
        ((32,) * 3, 3, 14),
        ((48,) * 3, 4, 8),
        ((64,) * 3, 3, 20),
        ((32, 48, 96), 3, 14),
    ],
)
def test_stitch_table_blocks_hold_their_cores_with_their_margins(shape, depth, tile):
    """Every block has the stage's static size, lies inside the grid and its window's
    output, holds the window's core, keeps a margin of context where it is not at a face,
    and the cores (the voxels each window owns) cover the output level exactly once."""
    config = tiny_config(f"model.depth={depth}")
    for stage in tiling.plan_stages(config, tile, shape):
        _check_stitch_table(stage)


def _check_stitch_table(stage: tiling.Stage) -> None:
    table = tiling.stitch_table(stage)
    block, out_size, extent = (
        np.asarray(stage.block),
        np.asarray(stage.out_size),
        np.asarray(stage.extent),
    )
    owned = np.zeros(stage.out_size, np.int8)
    assert table.shape == (len(stage.windows()), 4, 3)
    for (start, kept, first, stop), w in zip(table, stage.windows(), strict=True):
        window_out = start // stage.scale, (start + extent) // stage.scale
        assert (kept >= 0).all() and (kept + block <= out_size).all()
        assert (kept >= window_out[0]).all() and (kept + block <= window_out[1]).all()
        assert (kept <= first).all() and (stop <= kept + block).all()
        margin = stage.context // stage.scale
        inner = kept - window_out[0]
        assert ((window_out[0] == 0) | (inner >= margin)).all()
        assert ((window_out[1] == out_size) | (window_out[1] - kept - block >= margin)).all()
        core = tuple(slice(c.start // stage.scale, c.stop // stage.scale) for c in w.core)
        assert [(s.start, s.stop) for s in core] == list(zip(first, stop, strict=True))
        owned[core] += 1
    assert (owned == 1).all(), stage


@pytest.mark.parametrize(
    ("shapes", "depth", "core"),
    [
        ([(32, 32, 32), (24, 40, 56), (48, 28, 36)], 3, 8),
        ([(32, 32, 32), (64, 32, 96)], 2, 12),
        ([(144, 144, 144), (288, 160, 208)], 4, 128),
    ],
)
def test_fixed_windows_do_not_depend_on_the_box(shapes, depth, core):
    """Fixed windows: every stage's window extent and core are the same for boxes of any
    shape at least the floor a side (one window program serves them all), the cores are
    the asked size at level 0, every window fits its level, and the stitch table holds
    each core once; a box below the floor is refused."""
    config = tiny_config(f"model.depth={depth}")
    floor = tiling.window_floor(config, core)
    assert floor % config.alignment == 0 and floor >= core + 2 * tiling.stage_context(config, "up")
    keys = None
    for shape in shapes:
        stages = tiling.fixed_stages(config, core, shape)
        assert [(s.kind, s.level) for s in stages] == tiling.stage_order(depth)
        assert all(s.core == (core,) * 3 for s in stages if s.level == 0)
        these = [tiling.window_key(s) for s in stages]
        assert keys is None or these == keys
        keys = these
        for stage in stages:
            assert all(e <= n for e, n in zip(stage.extent, stage.size, strict=True))
            assert stage.extent == tuple(c + 2 * stage.context for c in stage.core)
            _check_stitch_table(stage)
    with pytest.raises(ValueError, match="below fixed windows"):
        tiling.fixed_stages(config, core, (floor - config.alignment, floor, floor))


@pytest.mark.parametrize(
    ("shape", "depth", "tile", "need"),
    [
        ((64, 48, 96), 3, 12, ((10, 30), (0, 48), (50, 70))),
        ((64, 48, 96), 4, 8, ((2, 4), (46, 48), (0, 96))),
        ((560, 560, 320), 4, 128, ((100, 420), (120, 360), (8, 300))),
    ],
)
def test_a_stage_s_span_reads_only_what_the_stages_before_it_compute(shape, depth, tile, need):
    """The cone of `need`: the last stage's span holds it; every window's core voxels read,
    within the stage's context, only voxels its input stages' spans computed (or the
    image); spans are even and inside their levels."""
    config = tiny_config(f"model.depth={depth}")
    stages = tiling.plan_stages(config, tile, shape)
    spans = tiling.stage_spans(stages, need)
    assert all(lo <= a and b <= hi for (lo, hi), (a, b) in zip(spans[-1], need, strict=True))
    computed = {}  # (kind, level) -> output span in the output level's voxels
    for stage, span in zip(stages, spans, strict=True):
        for (lo, hi), n in zip(span, stage.size, strict=True):
            assert 0 <= lo < hi <= n and lo % 2 == 0 and (hi % 2 == 0 or hi == n)
        if stage.kind == tiling.DOWN or stage.kind == tiling.BOTTOM:
            source = None if stage.level == 0 else computed[tiling.DOWN, stage.level - 1]
        else:
            source = None if stage.level == 0 else computed[tiling.DOWN, stage.level - 1]
            below = (
                computed.get((tiling.UP, stage.level + 1))
                or computed[tiling.BOTTOM, stage.level + 1]
            )
            for (lo, hi), (blo, bhi), n in zip(span, below, stage.size, strict=True):
                read = (max(0, lo - stage.context) // 2, -(-min(n, hi + stage.context) // 2))
                assert blo <= read[0] and read[1] <= bhi
        if source is not None:
            for (lo, hi), (slo, shi), n in zip(span, source, stage.size, strict=True):
                assert slo <= max(0, lo - stage.context) and min(n, hi + stage.context) <= shi
        computed[stage.kind, stage.level] = tuple(
            (lo // stage.scale, hi // stage.scale) for lo, hi in span
        )
        # Its windows, fixed (a compiled program's) or fitted to the span (ONNX Runtime's),
        # own the span's voxels once each, with their context, in windows no larger.
        for tiles in (stage, stage.fitted(span)):
            assert all(e <= full for e, full in zip(tiles.extent, stage.extent, strict=True))
            for axis, (lo, hi) in enumerate(span):
                cores = sorted(
                    {(w.core[axis].start, w.core[axis].stop) for w in tiles.windows(span)}
                )
                assert cores[0][0] == lo and cores[-1][1] == hi
                assert all(a[1] == b[0] for a, b in zip(cores, cores[1:], strict=False))
            for w in tiles.windows(span):
                for window, core, n in zip(w.window, w.core, stage.size, strict=True):
                    assert window.start == 0 or core.start - window.start >= stage.context
                    assert window.stop == n or window.stop - core.stop >= stage.context
        fitted = math.prod(math.prod(tiles.extent) for tiles in [stage.fitted(span)])
        assert len(stage.fitted(span).windows(span)) * fitted <= len(
            stage.windows(span)
        ) * math.prod(stage.extent)
    # Around a 512-class region the up stage at level 0 runs on the region, not the box.
    if shape[0] == 560:
        assert spans[-1] == need and spans[0] != spans[-1]


def test_a_windows_box_runs_as_many_level_0_windows_as_the_ladder_s_in_fewer_shapes():
    """lits512's cores of 128: a 512×512×63 scan's 560×560×306 grid in a 640×640×384 box,
    as many level-0 windows as the ladder's 640×640×320; and the grids of 63 down to 36
    slices in two box shapes where the ladder takes four."""
    config = cfg.load(REPO / "configs" / "lits512_16way.toml", [])
    box = tiling.windows_box(config, 128, (560, 560, 306))
    assert box == (640, 640, 384)
    ladder = grids.inference_box((560, 560, 306), 16)
    assert ladder == (640, 640, 320)
    level0 = [len(tiling.fixed_stages(config, 128, b)[0].windows()) for b in (box, ladder)]
    assert level0[0] == level0[1] == 75
    sides = range(175, 307, 14)  # the z of ten cut scans
    assert len({tiling.windows_box(config, 128, (560, 560, z)) for z in sides}) == 2
    assert len({grids.inference_box((560, 560, z), 16) for z in sides}) == 4
    assert min(tiling.windows_box(config, 128, (40, 40, 40))) >= tiling.window_floor(config, 128)
