"""The run directory's checkpoints (orbax): saved while training, restored to resume, and
read (`ctseg.run.trained` loads a model from them).

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
import functools
import logging
import math
import os
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from ctseg.errors import CtsegError
from ctseg.model.step import TrainState
from ctseg.reading import NotRegularFile, check_regular, read_json
from ctseg.run import rundir

VAL_METRIC = "val_dice"  # mean of liver and tumour Dice on the validation split
# The name under which CheckpointManager stores a single-item checkpoint in its step folder.
_ITEM = "default"
_log = logging.getLogger(__name__)


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


def _quiet_failed_io() -> None:
    """Keep a failed save's or restore's error to the one line the CLI prints (installed once)."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropReportedWriteFailures) for f in logger.filters):
            logger.addFilter(_DropReportedWriteFailures())
    if getattr(sys.unraisablehook, "_ctseg_quiet", False):
        return
    previous, orbax_dir = sys.unraisablehook, os.path.dirname(ocp.__file__)

    # Orbax gathers a save's writes (and a restore's reads) on a private event loop that it
    # closes when the first one fails: the others then finish onto the closed loop ("Event
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


class UnreadableCheckpoint(CtsegError):
    """A checkpoint folder orbax cannot read: a reader looking for `latest` or `best` skips it."""


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__


