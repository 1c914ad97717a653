"""The run directory's checkpoints (orbax) and loading a trained model back.

``RUN_DIR/checkpoints/<step>/`` holds the whole `TrainState` (parameters,
optimiser state, batch-norm statistics, step). Randomness is a function of the
config's seed and the step, so the step is all the RNG state a resume needs.
Orbax writes each checkpoint to a temporary folder and renames it when
complete: a killed or failed save (a full disk) leaves the previous ones intact,
and only a `<step>.orbax-checkpoint-tmp` folder, which is never taken for a
checkpoint and which the next writing `Checkpoints` (a resumed run) removes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from orbax.checkpoint import checkpoint_managers as policies

from ctseg import config as cfg
from ctseg.errors import CtsegError
from ctseg.partition import REPLICATED
from ctseg.step import TrainState, init_state

VAL_METRIC = "val_dice"  # mean of liver and tumour Dice on the validation split
# The name under which CheckpointManager stores a single-item checkpoint in its step folder.
_ITEM = "default"


def _write_failure(exc: BaseException | None) -> str | None:
    """The system's words for a failed file write ("No space left on device"), else None.

    Orbax's own Python writes raise OSError; the arrays go through tensorstore,
    whose failures reach Python as a ValueError that carries the errno only in
    its text (`... File too large [os_error_code='27']`). Any other ValueError is a bug.
    """
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    if isinstance(exc, ValueError):
        found = re.search(r"os_error_code='?(\d+)", str(exc))
        if found:
            return os.strerror(int(found.group(1)))
    return None


class _DropReportedWriteFailures(logging.Filter):
    """Drops the log records with which a failed save's threads announce their error.

    Orbax logs a failed write, with its traceback, from each of its background
    threads (and asyncio logs the writes nobody awaited any more), and then
    raises the same error to `Checkpoints.save`/`wait`, which report it in one line.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and _write_failure(record.exc_info[1]))


