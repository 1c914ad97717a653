"""The training loop: `train_and_evaluate(config, store_dir, run_dir)`.

It writes the run directory (its layout: `ctseg.run.rundir`). Running the same
command on an existing RUN_DIR resumes from its latest checkpoint; because
batches and augmentation are functions of (seed, step), a resumed run ends with
the same parameters as an uninterrupted one (to the order of floating-point sums
when it resumes on another layout).

A run goes: claim the run directory (`_claim`), restore or initialise the state
(`_Run.start`), compile its programs once (`ctseg.training.programs`), then the step loop
(`_Run.train`), which validates, checkpoints and logs as the config says, and saves
a checkpoint when stopped (`ctseg.training.signals`). It returns a `TrainingSummary`
(`to_json` for a file), and reports each step as `ctseg.progress.TrainingProgress`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from ctseg import atomic, lock
from ctseg import config as cfg
from ctseg.data.manifest import PREPARE_AGAIN
from ctseg.data.store import Store
from ctseg.errors import CtsegError
from ctseg.io import pictures
from ctseg.labels import TUMOUR
from ctseg.model.step import TrainState, abstract_state, init_state
from ctseg.parallel import devices as dev
from ctseg.parallel.partition import REPLICATED, make_mesh, replicated_shapes
from ctseg.progress import StepProgress, TrainingProgress
from ctseg.run import fingerprint, rundir
from ctseg.run.checkpoints import Checkpoints
from ctseg.training import signals
from ctseg.training.pipeline import Prefetcher
from ctseg.training.programs import Programs, compile_programs
from ctseg.training.validation import population_statistics, validation_dice


@dataclass(frozen=True)
class Validation:
    """One validation of a run, as metrics.jsonl logged it: its step and its Dice."""

    step: int
    liver: float
    tumour: float

    @classmethod
    def from_log(cls, entry: dict[str, Any] | None) -> Validation | None:
        """From `rundir.MetricsLog.validations`' {step, liver, tumour}; None stays None."""
        return None if entry is None else cls(entry["step"], entry["liver"], entry["tumour"])

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "liver": self.liver, "tumour": self.tumour}


@dataclass(frozen=True)
class TrainingSummary:
    """What `train_and_evaluate` returns: the run's state when the loop ended."""

    step: int  # the steps the run has trained
    val_dice: dict[str, float] | None  # this session's last validation Dice {liver, tumour}
    last_validation: Validation | None  # the run's latest validation (None: never validated)
    best_validation: Validation | None  # the validation of `predict_checkpoint`, if it had one
    predict_checkpoint: int  # the checkpoint `predict` and `evaluate` take (`best`)
    data_wait_fraction: float  # the share of the loop's time spent waiting for input
    run_dir: Path
    val_cases: int
    train_cases: int
    fold: int | None  # the cross-validation fold trained (`train.fold`), None for none

    def to_json(self) -> dict[str, Any]:
        """The summary as JSON: the dict `train_and_evaluate` returned before it was typed."""
        return {
            "step": self.step,
            "val_dice": self.val_dice,
            "last_validation": _json_of(self.last_validation),
            "best_validation": _json_of(self.best_validation),
            "predict_checkpoint": self.predict_checkpoint,
            "data_wait_fraction": self.data_wait_fraction,
            "run_dir": str(self.run_dir),
            "val_cases": self.val_cases,
            "train_cases": self.train_cases,
            "fold": self.fold,
        }


def _json_of(validation: Validation | None) -> dict[str, Any] | None:
    return None if validation is None else validation.to_json()


def open_store(data_dir: Path, config: cfg.Config) -> Store:
    """The store as the run sees it: its own train/val split, or with `train.fold` ≥ 0
    the view of that cross-validation fold (`Store.for_fold`: the fold validates, the
    other folds train), so that the loop and the input pipeline read splits alike."""
    store = Store.open(data_dir)
    store.check_grid(config.data)
    if config.train.fold >= 0:
        try:
            store = store.for_fold(config.train.fold)
        except CtsegError as exc:
            raise CtsegError(f"train.fold = {config.train.fold}: {exc}") from None
    if not store.split("train"):
        raise CtsegError(f"{data_dir} has no training cases")
    return store


def _nan_cause(store: Store) -> str:
    """What in the training data can have made the loss non-finite; else the learning rate."""
    # The store's images are int16 (checked when it is opened): only labels can be out of range.
    for case in store.split("train"):
        top = int(np.max(store.label(case.id)))
        if top > TUMOUR:
            return (
                f"The label map of case {case.id} holds the value {top} (labels are 0, 1, 2): "
                f"{PREPARE_AGAIN}"
            )
    return "The training data look sound (labels 0–2): lower train.learning_rate"


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


