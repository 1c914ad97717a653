"""Evaluations that predict with trained runs: a run (or an ensemble of runs) on a
store's split, and a cross-validation over fold runs.

`evaluate_run` (``ctseg evaluate RUN_DIR… --data PREP``) predicts every labelled case
of a store's split from its original scan, with one run's model or the mean of
several runs' (an ensemble), and scores it against the original label file (LiTS
style, in the original geometry), plus, for one run, the grid-level Dice that
training reports. A run of a cross-validation fold (``ctseg train --fold``) sees the
store as it trained on it: its "val" split is its fold.
`evaluate_cross_validation` (``ctseg evaluate RUN_DIR… --cross-validation``) predicts
every labelled case with the fold run that did not train on it, case by case exactly
as `evaluate_run`, into one report. Cases go through `evaluate.score_cases`, and the
reports are `evaluate`'s.

The prediction pipeline starts JAX: it is imported when an evaluation runs, so that
the CLI can choose the devices first.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ctseg import atomic, lock
from ctseg.config import Config, InferenceOptions
from ctseg.config import to_dict as cfg_to_dict
from ctseg.data import grids as preprocess
from ctseg.data.store import SPLITS, CaseEntry, Store
from ctseg.errors import CtsegError
from ctseg.evaluation import metrics
from ctseg.evaluation.scoring import Progress, evaluate_arrays, score_cases, write_reports
from ctseg.io import scans as volume
from ctseg.run import rundir

if TYPE_CHECKING:
    from ctseg.inference.predictor import Predictor


def evaluate_run(
    run_dirs: Path | Sequence[Path],
    data_dir: Path,
    split: str = "val",
    out_dir: Path | None = None,
    options: InferenceOptions | None = None,
    configs: Config | Sequence[Config] | None = None,
    progress: Progress | None = None,
    force: bool = False,
    warn: Callable[[str], None] | None = None,
) -> dict:
    """Predict a store's split with a run (or an ensemble of runs) and score it; writes
    summary.json and metrics.csv.

    `options`: checkpoint, tiles, backend, devices and TTA (`ctseg.predict.Predictor`);
    `configs`: the runs' config.toml if already read. `out_dir` (default RUN_DIR/eval;
    an ensemble's must be given) holds one evaluation: `rundir.EVALUATED` records its
    runs, checkpoints, store and split. Another one is replaced only with `force`;
    every evaluation first clears what an earlier one wrote, so that predictions are
    never mixed. The folder's lock is held throughout (`ctseg.lock`; `warn` hears of a
    dead holder's).

    Metrics compare the post-processed prediction, mapped back to the case's
    original scan, with its original label file (the LiTS way); each case of a lone
    run also gets the Dice of the raw prediction on the grid against the store's label
    (`grid_dice`, what training validates with; an ensemble's members have grids of
    their own, so it has none). Returns the report (the JSON's content).
    """
    # Imported here: the prediction pipeline starts JAX, which must not start before the
    # CLI has chosen the devices.
    from ctseg.inference.predictor import Predictor

    run_dirs = [Path(run_dirs)] if isinstance(run_dirs, str | Path) else list(map(Path, run_dirs))
    ensemble = len(run_dirs) > 1
    if ensemble and out_dir is None:
        raise CtsegError("an ensemble's evaluation needs --out DIR (it belongs to no one run)")
    data_dir = Path(data_dir)
    out_dir = rundir.evaluation_dir(run_dirs[0], out_dir)
    if ensemble:
        store, fold = Store.open(data_dir), None
        _check_unseen(store, run_dirs, split)
    else:
        store, fold = _as_the_run_saw_it(Store.open(data_dir), run_dirs[0], split)
    try:
        cases = store.split(split)
    except ValueError as exc:
        raise CtsegError(str(exc)) from None
    cases = [case for case in cases if case.labelled]
    if not cases:
        raise CtsegError(f"the store at {data_dir} has no labelled cases in the {split!r} split")
    with lock.hold(out_dir, warn):
        atomic.claim_folder(out_dir, _OWN_FILES, force=None)
        predictor = Predictor.from_run(run_dirs, options, configs)
        if not ensemble:  # the grid Dice compares with the store's boxes
            _check_grid(store, data_dir, predictor.config)
        steps = [member.model.step for member in predictor.members]
        _claim_evaluation(out_dir, _evaluation_of(run_dirs, steps, data_dir, split), force)
        records, errors = _score_run(predictor, store, cases, out_dir, progress)
        run = {
            "run_dir": str(run_dirs[0]),
            "checkpoint_step": steps[0],
            "data": str(data_dir),
            "split": split,
            "fold": fold,
            **_engine_record(predictor),
        }
        if ensemble:
            run["ensemble"] = [
                {"run_dir": str(r), "checkpoint_step": s}
                for r, s in zip(run_dirs, steps, strict=True)
            ]
        return _report({"run": run}, records, errors, out_dir)


def _report(head: dict, records: list[dict], errors: list[dict], out_dir: Path) -> dict:
    """The report of an evaluation (`head`, then its cases, summary and errors), written
    to `out_dir` as summary.json and metrics.csv."""
    result = {
        **head,
        "cases": records,
        "summary": _summary(records),
        "errors": errors,
        "unpaired": {"pred": [], "ref": []},  # the --pred/--ref report's shape
    }
    write_reports(result, out_dir / "summary.json", out_dir / "metrics.csv")
    return result


def _check_unseen(store: Store, run_dirs: Sequence[Path], split: str) -> None:
    """CtsegError if a member of an ensemble trained on cases of the split it is to be
    scored on (a fold run of this store, say): its score would flatter it."""
    ids = {case.id for case in store.split(split) if case.labelled} if split in SPLITS else set()
    for run_dir in run_dirs:
        record = rundir.read_fold(run_dir)
        seen = ids & set(record["train_cases"]) if record is not None else set()
        if seen:
            raise CtsegError(
                f"{run_dir} trained on {len(seen)} case(s) of the {split!r} split of "
                f"{store.path} (e.g. {sorted(seen)[0]}); score an ensemble of fold runs on "
                "scans none of them trained on, or with --cross-validation"
            )


# What makes a folder an evaluation's (`atomic.claim_folder`).
_OWN_FILES = ("summary.json", "predictions", rundir.EVALUATED)


def _as_the_run_saw_it(store: Store, run_dir: Path, split: str) -> tuple[Store, int | None]:
    """`store` as the run split it, and the run's fold (None: the store's own split).

    A fold run (RUN_DIR/fold.json) evaluated on its train or val split of a store that
    holds cases it trained on sees the store's fold view, so that "val" is the fold it
    did not train on; that fold must still be the one it trained on. On another store
    (an external data set sharing none of its cases) the store's own split applies.
    """
    record = rundir.read_fold(run_dir)
    if record is None or split == "test":
        return store, None
    trained_on = set(record["train_cases"]) | set(record["val_cases"])
    if not trained_on & {case.id for case in store.cases if case.labelled}:
        return store, None
    difference = rundir.fold_difference(record, store)
    if difference is not None:
        raise CtsegError(
            f"{run_dir} {difference}; its {split!r} split cannot be told apart from the cases "
            "it trained on"
        )
    return store.for_fold(record["fold"]), record["fold"]


def _check_grid(store: Store, data_dir: Path, config: Config) -> None:
    """CtsegError unless the store holds boxes of the run's grid."""
    wanted = preprocess.GridSpec.of(config.data)
    if store.grid_spec != wanted:
        raise CtsegError(
            f"{data_dir} holds a store of {store.grid_spec.describe()} but the run was "
            f"trained on {wanted.describe()}"
        )


