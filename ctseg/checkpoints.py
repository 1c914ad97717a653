"""The run directory's checkpoints (orbax) and loading a trained model back.

``RUN_DIR/checkpoints/<step>/`` holds the whole `TrainState` (parameters,
optimiser state, batch-norm statistics, step). Randomness is a function of the
config's seed and the step, so the step is all the RNG state a resume needs.
Orbax writes each checkpoint to a temporary folder and renames it when
complete: a killed or failed save (a full disk) leaves the previous ones intact.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from orbax.checkpoint import checkpoint_managers as policies

from ctseg import config as cfg
from ctseg.errors import CtsegError
from ctseg.partition import REPLICATED
from ctseg.step import TrainState, init_state

VAL_METRIC = "val_dice"  # mean of liver and tumour Dice on the validation split


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
            enable_async_checkpointing=not read_only,
            read_only=read_only,
            create=not read_only,
        )
        self.manager = ocp.CheckpointManager(directory, options=options)

    def save(self, state: TrainState, val_dice: float | None = None) -> None:
        step = int(state.step)
        metrics = None if val_dice is None else {VAL_METRIC: float(val_dice)}
        try:
            self.manager.save(step, args=ocp.args.StandardSave(state), metrics=metrics, force=True)
        except OSError as exc:
            raise CtsegError(f"could not save checkpoint {step}: {exc}") from exc

    def wait(self) -> None:
        try:
            self.manager.wait_until_finished()
        except OSError as exc:
            raise CtsegError(f"a checkpoint could not be written: {exc}") from exc

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
        return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def close(self) -> None:
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
    run_dir: Path, which: str, mesh: Mesh
) -> tuple[cfg.Config, nnx.GraphDef, nnx.State, nnx.State, int]:
    """(config, graphdef, params, batch_stats, step) of a run's checkpoint, replicated on `mesh`."""
    config = load_run_config(run_dir)
    graphdef, abstract = init_state_abstract(config)
    checkpoints = Checkpoints(run_dir, keep=1, read_only=True)
    try:
        step = checkpoints.resolve(which)
        state = checkpoints.restore(step, replicated_like(abstract, mesh))
    finally:
        checkpoints.close()
    return config, graphdef, state.params, state.stats, step


def init_state_abstract(config: cfg.Config) -> tuple[nnx.GraphDef, TrainState]:
    """Graphdef and shapes of a fresh train state, without allocating it."""
    holder = {}

    def build():
        graphdef, state = init_state(config)
        holder["graphdef"] = graphdef
        return state

    abstract = jax.eval_shape(build)
    return holder["graphdef"], abstract
