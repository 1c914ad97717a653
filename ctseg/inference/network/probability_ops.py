"""The class probabilities of the network's logits, on JAX arrays whichever backend ran it:
the softmax, the mirrored passes' sum (each flipped back) and their mean.

ONNX Runtime's logits come to the host CPU's JAX device without a copy
(`OnnxBackend.adopt_logits`), so both backends share these programs and the way back to the
scan (`ctseg.inference.scan.way_back`): XLA:CPU fuses them where NumPy would make a pass per
operation (measured faster: docs/experiments/design-figures.md#probabilities).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


@jax.jit
def softmax(logits: jax.Array) -> jax.Array:
    """Class probabilities of logits [x, y, z, C]."""
    return jax.nn.softmax(logits, axis=-1)


@partial(jax.jit, static_argnums=1)
def unflipped(logits: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """The probabilities of a mirrored pass's logits, mirrored back along `axes`."""
    return jnp.flip(jax.nn.softmax(logits, axis=-1), axes)


# The running sum is updated in place: a box's probabilities are the largest array a
# prediction holds.
@partial(jax.jit, static_argnums=2, donate_argnums=0)
def add_unflipped(total: jax.Array, logits: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """`total` plus `unflipped(logits, axes)`."""
    return total + unflipped(logits, axes)


@partial(jax.jit, static_argnums=1, donate_argnums=0)
def mean(total: jax.Array, count: int) -> jax.Array:
    """The mean of `count` passes summed in `total`."""
    return total / count
