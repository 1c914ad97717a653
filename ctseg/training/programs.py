"""A training run's compiled programs, and the check that its step fits the devices.

`compile_programs` starts their compiles in the background while the run initialises its
state: the training step and the on-device augmentation side by side, the
frozen-statistics step after the training step; the inference-mode programs that validate
and pool the batch-norm statistics are jitted there and compile when first called.
`ctseg.training.loop` runs them (`Programs`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from ctseg import config as cfg
from ctseg.data.store import Store
from ctseg.errors import CtsegError
from ctseg.memory import human_bytes
from ctseg.model import aot
from ctseg.model.step import make_batch_statistics, make_predict, pool_statistics
from ctseg.parallel import devices as dev
from ctseg.parallel.partition import REPLICATED
from ctseg.training.augment import Augmenter
from ctseg.training.pipeline import augmenter_for


def check_memory(compiled: jax.stages.Compiled, config: cfg.Config, devices: list) -> None:
    """On accelerators: the compiled step must fit the devices' free memory."""
    if not dev.is_accelerator(devices):
        return  # simulated CPU devices share the host's RAM; the OS has the last word
    needed, free = aot.memory_of(compiled).total, dev.free_memory(devices)
    if needed > free:
        raise CtsegError(
            f"the training step on {config.data.resolution}³ "
            f"({list(config.mesh.spatial)}, batch {config.train.batch_size}) needs "
            f"{human_bytes(needed)} per device but {dev.describe(devices)} has "
            f"{human_bytes(free)} free; use more devices, a lower data.resolution, "
            "model.remat = true, or --device cpu"
        )


@dataclass(frozen=True)
class Programs:
    """A run's programs, made by `compile_programs`: the compiled ones awaited when first
    asked for, the inference-mode ones (`segment` validates, `batch_statistics` and `pool`
    pool the batch-norm statistics) jitted, compiling when first called."""

    frozen_from: int  # the first step (from 0) on frozen statistics: `train.frozen_from`
    segment: Callable[..., jax.Array]
    batch_statistics: Callable[..., Any]
    pool: Callable[..., Any]
    _train: Future[jax.stages.Compiled]
    _frozen: Future[jax.stages.Compiled] | None
    _augmenter: Future[Augmenter] | None

    @property
    def train_step(self) -> jax.stages.Compiled:
        """The training step, once compiled and found to fit (a CtsegError where not)."""
        return self._train.result()

    @property
    def augmenter(self) -> Augmenter | None:
        """The on-device augmentation, once compiled; None where the host augments."""
        return None if self._augmenter is None else self._augmenter.result()

    def step_for(self, step: int) -> jax.stages.Compiled:
        """The program that trains step `step` (from 0): on frozen statistics from
        `frozen_from` on."""
        if step < self.frozen_from or self._frozen is None:
            return self.train_step
        return self._frozen.result()


def compile_programs(config: cfg.Config, mesh: Any, store: Store) -> Programs:
    """Start compiling a run's programs in background threads and return them at once:
    they need only the state's shapes (`aot.replicated_abstract_state`), so the model's
    initialisation, a checkpoint's restore and the fingerprint's record go on beside them.

    The training step and the on-device augmentation compile side by side (the step's
    memory need checked on accelerators; each then run as it is: compiling again would
    cost as much where the compilation cache is off); the frozen-statistics step after
    the training step, awaited only when its phase begins.

    The frozen step has the training step's convolutions. Compiled after it, it finds their
    tuning (a GPU times each convolution's algorithms by running them) in the process's
    cache; compiled beside it, both tuned the same convolutions on one GPU at once, and
    the first step came much later (measured:
    docs/experiments/design-figures.md#training-programs)."""
    graphdef, state = aot.replicated_abstract_state(config, mesh)
    batch = aot.abstract_batch(config, mesh)
    step = partial(aot.compile_train_step, graphdef, config, mesh, state, *batch)

    def checked_step() -> jax.stages.Compiled:
        compiled = step()
        check_memory(compiled, config, list(mesh.devices.flat))
        return compiled

    def frozen_step() -> jax.stages.Compiled:
        train.result()  # after the training step; not at all where it failed
        return step(frozen_norm=True)

    frozen_from = config.train.frozen_from
    # Two workers: the step and the augmentation; the frozen step takes the first free.
    pool = ThreadPoolExecutor(2, thread_name_prefix="compile")
    train = pool.submit(checked_step)
    augmenter = (
        pool.submit(augmenter_for, store, config, mesh) if config.augment.on_device else None
    )
    frozen = pool.submit(frozen_step) if frozen_from < config.train.steps else None
    pool.shutdown(wait=False)  # its tasks still run
    predict = make_predict(graphdef, config, mesh)
    return Programs(
        frozen_from=frozen_from,
        segment=jax.jit(lambda *args: jnp.argmax(predict(*args), axis=-1).astype(jnp.uint8)),
        batch_statistics=jax.jit(make_batch_statistics(graphdef, config, mesh)),
        pool=jax.jit(pool_statistics, out_shardings=NamedSharding(mesh, REPLICATED)),
        _train=train,
        _frozen=frozen,
        _augmenter=augmenter,
    )
