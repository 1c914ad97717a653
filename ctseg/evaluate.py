"""Evaluation: folders of predicted label maps against references, or a run on a store's split.

`evaluate_folders` (``ctseg evaluate --pred P --ref R``) pairs NIfTI label maps by
name and compares them in their own file geometry: a prediction must have its
reference's shape and affine, so no resampling or reorientation happens here.
`evaluate_run` (``ctseg evaluate RUN_DIR --data PREP``) predicts every case of a
store's split with the run's model from its original scan and scores it against
the original label file (LiTS style, in the original geometry), plus the
grid-level Dice that training reports. A run of a cross-validation fold
(``ctseg train --fold``) sees the store as it trained on it: its "val" split is
its fold. `evaluate_cross_validation` (``ctseg evaluate RUN_DIR… --cross-validation``)
predicts every labelled case with the fold run that did not train on it, case by
case exactly as `evaluate_run`, into one report. All go through one per-case loop
(`score_cases`): a case that fails (unreadable file, other geometry, labels
outside 0–2) is listed under ``errors`` and the other cases still count.
`evaluate_arrays` is the in-memory core of them all.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import re
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import nibabel as nib
import numpy as np

from ctseg import atomic, lock, metrics, preprocess, rundir, volume
from ctseg.atomic import claim_report, is_json_with, write_text
from ctseg.config import Config, InferenceOptions
from ctseg.config import to_dict as cfg_to_dict
from ctseg.errors import CtsegError
from ctseg.store import CaseEntry, Store

NIFTI_SUFFIXES = (".nii.gz", ".nii")
CSV_SECTIONS = ("liver", "tumour", "detection", "burden")
Case = TypeVar("Case")

Progress = Callable[[int, int, str], None]  # (cases done, cases in total, current case name)


class CasePair(NamedTuple):
    case: str  # the reference file name without extension, e.g. "segmentation-3"
    pred: Path
    ref: Path


# ---------------------------------------------------------------- pairing


def nifti_stem(path: Path) -> str | None:
    """The file name without .nii / .nii.gz, or None for other files."""
    for suffix in NIFTI_SUFFIXES:
        if path.name.endswith(suffix) and len(path.name) > len(suffix):
            return path.name[: -len(suffix)]
    return None


def _natural_key(name: str) -> list:
    """Sort "segmentation-2" before "segmentation-10"."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _nifti_files(folder: Path, role: str) -> dict[str, Path]:
    """NIfTI files of `folder` by stem; two files with one stem (.nii and .nii.gz) are an error."""
    if not folder.is_dir():
        raise CtsegError(f"{role} folder {folder} does not exist or is not a folder")
    files: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        stem = nifti_stem(path)
        if stem is None or path.name.startswith(".") or not path.is_file():
            continue
        if stem in files:
            raise CtsegError(f"{role} folder holds both {files[stem].name} and {path.name}")
        files[stem] = path
    return files


def reference_candidates(pred_stem: str) -> list[str]:
    """Reference stems a prediction may belong to, most specific first.

    `x` ↔ `x`; LiTS `test-segmentation-N` ↔ `segmentation-N`; and what
    `ctseg predict` writes, `<scan>_seg` ↔ `<scan>`, where a LiTS scan name
    `volume-N` (or `test-volume-N`) stands for its `segmentation-N`.
    """
    candidates = [pred_stem]
    if match := re.fullmatch(r"test-segmentation-(\d+)", pred_stem):
        candidates.append(f"segmentation-{match[1]}")
    if pred_stem.endswith("_seg"):
        scan = pred_stem[: -len("_seg")]
        candidates.append(scan)
        if match := re.fullmatch(r"(test-)?volume-(\d+)", scan):
            candidates.append(f"{match[1] or ''}segmentation-{match[2]}")
    return candidates


def pair_files(pred_dir: Path, ref_dir: Path) -> tuple[list[CasePair], list[str], list[str]]:
    """Match prediction files to reference files by name (see `reference_candidates`).

    Returns the pairs (sorted by case name) and the file names left unpaired in
    each folder. Two predictions claiming one reference are an error.
    """
    preds = _nifti_files(Path(pred_dir), "prediction")
    refs = _nifti_files(Path(ref_dir), "reference")
    claimed: dict[str, Path] = {}
    unpaired_pred = []
    for stem, pred_path in preds.items():
        ref_stem = next((c for c in reference_candidates(stem) if c in refs), None)
        if ref_stem is None:
            unpaired_pred.append(pred_path.name)
        elif ref_stem in claimed:
            raise CtsegError(
                f"{claimed[ref_stem].name} and {pred_path.name} both match reference "
                f"{refs[ref_stem].name}; keep one of them"
            )
        else:
            claimed[ref_stem] = pred_path
    pairs = [CasePair(stem, claimed[stem], refs[stem]) for stem in claimed]
    pairs.sort(key=lambda pair: _natural_key(pair.case))
    unpaired_ref = [refs[stem].name for stem in refs if stem not in claimed]
    return pairs, sorted(unpaired_pred, key=_natural_key), sorted(unpaired_ref, key=_natural_key)


