"""Training loss: class-weighted softmax cross-entropy plus soft Dice on liver and tumour.

Every sum goes through `comm.sum`, so under spatial partitioning the loss is
the loss of the whole batch, not a mean of per-partition losses.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ctseg.labels import LIVER, TUMOUR, liver_mask, tumour_mask
from ctseg.parallel.partition import Comm

# Soft-Dice smoothing, in voxels: keeps the ratio defined when a structure is absent.
_DICE_SMOOTH = 1.0


def soft_dice(prob: jax.Array, target: jax.Array, comm: Comm) -> jax.Array:
    intersection = comm.sum(prob * target)
    return (2.0 * intersection + _DICE_SMOOTH) / (comm.sum(prob) + comm.sum(target) + _DICE_SMOOTH)


def segmentation_loss(
    logits: jax.Array,
    labels: jax.Array,
    comm: Comm,
    class_weights: Sequence[float],
    dice_weight: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss of logits [b, x, y, z, 3] against integer labels [b, x, y, z].

    Returns the scalar loss and its parts (cross-entropy, soft Dice of liver
    and tumour), all global over the mesh.
    """
    logits = logits.astype(jnp.float32)
    log_prob = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(log_prob, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    weight = jnp.asarray(class_weights, jnp.float32)[labels]
    cross_entropy = comm.sum(weight * nll) / comm.sum(weight)

    prob = jnp.exp(log_prob)
    liver = prob[..., LIVER] + prob[..., TUMOUR]  # the whole organ, as the LiTS liver Dice
    dice_liver = soft_dice(liver, liver_mask(labels).astype(jnp.float32), comm)
    dice_tumour = soft_dice(prob[..., TUMOUR], tumour_mask(labels).astype(jnp.float32), comm)
    loss = cross_entropy + dice_weight * (1.0 - 0.5 * (dice_liver + dice_tumour))
    parts = {"cross_entropy": cross_entropy, "dice_liver": dice_liver, "dice_tumour": dice_tumour}
    return loss, parts
