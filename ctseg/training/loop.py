"""The training loop: `train_and_evaluate(config, store_dir, run_dir)`.

It writes the run directory (its layout: `ctseg.rundir`). Running the same
command on an existing RUN_DIR resumes from its latest checkpoint; because
batches and augmentation are functions of (seed, step), a resumed run ends with
the same parameters as an uninterrupted one (to the order of floating-point sums
when it resumes on another layout).
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from ctseg import atomic, lock
from ctseg import config as cfg
from ctseg.data.grids import GridSpec
from ctseg.data.store import Store
from ctseg.errors import CtsegError
from ctseg.evaluation import metrics
from ctseg.io import pictures
from ctseg.model import plan
from ctseg.model.step import (
    TrainState,
    init_state,
    make_batch_statistics,
    make_predict,
    pool_statistics,
)
from ctseg.parallel import devices as dev
from ctseg.parallel.partition import REPLICATED, make_mesh, replicated_shapes
from ctseg.run import fingerprint, rundir
from ctseg.run.checkpoints import Checkpoints
from ctseg.training.pipeline import Prefetcher, statistics_batches, validation_batches


@dataclass
class Progress:
    """What the loop reports after each step (the CLI turns it into a progress bar)."""

    step: int
    total: int
    loss: float
    steps_per_second: float
    val_dice: dict[str, float] | None
    held_norm: bool = False  # this step normalised by held statistics (`train.held_norm_steps`)


ProgressFn = Callable[[Progress], None]


def open_store(data_dir: Path, config: cfg.Config) -> Store:
    """The store as the run sees it: its own train/val split, or with `train.fold` ≥ 0
    the view of that cross-validation fold (`Store.for_fold`: the fold validates, the
    other folds train), so that the loop and the input pipeline read splits alike."""
    store = Store.open(data_dir)
    if store.resolution != config.data.resolution:
        raise CtsegError(
            f"{data_dir} holds a {store.resolution}³ grid but the config asks for "
            f"data.resolution = {config.data.resolution}; preprocess again or --set "
            f"data.resolution={store.resolution}"
        )
    wanted = GridSpec.of(config.data)
    if store.grid_spec != wanted:
        raise CtsegError(
            f"{data_dir} holds a store of {store.grid_spec.describe()} but the config asks for "
            f"{wanted.describe()} (data.grid, data.spacing); preprocess again with this config"
        )
    if config.train.fold >= 0:
        try:
            store = store.for_fold(config.train.fold)
        except CtsegError as exc:
            raise CtsegError(f"--fold {config.train.fold}: {exc}") from None
    if not store.split("train"):
        raise CtsegError(f"{data_dir} has no training cases")
    return store


def validate(
    segment, state: TrainState, store: Store, config: cfg.Config, mesh
) -> dict[str, float]:
    """Mean per-case grid Dice of liver and tumour over the validation split."""
    scores = []
    for ids, image, labels in validation_batches(store, config, mesh):
        # The labels are sharded over the mesh, possibly over several hosts:
        # gather the whole (small, uint8) label maps on every process.
        predicted = multihost_utils.process_allgather(
            segment(state.params, state.stats, image), tiled=True
        )
        for i in range(len(ids)):
            scores.append(metrics.grid_dice(predicted[i], labels[i]))
    if not scores:
        return {}
    return {k: float(np.mean([s[k] for s in scores])) for k in ("liver", "tumour")}


def population_statistics(
    batch_statistics, pool, state: TrainState, store: Store, config: cfg.Config, mesh
) -> TrainState:
    """`state` with the batch-norm statistics that inference will use.

    With `train.bn_population_volumes` > 0: pooled over that many training
    volumes at the current parameters, so that they depend on the parameters
    alone. The running averages they replace trail the parameters by about
    1 / (1 − momentum) steps and follow the last few volumes, which with one
    whole volume per step can put the liver far outside the liver.
    """
    if config.train.bn_population_volumes == 0:
        return state
    per_batch = [
        batch_statistics(state.params, state.stats, image)
        for image in statistics_batches(store, config, mesh)
    ]
    return state._replace(stats=pool(per_batch))


# Ctrl-C, and `kill` or a job scheduler's time limit: both save a checkpoint and stop.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _stop(number: int, frame: Any) -> None:
    """SIGTERM's handler while training: stop as Ctrl-C does, the signal's number kept."""
    raise KeyboardInterrupt(number)


@contextlib.contextmanager
def _handled(handlers: dict[int, Any]) -> Iterator[None]:
    """Signal handlers, in the main thread only (elsewhere the signals are not ours), except
    for a signal that is ignored (`nohup`, a background job): it stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {
        number: signal.signal(number, handler)
        for number, handler in handlers.items()
        if signal.getsignal(number) is not signal.SIG_IGN
    }
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


