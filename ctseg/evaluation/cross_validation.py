"""A cross-validation (``ctseg evaluate RUN_DIR… --cross-validation``): every labelled
case of a store predicted by the fold run that did not train on it, case by case
through the skeleton `ctseg.evaluation.runs.evaluate_run` uses
(`ctseg.evaluation.skeleton`), into one report.

`fold_runs` checks that the runs are one fold run per fold of the store's current
folds (their fold.json), sharing one config.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ctseg.config import Config, InferenceOptions
from ctseg.data.store import Store
from ctseg.errors import CtsegError
from ctseg.evaluation.reports import (
    CrossValidationHead,
    CrossValidationReport,
    FoldEntry,
    Json,
    Summary,
)
from ctseg.evaluation.skeleton import Part, Scored, check_request, evaluate
from ctseg.progress import Progress
from ctseg.run import evaluations, rundir

if TYPE_CHECKING:
    from ctseg.inference.network.backends import Backend
    from ctseg.inference.predictor import Predictor


class FoldRun(NamedTuple):
    fold: int
    run_dir: Path
    config: Config


def fold_runs(
    store: Store, run_dirs: Sequence[Path], configs: Sequence[Config] | None = None
) -> list[FoldRun]:
    """The runs as one cross-validation of `store`, by fold; CtsegError (one line) unless
    every run is a fold run of the store's current folds, each fold has exactly one run,
    and the runs share one config (their fold and mesh aside).

    `configs`: the runs' config.toml if already read, in the order of `run_dirs`.
    """
    if not store.folds:
        raise CtsegError(
            f"the store at {store.path} has no cross-validation folds; assign them (ctseg "
            "folds, say 5) and train one run per fold (train.fold = I)"
        )
    runs = []
    for index, run_dir in enumerate(run_dirs):
        run_dir = Path(run_dir)
        config = rundir.load_config(run_dir) if configs is None else configs[index]
        record = rundir.read_fold(run_dir)
        if record is None:
            raise CtsegError(
                f"{run_dir} is not a cross-validation fold run (no {rundir.FOLD}); train one "
                "run per fold (train.fold = I)"
            )
        difference = rundir.fold_difference(record, store)
        if difference is not None:
            raise CtsegError(f"{run_dir} {difference}")
        store.check_grid(config.data)
        runs.append(FoldRun(record["fold"], run_dir, config))
    by_fold: dict[int, list[Path]] = {}
    for run in runs:
        by_fold.setdefault(run.fold, []).append(run.run_dir)
    problems = [
        f"fold {fold} has {len(dirs)} runs ({', '.join(str(d) for d in dirs)})"
        for fold, dirs in sorted(by_fold.items())
        if len(dirs) > 1
    ]
    missing = [str(fold) for fold in range(store.folds) if fold not in by_fold]
    if missing:
        problems.append(f"no run for fold{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    if problems:
        raise CtsegError(
            f"a cross-validation needs one run per fold of the store at {store.path} "
            f"({store.folds} folds): {'; '.join(problems)}"
        )
    for run in runs[1:]:
        # What differs between the fold runs of one cross-validation: their fold and mesh.
        changed = rundir.config_changes(run.config, runs[0].config, ("mesh", "train.fold"))
        if changed:
            raise CtsegError(
                f"{run.run_dir} and {runs[0].run_dir} differ in {', '.join(changed)}: a "
                "cross-validation estimates one config, trained on every fold"
            )
    return sorted(runs, key=lambda run: run.fold)


def _checkpoint_steps(runs: Sequence[FoldRun], which: str) -> list[int]:
    """The step of each run's checkpoint `which` (best, latest, a step) names."""
    from ctseg.run.checkpoints import Checkpoints

    steps = []
    for run in runs:
        checkpoints = Checkpoints(run.run_dir, keep=1, read_only=True)
        try:
            steps.append(checkpoints.resolve(which))
        except CtsegError as exc:
            raise CtsegError(f"{run.run_dir}: {exc}") from None
        finally:
            checkpoints.close()
    return steps


