"""A cross-validation (``ctseg evaluate RUN_DIR… --cross-validation``): every labelled
case of a store predicted by the fold run that did not train on it, case by case as
`ctseg.evaluation.runs.evaluate_run` does, into one report.

`fold_runs` checks that the runs are one fold run per fold of the store's current
folds (their fold.json), sharing one config.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ctseg import atomic, lock
from ctseg.config import Config, InferenceOptions
from ctseg.data.store import Store
from ctseg.errors import CtsegError
from ctseg.evaluation.runs import engine_record, score_run, summary_of, write_report
from ctseg.progress import Progress
from ctseg.run import evaluations, rundir


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
            f"the store at {store.path} has no cross-validation folds; assign them with "
            f"`ctseg folds {store.path} --k 5` and train one run per fold (ctseg train --fold I)"
        )
    runs = []
    for index, run_dir in enumerate(run_dirs):
        run_dir = Path(run_dir)
        config = rundir.load_config(run_dir) if configs is None else configs[index]
        record = rundir.read_fold(run_dir)
        if record is None:
            raise CtsegError(
                f"{run_dir} is not a cross-validation fold run (no {rundir.FOLD}); train one "
                "run per fold with `ctseg train --fold I`"
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
) -> dict:
    """Every labelled case of the store predicted by the fold run that did not train on
    it, scored as `evaluate_run` scores a run's cases; one report in `out_dir`.

    `run_dirs`: one fold run per fold of the store (`fold_runs` checks them). Each
    run's model is loaded in turn and predicts its fold's cases (its "val" split),
    through the per-case work of `evaluate_run`. `out_dir` holds one evaluation, under
    its lock, by the rules of `evaluate_run` (`evaluations.EVALUATED` records the runs,
    their checkpoints and the store). Returns the report: the cases of every fold, their
    summary and errors, and ``runs`` (per fold: run, checkpoint step, cases, summary).
    """
    from ctseg.inference.predictor import Predictor

    data_dir, out_dir = Path(data_dir), Path(out_dir)
    options = options or InferenceOptions()
    store = Store.open(data_dir)
    runs = fold_runs(store, run_dirs, configs)
    folds = {run.fold: [c for c in store.fold_cases(run.fold) if c.labelled] for run in runs}
    total = sum(len(cases) for cases in folds.values())
    with lock.hold(out_dir, warn):
        atomic.claim_folder(out_dir, evaluations.OWN_FILES, force=None)
        steps = _checkpoint_steps(runs, options.checkpoint)
        evaluations.claim(out_dir, _record(runs, steps, data_dir), force)
        records, errors, entries, engine = [], [], [], {}
        for run in runs:
            predictor = Predictor.from_run(run.run_dir, options, run.config)
            cases, done = folds[run.fold], len(records) + len(errors)

            def counted(i: int, _: int, name: str, done: int = done) -> None:
                if progress is not None:
                    progress(done + i, total, name)

            view = store.for_fold(run.fold)
            fold_records, fold_errors = score_run(predictor, view, cases, out_dir, counted)
            records += fold_records
            errors += fold_errors
            engine = engine or engine_record(predictor)
            entries.append(
                {
                    "run_dir": str(run.run_dir),
                    "fold": run.fold,
                    "checkpoint_step": predictor.model.step,
                    "cases": [case.id for case in cases],
                    "summary": summary_of(fold_records),
                }
            )
            del predictor  # one model at a time on the devices
        actual = [entry["checkpoint_step"] for entry in entries]
        if actual != steps:  # a checkpoint that could not be read was skipped: say which was used
            atomic.write_json(out_dir / evaluations.EVALUATED, _record(runs, actual, data_dir))
        head = {
            "cross_validation": {
                "data": str(data_dir),
                "folds": store.folds,
                "fold_seed": store.fold_seed,
                **engine,
            },
            "runs": entries,
        }
        return write_report(head, records, errors, out_dir)
