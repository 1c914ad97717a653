"""Folder evaluation: pairing, per-case errors, reports, and the `ctseg evaluate` command."""

import csv
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO, SPACING, labels, save
from typer.testing import CliRunner

import ctseg.cli.main  # noqa: F401  (registers the commands)
from ctseg.cli.app import app
from ctseg.cli.flags import said
from ctseg.errors import CtsegError, OptionError
from ctseg.evaluation.pairing import pair_files
from ctseg.evaluation.scoring import evaluate_arrays, evaluate_folders, write_reports


def touch(folder: Path, *names: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"")


# ---------------------------------------------------------------- pairing


def test_pairing_rules(tmp_path):
    pred, ref = tmp_path / "pred", tmp_path / "ref"
    touch(
        pred,
        "same.nii.gz",
        "segmentation-1.nii.gz",  # .nii.gz against .nii
        "test-segmentation-2.nii",  # LiTS test naming
        "volume-3_seg.nii.gz",  # what `ctseg predict` writes for volume-3.nii
        "patient_a_seg.nii.gz",  # ... and for patient_a.nii.gz
        "orphan.nii.gz",
        "notes.txt",
    )
    touch(
        ref,
        "same.nii.gz",
        "segmentation-1.nii",
        "segmentation-2.nii.gz",
        "segmentation-3.nii",
        "patient_a.nii.gz",
        "segmentation-10.nii",
    )
    pairs, unpaired_pred, unpaired_ref = pair_files(pred, ref)
    assert [(p.case, p.pred.name, p.ref.name) for p in pairs] == [
        ("patient_a", "patient_a_seg.nii.gz", "patient_a.nii.gz"),
        ("same", "same.nii.gz", "same.nii.gz"),
        ("segmentation-1", "segmentation-1.nii.gz", "segmentation-1.nii"),
        ("segmentation-2", "test-segmentation-2.nii", "segmentation-2.nii.gz"),
        ("segmentation-3", "volume-3_seg.nii.gz", "segmentation-3.nii"),
    ]
    assert unpaired_pred == ["orphan.nii.gz"]
    assert unpaired_ref == ["segmentation-10.nii"]


def test_a_lits_folder_pairs_predictions_with_segmentations_not_with_the_scans(tmp_path):
    """A LiTS folder holds volume-N beside segmentation-N: `ctseg predict`'s volume-N_seg
    is scored against segmentation-N, never against the CT scan it was made from."""
    pred, ref = tmp_path / "pred", tmp_path / "ref"
    touch(pred, "volume-3_seg.nii.gz", "test-volume-4_seg.nii.gz")
    touch(ref, "volume-3.nii", "segmentation-3.nii", "test-volume-4.nii", "test-segmentation-4.nii")
    pairs, _, unpaired_ref = pair_files(pred, ref)
    assert [(p.pred.name, p.ref.name) for p in pairs] == [
        ("volume-3_seg.nii.gz", "segmentation-3.nii"),
        ("test-volume-4_seg.nii.gz", "test-segmentation-4.nii"),
    ]
    assert unpaired_ref == []  # the scans beside their labels are no references


def test_ambiguous_names_are_errors(tmp_path):
    touch(tmp_path / "pred", "segmentation-3.nii.gz", "volume-3_seg.nii.gz")
    touch(tmp_path / "ref", "segmentation-3.nii")
    with pytest.raises(CtsegError, match="both match reference segmentation-3.nii"):
        pair_files(tmp_path / "pred", tmp_path / "ref")
    touch(tmp_path / "ref2", "segmentation-3.nii", "segmentation-3.nii.gz")
    with pytest.raises(CtsegError, match="holds both"):
        pair_files(tmp_path / "pred", tmp_path / "ref2")
    with pytest.raises(CtsegError, match="does not exist"):
        pair_files(tmp_path / "missing", tmp_path / "ref")


# ---------------------------------------------------------------- evaluation


@pytest.fixture
def folders(tmp_path):
    """Two good cases (one without tumour) and three broken ones."""
    pred, ref = tmp_path / "pred", tmp_path / "ref"
    pred.mkdir()
    ref.mkdir()
    save(ref / "segmentation-1.nii", labels())
    save(pred / "volume-1_seg.nii.gz", labels(shift=1))
    save(ref / "segmentation-2.nii", labels(tumour=False))
    save(pred / "segmentation-2.nii.gz", labels(tumour=False))
    save(ref / "segmentation-3.nii", labels())
    save(pred / "segmentation-3.nii", labels()[:, :, :6])  # other shape
    save(ref / "segmentation-4.nii", labels())
    save(pred / "segmentation-4.nii", labels(), origin=(0.0, 0.0, 5.0))  # other position
    save(ref / "segmentation-5.nii", labels())
    save(pred / "segmentation-5.nii", labels() * 2)  # label 4
    return pred, ref