def train_and_evaluate(
    config: cfg.Config,
    data_dir: Path,
    run_dir: Path,
    progress: TrainingProgress | None = None,
    devices: Sequence[Any] | None = None,
    where: str = "",
    warn: Callable[[str], None] | None = None,
    say: Callable[[str], None] | None = None,
) -> TrainingSummary:
    """Train (or resume) a run; returns a summary of the final state.

    `devices`: where the config's mesh goes, chosen by the caller (the command's devices,
    `ctseg.parallel.devices.ChosenDevices`, fitted to the mesh by
    `ctseg.parallel.layouts.fit_training`, whose line `where` is); by default JAX's
    default devices (those of `--device auto`), and `where` describes them. The writing
    process holds the run directory's lock (`ctseg.lock`; `warn` hears of a dead
    holder's). `say` hears, before anything compiles, that a run resumes: from which
    step, and the layout it last trained on. Ctrl-C or SIGTERM saves a checkpoint and
    raises KeyboardInterrupt (its args: the signal's number, none for Ctrl-C).
    """
    run_dir = Path(run_dir)
    store = open_store(Path(data_dir), config)
    # In a multi-host job every process trains, but only process 0 writes the run
    # directory's files; orbax coordinates the checkpoints itself.
    main_process = jax.process_index() == 0
    with contextlib.ExitStack() as stack:
        if main_process:
            # One writer: a second `ctseg train` would log every step twice and race orbax.
            stack.enter_context(lock.hold(run_dir, warn))
        stack.enter_context(signals.sigterm_stops())
        _claim(config, store, run_dir, main_process)
        mesh = make_mesh(config.mesh.spatial, config.mesh.data, devices)
        run = _Run.start(config, store, run_dir, mesh, main_process, where, say)
        return run.train(progress)


def _claim(config: cfg.Config, store: Store, run_dir: Path, main_process: bool) -> None:
    """Make `run_dir` this run's: a new folder, or the same run's (config and fold checked)."""
    if main_process:
        # Never a folder of others' files: orbax deletes folders it takes for its temporaries.
        # (Only the writer looks: the others could see its config.toml half-written.)
        atomic.claim_folder(run_dir, rundir.OWN_FILES, force=None)
    else:
        atomic.output_folder(run_dir)
    rundir.write_or_check_config(run_dir, config, write=main_process)
    if config.train.fold >= 0:
        rundir.write_or_check_fold(run_dir, store, config.train.fold, write=main_process)


