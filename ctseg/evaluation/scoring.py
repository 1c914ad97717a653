"""Evaluation: scoring predicted label maps against references, and the reports.

`evaluate_folders` (``ctseg evaluate --pred P --ref R``) pairs NIfTI label maps by
name and compares them in their own geometry: a prediction must have its
reference's shape and affine, so no resampling happens here; both are read by
`ctseg.io.scans.read_scan`, with the checks every scan read gets. The
evaluations that predict with trained runs (a run, an ensemble, a cross-validation)
are `ctseg.evaluation.runs`'s and `ctseg.evaluation.cross_validation`'s (one skeleton,
`ctseg.evaluation.skeleton`), and go through the same per-case loop (`score_cases`):
a case that fails (unreadable file, other geometry, labels outside 0–2) is listed
under ``errors`` and the other cases still count. So is every case that could not be
evaluated at all: a reference without its prediction, and a prediction that cannot be
read (a dangling link, a pipe, a file without read permission). `evaluate_arrays` is the
in-memory core of them all; `write_reports` writes a `ctseg.evaluation.reports.Report`
as summary.json and metrics.csv.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import numpy as np

from ctseg import compat
from ctseg.atomic import claim_report, is_json_with, write_text
from ctseg.errors import CtsegError
from ctseg.evaluation import metrics
from ctseg.evaluation.reports import Report, Summary, Unpaired
from ctseg.io import scans
from ctseg.labels import check_labels
from ctseg.progress import Progress

NIFTI_SUFFIXES = (".nii.gz", ".nii")
CSV_SECTIONS = ("liver", "tumour", "detection", "burden")
# A case's prediction quality (`ctseg.inference.quality`) in metrics.csv, where it has one.
QUALITY_COLUMNS = ("verdict", "score", "liver", "tumour")
Case = TypeVar("Case")


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
    """NIfTI names of `folder` by stem; two files with one stem (.nii and .nii.gz) are an
    error. Every entry but a folder counts: a dangling link or a pipe of a label map's
    name is a case that cannot be read (`read_scan` says why), never silently no case."""
    if not folder.is_dir():
        raise CtsegError(f"{role} folder {folder} does not exist or is not a folder")
    files: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        stem = nifti_stem(path)
        if stem is None or path.name.startswith(".") or path.is_dir():
            continue
        if stem in files:
            raise CtsegError(f"{role} folder holds both {files[stem].name} and {path.name}")
        files[stem] = path
    return files


# A LiTS scan's name (its prefix, its N): in a references' folder, the scan beside its
# segmentation-N, no reference.
_LITS_SCAN = re.compile(r"(test-)?volume-(\d+)")


def reference_candidates(pred_stem: str) -> list[str]:
    """Reference stems a prediction may belong to, most specific first.

    `x` ↔ `x`; LiTS `test-segmentation-N` ↔ `segmentation-N`; and what
    `ctseg predict` writes, `<scan>_seg` ↔ `<scan>`, where a LiTS scan name
    `volume-N` (or `test-volume-N`) stands for its `segmentation-N`: first, because a
    LiTS folder holds the scan `volume-N` itself beside it, which is no reference.
    """
    candidates = [pred_stem]
    if match := re.fullmatch(r"test-segmentation-(\d+)", pred_stem):
        candidates.append(f"segmentation-{match[1]}")
    if pred_stem.endswith("_seg"):
        scan = pred_stem[: -len("_seg")]
        if match := _LITS_SCAN.fullmatch(scan):
            candidates.append(f"{match[1] or ''}segmentation-{match[2]}")
        candidates.append(scan)
    return candidates


def pair_files(pred_dir: Path, ref_dir: Path) -> tuple[list[CasePair], list[str], list[str]]:
    """Match prediction files to reference files by name (see `reference_candidates`).

    Returns the pairs (sorted by case name) and the file names left unpaired in
    each folder; a LiTS scan (`volume-N`) among the references is a scan beside them, no
    reference, and not listed. Two predictions claiming one reference are an error.
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
    unpaired_ref = [
        refs[stem].name for stem in refs if stem not in claimed and not _LITS_SCAN.fullmatch(stem)
    ]
    return pairs, sorted(unpaired_pred, key=_natural_key), sorted(unpaired_ref, key=_natural_key)