def _key_name(key: Any) -> str:
    for attribute in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """'params/down/0/first/conv/kernel' → shape, for each array of a state or of a
    checkpoint's metadata (which names list items by strings and nnx's `.value` as a key)."""
    return {
        "/".join(name for name in map(_key_name, path) if name != "value"): tuple(leaf.shape)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def _model_keys(shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """model.base_filters, depth and kernel_size as the U-Net's arrays show them ({} if not)."""
    first = shapes.get("params/down/0/first/conv/kernel")
    if first is None or len(first) != 5:
        return {}
    levels = {path.split("/")[2] for path in shapes if path.startswith("params/down/")}
    return {"base_filters": first[-1], "depth": len(levels), "kernel_size": first[0]}


def _difference(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> str:
    """How a checkpoint's arrays (`found`) differ from the model's, in words; "" if they do not."""
    if found == expected:
        return ""
    theirs, ours = _model_keys(found), _model_keys(expected)
    keys = [key for key in ours if key in theirs and ours[key] != theirs[key]]
    if keys:
        return ", ".join(
            f"model.{key} is {theirs[key]} in the checkpoint, {ours[key]} in config.toml"
            for key in keys
        )
    reshaped = [
        path for path in sorted(found.keys() & expected.keys()) if found[path] != expected[path]
    ]
    if reshaped:
        path = reshaped[0]
        shapes = f"{list(found[path])} in the checkpoint, {list(expected[path])} in the model"
        return f"{path} has shape {shapes}"
    missing, extra = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    if missing:
        return f"the checkpoint lacks {missing[0]} ({len(missing)} array(s) of the model in all)"
    return f"the checkpoint holds {extra[0]} ({len(extra)} array(s) the model lacks in all)"


@functools.cache
def _save_from_one_replica() -> None:
    """Orbax writes a replicated array from one of its replicas, not a slice of it from
    each: slicing compiled a program per slice (seconds at the first checkpoint for the
    demo's state on 16 devices, and each a compile on a GPU:
    docs/experiments/design-figures.md#checkpoints) to split a
    state of megabytes. Orbax decides this for the process (its type registry), as it
    does itself where JAX_PLATFORMS names a GPU; the default handler's store of arrays'
    metadata (random keys' types) is kept for the process's other checkpoints."""
    default = ocp.type_handlers.get_type_handler(jax.Array)
    one_replica = ocp.type_handlers.ArrayHandler(
        use_replica_parallel=False,
        array_metadata_store=getattr(default, "_array_metadata_store", None),
    )
    ocp.type_handlers.register_type_handler(jax.Array, one_replica, override=True)


class Checkpoints:
    """Keeps the `keep` latest checkpoints plus the best by validation Dice."""

    def __init__(self, run_dir: Path, keep: int, read_only: bool = False):
        directory = rundir.checkpoints_dir(run_dir)
        if read_only and not directory.is_dir():
            raise CtsegError(
                f"{run_dir} has no {rundir.CHECKPOINTS}/ folder: is it a ctseg run directory?"
            )
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
        if not read_only:
            _save_from_one_replica()
        self._check_metrics_files()
        try:
            self.manager = ocp.CheckpointManager(directory, options=options)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise self._damaged_metrics(exc) from None
        self._pending: int | None = None  # the step an asynchronous save may still be writing
        _quiet_failed_io()

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
            # The writes orbax abandoned when this one failed are reclaimed at exit, each a
            # "coroutine … was never awaited" warning: the line below says it all.
            warnings.filterwarnings(
                "ignore", message="coroutine .* was never awaited", category=RuntimeWarning
            )
            kept = [s for s in self.manager.all_steps() if s != step]
            intact = f"step {max(kept)} is the latest intact one" if kept else "none before it"
            which = "a checkpoint" if step is None else f"checkpoint {step}"
            raise CtsegError(
                f"could not save {which} in {self.directory}: {cause} ({intact}; "
                "free some space and run the same command to resume)"
            ) from exc

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def _scores(self) -> dict[int, float]:
        scores = {}
        for step in self.manager.all_steps():
            metrics = self.manager.metrics(step)
            if metrics and VAL_METRIC in metrics and math.isfinite(metrics[VAL_METRIC]):
                scores[step] = metrics[VAL_METRIC]
        return scores

    def best_step(self) -> int | None:
        scores = self._scores()
        return max(scores, key=lambda step: (scores[step], step)) if scores else None

    def resolve(self, which: str) -> int:
        """`best`, `latest` or a step number → an existing step (readable or not)."""
        return self.candidates(which)[0]

    def candidates(self, which: str) -> list[int]:
        """The steps `which` may mean, the preferred first.

        A step number means that one; `latest` every step, newest first; `best` the
        scored steps, best first, then the others newest first. A reader takes the
        first it can read (`load_model`).
        """
        steps = sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            raise CtsegError(f"{self.run_dir} has no checkpoints yet")
        if which == "latest":
            return steps
        if which == "best":
            scores = self._scores()
            best = sorted(scores, key=lambda step: (scores[step], step), reverse=True)
            return best + [step for step in steps if step not in scores]
        # Not str.isdigit: it takes "²" and other digits int() refuses.
        if re.fullmatch(r"[0-9]+", which) and int(which) in steps:
            return [int(which)]
        raise CtsegError(
            f"no checkpoint '{which}' in {self.run_dir}; use best, latest or one of {sorted(steps)}"
        )

    def restore(self, step: int, like: TrainState) -> TrainState:
        """Restore `step` into arrays shaped and sharded like `like` (abstract is fine)."""
        self.check_model(step, {"params": like.params, "stats": like.stats})
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        with self._reading(step):
            return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def restore_model(self, step: int, item: dict[str, Any]) -> dict[str, Any]:
        """Only `item`'s parts (`params`, `stats`) of checkpoint `step`, as host arrays.

        Not the optimiser state (twice the parameters' size) nor any device placement.
        """
        self.check_model(step, item)
        on_host = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
        with self._reading(step):
            return ocp.PyTreeCheckpointer().restore(
                self.directory / str(step) / _ITEM,
                args=ocp.args.PyTreeRestore(item=item, restore_args=on_host, partial_restore=True),
            )

    def check_model(self, step: int, model: dict[str, Any]) -> None:
        """CtsegError unless checkpoint `step` holds exactly `model`'s arrays, path and shape.

        Orbax restores whatever shapes were saved and, partially restoring, ignores
        what is not asked for: without this check a checkpoint of other widths, or a
        config.toml edited by hand, would predict with a network nobody trained.
        """
        expected = _shapes(model)
        with self._reading(step):
            metadata = ocp.PyTreeCheckpointer().metadata(self.directory / str(step) / _ITEM)
        if metadata.item_metadata is None:  # _METADATA missing or not JSON
            raise UnreadableCheckpoint(
                self._unreadable(step, "default/_METADATA is missing or damaged")
            )
        parts = {path.split("/")[0] for path in expected}
        found = {
            path: shape
            for path, shape in _shapes(metadata.item_metadata.tree).items()
            if path.split("/")[0] in parts
        }
        difference = _difference(found, expected)
        if difference:
            raise CtsegError(
                f"checkpoint {step} in {self.run_dir} does not match "
                f"{self.run_dir / rundir.CONFIG}: {difference}; use the config.toml of the run "
                "that wrote it"
            )

    @property
    def run_dir(self) -> Path:
        return self.directory.parent

    def _unreadable(self, step: int | str, why: str) -> str:
        return (
            f"checkpoint {step} in {self.run_dir} is unreadable (truncated, or not written by "
            f"ctseg?): {why}; move {self.directory / str(step)} out of the run"
        )

    def _damaged_metrics(self, exc: BaseException) -> CtsegError:
        """The error for a run whose checkpoints orbax cannot even list.

        With a best_fn, orbax reads every checkpoint's metrics when it opens the
        folder: one damaged metrics file stops it, and its error names no step.
        """
        for metrics in sorted(self.directory.glob("*/metrics/metrics")):
            try:
                read_json(metrics, "the checkpoint's metrics")
            except (OSError, CtsegError) as error:
                step = metrics.parent.parent.name
                return UnreadableCheckpoint(
                    self._unreadable(step, f"{metrics} is not JSON ({_first_line(error)})")
                )
        return CtsegError(f"cannot list the checkpoints in {self.directory}: {_first_line(exc)}")

    def _check_metrics_files(self) -> None:
        """UnreadableCheckpoint for a step's metrics that is no regular file: orbax reads
        every one as it opens the folder, and a FIFO's open would wait for ever."""
        for metrics in sorted(self.directory.glob("*/metrics/metrics")):
            try:
                check_regular(metrics, "the checkpoint's metrics")
            except NotRegularFile as error:
                step = metrics.parent.parent.name
                raise UnreadableCheckpoint(self._unreadable(step, str(error))) from None
            except OSError:
                pass  # orbax, or `_damaged_metrics`, says what is wrong with it

    @contextlib.contextmanager
    def _reading(self, step: int) -> Iterator[None]:
        """A checkpoint orbax cannot read (missing item, truncated array) → UnreadableCheckpoint."""
        try:
            yield
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UnreadableCheckpoint(self._unreadable(step, _first_line(exc))) from None

    def close(self) -> None:
        """Wait for the last save (CtsegError if it failed), then release orbax's threads."""
        try:
            self.wait()
        finally:
            self.manager.close()
