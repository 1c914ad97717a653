"""Partitioning invariants: the partitioned U-Net equals the unpartitioned one.

Forward output, loss, every parameter gradient and the batch-norm statistics,
for several layouts under both partitioners (ARCHITECTURE.md, invariants 1, 4, 5).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import shard_global

from ctseg import config as cfg
from ctseg.model import image_conv, step, unet
from ctseg.model.losses import segmentation_loss
from ctseg.parallel import partition as pt

GRID = 16
CONFIG_OVERRIDES = [
    f"data.resolution={GRID}",
    "model.base_filters=2",
    "model.depth=3",
    "train.batch_size=2",
]
CONFIG = cfg.load(overrides=CONFIG_OVERRIDES)
LAYOUTS = [
    ((2, 1, 1), 1),
    ((1, 2, 2), 1),
    ((2, 2, 2), 1),
    ((4, 4, 1), 1),
    ((1, 4, 4), 1),
    ((2, 2, 2), 2),
]


def _batch():
    rng = np.random.default_rng(42)
    image = rng.uniform(-1, 1, (2, GRID, GRID, GRID, 1)).astype(np.float32)
    label = rng.integers(0, 3, (2, GRID, GRID, GRID)).astype(np.int32)
    return image, label


def _start(config, frozen_norm):
    """A fresh model; for a frozen-norm step, statistics unlike the initial ones, so that
    normalising by them shows."""
    graphdef, params, stats = unet.create(config.model, seed=0)
    return graphdef, params, jax.tree.map(lambda s: s + 0.5, stats) if frozen_norm else stats


def _loss_grads_and_logits(config, mesh, frozen_norm=False):
    graphdef, params, stats = _start(config, frozen_norm)
    loss_fn = step.make_loss(graphdef, config, mesh, frozen_norm)
    predict = step.make_predict(graphdef, config, mesh)

    @jax.jit
    def run(params, stats, image, label):
        (loss, (_, new_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, stats, image, label
        )
        # Predict with the freshly updated statistics so inference mode is exercised too.
        return loss, grads, new_stats, predict(params, new_stats, image)

    image, label = _batch()
    return jax.device_get(
        run(
            params,
            stats,
            shard_global(mesh, image),
            shard_global(mesh, label, step.LABEL_SPEC),
        )
    )


@pytest.fixture(scope="module")
def reference():
    return _loss_grads_and_logits(CONFIG, pt.make_mesh((1, 1, 1)))


def _relative_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


@pytest.mark.parametrize("partitioner", ["halo", "gspmd"])
@pytest.mark.parametrize("spatial,data", LAYOUTS)
def test_partitioned_step_equals_unpartitioned(reference, spatial, data, partitioner):
    config = cfg.load(
        overrides=[
            *CONFIG_OVERRIDES,
            f"mesh.spatial={list(spatial)}",
            f"mesh.data={data}",
            f"mesh.partitioner={partitioner}",
        ]
    )
    got = _loss_grads_and_logits(config, pt.make_mesh(spatial, data))
    names = ["loss", "gradients", "batch statistics", "logits"]
    for name, g, w in zip(names, got, reference, strict=True):
        g_leaves, w_leaves = jax.tree.leaves(g), jax.tree.leaves(w)
        assert len(g_leaves) == len(w_leaves)
        for gl, wl in zip(g_leaves, w_leaves, strict=True):
            assert _relative_error(gl, wl) <= 1e-5, name


@pytest.mark.parametrize("partitioner", ["halo", "gspmd"])
def test_frozen_norm_step_is_the_inference_network_on_every_layout(partitioner):
    """`train.frozen_norm_share`: the loss is that of the inference-mode logits, the
    statistics stay as they are, and a partitioned step equals the unpartitioned one."""

    def config(spatial, data):
        layout = [f"mesh.spatial={list(spatial)}", f"mesh.data={data}"]
        return cfg.load(overrides=[*CONFIG_OVERRIDES, *layout, f"mesh.partitioner={partitioner}"])

    want = _loss_grads_and_logits(config((1, 1, 1), 1), pt.make_mesh((1, 1, 1)), frozen_norm=True)
    loss, _, new_stats, logits = want
    _, _, stats = _start(CONFIG, frozen_norm=True)
    for a, b in zip(jax.tree.leaves(new_stats), jax.tree.leaves(stats), strict=True):
        np.testing.assert_array_equal(a, b)
    _, label = _batch()
    reference, _ = segmentation_loss(
        jnp.asarray(logits),
        jnp.asarray(label),
        pt.LOCAL,
        CONFIG.train.class_weights,
        CONFIG.train.dice_weight,
    )
    assert _relative_error(loss, reference) <= 1e-6
    got = _loss_grads_and_logits(config((2, 2, 2), 2), pt.make_mesh((2, 2, 2), 2), frozen_norm=True)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert _relative_error(g, w) <= 1e-5


@pytest.mark.parametrize("spatial,data", [((1, 1, 1), 1), ((2, 2, 1), 2)])
def test_the_first_convolution_as_matrix_products_is_the_same_step(
    reference, spatial, data, monkeypatch
):
    """On GPUs the image's convolution runs as the patches' matrix products
    (`image_conv`): run here on the CPU, the step is the one XLA's convolution gives,
    unpartitioned and partitioned (its weights' gradient summed over partitions)."""
    monkeypatch.setattr(image_conv, "MATRIX_PRODUCTS_ON", {"cpu": image_conv.as_matrix_products})
    layout = [f"mesh.spatial={list(spatial)}", f"mesh.data={data}"]
    config = cfg.load(overrides=[*CONFIG_OVERRIDES, *layout])
    got = _loss_grads_and_logits(config, pt.make_mesh(spatial, data))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(reference), strict=True):
        assert _relative_error(g, w) <= 2e-5  # float32 sums in blocks: another order