def test_bad_cases_are_recorded_and_others_evaluated(folders):
    pred, ref = folders
    progress_calls = []
    result = evaluate_folders(pred, ref, progress=lambda *args: progress_calls.append(args))
    assert [case.case for case in result.cases] == ["segmentation-1", "segmentation-2"]
    errors = {error.case: error.message for error in result.errors}
    assert set(errors) == {"segmentation-3", "segmentation-4", "segmentation-5"}
    assert "shape" in errors["segmentation-3"]
    assert "affine" in errors["segmentation-4"]
    assert "label values outside 0 (background), 1 (liver), 2 (tumour)" in errors["segmentation-5"]
    assert all("\n" not in message for message in errors.values())
    assert progress_calls[0] == (0, 5, "segmentation-1") and progress_calls[-1][:2] == (5, 5)

    first = result.cases[0].metrics
    assert first["liver"]["mssd"] == pytest.approx(SPACING[0])  # shifted one voxel along x
    assert result.cases[1].metrics["tumour"]["hd95"] is None  # no tumour on either side
    assert result.summary.n_cases == 2
    assert result.summary.tumour["detection_recall"] == 1.0


def test_float_labels_are_accepted_when_whole():
    case = evaluate_arrays("c", labels().astype(np.float32), labels(), SPACING)
    assert case.metrics["liver"]["dice"] == 1.0
    fractional = labels().astype(np.float32)
    fractional[0, 0, 0] = 1.5
    with pytest.raises(CtsegError, match="the prediction has label values outside .*: 1.5"):
        evaluate_arrays("c", fractional, labels(), SPACING)


def test_reports_are_written_with_the_schema(folders, tmp_path):
    pred, ref = folders
    result = evaluate_folders(pred, ref)
    json_path, csv_path = tmp_path / "out" / "report.json", tmp_path / "out" / "cases.csv"
    write_reports(result, json_path=json_path, csv_path=csv_path)

    report = json.loads(json_path.read_text())
    assert report == result.to_json()  # the returned report is what the file holds
    assert list(report) == ["cases", "summary", "errors", "unpaired"]
    assert list(report["summary"]) == ["n_cases", "liver", "tumour"]  # no grid Dice here
    assert set(report["cases"][0]) == {"case", "liver", "tumour", "detection", "burden"}
    structure_keys = {"dice", "jaccard", "voe", "rvd", "assd", "hd95", "mssd"}
    assert structure_keys <= set(report["cases"][0]["tumour"])
    assert {"dice_per_case", "dice_global", *structure_keys - {"dice"}} <= set(
        report["summary"]["liver"]
    )
    assert {"detection_precision", "detection_recall", "burden_error"} <= set(
        report["summary"]["tumour"]
    )
    assert report["cases"][1]["tumour"]["assd"] is None  # JSON null, never NaN
    assert "NaN" not in json_path.read_text()

    with csv_path.open() as handle:
        rows = list(csv.DictReader(handle))
    assert [row["case"] for row in rows] == ["segmentation-1", "segmentation-2"]
    assert float(rows[0]["liver_dice"]) == pytest.approx(report["cases"][0]["liver"]["dice"])
    assert rows[1]["tumour_hd95"] == ""
    assert {"tumour_dice", "detection_n_detected", "burden_error"} <= set(rows[0])


# ---------------------------------------------------------------- command line


def test_cli_writes_reports_and_exits_1_on_case_errors(folders, tmp_path):
    pred, ref = folders
    json_path = tmp_path / "report.json"
    result = CliRunner().invoke(
        app, ["evaluate", "--pred", str(pred), "--ref", str(ref), "--json", str(json_path)]
    )
    assert result.exit_code == 1, result.output
    assert "Summary" in result.output and "segmentation-4" in result.output
    assert json.loads(json_path.read_text())["summary"]["n_cases"] == 2