def _quiet_failed_saves() -> None:
    """Keep a failed save's error to the one line the CLI prints (installed once)."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropReportedWriteFailures) for f in logger.filters):
            logger.addFilter(_DropReportedWriteFailures())
    if getattr(sys.unraisablehook, "_ctseg_quiet", False):
        return
    previous, orbax_dir = sys.unraisablehook, os.path.dirname(ocp.__file__)

    # Orbax gathers a save's writes on a private event loop that it closes when the
    # first write fails: the other writes then finish onto the closed loop ("Event
    # loop is closed") or are reclaimed at exit, each printed as "Exception ignored".
    # Only names bound here are used: the last ones come while Python shuts down.
    def hook(unraisable, previous=previous, orbax_dir=orbax_dir):
        exc, code = unraisable.exc_value, getattr(unraisable.object, "cr_code", None)
        if not (
            (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed")
            or (code is not None and code.co_filename.startswith(orbax_dir))
        ):
            previous(unraisable)

    hook._ctseg_quiet = True
    sys.unraisablehook = hook


class Checkpoints:
    """Keeps the `keep` latest checkpoints plus the best by validation Dice."""

    def __init__(self, run_dir: Path, keep: int, read_only: bool = False):
        directory = Path(run_dir).absolute() / "checkpoints"
        if read_only and not directory.is_dir():
            raise CtsegError(f"{run_dir} has no checkpoints/ folder: is it a ctseg run directory?")
        policy = policies.AnyPreservationPolicy(
            [
                policies.LatestN(n=keep),
                policies.BestN(
                    get_metric_fn=lambda m: m[VAL_METRIC],
                    n=1,
                    keep_checkpoints_without_metrics=False,
                ),
            ]
        )
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policy,
            # Without best_fn orbax keeps a step's metrics in memory only: a later reader
            # (predict, a resumed run) would see no scores, and "best" would be the latest.
            best_fn=lambda m: m[VAL_METRIC],
            best_mode="max",
            enable_async_checkpointing=not read_only,
            read_only=read_only,
            create=not read_only,
            # A failed save leaves `<step>.orbax-checkpoint-tmp`: never a checkpoint, but it
            # holds disk space. The next writer (a resumed run) removes it before saving.
            cleanup_tmp_directories=not read_only,
        )
        self.directory = directory
        self.manager = ocp.CheckpointManager(directory, options=options)
        self._pending: int | None = None  # the step an asynchronous save may still be writing
        if not read_only:
            _quiet_failed_saves()

    def save(self, state: TrainState, val_dice: float | None = None) -> None:
        step = int(state.step)
        # A NaN score is no score: handed to orbax, it upsets the ordering of its best-N
        # policy, which then deletes the true best checkpoint.
        scored = val_dice is not None and math.isfinite(val_dice)
        metrics = {VAL_METRIC: float(val_dice)} if scored else None
        # Saves finish in the background, and a failed one raises at the next call into
        # orbax: wait here so that it is reported under its own step, not this one.
        self.wait()
        with self._reporting_failure(step):
            self.manager.save(step, args=ocp.args.StandardSave(state), metrics=metrics, force=True)
        self._pending = step

    def wait(self) -> None:
        """Wait for the last save; CtsegError if it could not be written."""
        step, self._pending = self._pending, None
        with self._reporting_failure(step):
            self.manager.wait_until_finished()

    @contextlib.contextmanager
    def _reporting_failure(self, step: int | None) -> Iterator[None]:
        """A write the system refused (full disk, quota, permissions) → one-line CtsegError."""
        try:
            yield
        except (OSError, ValueError) as exc:
            cause = _write_failure(exc)
            if cause is None:
                raise
            kept = [s for s in self.manager.all_steps() if s != step]
            intact = f"step {max(kept)} is the latest intact one" if kept else "none before it"
            which = "a checkpoint" if step is None else f"checkpoint {step}"
            raise CtsegError(
                f"could not save {which} in {self.directory}: {cause} ({intact}; "
                "free some space and run the same command to resume)"
            ) from exc

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def best_step(self) -> int | None:
        scored = []
        for step in self.manager.all_steps():
            metrics = self.manager.metrics(step)
            if metrics and VAL_METRIC in metrics and math.isfinite(metrics[VAL_METRIC]):
                scored.append((metrics[VAL_METRIC], step))
        return max(scored)[1] if scored else None

    def resolve(self, which: str) -> int:
        """`best`, `latest` or a step number → an existing step."""
        steps = self.manager.all_steps()
        if not steps:
            raise CtsegError("the run directory has no checkpoints yet")
        if which == "latest":
            return self.latest_step()
        if which == "best":
            best = self.best_step()
            return best if best is not None else self.latest_step()
        if which.isdigit() and int(which) in steps:
            return int(which)
        raise CtsegError(f"no checkpoint '{which}'; use best, latest or one of {sorted(steps)}")

    def restore(self, step: int, like: TrainState) -> TrainState:
        """Restore `step` into arrays shaped and sharded like `like` (abstract is fine)."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        try:
            return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
        except (OSError, ValueError, KeyError, TypeError) as exc:  # a folder ctseg did not write
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise CtsegError(
                f"checkpoint {step} in {self.directory} cannot be read ({first_line}); "
                "move it out of checkpoints/ if ctseg did not write it"
            ) from None

    def close(self) -> None:
        """Wait for the last save (CtsegError if it failed), then release orbax's threads."""
        try:
            self.wait()
        finally:
            self.manager.close()


def replicated_like(state: TrainState, mesh: Mesh) -> TrainState:
    """Abstract `state` with every leaf replicated over `mesh`."""
    sharding = NamedSharding(mesh, REPLICATED)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)


def load_run_config(run_dir: Path) -> cfg.Config:
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        raise CtsegError(f"{run_dir} is not a ctseg run directory (no config.toml)")
    return cfg.load(path)


def load_for_inference(
    run_dir: Path, which: str
) -> tuple[cfg.Config, nnx.GraphDef, nnx.State, nnx.State, int]:
    """(config, graphdef, params, batch_stats, step) of a run's checkpoint, as host arrays.

    Reads only what inference needs: the parameters and the normalisation
    statistics, not the optimiser state (twice the parameters' size) nor any
    device placement; each inference engine puts them on its own devices.
    """
    config = load_run_config(run_dir)
    graphdef, abstract = init_state_abstract(config)
    checkpoints = Checkpoints(run_dir, keep=1, read_only=True)
    try:
        step = checkpoints.resolve(which)
    finally:
        checkpoints.close()
    item = {"params": abstract.params, "stats": abstract.stats}
    on_host = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    restored = ocp.PyTreeCheckpointer().restore(
        checkpoints.directory / str(step) / _ITEM,
        args=ocp.args.PyTreeRestore(item=item, restore_args=on_host, partial_restore=True),
    )
    return config, graphdef, restored["params"], restored["stats"], step


def init_state_abstract(config: cfg.Config) -> tuple[nnx.GraphDef, TrainState]:
    """Graphdef and shapes of a fresh train state, without allocating it."""
    holder = {}

    def build():
        graphdef, state = init_state(config)
        holder["graphdef"] = graphdef
        return state

    abstract = jax.eval_shape(build)
    return holder["graphdef"], abstract
