"""Pure, jit-able steps: the partitioned training step and the inference pass.

`make_train_step` and `make_predict` return functions of plain pytrees that
run over a mesh with the config's partitioner; the loop (`train.py`), the
inference engine (`infer.py`), `ctseg plan` and `ctseg bench` all use them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ctseg import unet
from ctseg.config import Config, TrainConfig
from ctseg.losses import segmentation_loss
from ctseg.partition import ACTIVATION_SPEC, REPLICATED, Comm, partitioned

LABEL_SPEC = P("data", "x", "y", "z")


class TrainState(NamedTuple):
    step: jax.Array
    params: nnx.State
    stats: nnx.State
    opt_state: optax.OptState


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


def init_state(config: Config) -> tuple[nnx.GraphDef, TrainState]:
    graphdef, params, stats = unet.create(config.model, config.train.seed)
    opt_state = make_optimizer(config.train).init(params)
    return graphdef, TrainState(jnp.zeros((), jnp.int32), params, stats, opt_state)


def make_loss(graphdef: nnx.GraphDef, config: Config, mesh: Mesh) -> Callable[..., Any]:
    """loss(params, stats, image, label) -> (loss, (parts, new_stats)), partitioned over `mesh`."""
    tc = config.train

    def body(comm: Comm, params, stats, image, label):
        logits, new_stats = unet.apply(graphdef, params, stats, image, comm, train=True)
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


def make_train_step(graphdef: nnx.GraphDef, config: Config, mesh: Mesh) -> Callable[..., Any]:
    """train_step(state, image, label) -> (state, metrics); jit it (plan/bench lower it)."""
    loss_fn = make_loss(graphdef, config, mesh)
    optimizer = make_optimizer(config.train)

    def train_step(state: TrainState, image: jax.Array, label: jax.Array):
        (loss, (parts, stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, state.stats, image, label
        )
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **parts}
        return TrainState(state.step + 1, params, stats, opt_state), metrics

    return train_step


def make_predict(graphdef: nnx.GraphDef, config: Config, mesh: Mesh) -> Callable[..., Any]:
    """predict(params, stats, image) -> logits [b, x, y, z, 3], inference mode.

    Logits, not probabilities: the argmax needs no softmax, and tiled inference
    compares and stitches logits before a single softmax of the whole grid.
    """

    def body(comm: Comm, params, stats, image):
        logits, _ = unet.apply(graphdef, params, stats, image, comm, train=False)
        return logits

    return partitioned(
        body,
        mesh,
        config.mesh.partitioner,
        in_specs=(REPLICATED, REPLICATED, ACTIVATION_SPEC),
        out_specs=ACTIVATION_SPEC,
    )
