"""Evaluation: scoring predicted label maps against references, and the reports.

`evaluate_folders` (``ctseg evaluate --pred P --ref R``) pairs NIfTI label maps
(`ctseg.evaluation.pairing`) and compares them on one grid: a prediction must have its
reference's voxels in the world (compared in canonical order: the same voxels stored
mirrored or transposed are one grid), so no resampling happens here; both are read by
`ctseg.io.scans.read_scan`, with the checks every scan read gets, and a prediction that is
its reference itself (a link, a hard link) is refused. The quality `ctseg predict`
recorded beside a prediction (its `_stats.json`) is read through `ctseg.reading`: one that
cannot be read is a warning, its case scored without it. The
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import numpy as np

from ctseg import compat
from ctseg.atomic import claim_report, write_text
from ctseg.errors import CtsegError, OptionError
from ctseg.evaluation import metrics
from ctseg.evaluation.pairing import CasePair, nifti_stem, pair_files, same_file
from ctseg.evaluation.reports import CaseRecord, FailedCase, Report, Summary, Unpaired
from ctseg.io import scans
from ctseg.io.orientation import voxels_difference
from ctseg.labels import check_labels
from ctseg.progress import Progress
from ctseg.reading import Record, open_regular, read_json

CSV_SECTIONS = ("liver", "tumour", "detection", "burden")
# A case's prediction quality (`ctseg.inference.quality.scores`) in metrics.csv, where it has one.
QUALITY_COLUMNS = ("verdict", "score", "liver", "tumour")
Case = TypeVar("Case")


# ---------------------------------------------------------------- one case


def evaluate_arrays(
    name: str, pred_labels: np.ndarray, ref_labels: np.ndarray, spacing: Sequence[float]
) -> CaseRecord:
    """The case's record for two label maps on one grid (spacing in mm)."""
    if pred_labels.shape != ref_labels.shape:
        raise CtsegError(
            f"prediction shape {pred_labels.shape} differs from reference shape {ref_labels.shape}"
        )
    pred = check_labels(pred_labels, "the prediction")
    ref = check_labels(ref_labels, "the reference")
    return CaseRecord(name, metrics.case_metrics(pred, ref, spacing))


def evaluate_pair(pair: CasePair, judged: dict | None = None) -> CaseRecord:
    """Read one prediction/reference pair (`read_scan`, with its checks), check that they
    are two files of one grid, and evaluate it; `judged`: the quality `ctseg predict`
    recorded for the prediction (`Recorded`), kept in its record."""
    for role, path in (("prediction", pair.pred), ("reference", pair.ref)):
        if why := _unusable(path):
            raise CtsegError(f"the {role} {path} is {why}")
    if same_file(pair.pred, pair.ref):
        raise CtsegError(
            f"the prediction {pair.pred} is the reference {pair.ref} itself (a link to it, or "
            "the same file): it would score perfectly; give the model's prediction"
        )
    pred, ref = scans.read_scan(pair.pred), scans.read_scan(pair.ref)
    # Compared, and scored, in canonical order: the same voxels stored in another order
    # (mirrored, transposed, the affine to match) are one grid, and the spacing is the
    # canonical voxel's, so the metrics equal those in either file's own order.
    difference = voxels_difference(pred, ref)
    if difference:
        raise CtsegError(f"the prediction's geometry is not the reference's: {difference}")
    record = evaluate_arrays(pair.case, pred.array, ref.array, ref.spacing)
    return dataclasses.replace(record, quality=judged)


def _stats_beside(pred: Path) -> Path | None:
    """The `ctseg predict` stats file beside a prediction `<scan>_seg.nii.gz`, if any (a
    FIFO or a folder of its name too: reading it says why it is none)."""
    stem = nifti_stem(pred) or ""
    stats_path = pred.with_name(f"{stem.removesuffix('_seg')}_stats.json")
    return stats_path if stem.endswith("_seg") and os.path.lexists(stats_path) else None


class Recorded(NamedTuple):
    """What `ctseg predict` recorded beside a prediction (its `_stats.json`): the model that
    made it (run, step, TTA, ensemble) and the prediction's quality."""

    model: tuple
    quality: dict | None


