"""Programs compiled ahead of time, and what XLA says of them.

The training step and the inference pass compiled from abstract inputs
(`jax.ShapeDtypeStruct`s carrying their shardings; the state from `jax.eval_shape`), so
that nothing of a 512³ grid is allocated to compile for it; a compiled program's memory
per device and FLOPs from XLA's own analysis. Training compiles its step here, and `ctseg
plan` (`ctseg.model.plan`), `ctseg bench`, inference's plans and the targets read the
figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from ctseg.config import Config
from ctseg.model import step
from ctseg.parallel.partition import ACTIVATION_SPEC, replicated_shapes

LABEL_DTYPE = jnp.int32  # labels as the input pipeline hands them to the step


@dataclass(frozen=True)
class Memory:
    """Per-device bytes of one compiled program, as XLA's buffer assignment reports them."""

    arguments: int
    outputs: int
    temporaries: int
    aliased: int  # outputs written into donated argument buffers

    @property
    def total(self) -> int:
        return self.arguments + self.outputs + self.temporaries - self.aliased


def global_image_shape(config: Config) -> tuple[int, ...]:
    r = config.data.resolution
    return (config.train.batch_size, r, r, r, 1)


# --------------------------------------------------------------------------- abstract inputs


def replicated_abstract_state(config: Config, mesh: Mesh) -> tuple[nnx.GraphDef, step.TrainState]:
    """The train state's shapes (no values), replicated over `mesh`, and the model's graphdef."""
    graphdef, shapes = step.abstract_state(config)
    return graphdef, replicated_shapes(shapes, mesh)


def abstract_batch(config: Config, mesh: Mesh) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Image and label descriptions, sharded as the step expects them."""
    shape = global_image_shape(config)
    image = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, ACTIVATION_SPEC))
    label = jax.ShapeDtypeStruct(
        shape[:-1], LABEL_DTYPE, sharding=NamedSharding(mesh, step.LABEL_SPEC)
    )
    return image, label


def lower_train_step(
    graphdef: nnx.GraphDef,
    config: Config,
    mesh: Mesh,
    state: Any,
    image: Any,
    label: Any,
    frozen_norm: bool = False,
) -> jax.stages.Lowered:
    """The jitted training step lowered for these (abstract or concrete) arguments.

    The state is donated, as a training loop does, so its buffers are reused
    for the new state and count once in the memory analysis.
    """
    train_step = step.make_train_step(graphdef, config, mesh, frozen_norm)
    return jax.jit(train_step, donate_argnums=0).lower(state, image, label)


def compile_train_step(
    graphdef: nnx.GraphDef,
    config: Config,
    mesh: Mesh,
    state: Any,
    image: Any,
    label: Any,
    frozen_norm: bool = False,
) -> jax.stages.Compiled:
    """`lower_train_step`, compiled."""
    return lower_train_step(graphdef, config, mesh, state, image, label, frozen_norm).compile()


def lower_predict(
    graphdef: nnx.GraphDef, config: Config, mesh: Mesh, state: step.TrainState, image: Any
) -> jax.stages.Lowered:
    predict = step.make_predict(graphdef, config, mesh)
    return jax.jit(predict).lower(state.params, state.stats, image)


def memory_of(compiled: jax.stages.Compiled) -> Memory:
    """Per-device memory: an SPMD program is compiled once for every device alike."""
    stats = compiled.memory_analysis()
    return Memory(
        arguments=stats.argument_size_in_bytes,
        outputs=stats.output_size_in_bytes,
        temporaries=stats.temp_size_in_bytes,
        aliased=stats.alias_size_in_bytes,
    )


def flops_of(
    lowered: jax.stages.Lowered, compiled: jax.stages.Compiled, mesh: Mesh
) -> float | None:
    """FLOPs of the whole program: XLA counts the per-device program, so × devices; None
    where the compiler counts none (a GPU or TPU compiled for without one).

    Counted on the program as lowered, before XLA optimises it, where the backend can: a
    GPU's optimised program calls cuDNN for its convolutions, which XLA's count of it
    leaves out (a small share of the true count:
    docs/experiments/design-figures.md#flop-counts), so a GPU's compiled count is never
    used. Elsewhere the compiled
    program's count stands in for a lowered one the backend does not give.
    `cost_analysis()` is a dict in recent JAX and a one-element list in older versions.
    """
    on_gpu = mesh.devices.flat[0].platform in ("gpu", "cuda", "rocm")
    for stage in (lowered,) if on_gpu else (lowered, compiled):
        costs = stage.cost_analysis()
        if isinstance(costs, (list, tuple)):
            costs = costs[0] if costs else None
        if costs and "flops" in costs:
            return float(costs["flops"]) * mesh.size
    return None
