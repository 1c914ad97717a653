"""Evaluations that predict with trained runs: a run (or an ensemble of runs) on a
store's split, case by case (the per-case work `ctseg.evaluation.cross_validation`
shares).

`evaluate_run` (``ctseg evaluate RUN_DIR… --data PREP``) predicts every labelled case
of a store's split from its original scan, with one run's model or the mean of
several runs' (an ensemble), and scores it against the original label file (LiTS
style, in the original geometry), plus, for one run, the grid-level Dice that
training reports. With a locator run (``--locate COARSE_RUN``) every case is predicted
as ``ctseg predict --locate`` predicts it (`Predictor.predict_region`): at full
resolution on the located liver's box plus a margin, or the whole scan where the locator
finds no liver or a cut one; each case's record says which. A run of a cross-validation
fold (``ctseg train --fold``) sees the store as it trained on it: its "val" split is its
fold.
Cases go through `ctseg.evaluation.scoring.score_cases`, and the reports are written
as `ctseg evaluate --pred/--ref` writes them. The evaluation folder's record and
clearing are `ctseg.run.evaluations`'s.

The prediction pipeline starts JAX: it is imported when an evaluation runs, so that
the CLI can choose the devices first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ctseg import atomic, labels, lock
from ctseg.config import Config, InferenceOptions
from ctseg.data.manifest import SPLITS
from ctseg.data.store import CaseEntry, Store
from ctseg.errors import CtsegError
from ctseg.evaluation import metrics
from ctseg.evaluation import quality as quality_power
from ctseg.evaluation.scoring import evaluate_arrays, score_cases, write_reports
from ctseg.inference import quality
from ctseg.inference.region import check_margin
from ctseg.io import scans
from ctseg.progress import Progress
from ctseg.run import evaluations, rundir

if TYPE_CHECKING:
    from ctseg.inference.predictor import Predictor


def _checked_locator(
    locate: Path | None, margin_mm: float | None
) -> tuple[Path | None, float | None]:
    """The locator run and its margin (default `predictor.DEFAULT_MARGIN_MM`), checked
    before anything is claimed or cleared: a wrong path or margin is one line."""
    from ctseg.inference.predictor import DEFAULT_MARGIN_MM

    check_margin(margin_mm, locate is not None, "--margin", "--locate COARSE_RUN")
    if locate is None:
        return None, margin_mm
    try:
        rundir.load_config(Path(locate))
    except CtsegError as exc:
        raise CtsegError(f"--locate: {exc}") from None
    return Path(locate), DEFAULT_MARGIN_MM if margin_mm is None else float(margin_mm)


def _labelled_cases(store: Store, split: str) -> list[CaseEntry]:
    """The split's labelled cases; CtsegError when there are none."""
    try:
        cases = store.split(split)
    except ValueError as exc:
        raise CtsegError(str(exc)) from None
    cases = [case for case in cases if case.labelled]
    if not cases:
        raise CtsegError(f"the store at {store.path} has no labelled cases in the {split!r} split")
    return cases


def evaluate_run(
    run_dirs: Path | Sequence[Path],
    data_dir: Path,
    split: str = "val",
    out_dir: Path | None = None,
    options: InferenceOptions | None = None,
    configs: Config | Sequence[Config] | None = None,
    locate: Path | None = None,
    margin_mm: float | None = None,
    progress: Progress | None = None,
    force: bool = False,
    warn: Callable[[str], None] | None = None,
) -> dict:
    """Predict a store's split with a run (or an ensemble of runs) and score it; writes
    summary.json and metrics.csv.

    `options`: checkpoint, tiles, backend, devices and TTA (`ctseg.inference.predictor.Predictor`);
    `configs`: the runs' config.toml if already read. `locate`: a coarse run that finds
    the liver first, with `margin_mm` around it (default `predictor.DEFAULT_MARGIN_MM`,
    as `ctseg predict`): `Predictor.predict_region`. Each case's record then holds the
    predictor's `located` (its region, or why the whole scan was predicted instead), the
    report's "run" the locator and margin, and the summary how many cases used a region.
    `out_dir` (default RUN_DIR/eval; an ensemble's must be given) holds one evaluation:
    evaluated.json records its runs, checkpoints, store and split (not the locator: as
    TTA or the backend, it is how the run predicted, and the report records it). Another
    one is replaced only with `force`; every evaluation first clears what an earlier one
    wrote, so that predictions are never mixed. The folder's lock is held throughout
    (`ctseg.lock`; `warn` hears of a dead holder's).

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
    locate, margin_mm = _checked_locator(locate, margin_mm)
    data_dir = Path(data_dir)
    out_dir = evaluations.evaluation_dir(run_dirs[0], out_dir)
    if ensemble:
        store, fold = Store.open(data_dir), None
        _check_unseen(store, run_dirs, split)
    else:
        store, fold = _as_the_run_saw_it(Store.open(data_dir), run_dirs[0], split)
    cases = _labelled_cases(store, split)
    with lock.hold(out_dir, warn):
        atomic.claim_folder(out_dir, evaluations.OWN_FILES, force=None)
        predictor = Predictor.from_run(run_dirs, options, configs)
        if locate is not None:  # exactly as `ctseg predict --locate` (its checkpoint option too)
            predictor.predict_region(locate, None, margin_mm, options)
        if not ensemble:  # the grid Dice compares with the store's boxes
            store.check_grid(predictor.config.data)
        steps = [member.model.step for member in predictor.members]
        located = None
        if predictor.locator is not None:
            located = {
                "run_dir": str(locate),
                "checkpoint_step": predictor.locator.model.step,
                "margin_mm": predictor.margin_mm,
            }
        record = evaluations.evaluation_record(run_dirs, steps, data_dir, split, located)
        evaluations.claim(out_dir, record, force)
        records, errors = score_run(predictor, store, cases, out_dir, progress)
        run = {
            "run_dir": str(run_dirs[0]),
            "checkpoint_step": steps[0],
            "data": str(data_dir),
            "split": split,
            "fold": fold,
            **engine_record(predictor),
        }
        if located is not None:
            run["locate"] = located
        if ensemble:
            run["ensemble"] = [
                {"run_dir": str(r), "checkpoint_step": s}
                for r, s in zip(run_dirs, steps, strict=True)
            ]
        return write_report({"run": run}, records, errors, out_dir)


def write_report(head: dict, records: list[dict], errors: list[dict], out_dir: Path) -> dict:
    """The report of an evaluation (`head`, then its cases, summary and errors), written
    to `out_dir` as summary.json and metrics.csv."""
    result = {
        **head,
        "cases": records,
        "summary": summary_of(records),
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


def engine_record(predictor: Predictor) -> dict[str, Any]:
    """How a run's model predicted: tiles, backend, TTA and devices."""
    return {
        "tiling": predictor.plan,
        "backend": predictor.backend,
        "tta": predictor.tta,
        "device": predictor.summary,
    }


