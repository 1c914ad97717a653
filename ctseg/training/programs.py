"""A training run's compiled programs, and the check that its step fits the devices.

They compile in the background while the run initialises its state: the training step
and the on-device augmentation side by side, the held-statistics step after the training
step; the inference-mode programs that validate and pool the batch-norm statistics are
jitted here and compile when first called. `ctseg.training.loop` runs them.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
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


class Programs:
    """A run's compiled programs, compiled in the background from the moment the run
    starts: they need only the state's shapes (`aot.replicated_abstract_state`), so the model's
    initialisation, a checkpoint's restore and the fingerprint's record go on beside them.

    The training step and the on-device augmentation (`augmenter`) compile side by side
    (the step's memory need checked on accelerators; each then run as it is: compiling
    again would cost as much where the compilation cache is off); the held-statistics
    step after the training step, awaited only when its phase begins; the inference-mode
    programs that validate and pool the batch-norm statistics are jitted here and compile
    when first called.

    The held step has the training step's convolutions. Compiled after it, it finds their
    tuning (a GPU times each convolution's algorithms by running them) in the process's
    cache; compiled beside it, both tuned the same convolutions on one GPU at once, and
    lits256's first step on an H100 came 134 s after the command started, against 73.5 s
    with the held step compiled mid-run and 67.9 s with it compiled after
    (docs/experiments/gpu.md)."""

    def __init__(self, config: cfg.Config, mesh: Any, store: Store, hold_from: int):
        graphdef, state = aot.replicated_abstract_state(config, mesh)
        batch = aot.abstract_batch(config, mesh)
        step = partial(aot.compile_train_step, graphdef, config, mesh, state, *batch)

        def checked_step() -> jax.stages.Compiled:
            compiled = step()
            check_memory(compiled, config, list(mesh.devices.flat))
            return compiled

        def held_step() -> jax.stages.Compiled:
            self._train.result()  # after the training step; not at all where it failed
            return step(held_norm=True)

        # Two workers: the step and the augmentation; the held step takes the first free.
        pool = ThreadPoolExecutor(2, thread_name_prefix="compile")
        self._train: Future[Any] = pool.submit(checked_step)
        self._augmenter: Future[Any] | None = (
            pool.submit(augmenter_for, store, config, mesh) if config.augment.on_device else None
        )
        self._held: Future[Any] | None = (
            pool.submit(held_step) if hold_from < config.train.steps else None
        )
        pool.shutdown(wait=False)  # its tasks still run
        predict = make_predict(graphdef, config, mesh)
        self.segment = jax.jit(lambda *args: jnp.argmax(predict(*args), axis=-1).astype(jnp.uint8))
        self.batch_statistics = jax.jit(make_batch_statistics(graphdef, config, mesh))
        self.pool = jax.jit(pool_statistics, out_shardings=NamedSharding(mesh, REPLICATED))

    @property
    def train_step(self) -> jax.stages.Compiled:
        """The training step, once compiled and found to fit (a CtsegError where not)."""
        return self._train.result()

    @property
    def augmenter(self) -> Augmenter | None:
        """The on-device augmentation, once compiled; None where the host augments."""
        return None if self._augmenter is None else self._augmenter.result()

    def step_for(self, step: int, hold_from: int) -> Any:
        """The program that trains step `step`: on held statistics from `hold_from` on."""
        return self.train_step if step < hold_from else self._held.result()