# ---------------------------------------------------------------- one case


def check_labels(labels: np.ndarray, role: str) -> np.ndarray:
    """The label map as uint8, or CtsegError if it holds anything but 0, 1, 2."""
    if labels.size and (labels.min() < 0 or labels.max() > metrics.TUMOUR):
        raise CtsegError(f"{role} has labels outside 0–2 (min {labels.min()}, max {labels.max()})")
    # LiTS stores some segmentations as floats; only whole numbers are labels.
    if not np.issubdtype(labels.dtype, np.integer) and not np.array_equal(labels, np.rint(labels)):
        raise CtsegError(f"{role} has non-integer label values")
    return labels.astype(np.uint8)


def evaluate_arrays(
    name: str, pred_labels: np.ndarray, ref_labels: np.ndarray, spacing: Sequence[float]
) -> dict:
    """The case record of the JSON report for two label maps on one grid (spacing in mm)."""
    if pred_labels.shape != ref_labels.shape:
        raise CtsegError(
            f"prediction shape {pred_labels.shape} differs from reference shape {ref_labels.shape}"
        )
    pred = check_labels(pred_labels, "prediction")
    ref = check_labels(ref_labels, "reference")
    return {"case": name, **metrics.case_metrics(pred, ref, spacing)}


def _load_nifti(path: Path) -> nib.Nifti1Image:
    try:
        image = nib.load(path)
    except (OSError, EOFError, ValueError, nib.filebasedimages.ImageFileError) as exc:
        raise CtsegError(f"could not read {path.name}: {exc}") from exc
    if len(image.shape) != 3:
        raise CtsegError(f"{path.name} is not a 3-D image (shape {image.shape})")
    return image


def _read_labels(image: nib.Nifti1Image, path: Path) -> np.ndarray:
    try:
        return np.asanyarray(image.dataobj)
    except (OSError, EOFError, ValueError, zlib.error) as exc:  # truncated or corrupt voxel data
        raise CtsegError(f"could not read the voxels of {path.name}: {exc}") from exc


def evaluate_pair(pair: CasePair) -> dict:
    """Read one prediction/reference pair, check their geometry, and evaluate it."""
    pred_image, ref_image = _load_nifti(pair.pred), _load_nifti(pair.ref)
    difference = volume.geometry_difference(
        pred_image.shape, pred_image.affine, ref_image.shape, ref_image.affine
    )
    if difference:
        raise CtsegError(f"the prediction's geometry is not the reference's: {difference}")
    spacing = tuple(float(z) for z in ref_image.header.get_zooms()[:3])
    return evaluate_arrays(
        pair.case, _read_labels(pred_image, pair.pred), _read_labels(ref_image, pair.ref), spacing
    )


# ---------------------------------------------------------------- many cases


def score_cases(
    cases: Sequence[Case],
    name: Callable[[Case], str],
    score: Callable[[Case], dict],
    progress: Progress | None = None,
) -> tuple[list[dict], list[dict]]:
    """`score` every case: (the records, {"case", "message"} of each that failed).

    A case's `CtsegError` fails that case alone; the others go on.
    """
    records, errors = [], []
    for done, case in enumerate(cases):
        if progress is not None:
            progress(done, len(cases), name(case))
        try:
            records.append(score(case))
        except CtsegError as exc:
            errors.append({"case": name(case), "message": str(exc)})
    if progress is not None:
        progress(len(cases), len(cases), "")
    return records, errors


def evaluate_pairs(pairs: Sequence[CasePair], progress: Progress | None = None) -> dict:
    """Evaluate every pair; a case that fails is listed under "errors" and the rest go on.

    Returns ``{"cases", "summary", "errors", "unpaired"}`` (unpaired lists empty;
    `evaluate_folders` fills them).
    """
    cases, errors = score_cases(pairs, lambda pair: pair.case, evaluate_pair, progress)
    return {
        "cases": cases,
        "summary": metrics.summarize(cases),
        "errors": errors,
        "unpaired": {"pred": [], "ref": []},
    }