def score_run(
    predictor: Predictor,
    store: Store,
    cases: Sequence[CaseEntry],
    out_dir: Path,
    progress: Progress | None,
) -> tuple[list[dict], list[dict]]:
    """Predict and score `cases` with one run's model (`score_cases` over `_evaluate_case`)."""
    training = quality.Reference.of_run(predictor.members[0].run_dir)

    def score(case: CaseEntry) -> dict:
        return _evaluate_case(predictor, store, case, out_dir, training)

    return score_cases(cases, lambda case: case.id, score, progress)


def summary_of(records: list[dict]) -> dict:
    """`metrics.summarize`, plus the mean grid Dice of a run's evaluation, with a locator
    how many cases it gave a region and how many fell back to the whole scan, and the
    prediction quality's power to find the bad cases (`ctseg.evaluation.quality`)."""
    summary = metrics.summarize(records)
    summary["grid_dice"] = {
        key: metrics.mean_defined([r["grid_dice"][key] for r in records])
        for key in ("liver", "tumour")
    }
    located = [r["located"] for r in records if r.get("located") is not None]
    if located:
        regions = sum(entry["region"] is not None for entry in located)
        summary["located"] = {"region": regions, "whole_scan": len(located) - regions}
    power = quality_power.summarize(records)
    if power is not None:
        summary["quality"] = power
    return summary


# ---------------------------------------------------------------- cross-validation


def _evaluate_case(
    predictor: Predictor,
    store: Store,
    case: CaseEntry,
    out_dir: Path,
    training: quality.Reference | None = None,
) -> dict:
    """Predict one case from its original scan and score it there and on the grid, with
    the prediction's quality (as `ctseg predict` records it) beside its metrics."""
    scan = scans.read_scan(case.image_source)
    # A source is outside the store: use it only while it is the scan the case was made from.
    if scans.geometry_difference(
        scan.original_shape, scan.original_affine, case.original_shape, case.original_affine
    ):
        raise CtsegError(
            f"{case.image_source} is not the scan case {case.id} was prepared from (its geometry "
            "differs from the store manifest's); re-run `ctseg preprocess --force`"
        )
    reference = scans.read_scan(case.label_source)
    if scans.geometry_difference(
        scan.original_shape,
        scan.original_affine,
        reference.original_shape,
        reference.original_affine,
    ):
        raise CtsegError(f"{case.label_source} does not have its scan's geometry")
    prediction = predictor.predict(scan)
    predicted = out_dir / evaluations.PREDICTIONS / f"{case.id}_seg.nii.gz"
    scans.write_labels(scan, prediction.labels, predicted)
    # Canonical order is a flip/permutation of the file's, and scan.spacing is canonical: the
    # metrics equal those computed in the file's own voxel order.
    record = evaluate_arrays(case.id, prediction.labels, reference.array, scan.spacing)
    if prediction.located is not None:  # a locator's region, or why the whole scan
        record["located"] = prediction.located
    # What the training data says of it (`training`: the run's fingerprint).
    record["quality"] = quality.of_prediction(prediction, scan, training).to_json()
    # On the grid (the run's and the store's: the same scan, the same resampling), against
    # the store's labels. An ensemble has no one grid, nor has a prediction on a region's
    # window of it.
    on_grid = prediction.grid_labels
    if on_grid is None:
        record["grid_dice"] = {"liver": None, "tumour": None}
        return record
    record["grid_dice"] = labels.grid_dice(on_grid, np.asarray(store.label(case.id)))
    return record