def read_recorded(pred: Path) -> Recorded | None:
    """The stats `ctseg predict` wrote beside `pred`; None where there are none. CtsegError
    (one line naming the file and the key) for a file that is not a regular file, not JSON,
    or whose keys are not what ctseg writes (`ctseg.reading.Record`)."""
    stats_path = _stats_beside(pred)
    if stats_path is None:
        return None
    try:
        stats = Record.read(stats_path, "the prediction's stats")
    except FileNotFoundError:
        return None
    ensemble = stats.items("ensemble", optional=True)
    model = (
        stats.text("run_dir", optional=True),
        stats.integer("run_step", optional=True),
        stats.flag("tta", optional=True),
        json.dumps(ensemble),  # a list of members: made hashable
    )
    judged = stats.record("quality", optional=True)
    if judged is None:
        return Recorded(model, None)
    judged.text("verdict")
    for key in ("score", "liver", "tumour"):
        judged.number(key, low=0.0, high=1.0)
    try:  # the whole of it goes into the report, which holds finite numbers only
        json.dumps(judged.value, allow_nan=False)
    except ValueError:
        raise CtsegError(
            f"the prediction's stats {stats_path}: key 'quality' holds a number that is not finite"
        ) from None
    return Recorded(model, judged.value)


# ---------------------------------------------------------------- many cases


def score_cases(
    cases: Sequence[Case],
    name: Callable[[Case], str],
    score: Callable[[Case], CaseRecord],
    progress: Progress | None = None,
) -> tuple[list[CaseRecord], list[FailedCase]]:
    """`score` every case: (the records, each case that failed).

    A case's `CtsegError` fails that case alone; the others go on.
    """
    records: list[CaseRecord] = []
    errors: list[FailedCase] = []
    for done, case in enumerate(cases):
        if progress is not None:
            progress(done, len(cases), name(case))
        try:
            records.append(score(case))
        except CtsegError as exc:
            errors.append(FailedCase(name(case), str(exc)))
    if progress is not None:
        progress(len(cases), len(cases), "")
    return records, errors


def evaluate_pairs(
    pairs: Sequence[CasePair],
    progress: Progress | None = None,
    recorded: dict[str, Recorded | None] | None = None,
) -> Report:
    """Evaluate every pair; a case that fails is listed under "errors" and the rest go on.

    Returns the `Report` (nothing unpaired; `evaluate_folders` says what was), its
    summary with the quality's power where `ctseg predict` recorded the quality
    (`recorded`, by case: what `read_recorded` found beside each prediction).
    """
    recorded = recorded or {}

    def evaluate(pair: CasePair) -> CaseRecord:
        found = recorded.get(pair.case)
        return evaluate_pair(pair, None if found is None else found.quality)

    cases, errors = score_cases(pairs, lambda pair: pair.case, evaluate, progress)
    return Report(cases, Summary.of(cases, grid_dice=False), errors)


def _recorded(
    pairs: Sequence[CasePair], warn: Callable[[str], None] | None
) -> dict[str, Recorded | None]:
    """What `ctseg predict` recorded beside each pair's prediction; a stats file that cannot
    be read is a warning (`warn`), its case scored without the quality."""
    found: dict[str, Recorded | None] = {}
    for pair in pairs:
        try:
            found[pair.case] = read_recorded(pair.pred)
        except CtsegError as exc:
            found[pair.case] = None
            if warn is not None:
                warn(f"{exc}; its case is scored without the quality recorded there")
    return found