def _models(pairs: Sequence[CasePair]) -> set[tuple]:
    """The models (run, checkpoint step, TTA) whose `ctseg predict` stats lie beside the pairs'
    predictions (`<scan>_seg.nii.gz` beside `<scan>_stats.json`)."""
    models = set()
    for pair in pairs:
        stem = nifti_stem(pair.pred) or ""
        stats_path = pair.pred.with_name(f"{stem.removesuffix('_seg')}_stats.json")
        if not stem.endswith("_seg") or not stats_path.is_file():
            continue
        try:
            stats = json.loads(stats_path.read_text())
            models.add((stats.get("run_dir"), stats.get("run_step"), stats.get("tta")))
        except (OSError, ValueError, AttributeError):
            continue  # not a stats file of ours: nothing to compare
    return models


def evaluate_folders(pred_dir: Path, ref_dir: Path, progress: Progress | None = None) -> dict:
    """Pair the two folders' files and evaluate them.

    No pair at all is an error; so are one folder given as both (every case would
    score perfectly) and predictions of several models in one folder (their mean
    would describe none of them).
    """
    if Path(pred_dir).resolve() == Path(ref_dir).resolve():
        raise CtsegError(f"--pred and --ref are the same folder ({pred_dir})")
    pairs, unpaired_pred, unpaired_ref = pair_files(pred_dir, ref_dir)
    if not pairs:
        raise CtsegError(f"no prediction in {pred_dir} matches a reference in {ref_dir}")
    if len(models := _models(pairs)) > 1:
        described = "; ".join(
            f"run {run or '?'} step {step}{' TTA' if tta else ''}"
            for run, step, tta in sorted(models, key=str)
        )
        raise CtsegError(
            f"{pred_dir} holds predictions of {len(models)} models ({described}); "
            "predict every scan with one model (ctseg predict --force) or evaluate them apart"
        )
    result = evaluate_pairs(pairs, progress)
    result["unpaired"] = {"pred": unpaired_pred, "ref": unpaired_ref}
    return result


# ---------------------------------------------------------------- a run on a store's split


def evaluate_run(
    run_dir: Path,
    data_dir: Path,
    split: str = "val",
    out_dir: Path | None = None,
    options: InferenceOptions | None = None,
    config: Config | None = None,
    progress: Progress | None = None,
    force: bool = False,
    warn: Callable[[str], None] | None = None,
) -> dict:
    """Predict a store's split with a run and score it; writes summary.json and metrics.csv.

    `options`: checkpoint, tiles, backend, devices and TTA (`ctseg.predict.Predictor`);
    `config`: the run's config.toml if already read. `out_dir` (default RUN_DIR/eval)
    holds one evaluation: `rundir.EVALUATED` records its run, checkpoint, store and split.
    Another one is replaced only with `force`; every evaluation first clears what an
    earlier one wrote, so that predictions are never mixed. The folder's lock is held
    throughout (`ctseg.lock`; `warn` hears of a dead holder's).

    Metrics compare the post-processed prediction, mapped back to the case's
    original scan, with its original label file (the LiTS way); each case also
    gets the Dice of the raw prediction on the grid against the store's label
    (`grid_dice`, what training validates with). Returns the report (the JSON's content).
    """
    # Imported here: the prediction pipeline starts JAX, which `ctseg evaluate --pred/--ref`
    # never needs (and which must not start before the CLI has chosen the devices).
    from ctseg.predict import Predictor

    run_dir, data_dir = Path(run_dir), Path(data_dir)
    out_dir = rundir.evaluation_dir(run_dir, out_dir)
    store, fold = _as_the_run_saw_it(Store.open(data_dir), run_dir, split)
    try:
        cases = store.split(split)
    except ValueError as exc:
        raise CtsegError(str(exc)) from None
    cases = [case for case in cases if case.labelled]
    if not cases:
        raise CtsegError(f"the store at {data_dir} has no labelled cases in the {split!r} split")
    with lock.hold(out_dir, warn):
        atomic.claim_folder(out_dir, _OWN_FILES, force=None)
        predictor = Predictor.from_run(run_dir, options, config)
        _check_grid(store, data_dir, predictor.config)
        _claim_evaluation(
            out_dir, _evaluation_of(run_dir, predictor.model.step, data_dir, split), force
        )
        records, errors = _score_run(predictor, store, cases, out_dir, progress)
        result = {
            "run": {
                "run_dir": str(run_dir),
                "checkpoint_step": predictor.model.step,
                "data": str(data_dir),
                "split": split,
                "fold": fold,
                **_engine_record(predictor),
            },
            "cases": records,
            "summary": _summary(records),
            "errors": errors,
            "unpaired": {"pred": [], "ref": []},  # the --pred/--ref report's shape
        }
        write_reports(result, out_dir / "summary.json", out_dir / "metrics.csv")
        return result


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


