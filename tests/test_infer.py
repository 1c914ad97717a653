"""The inference engine: exact tiled inference equals the whole-volume pass (invariant 6)."""

import dataclasses

import jax
import numpy as np
import pytest

from ctseg import config as cfg
from ctseg import infer, unet
from ctseg.errors import CtsegError

RESOLUTION = 32


def random_model(depth: int) -> infer.Model:
    """An untrained tiny model whose batch-norm running statistics are not the identity."""
    config = cfg.from_dict(
        {
            "data": {"resolution": RESOLUTION},
            "model": {"base_filters": 2, "depth": depth},
            "mesh": {"spatial": [2, 2, 1]},
        }
    )
    graphdef, params, stats = unet.create(config.model, seed=3)
    rng = np.random.default_rng(0)

    def perturb(path, leaf):
        name = jax.tree_util.keystr(path)
        if "head" in name:
            return leaf  # a large class bias would make every voxel one class
        if "var" in name:
            return np.asarray(rng.uniform(0.5, 2.0, leaf.shape), np.float32)
        if "mean" in name or "bias" in name:
            return np.asarray(rng.normal(0, 0.3, leaf.shape), np.float32)
        return leaf

    stats = jax.tree_util.tree_map_with_path(perturb, stats)
    params = jax.tree_util.tree_map_with_path(perturb, params)
    return infer.Model(config, graphdef, params, stats, step=0)


@pytest.fixture(scope="module")
def image():
    rng = np.random.default_rng(1)
    return rng.uniform(-1, 1, (RESOLUTION,) * 3).astype(np.float32)


@pytest.mark.parametrize(
    ("depth", "tiles"),
    [
        # depth 2: alignment 2, margin 10; windows of 30 and 32 voxels; 10 does not divide 32.
        (2, [10, 16]),
        # depth 3: alignment 4, margin 24; core 12 does not divide 32 (cores 12, 12, 8).
        (3, [12]),
    ],
)
def test_tiled_equals_whole_volume(depth, tiles, image):
    model = random_model(depth)
    whole = infer.Engine(model, tile=0)
    assert whole.tile == 0
    reference = whole.logits(image)
    assert reference.shape == (RESOLUTION,) * 3 + (3,)
    assert np.ptp(reference.argmax(-1)) > 0  # a non-trivial labelling to compare
    for tile in tiles:
        engine = infer.Engine(model, tile=tile)
        calls: list[tuple[int, int]] = []
        logits = engine.logits(image, progress=lambda *call, calls=calls: calls.append(call))
        assert (
            calls[-1][0]
            == calls[-1][1]
            == len(infer.plan_windows(RESOLUTION, tile, infer.margin(model.config)))
        )
        np.testing.assert_allclose(logits, reference, rtol=0, atol=1e-4, err_msg=f"tile {tile}")
        np.testing.assert_array_equal(logits.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize(
    ("resolution", "core", "context"), [(32, 12, 24), (32, 4, 10), (64, 16, 8)]
)
def test_windows_cover_the_grid_once_with_enough_context(resolution, core, context):
    windows = infer.plan_windows(resolution, core, context)
    covered = np.zeros((resolution,) * 3, int)
    extent = min(core + 2 * context, resolution)
    for w in windows:
        covered[w.core] += 1
        assert all(s.stop - s.start == extent for s in w.window)  # one shape: one compile
        for window, c in zip(w.window, w.core):
            assert window.start <= c.start and c.stop <= window.stop
            # Context on each side, unless the window stops at the volume's face.
            assert window.start == 0 or c.start - window.start >= context
            assert window.stop == resolution or window.stop - c.stop >= context
    assert (covered == 1).all()


def test_choose_tile_from_memory():
    config = cfg.from_dict({"data": {"resolution": 512}, "model": {"base_filters": 32, "depth": 4}})
    assert infer.choose_tile(config, 1, memory=2**50) == 0
    tile = infer.choose_tile(config, 1, memory=16 * 2**30)
    assert 0 < tile < 512 and tile % config.alignment == 0
    assert infer.choose_tile(config, 4, memory=16 * 2**30) < tile  # more windows per step
    assert infer.choose_tile(config, 1, memory=2**20) == config.alignment


def test_tile_must_be_aligned():
    model = random_model(3)
    with pytest.raises(CtsegError, match="multiple of"):
        infer.Engine(model, tile=6)
    assert infer.Engine(model, tile=64).tile == 0  # a core as large as the grid is whole


def test_softmax_in_place():
    logits = np.random.default_rng(0).normal(size=(40, 3, 2, 3)).astype(np.float32)
    expected = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    probs = infer.softmax_(logits.copy())
    np.testing.assert_allclose(probs, expected, rtol=1e-6)


def test_activation_estimate_grows_with_width():
    small = cfg.from_dict({"model": {"base_filters": 16}})
    large = dataclasses.replace(small, model=dataclasses.replace(small.model, base_filters=32))
    fixed = infer.activation_bytes_per_voxel(
        dataclasses.replace(small, model=dataclasses.replace(small.model, base_filters=0))
    )
    assert infer.activation_bytes_per_voxel(large) - fixed == 2 * (
        infer.activation_bytes_per_voxel(small) - fixed
    )
