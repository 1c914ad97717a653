"""What training measures between steps, on the run's own grid: the validation split's Dice,
and the batch-norm statistics that inference will use (pooled over training volumes).

Both run the compiled inference-mode programs on the mesh the loop trains on, so a
partitioned run measures what an unpartitioned one would.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.experimental import multihost_utils

from ctseg.config import Config
from ctseg.data.store import Store
from ctseg.labels import grid_dice
from ctseg.model.step import TrainState
from ctseg.training.pipeline import statistics_batches, validation_batches


def validation_dice(
    segment: Any, state: TrainState, store: Store, config: Config, mesh: Any
) -> dict[str, float]:
    """Mean per-case grid Dice of liver and tumour over the validation split."""
    scores = []
    for ids, image, labels in validation_batches(store, config, mesh):
        # The labels are sharded over the mesh, possibly over several hosts:
        # gather the whole (small, uint8) label maps on every process.
        predicted = multihost_utils.process_allgather(
            segment(state.weights, state.stats, image), tiled=True
        )
        for i in range(len(ids)):
            scores.append(grid_dice(predicted[i], labels[i]))
    if not scores:
        return {}
    return {k: float(np.mean([s[k] for s in scores])) for k in ("liver", "tumour")}


def population_statistics(
    batch_statistics: Any, pool: Any, state: TrainState, store: Store, config: Config, mesh: Any
) -> TrainState:
    """`state` with the batch-norm statistics that inference will use.

    With `train.bn_population_volumes` > 0: pooled over that many training
    volumes at the weights inference uses (`TrainState.weights`: the moving
    average where `train.ema_decay` > 0), so that they depend on those alone.
    The running averages they replace trail the parameters by about
    1 / (1 − momentum) steps and follow the last few volumes, which with one
    whole volume per step can put the liver far outside the liver.
    """
    if config.train.bn_population_volumes == 0:
        return state
    per_batch = [
        batch_statistics(state.weights, state.stats, image)
        for image in statistics_batches(store, config, mesh)
    ]
    return state._replace(stats=pool(per_batch))