def _record(runs: Sequence[FoldRun], steps: Sequence[int], data_dir: Path) -> dict[str, Any]:
    """The evaluation folder's record (evaluated.json) of the fold runs at these steps."""
    folds = [(run.fold, run.run_dir, step) for run, step in zip(runs, steps, strict=True)]
    return evaluations.cross_validation_record(folds, data_dir)


def evaluate_cross_validation(
    run_dirs: Sequence[Path],
    data_dir: Path,
    out_dir: Path,
    options: InferenceOptions | None = None,
    configs: Sequence[Config] | None = None,
    progress: Progress | None = None,
    force: bool = False,
    warn: Callable[[str], None] | None = None,
    backend: Backend | None = None,
) -> CrossValidationReport:
    """Every labelled case of the store predicted by the fold run that did not train on
    it, scored as `evaluate_run` scores a run's cases; one report in `out_dir`.

    `run_dirs`: one fold run per fold of the store (`fold_runs` checks them). Each
    run's model is loaded in turn (on `backend`, a command's, chosen when it started JAX;
    default: started as the API starts it, from `options`) and predicts its fold's cases (its
    "val" split), through the skeleton of `evaluate_run` (`ctseg.evaluation.skeleton`).
    `out_dir` holds one evaluation, under its lock, by the rules of `evaluate_run`
    (`evaluations.EVALUATED` records the runs, their checkpoints and the store). Returns
    the report (`CrossValidationReport`): the cases of every fold, their summary and
    errors, and ``runs`` (per fold: run, checkpoint step, cases, summary).
    """
    check_request(run_dirs, out_dir, cross_validation=True)
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    store = Store.open(data_dir)
    runs = fold_runs(store, run_dirs, configs)
    evaluation = _CrossValidation(store, runs, data_dir, options or InferenceOptions(), backend)
    return evaluate(evaluation, out_dir, force, progress, warn)


@dataclass(frozen=True)
class _CrossValidation:
    """A cross-validation: one part per fold run, its fold's labelled cases."""

    store: Store
    runs: list[FoldRun]
    data_dir: Path
    options: InferenceOptions
    backend: Backend | None

    def _load(self, run: FoldRun) -> Callable[[], Predictor]:
        from ctseg.inference.network.choice import start_backend
        from ctseg.inference.predictor import Predictor

        def load() -> Predictor:
            backend = self.backend or start_backend(self.options)
            return Predictor.from_run(run.run_dir, backend, self.options, run.config)

        return load

    @property
    def parts(self) -> list[Part]:
        return [
            Part(
                self._load(run),
                self.store.for_fold(run.fold),
                [case for case in self.store.fold_cases(run.fold) if case.labelled],
            )
            for run in self.runs
        ]

    def record(self, scored: Sequence[Scored] | None) -> Json:
        if scored is None:  # the checkpoints `options.checkpoint` names
            steps = _checkpoint_steps(self.runs, self.options.checkpoint)
        else:  # those the predictors loaded
            steps = [part.steps[0] for part in scored]
        return _record(self.runs, steps, self.data_dir)

    def report(self, scored: Sequence[Scored]) -> CrossValidationReport:
        entries = tuple(
            FoldEntry(
                str(run.run_dir),
                run.fold,
                part.steps[0],
                [case.id for case in part.part.cases],
                Summary.of(part.records),
            )
            for run, part in zip(self.runs, scored, strict=True)
        )
        head = CrossValidationHead(
            str(self.data_dir), self.store.folds, self.store.fold_seed, scored[0].engine
        )
        records = [record for part in scored for record in part.records]
        errors = [error for part in scored for error in part.errors]
        return CrossValidationReport(
            records, Summary.of(records), errors, cross_validation=head, runs=entries
        )