# ---------------------------------------------------------------- one case


def evaluate_arrays(
    name: str, pred_labels: np.ndarray, ref_labels: np.ndarray, spacing: Sequence[float]
) -> dict:
    """The case record of the JSON report for two label maps on one grid (spacing in mm)."""
    if pred_labels.shape != ref_labels.shape:
        raise CtsegError(
            f"prediction shape {pred_labels.shape} differs from reference shape {ref_labels.shape}"
        )
    pred = check_labels(pred_labels, "the prediction")
    ref = check_labels(ref_labels, "the reference")
    return {"case": name, **metrics.case_metrics(pred, ref, spacing)}


def evaluate_pair(pair: CasePair) -> dict:
    """Read one prediction/reference pair (`read_scan`, with its checks), check that they
    share one geometry, and evaluate it."""
    for role, path in (("prediction", pair.pred), ("reference", pair.ref)):
        if why := _unusable(path):
            raise CtsegError(f"the {role} {path} is {why}")
    pred, ref = scans.read_scan(pair.pred), scans.read_scan(pair.ref)
    difference = scans.geometry_difference(
        pred.original_shape, pred.original_affine, ref.original_shape, ref.original_affine
    )
    if difference:
        raise CtsegError(f"the prediction's geometry is not the reference's: {difference}")
    # Both are in canonical order, a flip or permutation of the files' own, and the spacing
    # is the canonical voxel's (from the affine): the metrics equal those in file order.
    record = evaluate_arrays(pair.case, pred.array, ref.array, ref.spacing)
    judged = _predicted_quality(pair.pred)
    if judged is not None:
        record["quality"] = judged
    return record


def _stats_beside(pred: Path) -> Path | None:
    """The `ctseg predict` stats file beside a prediction `<scan>_seg.nii.gz`, if any."""
    stem = nifti_stem(pred) or ""
    stats_path = pred.with_name(f"{stem.removesuffix('_seg')}_stats.json")
    return stats_path if stem.endswith("_seg") and stats_path.is_file() else None


def _predicted_quality(pred: Path) -> dict | None:
    """The quality `ctseg predict` recorded for a prediction (its stats' "quality")."""
    stats_path = _stats_beside(pred)
    try:
        judged = json.loads(stats_path.read_text()).get("quality") if stats_path else None
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(judged, dict) or not isinstance(judged.get("verdict"), str):
        return None
    if not all(isinstance(judged.get(key), int | float) for key in ("score", "liver", "tumour")):
        return None
    return judged


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


def evaluate_pairs(pairs: Sequence[CasePair], progress: Progress | None = None) -> Report:
    """Evaluate every pair; a case that fails is listed under "errors" and the rest go on.

    Returns the `Report` (nothing unpaired; `evaluate_folders` says what was), its
    summary with the quality's power where `ctseg predict` recorded the quality.
    """
    cases, errors = score_cases(pairs, lambda pair: pair.case, evaluate_pair, progress)
    return Report(cases, Summary.of(cases, grid_dice=False), errors)


def _models(pairs: Sequence[CasePair]) -> set[tuple]:
    """The models (run, checkpoint step, TTA) whose `ctseg predict` stats lie beside the pairs'
    predictions (`<scan>_seg.nii.gz` beside `<scan>_stats.json`)."""
    models = set()
    for pair in pairs:
        stats_path = _stats_beside(pair.pred)
        if stats_path is None:
            continue
        try:
            stats = json.loads(stats_path.read_text())
            ensemble = json.dumps(stats.get("ensemble"))  # a list of members: made hashable
            models.add((stats.get("run_dir"), stats.get("run_step"), stats.get("tta"), ensemble))
        except (OSError, ValueError, AttributeError):
            continue  # not a stats file of ours: nothing to compare
    return models


def missing_predictions(unpaired_ref: Sequence[str], pred_dir: Path) -> list[dict]:
    """A failed case ({"case", "message"}) for each reference without its prediction."""
    missing = []
    for name in unpaired_ref:
        stem = nifti_stem(Path(name)) or name
        missing.append(
            {
                "case": stem,
                "message": f"no prediction in {pred_dir} for the reference {name} (looked for "
                f"{stem}.nii.gz, {stem}_seg.nii.gz and the like)",
            }
        )
    return missing