def test_gradients_are_not_trivially_zero(reference):
    _, grads, _, _ = reference
    assert all(np.linalg.norm(np.asarray(g)) > 0 for g in jax.tree.leaves(grads))


def test_bfloat16_compute_keeps_float32_parameters():
    model_cfg = cfg.ModelConfig(base_filters=2, depth=2, dtype="bfloat16")
    graphdef, params, stats = unet.create(model_cfg, seed=0)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    logits, _ = unet.apply(graphdef, params, stats, jnp.zeros((1, 8, 8, 8, 1)), pt.LOCAL, True)
    assert logits.dtype == jnp.float32 and logits.shape == (1, 8, 8, 8, 3)


def test_remat_changes_memory_not_results():
    base = cfg.ModelConfig(base_filters=2, depth=2)
    x = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (1, 8, 8, 8, 1)), jnp.float32)
    outs = []
    for remat in (False, True):
        graphdef, params, stats = unet.create(
            cfg.ModelConfig(**{**base.__dict__, "remat": remat}), 0
        )

        def loss(p, graphdef=graphdef, stats=stats):
            return jnp.sum(unet.apply(graphdef, p, stats, x, pt.LOCAL, True)[0] ** 2)

        outs.append(jax.grad(loss)(params))
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
        # float32 sums in another order: under remat the first convolution's weights'
        # gradient (`image_conv`) moved by up to 4e-5 where its largest element is 115,
        # and an element of 1.3 by 1.2e-5 of itself
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())


@pytest.mark.parametrize("depth,kernel", [(2, 3), (3, 3), (3, 5)])
def test_receptive_field_radius_bounds_the_dependency_of_every_output(depth, kernel):
    """The gradient of one output voxel reaches no input voxel beyond the radius,
    and does reach one at exactly the radius for some phase (the bound is tight)."""
    model_cfg = cfg.ModelConfig(base_filters=1, depth=depth, kernel_size=kernel)
    radius = unet.receptive_field_radius(model_cfg)
    graphdef, params, stats = unet.create(model_cfg, seed=0)
    # Positive weights everywhere: no accidental cancellation hides a dependency.
    params = jax.tree.map(lambda p: jnp.abs(p) + 0.1, params)
    size = 4 * radius + 4 * 2 ** (depth - 1)
    size += -size % 2 ** (depth - 1)
    side = 2 ** (depth - 1)  # the other two axes: as small as pooling allows
    x = jnp.full((1, size, side, side, 1), 0.5)

    reach = 0
    for out in range(size // 2 - 2 ** (depth - 1), size // 2 + 2 ** (depth - 1)):

        def voxel(inp, out=out):
            logits, _ = unet.apply(graphdef, params, stats, inp, pt.LOCAL, False)
            return logits[0, out, 0, 0, 0]

        support = np.nonzero(np.abs(np.asarray(jax.grad(voxel)(x))[0, :, :, :, 0]).sum((1, 2)))[0]
        reach = max(reach, abs(support - out).max())
    assert reach == radius


def test_a_training_mode_call_leaves_the_callers_host_statistics_alone():
    # Inference loads statistics as numpy arrays: an eager training-mode pass (the
    # statistics of a batch) must not write the batch's into them.
    config = cfg.load(overrides=["model.base_filters=2", "model.depth=2"])
    graphdef, params, stats = unet.create(config.model, seed=0)
    host = jax.tree.map(np.array, stats)
    before = jax.tree.map(np.copy, host)
    image = jnp.asarray(_batch()[0][:1])
    own = unet.batch_statistics(graphdef, params, host, image, pt.LOCAL)
    unet.apply(graphdef, params, host, image, pt.LOCAL, train=True)
    for kept, now, batch in zip(
        jax.tree.leaves(before), jax.tree.leaves(host), jax.tree.leaves(own), strict=True
    ):
        np.testing.assert_array_equal(now, kept)
        assert not np.array_equal(np.asarray(batch), kept)  # the batch's are not these


def test_the_moving_average_follows_the_trained_weights_step_by_step():
    """`train.ema_decay`: after each step the average is decay_t · average + (1 − decay_t) ·
    weights, decay_t = min(decay, (1 + t) / (10 + t)), starting from the initial weights."""
    # No warm-up, so that the weights move from the first step on.
    moving = ["train.ema_decay=0.5", "train.warmup_steps=0", "train.learning_rate=0.01"]
    config = cfg.load(overrides=[*CONFIG_OVERRIDES, *moving])
    mesh = pt.make_mesh((1, 1, 1))
    graphdef, state = step.init_state(config)
    train_step = jax.jit(step.make_train_step(graphdef, config, mesh))
    image, label = _batch()
    image, label = shard_global(mesh, image), shard_global(mesh, label, step.LABEL_SPEC)
    want = [np.asarray(leaf, np.float64) for leaf in jax.tree.leaves(state.params)]
    for t in range(3):
        state, _ = train_step(state, image, label)
        decay = min(0.5, (1 + t) / (10 + t))
        weights = [np.asarray(leaf, np.float64) for leaf in jax.tree.leaves(state.params)]
        want = [decay * a + (1 - decay) * w for a, w in zip(want, weights, strict=True)]
    got = jax.tree.leaves(state.average)
    assert all(np.max(np.abs(g - w)) <= 1e-6 for g, w in zip(got, want, strict=True))
    assert any(np.max(np.abs(g - w)) > 1e-4 for g, w in zip(got, weights, strict=True))
    # Without it the state holds no average, and inference uses the trained weights.
    _, plain = step.init_state(cfg.load(overrides=CONFIG_OVERRIDES))
    assert plain.average is None and plain.weights is plain.params
