"""The inference engine: exact level-wise tiled inference equals the whole-volume pass."""

import dataclasses
import math

import jax
import numpy as np
import pytest

from ctseg import config as cfg
from ctseg import infer, unet
from ctseg.errors import CtsegError
from ctseg.partition import LOCAL

RESOLUTION = 32


def random_model(
    depth: int, dtype: str = "float32", spatial: tuple[int, int, int] = (2, 2, 1)
) -> infer.Model:
    """An untrained tiny model whose batch-norm running statistics are not the identity."""
    config = cfg.from_dict(
        {
            "data": {"resolution": RESOLUTION},
            "model": {"base_filters": 2, "depth": depth, "dtype": dtype},
            "mesh": {"spatial": list(spatial)},
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


def _progress(engine: infer.Engine, image: np.ndarray) -> tuple[np.ndarray, list]:
    calls: list[tuple[int, int]] = []
    logits = engine.logits(image, progress=lambda *call: calls.append(call))
    return logits, calls


@pytest.mark.parametrize(
    ("depth", "tiles"),
    [
        # depth 2, levels 32 and 16: cores 6 (level 0: 6·5 + 2; level 1: 6, 6, 4), 12
        # (14 balanced: 12, 12, 8; level 1: 8, 8), 16 (level 1 in one window).
        (2, [6, 14, 16]),
        # depth 3, levels 32, 16, 8: cores 6 (6·5 + 2; 6, 6, 4; 8 whole) and 12 (12, 12, 8;
        # 8, 8 down, the 16 grid whole up).
        (3, [6, 12]),
    ],
)
def test_level_wise_tiles_equal_whole_volume(depth, tiles, image):
    model = random_model(depth)
    whole = infer.Engine(model, tile=0)
    assert whole.tile == 0 and whole.stages == []
    reference = whole.logits(image)
    assert reference.shape == (RESOLUTION,) * 3 + (3,)
    assert np.ptp(reference.argmax(-1)) > 0  # a non-trivial labelling to compare
    for tile in tiles:
        # Four windows per step, one per device, as on four accelerators.
        engine = infer.Engine(model, tile=tile, devices=jax.devices()[:4])
        assert [(s.kind, s.level) for s in engine.stages] == infer.stage_order(depth)
        assert f"tiles ≤ {tile}³ ({2 * depth - 1} stages" in engine.description
        logits, calls = _progress(engine, image)
        total = sum(len(s.windows()) for s in engine.stages)
        assert total > 2 * depth - 1  # some stage really is tiled
        assert calls[-1] == (total, total)
        assert logits.dtype == np.float32 and logits.flags.writeable
        np.testing.assert_allclose(logits, reference, rtol=0, atol=1e-4, err_msg=f"tile {tile}")
        np.testing.assert_array_equal(logits.argmax(-1), reference.argmax(-1))


def test_a_model_trained_16_way_predicts_on_the_devices_there(image):
    """The training mesh is a training fact: on 1 device or 4, whole or tiled, the logits are
    those of one plain unpartitioned pass of the same weights."""
    model = random_model(2, spatial=(4, 4, 1))
    reference = np.asarray(
        jax.jit(
            lambda x: unet.apply(model.graphdef, model.params, model.stats, x, LOCAL, train=False)[
                0
            ]
        )(image[None, ..., None])[0]
    )
    for count in (1, 4):
        for tile in (0, 14):
            engine = infer.Engine(model, tile=tile, devices=jax.devices()[:count])
            if tile == 0:
                assert engine.spatial == ((1, 1, 1) if count == 1 else (2, 2, 1))
            logits = engine.logits(image)
            np.testing.assert_allclose(
                logits, reference, rtol=0, atol=1e-5, err_msg=f"{count} devices, tile {tile}"
            )


def test_mirrored_tta_is_the_mean_of_eight_flipped_passes_and_mirror_equivariant(image):
    engine = infer.Engine(random_model(2), tile=0)
    calls: list[tuple[int, int]] = []
    mirrored = infer.probabilities(engine, image, True, lambda *call: calls.append(call))
    assert calls[-1] == (8, 8)
    passes = []
    for axes in [(), (0,), (1,), (2,), (0, 1), (0, 2), (1, 2), (0, 1, 2)]:
        logits = engine.logits(np.ascontiguousarray(np.flip(image, axes)))
        passes.append(np.flip(jax.nn.softmax(logits, axis=-1), axes))
    np.testing.assert_allclose(mirrored, np.mean(passes, axis=0), rtol=0, atol=1e-6)
    # Mirroring the scan mirrors the prediction: no axis is preferred any more.
    flipped = infer.probabilities(engine, np.flip(image, (0, 2)), True)
    np.testing.assert_allclose(np.flip(flipped, (0, 2)), mirrored, rtol=0, atol=1e-6)
    plain = infer.probabilities(engine, image, False)
    assert np.abs(plain - mirrored).max() > 1e-3  # the passes do differ on this model


def test_a_whole_volume_that_does_not_fit_is_one_line(monkeypatch):
    monkeypatch.setattr(infer.dev, "free_memory", lambda devices: 2**20)  # 1 MiB free
    with pytest.raises(
        CtsegError,
        match=r"a whole-volume pass of the 32³ grid needs .* GiB per "
        r"device, more than the 0\.0 GiB free on CPU .*; use tiles",
    ):
        infer.Engine(random_model(2), tile=0)


def test_windows_run_one_per_device():
    model = random_model(2)  # trained on a [2, 2, 1] mesh: that does not matter
    assert infer.Engine(model, tile=6).description.endswith(" windows)")
    assert infer.Engine(model, tile=6, devices=jax.devices()[:4]).description.endswith(
        " windows, 4 at a time)"
    )


def test_level_wise_bfloat16_equals_whole_volume_bfloat16(image):
    """Intermediates stay bfloat16, as in the whole pass: the stitched logits match it."""
    model = random_model(3, dtype="bfloat16")
    reference = infer.Engine(model, tile=0).logits(image)
    logits = infer.Engine(model, tile=12).logits(image)
    # Measured bit-equal (jax 0.10.2, CPU). Allowed: a rare last-bit difference of a
    # float32 sum flipping a bfloat16 rounding, about one bfloat16 step of the logits.
    assert (logits == reference).mean() > 0.99
    np.testing.assert_allclose(logits, reference, rtol=0, atol=1e-2)
    np.testing.assert_array_equal(logits.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize(
    ("resolution", "depth", "tile"),
    [(32, 2, 6), (32, 3, 12), (64, 4, 10), (512, 4, 128), (48, 4, 8)],
)
def test_stage_windows_cover_each_level_once_with_enough_context(resolution, depth, tile):
    config = cfg.from_dict(
        {"data": {"resolution": resolution}, "model": {"base_filters": 2, "depth": depth}}
    )
    for stage in infer.plan_stages(config, tile):
        size = resolution >> stage.level
        assert stage.size == size
        assert stage.core <= tile or stage.core == size  # a stage in one window may be larger
        covered = np.zeros((size,) * 3, np.int8) if size <= 64 else None
        for w in stage.windows():
            if covered is not None:
                covered[w.core] += 1
            assert all(s.stop - s.start == stage.extent for s in w.window)  # one compile
            for window, core in zip(w.window, w.core):
                assert window.start <= core.start and core.stop <= window.stop
                # Context on each side, unless the window stops at the level's face.
                assert window.start == 0 or core.start - window.start >= stage.context
                assert window.stop == size or window.stop - core.stop >= stage.context
                if stage.kind != infer.BOTTOM:  # pooled or read through halved windows
                    assert window.start % 2 == core.start % 2 == core.stop % 2 == 0
        if covered is not None:
            assert (covered == 1).all(), (stage, np.unique(covered))
        else:  # 512³: count per axis
            assert sum(1 for _ in stage.windows()) == math.ceil(size / stage.core) ** 3


@pytest.mark.parametrize(
    ("size", "core", "context"), [(32, 12, 24), (32, 4, 10), (64, 16, 8), (16, 6, 2)]
)
def test_windows_cover_the_grid_once_with_enough_context(size, core, context):
    windows = infer.plan_windows(size, core, context)
    covered = np.zeros((size,) * 3, int)
    extent = min(core + 2 * context, size)
    for w in windows:
        covered[w.core] += 1
        assert all(s.stop - s.start == extent for s in w.window)  # one shape: one compile
        for window, c in zip(w.window, w.core):
            assert window.start <= c.start and c.stop <= window.stop
            assert window.start == 0 or c.start - window.start >= context
            assert window.stop == size or window.stop - c.stop >= context
    assert (covered == 1).all()


def test_stage_margins_cover_the_receptive_field():
    """Down/bottom stages: two convolutions; up: the skip's two and the decoder's two."""
    config = cfg.from_dict({"model": {"kernel_size": 5, "depth": 3}})
    assert infer.stage_context(config, infer.DOWN) == 4
    assert infer.stage_context(config, infer.BOTTOM) == 4
    assert infer.stage_context(config, infer.UP) == 8


LITS512 = cfg.from_dict({"data": {"resolution": 512}, "model": {"base_filters": 32, "depth": 4}})


def test_automatic_plan_from_memory():
    config = LITS512
    assert infer.choose_stages(config, 1, memory=2**50, itemsize=2) == []  # whole volume
    stages = infer.choose_stages(config, 1, memory=16 * 2**30, itemsize=2)
    assert [(s.kind, s.level) for s in stages] == infer.stage_order(4)
    level0 = [s.core for s in stages if s.level == 0]
    assert all(0 < core < 512 and core % 2 == 0 for core in level0)
    for stage in stages:  # every stage's step fits what its materialised arrays leave
        resident = infer.resident_bytes(config, stage.kind, stage.level, 2)
        room = infer._MEMORY_SHARE * 16 * 2**30 - resident
        assert infer.window_bytes(config, stage.level, stage.extent) <= room
    # Less memory, more windows per step or float32 intermediates: smaller cores.
    for smaller in (
        infer.choose_stages(config, 1, memory=8 * 2**30, itemsize=2),
        infer.choose_stages(config, 4, memory=16 * 2**30, itemsize=2),
        infer.choose_stages(config, 1, memory=16 * 2**30, itemsize=4),
    ):
        assert all(a.core <= b.core for a, b in zip(smaller, stages))
        assert any(a.core < b.core for a, b in zip(smaller, stages))
    # Nothing fits: small cores are the best chance.
    tiny = infer.choose_stages(config, 1, memory=2**20, itemsize=2)
    assert max(s.core for s in tiny) == 32


def test_memory_estimates():
    small = cfg.from_dict({"model": {"base_filters": 16}})
    large = dataclasses.replace(small, model=dataclasses.replace(small.model, base_filters=32))
    none = dataclasses.replace(small, model=dataclasses.replace(small.model, base_filters=0))
    fixed = infer.window_bytes(none, 0, 10)
    assert infer.window_bytes(large, 0, 10) - fixed == 2 * (
        infer.window_bytes(small, 0, 10) - fixed
    )
    assert infer.window_bytes(small, 1, 10) > infer.window_bytes(small, 0, 10)  # wider level
    assert infer.whole_volume_bytes(large) > infer.whole_volume_bytes(small)
    # bfloat16 intermediates halve everything but the float32 image and logits.
    for kind, level in infer.stage_order(LITS512.model.depth):
        f32 = infer.resident_bytes(LITS512, kind, level, 4)
        bf16 = infer.resident_bytes(LITS512, kind, level, 2)
        assert bf16 < f32 < 2 * bf16


def test_tile_must_be_even():
    model = random_model(3)
    with pytest.raises(CtsegError, match="must be even"):
        infer.Engine(model, tile=7)
    assert infer.Engine(model, tile=6).tile == 6  # no longer a multiple of 2^(depth-1)
    assert infer.Engine(model, tile=32).tile == 0  # a core as large as the grid is whole
    assert infer.Engine(model, tile=64).stages == []


def test_softmax_in_place():
    logits = np.random.default_rng(0).normal(size=(40, 3, 2, 3)).astype(np.float32)
    expected = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    probs = infer.softmax_(logits.copy())
    np.testing.assert_allclose(probs, expected, rtol=1e-6)