def _engine_record(predictor: Predictor) -> dict[str, Any]:
    """How a run's model predicted: tiles, backend, TTA and devices."""
    return {
        "tiling": predictor.plan,
        "backend": predictor.backend,
        "tta": predictor.tta,
        "device": predictor.summary,
    }


def _score_run(
    predictor: Predictor,
    store: Store,
    cases: Sequence[CaseEntry],
    out_dir: Path,
    progress: Progress | None,
) -> tuple[list[dict], list[dict]]:
    """Predict and score `cases` with one run's model (`score_cases` over `_evaluate_case`)."""

    def score(case: CaseEntry) -> dict:
        return _evaluate_case(predictor, store, case, out_dir)

    return score_cases(cases, lambda case: case.id, score, progress)


def _summary(records: list[dict]) -> dict:
    """`metrics.summarize`, plus the mean grid Dice of a run's evaluation."""
    summary = metrics.summarize(records)
    summary["grid_dice"] = {
        key: metrics.mean_defined([r["grid_dice"][key] for r in records])
        for key in ("liver", "tumour")
    }
    return summary


# ---------------------------------------------------------------- cross-validation


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
        _check_grid(store, store.path, config)
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
    first = _identity(runs[0].config)
    for run in runs[1:]:
        theirs = _identity(run.config)
        changed = [
            f"{section}.{key}"
            for section, values in first.items()
            for key, value in values.items()
            if theirs[section][key] != value
        ]
        if changed:
            raise CtsegError(
                f"{run.run_dir} and {runs[0].run_dir} differ in {', '.join(changed)}: a "
                "cross-validation estimates one config, trained on every fold"
            )
    return sorted(runs, key=lambda run: run.fold)