@dataclass
class _Run:
    """One run's training, from its restored state on."""

    config: cfg.Config
    store: Store
    run_dir: Path
    mesh: Any
    main_process: bool
    state: TrainState
    checkpoints: Checkpoints
    log: rundir.MetricsLog
    programs: Programs

    @classmethod
    def start(
        cls,
        config: cfg.Config,
        store: Store,
        run_dir: Path,
        mesh: Any,
        main_process: bool,
        where: str,
        say: Callable[[str], None] | None,
    ) -> _Run:
        """The run restored from its latest checkpoint (or initialised), its start recorded,
        its programs compiling from the start (they need only the state's shapes)."""
        programs = compile_programs(config, mesh, store)
        checkpoints = Checkpoints(run_dir, keep=config.train.keep_checkpoints)
        latest = checkpoints.latest_step()
        if latest is None:
            _, state = init_state(config, NamedSharding(mesh, REPLICATED))
        else:
            state = checkpoints.restore(latest, replicated_shapes(abstract_state(config)[1], mesh))
        start = int(state.step)
        if start and say is not None:
            say(_resuming(run_dir, start, config.train.steps))
        log = rundir.MetricsLog(run_dir, start, write=main_process)
        if main_process:
            where = where or dev.describe(list(mesh.devices.flat), simulated=True)
            rundir.record_layout(run_dir, start, config, where)
            fingerprint.record(run_dir, store)  # what `predict` holds scans against; kept on resume
        return cls(config, store, run_dir, mesh, main_process, state, checkpoints, log, programs)

    def for_inference(self, state: TrainState) -> TrainState:
        """`state` with the statistics inference will use; frozen ones are never recomputed:
        the weights train against them."""
        if int(state.step) > self.programs.frozen_from:
            return state
        return population_statistics(
            self.programs.batch_statistics,
            self.programs.pool,
            state,
            self.store,
            self.config,
            self.mesh,
        )

    def train(self, progress: TrainingProgress | None) -> TrainingSummary:
        """The step loop to train.steps; the run's summary."""
        tc = self.config.train
        prefetch = Prefetcher(
            self.store,
            self.config,
            self.mesh,
            int(self.state.step),
            tc.steps,
            augmenter=self.programs.augmenter,
        )
        clock = _Clock()
        val_dice: dict[str, float] | None = None
        try:
            for step, (image, label) in prefetch:
                run_step = self.programs.step_for(step)
                began = time.perf_counter()
                with signals.interrupt_after_step():
                    self.state, step_metrics = run_step(self.state, image, label)
                loss = float(step_metrics["loss"])
                clock.computed(time.perf_counter() - began)
                if not math.isfinite(loss):
                    self._stop_on_nan(loss, step + 1)
                validation = self._after_step(step + 1, step_metrics, clock, prefetch)
                val_dice = validation or val_dice
                if progress:
                    progress(
                        StepProgress(
                            step + 1,
                            tc.steps,
                            loss,
                            clock.rate,
                            val_dice,
                            frozen_norm=step >= self.programs.frozen_from,
                            validated=validation is not None,
                        )
                    )
            self.checkpoints.wait()  # the last save counts: orbax lists a step once written
            predict_step = self.checkpoints.resolve("best")
        except KeyboardInterrupt:
            # Ctrl-C: keep what was learnt, so that re-running the command resumes here.
            # `state` is only rebound after a step completes, so it is always whole.
            if int(self.state.step) > (self.checkpoints.latest_step() or 0):
                self.checkpoints.save(self.for_inference(self.state))
            raise
        finally:
            prefetch.close()
            # Waits for the last save: a failed one (full disk) raises CtsegError here,
            # naming its step and the latest intact one, and still releases orbax's threads.
            self.checkpoints.close()
        return self._summary(val_dice, predict_step, clock.wait_fraction(prefetch))

    def _after_step(
        self,
        done: int,
        step_metrics: dict[str, Any],
        clock: _Clock,
        prefetch: Prefetcher,
    ) -> dict[str, float] | None:
        """Validate, checkpoint and log after step `done`, as the config says; the
        validation's Dice, None where it did not validate."""
        tc = self.config.train
        validating = bool(self.store.split("val")) and (
            done % tc.eval_every == 0 or done == tc.steps
        )
        saving = validating or done % tc.checkpoint_every == 0 or done == tc.steps
        if saving or done == self.programs.frozen_from:
            # Every checkpoint carries the statistics that inference will use.
            self.state = self.for_inference(self.state)
        val_dice = None
        if validating:
            val_dice = validation_dice(
                self.programs.segment, self.state, self.store, self.config, self.mesh
            )
        if done % tc.log_every == 0 or validating or done == tc.steps:
            entry = {k: float(v) for k, v in step_metrics.items()}
            entry.update(step=done, steps_per_second=clock.rate, time=time.time())
            entry["data_wait_fraction"] = clock.wait_fraction(prefetch)
            if validating:
                entry.update(val_dice_liver=val_dice["liver"], val_dice_tumour=val_dice["tumour"])
            self.log.append(entry)
        if validating:
            self.checkpoints.save(self.state, 0.5 * (val_dice["liver"] + val_dice["tumour"]))
            if self.main_process:
                pictures.plot_curves(self.log.entries, self.run_dir / rundir.CURVES)
        elif saving:
            self.checkpoints.save(self.state)
        return val_dice

    def _stop_on_nan(self, loss: float, done: int) -> None:
        latest = self.checkpoints.latest_step()
        kept = "no checkpoint before it" if latest is None else f"last good one: {latest}"
        raise CtsegError(
            f"the loss became {loss} at step {done}; training stopped ({kept}). "
            + _nan_cause(self.store)
        )

    def _summary(
        self, val_dice: dict[str, float] | None, predict_step: int, wait_fraction: float
    ) -> TrainingSummary:
        validations = self.log.validations()
        fold = self.config.train.fold
        return TrainingSummary(
            step=int(self.state.step),
            val_dice=val_dice,
            last_validation=Validation.from_log(validations[max(validations)])
            if validations
            else None,
            # The checkpoints' own choice of best (no second ranking here to drift from it).
            best_validation=Validation.from_log(validations.get(predict_step)),
            predict_checkpoint=predict_step,
            data_wait_fraction=wait_fraction,
            run_dir=self.run_dir,
            val_cases=len(self.store.split("val")),
            train_cases=len(self.store.split("train")),
            fold=fold if fold >= 0 else None,
        )


class _Clock:
    """Steps per second since the loop (re)started, and the seconds spent computing."""

    def __init__(self) -> None:
        self.start, self.steps, self.compute_seconds = time.perf_counter(), 0, 0.0

    def computed(self, seconds: float) -> None:
        self.steps += 1
        self.compute_seconds += seconds

    @property
    def rate(self) -> float:
        return self.steps / (time.perf_counter() - self.start)

    def wait_fraction(self, prefetch: Prefetcher) -> float:
        """Share of the loop's time spent waiting for input rather than computing."""
        return prefetch.wait_seconds / max(prefetch.wait_seconds + self.compute_seconds, 1e-9)
