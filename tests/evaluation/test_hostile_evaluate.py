"""Hostile and careless use of `ctseg evaluate`, round four: every case it could not
evaluate is a failed case with its row, and the exit status says so; a bad --margin is
one line before anything is written."""

import json
import os
import threading

import pytest
from helpers import labels, save
from typer.testing import CliRunner

import ctseg.cli.main  # noqa: F401  (registers the commands)
from ctseg.cli.app import app
from ctseg.errors import CtsegError
from ctseg.evaluation import scoring

runner = CliRunner(env={"COLUMNS": "400"})


@pytest.fixture
def folders(tmp_path):
    """Three references, one prediction of them."""
    pred, ref = tmp_path / "pred", tmp_path / "ref"
    pred.mkdir()
    ref.mkdir()
    for case in range(3):
        save(ref / f"segmentation-{case}.nii.gz", labels())
    save(pred / "volume-0_seg.nii.gz", labels())
    return pred, ref


def _evaluate(pred, ref, *args) -> tuple[int, str, dict]:
    report = pred.parent / "report.json"
    result = runner.invoke(
        app, ["evaluate", "--pred", str(pred), "--ref", str(ref), "--json", str(report), *args]
    )
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, " ".join(result.output.split()), json.loads(report.read_text())


def test_references_without_their_prediction_are_failed_cases(folders):
    pred, ref = folders
    code, output, report = _evaluate(pred, ref)
    assert code == 1, output
    assert report["summary"]["n_cases"] == 1
    failed = {error["case"]: error["message"] for error in report["errors"]}
    assert set(failed) == {"segmentation-1", "segmentation-2"}
    assert failed["segmentation-1"].startswith(f"no prediction in {pred} for the reference")
    assert "case segmentation-2 failed: no prediction" in output


def test_a_lits_folder_of_references_counts_only_its_segmentations(folders):
    """The LiTS scans beside the references (volume-N) are no cases to predict."""
    pred, ref = folders
    for case in range(3):
        save(ref / f"volume-{case}.nii.gz", labels())
    for case in (1, 2):
        save(pred / f"volume-{case}_seg.nii.gz", labels())
    code, output, report = _evaluate(pred, ref)
    assert code == 0 and report["errors"] == [], output
    assert report["summary"]["n_cases"] == 3


def test_dangling_pipes_and_unreadable_predictions_are_failed_cases(folders, monkeypatch):
    pred, ref = folders
    (pred / "volume-1_seg.nii.gz").symlink_to(pred / "gone.nii.gz")  # a dangling link
    os.mkfifo(pred / "volume-2_seg.nii.gz")  # never opened: a reader would block for ever
    save(pred / "stray.nii.gz", labels())  # matches no reference, and cannot be read:
    unreadable = pred / "stray.nii.gz"
    real_access = os.access  # (the tests may run as root, who reads anything)
    monkeypatch.setattr(
        scoring.os, "access", lambda path, mode: path != unreadable and real_access(path, mode)
    )
    done = []
    thread = threading.Thread(target=lambda: done.append(_evaluate(pred, ref)), daemon=True)
    thread.start()
    thread.join(60)
    assert done, "evaluate hung on a pipe"
    code, output, report = done[0]
    assert code == 1, output
    failed = {error["case"]: error["message"] for error in report["errors"]}
    dangling = failed["segmentation-1"]
    assert "is a link to" in dangling and "does not exist" in dangling
    assert "not a regular file" in failed["segmentation-2"]
    assert "not readable" in failed["stray"] and "matches no reference" in failed["stray"]
    assert report["summary"]["n_cases"] == 1


def test_an_unreadable_reference_is_a_failed_case_too(folders, monkeypatch):
    pred, ref = folders
    unreadable = ref / "segmentation-0.nii.gz"
    real_access = os.access
    monkeypatch.setattr(
        scoring.os, "access", lambda path, mode: path != unreadable and real_access(path, mode)
    )
    code, output, report = _evaluate(pred, ref)
    assert code == 1
    assert any(
        error["case"] == "segmentation-0" and "the reference" in error["message"]
        for error in report["errors"]
    ), report["errors"]


@pytest.mark.parametrize(
    ("margin", "words"),
    [
        ("nan", ["--margin must be a finite number"]),
        ("inf", ["--margin must be a finite number"]),
        ("-3", ["--margin must not be negative"]),
    ],
)
def test_a_bad_margin_is_one_line_before_anything_is_written(trained, tmp_path, margin, words):
    run_dir, store, _ = trained
    out = tmp_path / "eval"
    args = ["evaluate", str(run_dir), "--data", str(store), "--out", str(out)]
    result = runner.invoke(app, [*args, "--locate", str(run_dir), "--margin", margin])
    assert isinstance(result.exception, CtsegError), result.output
    assert "\n" not in str(result.exception)
    assert all(word in str(result.exception) for word in words), str(result.exception)
    assert not out.exists()
    # The library's own entry checks it too (a script calling it without the CLI).
    from ctseg.evaluation.runs import evaluate_run

    with pytest.raises(CtsegError, match="^`margin_mm` must"):  # in the library's words
        evaluate_run(run_dir, store, out_dir=out, locate=run_dir, margin_mm=float(margin))
    assert not out.exists()