def _identity(config: Config) -> dict[str, dict[str, Any]]:
    """A run's config without what differs between the fold runs of one cross-validation."""
    values = cfg_to_dict(config)
    values.pop("mesh")
    values["train"].pop("fold")
    return values


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
    its lock, by the rules of `evaluate_run` (`rundir.EVALUATED` records the runs,
    their checkpoints and the store). Returns the report: the cases of every fold, their
    summary and errors, and ``runs`` (per fold: run, checkpoint step, cases, summary).
    """
    from ctseg.inference.predictor import Predictor
    from ctseg.run.checkpoints import Checkpoints

    data_dir, out_dir = Path(data_dir), Path(out_dir)
    options = options or InferenceOptions()
    store = Store.open(data_dir)
    runs = fold_runs(store, run_dirs, configs)
    folds = {run.fold: [c for c in store.fold_cases(run.fold) if c.labelled] for run in runs}
    total = sum(len(cases) for cases in folds.values())
    with lock.hold(out_dir, warn):
        atomic.claim_folder(out_dir, _OWN_FILES, force=None)
        steps = []
        for run in runs:
            checkpoints = Checkpoints(run.run_dir, keep=1, read_only=True)
            try:
                steps.append(checkpoints.resolve(options.checkpoint))
            except CtsegError as exc:
                raise CtsegError(f"{run.run_dir}: {exc}") from None
            finally:
                checkpoints.close()
        _claim_evaluation(out_dir, _cross_validation_of(runs, steps, data_dir), force)
        records, errors, entries, engine = [], [], [], {}
        for run in runs:
            predictor = Predictor.from_run(run.run_dir, options, run.config)
            cases, done = folds[run.fold], len(records) + len(errors)

            def counted(i: int, _: int, name: str, done: int = done) -> None:
                if progress is not None:
                    progress(done + i, total, name)

            view = store.for_fold(run.fold)
            fold_records, fold_errors = _score_run(predictor, view, cases, out_dir, counted)
            records += fold_records
            errors += fold_errors
            engine = engine or _engine_record(predictor)
            entries.append(
                {
                    "run_dir": str(run.run_dir),
                    "fold": run.fold,
                    "checkpoint_step": predictor.model.step,
                    "cases": [case.id for case in cases],
                    "summary": _summary(fold_records),
                }
            )
            del predictor  # one model at a time on the devices
        actual = [entry["checkpoint_step"] for entry in entries]
        if actual != steps:  # a checkpoint that could not be read was skipped: say which was used
            atomic.write_json(
                out_dir / rundir.EVALUATED, _cross_validation_of(runs, actual, data_dir)
            )
        head = {
            "cross_validation": {
                "data": str(data_dir),
                "folds": store.folds,
                "fold_seed": store.fold_seed,
                **engine,
            },
            "runs": entries,
        }
        return _report(head, records, errors, out_dir)


def _cross_validation_of(
    runs: Sequence[FoldRun], steps: Sequence[int], data_dir: Path
) -> dict[str, Any]:
    return {
        "cross_validation": [
            {"fold": run.fold, "run_dir": str(run.run_dir.resolve()), "checkpoint_step": step}
            for run, step in zip(runs, steps, strict=True)
        ],
        "data": str(Path(data_dir).resolve()),
    }


def _evaluation_of(
    run_dirs: Sequence[Path], steps: Sequence[int], data_dir: Path, split: str
) -> dict[str, Any]:
    """What an evaluation's folder holds (`rundir.EVALUATED`): its run(s) and store."""
    evaluation = {
        "run_dir": str(Path(run_dirs[0]).resolve()),
        "checkpoint_step": steps[0],
        "data": str(Path(data_dir).resolve()),
        "split": split,
    }
    if len(run_dirs) > 1:
        evaluation["ensemble"] = [
            {"run_dir": str(Path(r).resolve()), "checkpoint_step": s}
            for r, s in zip(run_dirs, steps, strict=True)
        ]
    return evaluation