def _unusable(path: Path) -> str | None:
    """Why a label map's path cannot be read, in words (None: a readable file, as far as
    can be told before reading it)."""
    if path.is_symlink() and not path.exists():
        return f"a link to {os.readlink(path)}, which does not exist"
    if not path.is_file():
        return "not a regular file (a pipe, device or socket)"
    if not os.access(path, os.R_OK):
        return "not readable (permission denied)"
    return None


def _unreadable(unpaired_pred: Sequence[str], pred_dir: Path) -> list[dict]:
    """A failed case for each unpaired prediction that cannot be read (a dangling link, a
    pipe, one without read permission): whatever it was meant to be, it was not scored."""
    failed = []
    for name in unpaired_pred:
        path = Path(pred_dir) / name
        if why := _unusable(path):
            case = nifti_stem(Path(name)) or name
            failed.append(
                {
                    "case": case,
                    "message": f"the prediction {path} is {why}; it matches no reference",
                }
            )
    return failed


def evaluate_folders(pred_dir: Path, ref_dir: Path, progress: Progress | None = None) -> Report:
    """Pair the two folders' files and evaluate them.

    No pair at all is an error; so are one folder given as both (every case would
    score perfectly) and predictions of several models in one folder (their mean
    would describe none of them). A case that could not be evaluated is a failed case
    (under "errors"): a reference without its prediction (`missing_predictions`), a
    prediction that cannot be read, paired or not.
    """
    if Path(pred_dir).resolve() == Path(ref_dir).resolve():
        raise CtsegError(f"--pred and --ref are the same folder ({pred_dir})")
    pairs, unpaired_pred, unpaired_ref = pair_files(pred_dir, ref_dir)
    if not pairs:
        raise CtsegError(f"no prediction in {pred_dir} matches a reference in {ref_dir}")
    if len(models := _models(pairs)) > 1:
        described = "; ".join(
            f"run {run or '?'} step {step}{' TTA' if tta else ''}"
            + (" (an ensemble)" if ensemble != "null" else "")
            for run, step, tta, ensemble in sorted(models, key=str)
        )
        raise CtsegError(
            f"{pred_dir} holds predictions of {len(models)} models ({described}); "
            "predict every scan with one model (ctseg predict --force) or evaluate them apart"
        )
    result = evaluate_pairs(pairs, progress)
    errors = [
        *result.errors,
        *_unreadable(unpaired_pred, pred_dir),
        *missing_predictions(unpaired_ref, pred_dir),
    ]
    return dataclasses.replace(
        result, errors=errors, unpaired=Unpaired(unpaired_pred, unpaired_ref)
    )


# ---------------------------------------------------------------- reports


def case_row(case: dict) -> dict[str, Any]:
    """One flat CSV row: "case", then "<section>_<metric>" for every per-case value, and
    the prediction's quality (`quality_verdict`, `quality_score`, …) where it has one."""
    row: dict[str, Any] = {"case": case["case"]}
    for section in CSV_SECTIONS:
        for key, value in case[section].items():
            row[f"{section}_{key}"] = value
    judged = case.get("quality")
    if isinstance(judged, dict):
        for key in QUALITY_COLUMNS:
            row[f"quality_{key}"] = judged.get(key)
    return row


def cases_csv(cases: Sequence[dict]) -> str:
    """The per-case table as CSV text; undefined values are empty cells."""
    rows = [case_row(case) for case in cases]
    columns = list(dict.fromkeys(column for row in rows for column in row)) or ["case"]
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
    sections = (*CSV_SECTIONS, "quality", *compat.OLD_REPORT_SECTIONS)
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
    result: Report, json_path: Path | None = None, csv_path: Path | None = None
) -> None:
    """Write the JSON report (`Report.to_json`) and/or the per-case CSV, each atomically."""
    if json_path is not None:
        # allow_nan=False: a NaN would be a bug in the metrics (they use None), so fail loudly.
        text = json.dumps(result.to_json(), indent=2, allow_nan=False)
        write_text(json_path, text + "\n")
    if csv_path is not None:
        write_text(csv_path, cases_csv(result.cases))
