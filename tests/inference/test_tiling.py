"""Geometry of level-wise tiles and the first-guess memory model (pure, no devices)."""

import dataclasses
import math

import numpy as np
import pytest
from helpers import tiny_config

from ctseg import config as cfg
from ctseg.inference import tiling


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
    assert tiling.fits_whole(config, memory=2**50, itemsize=2)
    assert not tiling.fits_whole(config, memory=16 * 2**30, itemsize=2)
    stages = tiling.choose_stages(config, memory=16 * 2**30, itemsize=2)
    assert [(s.kind, s.level) for s in stages] == tiling.stage_order(4)
    level0 = [s.largest_core for s in stages if s.level == 0]
    assert all(0 < core < 512 and core % 2 == 0 for core in level0)
    for stage in stages:  # every stage's step fits what its materialised arrays leave
        resident = tiling.resident_bytes(config, (512,) * 3, stage.kind, stage.level, 2)
        room = tiling.MEMORY_SHARE * 16 * 2**30 - resident
        assert tiling.window_bytes(config, stage.level, stage.extent, 2) <= room
    # Less memory or float32 intermediates: smaller cores (however many devices share them).
    for smaller in (
        tiling.choose_stages(config, memory=8 * 2**30, itemsize=2),
        tiling.choose_stages(config, memory=16 * 2**30, itemsize=4),
    ):
        pairs = list(zip(smaller, stages, strict=True))
        assert all(a.largest_core <= b.largest_core for a, b in pairs)
        assert any(a.largest_core < b.largest_core for a, b in pairs)
    # Nothing fits: small cores are the best chance.
    tiny = tiling.choose_stages(config, memory=2**20, itemsize=2)
    assert max(s.largest_core for s in tiny) == 32
    # A box twice as long along z needs about twice the memory of its cube.
    box = (512, 512, 1024)
    assert tiling.whole_volume_bytes(config, 2, box) == 2 * tiling.whole_volume_bytes(config, 2)


def test_memory_estimates():
    small = cfg.from_dict({"model": {"base_filters": 16}})
    large = dataclasses.replace(small, model=dataclasses.replace(small.model, base_filters=32))
    none = dataclasses.replace(small, model=dataclasses.replace(small.model, base_filters=0))
    ten = (10, 10, 10)
    fixed = tiling.window_bytes(none, 0, ten, 4)
    assert tiling.window_bytes(large, 0, ten, 4) - fixed == 2 * (
        tiling.window_bytes(small, 0, ten, 4) - fixed
    )
    assert tiling.window_bytes(small, 1, ten, 4) > tiling.window_bytes(small, 0, ten, 4)  # wider
    assert tiling.whole_volume_bytes(large, 4) > tiling.whole_volume_bytes(small, 4)
    # The compute dtype counts: bfloat16 activations take half the width term of float32.
    assert (
        tiling.window_bytes(large, 0, ten, 2) - fixed
        == (tiling.window_bytes(large, 0, ten, 4) - fixed) / 2
    )
    assert tiling.whole_volume_bytes(large, 2) < tiling.whole_volume_bytes(large, 4)
    # bfloat16 intermediates halve everything but the float32 image and logits.
    for kind, level in tiling.stage_order(LITS512.model.depth):
        f32 = tiling.resident_bytes(LITS512, (512,) * 3, kind, level, 4)
        bf16 = tiling.resident_bytes(LITS512, (512,) * 3, kind, level, 2)
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