def missing_predictions(unpaired_ref: Sequence[str], pred_dir: Path) -> list[FailedCase]:
    """A failed case for each reference without its prediction."""
    missing = []
    for name in unpaired_ref:
        stem = nifti_stem(Path(name)) or name
        missing.append(
            FailedCase(
                stem,
                f"no prediction in {pred_dir} for the reference {name} (looked for "
                f"{stem}.nii.gz, {stem}_seg.nii.gz and the like)",
            )
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


def _unreadable(unpaired_pred: Sequence[str], pred_dir: Path) -> list[FailedCase]:
    """A failed case for each unpaired prediction that cannot be read (a dangling link, a
    pipe, one without read permission): whatever it was meant to be, it was not scored."""
    failed = []
    for name in unpaired_pred:
        path = Path(pred_dir) / name
        if why := _unusable(path):
            case = nifti_stem(Path(name)) or name
            failed.append(
                FailedCase(case, f"the prediction {path} is {why}; it matches no reference")
            )
    return failed


def evaluate_folders(
    pred_dir: Path,
    ref_dir: Path,
    progress: Progress | None = None,
    warn: Callable[[str], None] | None = None,
) -> Report:
    """Pair the two folders' files and evaluate them.

    No pair at all is an error; so are one folder given as both (every case would
    score perfectly) and predictions of several models in one folder (their mean
    would describe none of them). A case that could not be evaluated is a failed case
    (under "errors"): a reference without its prediction (`missing_predictions`), a
    prediction that cannot be read, paired or not, or that is its reference itself. A
    stats file beside a prediction that cannot be read is a warning (`warn`).
    """
    if same_file(pred_dir, ref_dir):
        raise OptionError(f"`pred_dir` and `ref_dir` are the same folder ({pred_dir})")
    pairs, unpaired_pred, unpaired_ref = pair_files(pred_dir, ref_dir)
    if not pairs:
        raise CtsegError(f"no prediction in {pred_dir} matches a reference in {ref_dir}")
    recorded = _recorded(pairs, warn)
    models = {found.model for found in recorded.values() if found is not None}
    if len(models) > 1:
        described = "; ".join(
            f"run {run or '?'} step {step}{' TTA' if tta else ''}"
            + (" (an ensemble)" if ensemble != "null" else "")
            for run, step, tta, ensemble in sorted(models, key=str)
        )
        raise CtsegError(
            f"{pred_dir} holds predictions of {len(models)} models ({described}); "
            "predict every scan with one model (ctseg predict, forced) or evaluate them apart"
        )
    result = evaluate_pairs(pairs, progress, recorded)
    errors = [
        *result.errors,
        *_unreadable(unpaired_pred, pred_dir),
        *missing_predictions(unpaired_ref, pred_dir),
    ]
    return dataclasses.replace(
        result, errors=errors, unpaired=Unpaired(unpaired_pred, unpaired_ref)
    )


# ---------------------------------------------------------------- reports


def case_row(case: CaseRecord) -> dict[str, Any]:
    """One flat CSV row: "case", then "<section>_<metric>" for every per-case value, and
    the prediction's quality (`quality_verdict`, `quality_score`, …) where it has one."""
    row: dict[str, Any] = {"case": case.case}
    for section in CSV_SECTIONS:
        for key, value in case.metrics[section].items():
            row[f"{section}_{key}"] = value
    if case.quality is not None:
        for key in QUALITY_COLUMNS:
            row[f"quality_{key}"] = case.quality.get(key)
    return row


def cases_csv(cases: Sequence[CaseRecord]) -> str:
    """The per-case table as CSV text; undefined values are empty cells."""
    rows = [case_row(case) for case in cases]
    columns = list(dict.fromkeys(column for row in rows for column in row)) or ["case"]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)  # DictWriter writes None as an empty cell
    return buffer.getvalue()


REPORT_KEYS = ("cases", "summary", "errors", "unpaired")


def is_report(path: Path) -> bool:
    """Whether `path` holds a JSON report of `write_reports` (by its keys); False for
    anything else, a FIFO or a record past Python's limits too (`ctseg.reading`)."""
    try:
        report = read_json(path, "the report")
    except (OSError, CtsegError):
        return False
    return isinstance(report, dict) and set(REPORT_KEYS) <= set(report)


def is_cases_csv(path: Path) -> bool:
    """Whether `path` holds a per-case CSV that `cases_csv` wrote (by its header); False
    for anything else, a FIFO too (never opened to wait for a writer)."""
    try:
        with open_regular(path, "the report") as f:
            header = f.readline(1 << 16).decode("utf-8", errors="replace").rstrip("\n")
    except (OSError, CtsegError):
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
            raise OptionError("`json_path` and `csv_path` name the same file; give two files")
    # The label maps the folders hold are inputs too (a report may go beside them).
    inputs = [*inputs, *(f for d in inputs if d.is_dir() for f in d.iterdir() if nifti_stem(f))]
    if json_path is not None:
        claim_report(json_path, is_report, inputs, force)
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
