"""A trained model for inference: a run's checkpoint read as parameters and batch-norm
statistics only, shaped from the run's config (no optimiser, no train state), whatever
mesh trained it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flax import nnx

from ctseg import config as cfg
from ctseg.errors import CtsegError
from ctseg.model import unet
from ctseg.run import rundir
from ctseg.run.checkpoints import Checkpoints, UnreadableCheckpoint

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainedModel:
    """A run's network ready for inference: its config, architecture, weights and step."""

    config: cfg.Config
    graphdef: nnx.GraphDef
    params: nnx.State
    stats: nnx.State  # the batch-norm statistics inference uses
    step: int  # the checkpoint's training step


def load_model(run_dir: Path, which: str, config: cfg.Config | None = None) -> TrainedModel:
    """Checkpoint `which` (`best`, `latest` or a step number) of a run, for inference.

    Only the parameters and batch-norm statistics are read, as host arrays, whatever
    mesh trained them: the model's shapes come from its config (`config`, else the
    run's config.toml), not from a train state, so no optimiser is built or read.
    `latest` and `best` take the latest (best) checkpoint that can be read, and log a
    warning for each skipped; a step number must be readable. A checkpoint that does
    not match the run's config.toml is an error either way: falling back to an older
    one would hide that the run directory is not one run's any more.
    """
    config = rundir.load_config(run_dir) if config is None else config
    graphdef, params, stats = unet.abstract(config.model)
    item = {_weights_key(config): params, "stats": stats}
    with _orbax_quiet():
        return _load(run_dir, which, config, graphdef, item)


def _weights_key(config: cfg.Config) -> str:
    """The train state's field that holds the weights inference uses (`TrainState.weights`)."""
    return "average" if config.train.ema_decay > 0 else "params"


@contextlib.contextmanager
def _orbax_quiet() -> Iterator[None]:
    """While a model loads: orbax's notes on reading a checkpoint ("Metadata file does not
    exist", "Given directory is read only") are no news to whoever loads a model, in a
    notebook as on the command line; its errors still pass."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        logger.setLevel(level)


def _load(
    run_dir: Path, which: str, config: cfg.Config, graphdef: nnx.GraphDef, item: dict[str, Any]
) -> TrainedModel:
    checkpoints = Checkpoints(run_dir, keep=1, read_only=True)
    try:
        candidates = checkpoints.candidates(which)
        for step in candidates:
            try:
                restored = checkpoints.restore_model(step, item)
            except UnreadableCheckpoint as exc:
                if which not in ("latest", "best"):
                    raise
                _log.warning("%s; skipped", exc)
                continue
            weights = restored[_weights_key(config)]
            return TrainedModel(config, graphdef, weights, restored["stats"], step)
    finally:
        checkpoints.close()
    raise CtsegError(
        f"no checkpoint in {checkpoints.directory} can be read (steps {sorted(candidates)})"
    )