@contextlib.contextmanager
def _interrupt_after_step() -> Iterator[None]:
    """Hold a Ctrl-C or SIGTERM that lands during a step until the new state is bound.

    The step consumes (donates) the old state's buffers: interrupted inside it, the
    loop would have no whole state left to save, and Ctrl-C would end in a traceback.
    """
    received: list[int] = []
    with _handled({number: lambda n, frame: received.append(n) for number in _STOP_SIGNALS}):
        yield
    if received:
        raise KeyboardInterrupt(received[0])


def _nan_cause(store: Store) -> str:
    """What in the training data can have made the loss non-finite; else the learning rate."""
    # The store's images are int16 (checked when it is opened): only labels can be out of range.
    for case in store.split("train"):
        top = int(np.max(store.label(case.id)))
        if top > metrics.TUMOUR:
            return (
                f"The label map of case {case.id} holds the value {top} (labels are 0, 1, 2): "
                "re-run `ctseg preprocess --force`"
            )
    return "The training data look sound (labels 0–2): lower train.learning_rate"


def _wait_fraction(prefetch: Prefetcher, compute_seconds: float) -> float:
    """Share of the loop's time spent waiting for input rather than computing."""
    return prefetch.wait_seconds / max(prefetch.wait_seconds + compute_seconds, 1e-9)


def _resuming(run_dir: Path, step: int, steps: int) -> str:
    """The line that says a run resumes: from which step, and the layout it trained on before."""
    line = f"resuming from checkpoint {step} (of {steps} steps)"
    before = rundir.last_layout(run_dir)
    if before is None:
        return line
    mesh = before.get("mesh") or {}
    return (
        f"{line}; steps {before.get('from_step')}–{step} trained on mesh.spatial "
        f"{mesh.get('spatial')}, data {mesh.get('data')}: {before.get('devices')}"
    )


def check_memory(compiled: jax.stages.Compiled, config: cfg.Config, devices: list) -> None:
    """On accelerators: the compiled step must fit the devices' free memory."""
    if not dev.is_accelerator(devices):
        return  # simulated CPU devices share the host's RAM; the OS has the last word
    needed, free = plan.memory_of(compiled).total, dev.free_memory(devices)
    if needed > free:
        raise CtsegError(
            f"the training step on {config.data.resolution}³ "
            f"({list(config.mesh.spatial)}, batch {config.train.batch_size}) needs "
            f"{dev.human_bytes(needed)} per device but {dev.describe(devices)} has "
            f"{dev.human_bytes(free)} free; use more devices, a lower data.resolution, "
            "model.remat = true, or --device cpu"
        )


