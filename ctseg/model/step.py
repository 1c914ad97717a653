"""Pure, jit-able steps: the partitioned training step, the inference pass, and
the population statistics of batch normalisation.

`make_train_step`, `make_predict` and `make_batch_statistics` return functions
of plain pytrees that run over a mesh with the config's partitioner; the training
loop (`ctseg.training`), the inference engine (`ctseg.inference`), `ctseg plan` and
`ctseg bench` use them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ctseg.config import Config, ModelConfig, TrainConfig
from ctseg.model import unet
from ctseg.model.losses import segmentation_loss
from ctseg.parallel.partition import ACTIVATION_SPEC, REPLICATED, Comm, partitioned
from ctseg.parallel.xla_options import compile_unoptimised

LABEL_SPEC = P("data", "x", "y", "z")


class TrainState(NamedTuple):
    step: jax.Array
    params: nnx.State
    stats: nnx.State
    opt_state: optax.OptState
    # With `train.ema_decay` > 0: the moving average of `params` that validation and
    # inference use (None otherwise, so that such runs keep their checkpoints' form).
    average: nnx.State | None = None

    @property
    def weights(self) -> nnx.State:
        """The weights that validate, pool the batch-norm statistics and predict."""
        return self.params if self.average is None else self.average


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warm-up, cosine decay and global-norm clipping."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=tc.learning_rate,
        warmup_steps=min(tc.warmup_steps, tc.steps),
        decay_steps=max(tc.steps, tc.warmup_steps + 1),
        end_value=0.01 * tc.learning_rate,
    )
    return optax.chain(
        optax.clip_by_global_norm(tc.grad_clip),
        optax.adamw(schedule, weight_decay=tc.weight_decay),
    )


def init_state(config: Config, sharding: Any = None) -> tuple[nnx.GraphDef, TrainState]:
    """The model's graphdef and a fresh train state made by one program, placed by
    `sharding` (replicated over a mesh, say; JAX's default device without one)."""
    graphdef, _ = abstract_state(config)
    return graphdef, _fresh_state(config.model, config.train, sharding)()


@functools.cache
def _fresh_state(model: ModelConfig, tc: TrainConfig, sharding: Any) -> Any:
    def fresh() -> TrainState:
        _, params, stats = unet.build(model, tc.seed)
        opt_state = make_optimizer(tc).init(params)
        average = jax.tree.map(jnp.copy, params) if tc.ema_decay > 0 else None
        return TrainState(jnp.zeros((), jnp.int32), params, stats, opt_state, average)

    placed = {} if sharding is None else {"out_shardings": sharding}
    return compile_unoptimised(jax.jit(fresh, **placed).lower())


def abstract_state(config: Config) -> tuple[nnx.GraphDef, TrainState]:
    """The model's graphdef and a fresh train state's shapes, without allocating it."""
    graphdef, params, stats = unet.abstract(config.model)
    opt_state = jax.eval_shape(make_optimizer(config.train).init, params)
    average = params if config.train.ema_decay > 0 else None
    step = jax.ShapeDtypeStruct((), jnp.int32)
    return graphdef, TrainState(step, params, stats, opt_state, average)


def ema_decay_at(decay: float, step: jax.Array) -> jax.Array:
    """The moving average's decay after `step` updates: `decay`, lower at first
    ((1 + step) / (10 + step), as TensorFlow's ExponentialMovingAverage with
    num_updates), so that the average is not held near the initial weights."""
    step = jnp.asarray(step, jnp.float32)
    return jnp.minimum(jnp.float32(decay), (1.0 + step) / (10.0 + step))


def update_average(average: nnx.State, params: nnx.State, decay: jax.Array) -> nnx.State:
    return jax.tree.map(lambda a, p: decay * a + (1.0 - decay) * p, average, params)


def make_loss(
    graphdef: nnx.GraphDef, config: Config, mesh: Mesh, frozen_norm: bool = False
) -> Callable[..., Any]:
    """loss(params, stats, image, label) -> (loss, (parts, new_stats)), partitioned over `mesh`.

    `frozen_norm`: batch norm in inference mode, normalising by `stats` and leaving
    them as they are (`train.frozen_norm_share`).
    """
    tc = config.train

    def body(comm: Comm, params, stats, image, label):
        logits, new_stats = unet.apply(graphdef, params, stats, image, comm, train=not frozen_norm)
        loss, parts = segmentation_loss(logits, label, comm, tc.class_weights, tc.dice_weight)
        return loss, parts, new_stats

    run = partitioned(
        body,
        mesh,
        config.mesh.partitioner,
        in_specs=(REPLICATED, REPLICATED, ACTIVATION_SPEC, LABEL_SPEC),
        out_specs=(REPLICATED, REPLICATED, REPLICATED),
    )

    def loss_fn(params, stats, image, label):
        loss, parts, new_stats = run(params, stats, image, label)
        return loss, (parts, new_stats)

    return loss_fn


def make_train_step(
    graphdef: nnx.GraphDef, config: Config, mesh: Mesh, frozen_norm: bool = False
) -> Callable[..., Any]:
    """train_step(state, image, label) -> (state, metrics); jit it (plan/bench lower it).

    `frozen_norm`: the step of `train.frozen_norm_share`, see `make_loss`.
    """
    loss_fn = make_loss(graphdef, config, mesh, frozen_norm)
    optimizer = make_optimizer(config.train)
    decay = config.train.ema_decay

    def train_step(state: TrainState, image: jax.Array, label: jax.Array):
        (loss, (parts, stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, state.stats, image, label
        )
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        average = state.average
        if average is not None:
            average = update_average(average, params, ema_decay_at(decay, state.step))
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **parts}
        return TrainState(state.step + 1, params, stats, opt_state, average), metrics

    return train_step


def _of_image(body: Callable[..., Any], config: Config, mesh: Mesh, out_specs: Any):
    """`body(comm, params, stats, image)` partitioned over `mesh`, the image sharded."""
    return partitioned(
        body,
        mesh,
        config.mesh.partitioner,
        in_specs=(REPLICATED, REPLICATED, ACTIVATION_SPEC),
        out_specs=out_specs,
    )


def make_predict(graphdef: nnx.GraphDef, config: Config, mesh: Mesh) -> Callable[..., Any]:
    """predict(params, stats, image) -> logits [b, x, y, z, 3], inference mode.

    Logits, not probabilities: the argmax needs no softmax, and tiled inference
    compares and stitches logits before a single softmax of the whole grid.
    """

    def body(comm: Comm, params, stats, image):
        logits, _ = unet.apply(graphdef, params, stats, image, comm, train=False)
        return logits

    return _of_image(body, config, mesh, out_specs=ACTIVATION_SPEC)


def make_batch_statistics(graphdef: nnx.GraphDef, config: Config, mesh: Mesh) -> Callable[..., Any]:
    """batch_statistics(params, stats, image) -> every batch norm's mean and variance on `image`."""

    def body(comm: Comm, params, stats, image):
        return unet.batch_statistics(graphdef, params, stats, image, comm)

    return _of_image(body, config, mesh, out_specs=REPLICATED)


def pool_statistics(per_batch: list[nnx.State]) -> nnx.State:
    """Population statistics from equal-sized batches' own statistics.

    The mean of their means, and their pooled variance: the mean within-batch
    variance plus the variance of the batch means, which is the variance of all
    their voxels taken together (no E[x²] − E[x]² cancellation). These replace
    the running averages for inference: "precise batch norm" (Wu & Johnson,
    2021). Still one mean and variance per channel, so inference stays a
    per-voxel affine map (invariant 6).
    """

    def pool(nodes: list[dict]) -> dict:
        if set(nodes[0]) == {"mean", "var"}:
            means = jnp.stack([n["mean"] for n in nodes])
            mean = means.mean(axis=0)
            within = jnp.stack([n["var"] for n in nodes]).mean(axis=0)
            return {"mean": mean, "var": within + jnp.square(means - mean).mean(axis=0)}
        return {key: pool([n[key] for n in nodes]) for key in nodes[0]}

    pooled = jax.tree.map(lambda leaf: leaf, per_batch[0])  # a new State of the same form
    nnx.replace_by_pure_dict(pooled, pool([nnx.to_pure_dict(s) for s in per_batch]))
    return pooled