def test_cli_succeeds_on_clean_folders(tmp_path):
    pred, ref = tmp_path / "pred", tmp_path / "ref"
    pred.mkdir()
    ref.mkdir()
    save(ref / "segmentation-1.nii", labels())
    save(pred / "segmentation-1.nii.gz", labels())
    save(ref / "volume-1.nii", labels())  # a LiTS scan beside its reference: no case
    save(pred / "orphan.nii.gz", labels())  # a prediction of no reference: named, no case
    csv_path = tmp_path / "cases.csv"
    result = CliRunner().invoke(
        app, ["evaluate", "--pred", str(pred), "--ref", str(ref), "--csv", str(csv_path)]
    )
    assert result.exit_code == 0, result.output
    # The scan is not listed: a LiTS folder's 131 scans would bury the line.
    assert "unpaired predictions: orphan.nii.gz; unpaired references: none" in result.output
    assert csv_path.read_text().startswith("case,liver_dice,")


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ([], "give --pred"),
        (["run", "--pred", "p", "--ref", "r"], "not both"),
        (["run", "--data", "d"], "not a ctseg run directory"),
    ],
    ids=["neither-form", "both-forms", "run-dir"],
)
def test_cli_usage_errors_exit_2(arguments, message):
    completed = subprocess.run(
        [sys.executable, "-m", "ctseg.cli.main", "evaluate", *arguments],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 2, completed.stderr
    assert "error:" in completed.stderr and message in completed.stderr


def test_the_reports_json_keeps_summary_jsons_layout():
    """A run's and a cross-validation's report give summary.json's keys, in its order."""
    from ctseg.evaluation.reports import (
        Checkpoint,
        CrossValidationHead,
        CrossValidationReport,
        FoldEntry,
        HowPredicted,
        Locator,
        RunHead,
        RunReport,
        Summary,
    )

    record = dataclasses.replace(
        evaluate_arrays("c", labels(), labels(), SPACING),
        grid_dice={"liver": 1.0, "tumour": None},
        located={"region": [[0, 0, 0], [4, 4, 4]]},
    )
    summary = Summary.of([record])
    assert list(summary.to_json()) == ["n_cases", "liver", "tumour", "grid_dice", "located"]
    assert summary.to_json()["located"] == {"region": 1, "whole_scan": 0}
    engine = HowPredicted("whole volume", "jax", True, "CPU")
    members = (Checkpoint("a", 2), Checkpoint("b", 3))
    head = RunHead("a", 2, "p", "val", None, engine, Locator("l", 1, 20.0), members)
    run = RunReport([record], summary, [], run=head).to_json()
    assert list(run) == ["run", "cases", "summary", "errors", "unpaired"]
    assert list(run["cases"][0]) == [
        *("case", "liver", "tumour", "detection", "burden", "located", "grid_dice")
    ]
    assert list(run["run"]) == [
        *("run_dir", "checkpoint_step", "data", "split", "fold"),
        *("tiling", "backend", "tta", "device", "locate", "ensemble"),
    ]
    assert run["run"]["ensemble"][1] == {"run_dir": "b", "checkpoint_step": 3}
    assert run["unpaired"] == {"pred": [], "ref": []}
    entry = FoldEntry("a", 0, 2, ["c"], summary)
    cv = CrossValidationReport(
        [record],
        summary,
        [],
        cross_validation=CrossValidationHead("p", 3, 0, engine),
        runs=(entry,),
    ).to_json()
    assert list(cv) == ["cross_validation", "runs", "cases", "summary", "errors", "unpaired"]
    assert list(cv["cross_validation"]) == [
        *("data", "folds", "fold_seed", "tiling", "backend", "tta", "device")
    ]
    assert list(cv["runs"][0]) == ["run_dir", "fold", "checkpoint_step", "cases", "summary"]


def test_the_requests_checks_speak_the_callers_words(tmp_path):
    """One check of what an evaluation is asked: the library's parameters by default,
    the command's flags where it passes them."""
    from ctseg.evaluation.skeleton import check_request

    runs = [tmp_path / "a", tmp_path / "b"]
    with pytest.raises(CtsegError, match="reports into `out_dir`: give one"):
        check_request(runs)
    with pytest.raises(CtsegError, match="^`cross_validation` writes .* into `out_dir`"):
        check_request(runs[:1], cross_validation=True)
    with pytest.raises(OptionError, match="^`margin_mm` applies only around a region") as raised:
        check_request(runs[:1], tmp_path, margin_mm=5.0)
    assert said(str(raised.value)) == (
        "--margin applies only around a region: give --locate or --roi"
    )
    with pytest.raises(OptionError, match="^`locate`: .*not a ctseg run") as raised:
        check_request(runs[:1], tmp_path, locate=tmp_path / "missing")
    assert said(str(raised.value)).startswith("--locate: ")
    check_request(runs, tmp_path)  # an ensemble with its folder: nothing to say