def train_and_evaluate(
    config: cfg.Config,
    data_dir: Path,
    run_dir: Path,
    progress: ProgressFn | None = None,
    devices: list | None = None,
    where: str = "",
    warn: Callable[[str], None] | None = None,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train (or resume) a run; returns a summary of the final state.

    `devices`: where the config's mesh goes (`devices.fit_training` chooses them
    and `where` says it); by default JAX's default devices. The writing process
    holds the run directory's lock (`ctseg.lock`; `warn` hears of a dead holder's).
    `say` hears, before anything compiles, that a run resumes: from which step, and
    the layout it last trained on. Ctrl-C or SIGTERM saves a checkpoint and raises
    KeyboardInterrupt (its args: the signal's number, none for Ctrl-C).
    """
    run_dir = Path(run_dir)
    store = open_store(Path(data_dir), config)
    with contextlib.ExitStack() as stack:
        # In a multi-host job every process trains, but only process 0 writes the
        # run directory's files; orbax coordinates the checkpoints itself.
        if jax.process_index() == 0:
            # One writer: a second `ctseg train` would log every step twice and race orbax.
            stack.enter_context(lock.hold(run_dir, warn))
        stack.enter_context(_handled({signal.SIGTERM: _stop}))
        return _train(config, store, run_dir, progress, devices, where, say)


def _train(
    config: cfg.Config,
    store: Store,
    run_dir: Path,
    progress: ProgressFn | None,
    devices: list | None,
    where: str,
    say: Callable[[str], None] | None,
) -> dict[str, Any]:
    """`train_and_evaluate` once it holds the run directory."""
    main_process = jax.process_index() == 0
    if main_process:
        # Never a folder of others' files: orbax deletes folders it takes for its temporaries.
        # (Only the writer looks: the others could see its config.toml half-written.)
        atomic.claim_folder(run_dir, rundir.OWN_FILES, force=None)
    else:
        atomic.output_folder(run_dir)
    rundir.write_or_check_config(run_dir, config, write=main_process)
    if config.train.fold >= 0:
        rundir.write_or_check_fold(run_dir, store, config.train.fold, write=main_process)
    mesh = make_mesh(config.mesh.spatial, config.mesh.data, devices)
    devices = list(mesh.devices.flat)
    tc = config.train

    graphdef, state = init_state(config)
    state = jax.device_put(state, NamedSharding(mesh, REPLICATED))
    checkpoints = Checkpoints(run_dir, keep=tc.keep_checkpoints)
    start = checkpoints.latest_step()
    if start is not None:
        state = checkpoints.restore(start, replicated_shapes(state, mesh))
    start = int(state.step)
    where = where or dev.describe(devices, simulated=True)
    if start and say is not None:
        say(_resuming(run_dir, start, tc.steps))
    log = rundir.MetricsLog(run_dir, start, write=main_process)
    if main_process:
        rundir.record_layout(run_dir, start, config, where)
        fingerprint.record(run_dir, store)  # what `predict` holds scans against; kept on resume

    # Compiled ahead, before the first batch, so that its memory need is checked on
    # accelerators; the loop runs this very program (compiling the step a second time
    # would cost as much again where the compilation cache is off).
    train_step = plan.compile_train_step(
        graphdef, config, mesh, state, *plan.abstract_batch(config, mesh)
    )
    check_memory(train_step, config, devices)
    predict = make_predict(graphdef, config, mesh)
    segment = jax.jit(lambda *args: jnp.argmax(predict(*args), axis=-1).astype(jnp.uint8))
    batch_statistics = jax.jit(make_batch_statistics(graphdef, config, mesh))
    pool = jax.jit(pool_statistics, out_shardings=NamedSharding(mesh, REPLICATED))

    # From this step on, the statistics are held (`train.held_norm_steps`): the weights
    # train against the ones inference will use, so they are never recomputed after it.
    hold_from = tc.steps - tc.held_norm_steps
    held_step = None

    def for_inference(state: TrainState) -> TrainState:
        if int(state.step) > hold_from:
            return state
        return population_statistics(batch_statistics, pool, state, store, config, mesh)

    has_val = bool(store.split("val"))
    val_dice: dict[str, float] | None = None
    prefetch = Prefetcher(store, config, mesh, start, tc.steps)
    window_start, window_steps, compute_seconds = time.perf_counter(), 0, 0.0
    try:
        for step, (image, label) in prefetch:
            if step >= hold_from and held_step is None:
                held_step = plan.compile_train_step(
                    graphdef, config, mesh, state, image, label, held_norm=True
                )
            began = time.perf_counter()
            with _interrupt_after_step():
                run_step = train_step if step < hold_from else held_step
                state, step_metrics = run_step(state, image, label)
            loss = float(step_metrics["loss"])
            compute_seconds += time.perf_counter() - began
            done = step + 1
            if not math.isfinite(loss):
                latest = checkpoints.latest_step()
                kept = "no checkpoint before it" if latest is None else f"last good one: {latest}"
                raise CtsegError(
                    f"the loss became {loss} at step {done}; training stopped ({kept}). "
                    + _nan_cause(store)
                )
            window_steps += 1
            rate = window_steps / (time.perf_counter() - window_start)
            validating = has_val and (done % tc.eval_every == 0 or done == tc.steps)
            saving = validating or done % tc.checkpoint_every == 0 or done == tc.steps
            if saving or done == hold_from:
                # Every checkpoint carries the statistics that inference will use.
                state = for_inference(state)
            if validating:
                val_dice = validate(segment, state, store, config, mesh)
            if done % tc.log_every == 0 or validating or done == tc.steps:
                entry = {k: float(v) for k, v in step_metrics.items()}
                entry.update(step=done, steps_per_second=rate)
                entry["data_wait_fraction"] = _wait_fraction(prefetch, compute_seconds)
                if validating:
                    entry.update(
                        val_dice_liver=val_dice["liver"], val_dice_tumour=val_dice["tumour"]
                    )
                log.append(entry)
            if validating:
                checkpoints.save(state, 0.5 * (val_dice["liver"] + val_dice["tumour"]))
                if main_process:
                    pictures.plot_curves(log.entries, run_dir / rundir.CURVES)
            elif saving:
                checkpoints.save(state)
            if progress:
                progress(Progress(done, tc.steps, loss, rate, val_dice, step >= hold_from))
        checkpoints.wait()  # the last save counts: orbax lists a step once it is written
        predict_step = checkpoints.resolve("best")
    except KeyboardInterrupt:
        # Ctrl-C: keep what was learnt, so that re-running the command resumes here.
        # `state` is only rebound after a step completes, so it is always whole.
        if int(state.step) > (checkpoints.latest_step() or 0):
            checkpoints.save(for_inference(state))
        raise
    finally:
        prefetch.close()
        # Waits for the last save: a failed one (full disk) raises CtsegError here,
        # naming its step and the latest intact one, and still releases orbax's threads.
        checkpoints.close()
    validations = log.validations()
    return {
        "step": int(state.step),
        "val_dice": val_dice,
        "last_validation": validations[max(validations)] if validations else None,
        # The checkpoints' own choice of best (no second ranking here to drift from it).
        "best_validation": validations.get(predict_step),
        "predict_checkpoint": predict_step,
        "data_wait_fraction": _wait_fraction(prefetch, compute_seconds),
        "run_dir": str(run_dir),
        "val_cases": len(store.split("val")),
        "train_cases": len(store.split("train")),
        "fold": config.train.fold if config.train.fold >= 0 else None,
    }