def _claim_evaluation(out_dir: Path, evaluation: dict[str, Any], force: bool) -> None:
    """Make `out_dir` the folder of `evaluation`: refuse another's unless `force`, then clear."""
    record, summary = out_dir / rundir.EVALUATED, out_dir / "summary.json"
    earlier = None
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        if record.exists():
            earlier = json.loads(record.read_text())
            earlier = earlier if isinstance(earlier, dict) else None
        elif summary.exists():  # written before the record existed: its "run" says the same
            run = json.loads(summary.read_text())["run"]
            earlier = _evaluation_of(
                run["run_dir"], run["checkpoint_step"], run["data"], run["split"]
            )
    has_files = record.exists() or summary.exists() or (out_dir / "predictions").exists()
    if earlier != evaluation and has_files and not force:
        raise CtsegError(
            f"{out_dir} holds {_described(earlier)}; give another --out, or --force to replace it"
        )
    # An evaluation is never resumed: what an earlier one wrote goes, so that the
    # predictions and reports here are all of this one, even if it stops half-way.
    predictions = out_dir / "predictions"
    if predictions.is_dir():
        for path in predictions.iterdir():
            if path.name.endswith("_seg.nii.gz") or path.name.startswith(atomic.TEMP_PREFIX):
                path.unlink()
    for name in ("summary.json", "metrics.csv"):
        (out_dir / name).unlink(missing_ok=True)
    atomic.write_json(record, evaluation)


def _described(evaluation: dict[str, Any] | None) -> str:
    """An evaluation's record (`rundir.EVALUATED`) in words."""
    try:
        if evaluation is not None and "cross_validation" in evaluation:
            runs = evaluation["cross_validation"]
            return (
                f"the cross-validation of {len(runs)} fold runs ({runs[0]['run_dir']}, …) on "
                f"{evaluation['data']}"
            )
        if evaluation is not None:
            return (
                f"the evaluation of {evaluation['run_dir']} (checkpoint "
                f"{evaluation['checkpoint_step']}, {evaluation['data']} split "
                f"{evaluation['split']!r})"
            )
    except (KeyError, IndexError, TypeError):
        pass
    return "an evaluation that cannot be read"


def _evaluate_case(predictor: Predictor, store: Store, case: CaseEntry, out_dir: Path) -> dict:
    """Predict one case from its original scan and score it there and on the grid."""
    scan = volume.read_scan(case.image_source)
    # A source is outside the store: use it only while it is the scan the case was made from.
    if volume.geometry_difference(
        scan.original_shape, scan.original_affine, case.original_shape, case.original_affine
    ):
        raise CtsegError(
            f"{case.image_source} is not the scan case {case.id} was prepared from (its geometry "
            "differs from the store manifest's); re-run `ctseg preprocess --force`"
        )
    reference = volume.read_scan(case.label_source)
    if volume.geometry_difference(
        scan.original_shape,
        scan.original_affine,
        reference.original_shape,
        reference.original_affine,
    ):
        raise CtsegError(f"{case.label_source} does not have its scan's geometry")
    prediction = predictor.predict(scan)
    volume.write_labels(scan, prediction.labels, out_dir / "predictions" / f"{case.id}_seg.nii.gz")
    # Canonical order is a flip/permutation of the file's, and scan.spacing is canonical: the
    # metrics equal those computed in the file's own voxel order.
    record = evaluate_arrays(case.id, prediction.labels, reference.array, scan.spacing)
    # On the grid (the run's and the store's: the same scan, the same resampling), against
    # the store's labels. An ensemble has no one grid.
    on_grid = prediction.grid_labels
    if on_grid is None:
        record["grid_dice"] = {"liver": None, "tumour": None}
        return record
    record["grid_dice"] = metrics.grid_dice(on_grid, np.asarray(store.label(case.id)))
    return record