def _engine_record(predictor: Any) -> dict[str, Any]:
    """How a run's model predicted: tiles, backend, TTA and devices."""
    return {
        "tiling": predictor.plan,
        "backend": predictor.backend,
        "tta": predictor.tta,
        "device": predictor.summary,
    }


def _score_run(
    predictor: Any,
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
    from ctseg.checkpoints import Checkpoints
    from ctseg.predict import Predictor

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
        result = {
            "cross_validation": {
                "data": str(data_dir),
                "folds": store.folds,
                "fold_seed": store.fold_seed,
                **engine,
            },
            "runs": entries,
            "cases": records,
            "summary": _summary(records),
            "errors": errors,
            "unpaired": {"pred": [], "ref": []},  # the --pred/--ref report's shape
        }
        write_reports(result, out_dir / "summary.json", out_dir / "metrics.csv")
        return result


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


def _evaluation_of(run_dir: Path, step: int, data_dir: Path, split: str) -> dict[str, Any]:
    return {
        "run_dir": str(Path(run_dir).resolve()),
        "checkpoint_step": step,
        "data": str(Path(data_dir).resolve()),
        "split": split,
    }


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


def _evaluate_case(predictor: Any, store: Store, case: CaseEntry, out_dir: Path) -> dict:
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
    # On the grid: the prediction where the store's training box lies (the whole grid on
    # the cube), against the box's labels.
    box = (store.resolution,) * 3
    predicted = preprocess.take_box(prediction.grid_labels, case.box_offset, box)
    record["grid_dice"] = metrics.grid_dice(predicted, np.asarray(store.label(case.id)))
    return record


# ---------------------------------------------------------------- reports


def case_row(case: dict) -> dict[str, Any]:
    """One flat CSV row: "case", then "<section>_<metric>" for every per-case value."""
    row: dict[str, Any] = {"case": case["case"]}
    for section in CSV_SECTIONS:
        for key, value in case[section].items():
            row[f"{section}_{key}"] = value
    return row


def cases_csv(cases: Sequence[dict]) -> str:
    """The per-case table as CSV text; undefined values are empty cells."""
    rows = [case_row(case) for case in cases]
    columns = list(rows[0]) if rows else ["case"]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)  # DictWriter writes None as an empty cell
    return buffer.getvalue()


REPORT_KEYS = ("cases", "summary", "errors", "unpaired")


def is_cases_csv(path: Path) -> bool:
    """Whether `path` holds a per-case CSV that `cases_csv` wrote (by its header)."""
    try:
        with path.open(errors="replace") as f:
            header = f.readline().rstrip("\n")
    except OSError:
        return False
    columns = header.split(",")
    # "tumor_…": the spelling of reports written before the outputs settled on one.
    sections = (*CSV_SECTIONS, "tumor")
    return columns[0] == "case" and all(c.split("_")[0] in sections for c in columns[1:])


def claim_reports(
    json_path: Path | None,
    csv_path: Path | None,
    inputs: Sequence[Path],
    force: bool = False,
) -> None:
    """Check, before evaluating, that the reports may go where they are asked to.

    Never over an input (the `inputs` folders or a label map in them), nor one over
    the other; an existing file only when it is such a report already, or with `force`.
    """
    if json_path is not None and csv_path is not None:
        if Path(json_path).resolve() == Path(csv_path).resolve():
            raise CtsegError("--json and --csv name the same file; give two files")
    # The label maps the folders hold are inputs too (a report may go beside them).
    inputs = [*inputs, *(f for d in inputs if d.is_dir() for f in d.iterdir() if nifti_stem(f))]
    if json_path is not None:
        claim_report(json_path, lambda p: is_json_with(p, REPORT_KEYS), inputs, force)
    if csv_path is not None:
        claim_report(csv_path, is_cases_csv, inputs, force)


def write_reports(
    result: dict, json_path: Path | None = None, csv_path: Path | None = None
) -> None:
    """Write the JSON report and/or the per-case CSV, each atomically."""
    if json_path is not None:
        # allow_nan=False: a NaN would be a bug in the metrics (they use None), so fail loudly.
        write_text(json_path, json.dumps(result, indent=2, allow_nan=False) + "\n")
    if csv_path is not None:
        write_text(csv_path, cases_csv(result["cases"]))
