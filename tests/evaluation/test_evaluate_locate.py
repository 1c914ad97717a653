"""`ctseg evaluate RUN_DIR --locate COARSE_RUN`: a split predicted as `ctseg predict
--locate` predicts it (the located liver's box plus a margin, exactly the whole scan's
labels there), each case saying whether its region was used, the report naming the
locator; and the forms it does not apply to refused in one line."""

import json
from types import SimpleNamespace

import numpy as np
import typer
from typer.testing import CliRunner

import ctseg.cli.main  # noqa: F401  (registers the commands)
from ctseg.cli.app import app
from ctseg.errors import CtsegError
from ctseg.inference.predictor import DEFAULT_MARGIN_MM, Predictor
from ctseg.inference.scan import postprocess
from ctseg.io.scans import read_scan

runner = CliRunner()


def _refused(args: list[str], *words: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code != 0
    assert isinstance(result.exception, CtsegError), result.output
    message = str(result.exception)
    assert "\n" not in message and all(word in message for word in words), message


def test_locate_is_refused_where_it_does_not_apply(trained, tmp_path):
    run_dir, store, _ = trained
    run = ["evaluate", str(run_dir), "--data", str(store)]
    folders = ["evaluate", "--pred", str(tmp_path), "--ref", str(tmp_path)]
    _refused([*folders, "--locate", str(run_dir)], "--locate", "RUN_DIR")
    cross = [*run, "--cross-validation", "--out", str(tmp_path / "cv"), "--locate", str(run_dir)]
    _refused(cross, "--locate", "--cross-validation")
    _refused([*run, "--margin", "5"], "--margin", "--locate")
    out = ["--out", str(tmp_path / "eval")]
    _refused([*run, *out, "--locate", str(tmp_path / "missing")], "--locate", "not a ctseg run")
    _refused([*run, *out, "--locate", str(tmp_path)], "--locate", "not a ctseg run directory")
    assert not (tmp_path / "eval" / "summary.json").exists()  # nothing claimed or written
    # One default margin for both commands: predict's help, the predictor's constant
    # (evaluate's, when --margin is not given), and evaluate's help.
    commands = typer.main.get_command(app).commands
    (option,) = [param for param in commands["predict"].params if param.name == "margin"]
    assert f"default {DEFAULT_MARGIN_MM:g};" in option.help
    (option,) = [param for param in commands["evaluate"].params if param.name == "margin"]
    assert f"{DEFAULT_MARGIN_MM:g})" in option.help


def test_evaluate_locate_predicts_the_region_exactly_and_says_so(trained, tmp_path, monkeypatch):
    """The trained run as its own locator, which then answers with the reference liver
    (a 2-step model finds none of its own), or with none for volume-0: inside each
    located case's region the labels equal the whole-scan evaluation's, outside it is
    background; the case without a liver falls back to the whole scan, and says so."""
    run_dir, store, _ = trained
    # Raw labels: post-processing keeps the largest liver component of what it is given,
    # which a region may change; the exactness is the network's (tests/inference/test_region.py).
    monkeypatch.setattr(postprocess, "clean_labels", lambda labels, *options: labels)
    predict_region = Predictor.predict_region
    asked = []

    def with_the_reference_liver(self, locate=None, roi=None, margin_mm=20.0, options=None):
        predict_region(self, locate, roi, margin_mm, options)
        locator = self.locator.predict

        def predict(scan):
            asked.append(locator(scan).labels.shape == scan.array.shape)  # it ran, on the scan
            label = scan.source.with_name(scan.source.name.replace("volume", "segmentation"))
            liver = read_scan(label).array
            if scan.source.name == "volume-0.nii.gz":
                liver = np.zeros_like(liver)  # no liver found: the whole scan
            return SimpleNamespace(labels=liver)

        self.locator.predict = predict

    monkeypatch.setattr(Predictor, "predict_region", with_the_reference_liver)
    base = ["evaluate", str(run_dir), "--data", str(store), "--split", "train"]
    base += ["--checkpoint", "latest"]
    whole, located = tmp_path / "whole", tmp_path / "located"
    result = runner.invoke(app, [*base, "--out", str(whole)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, [*base, "--out", str(located), "--locate", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "located by" in result.output and "region" in result.output

    report = json.loads((located / "summary.json").read_text())
    assert report["run"]["locate"] == {
        "run_dir": str(run_dir),
        "checkpoint_step": report["run"]["checkpoint_step"],
        "margin_mm": DEFAULT_MARGIN_MM,
    }
    # The folder's record names the locator: a located evaluation is another evaluation,
    # which does not replace the whole-scan one without --force.
    record = json.loads((located / "evaluated.json").read_text())
    assert record["locate"] == {**report["run"]["locate"], "run_dir": str(run_dir.resolve())}
    _refused([*base, "--out", str(whole), "--locate", str(run_dir)], "--force", "holds")
    assert (whole / "summary.json").exists()
    cases = report["cases"]
    assert report["errors"] == [] and cases and asked == [True] * len(cases)
    regions = [case for case in cases if case["located"]["region"] is not None]
    assert 0 < len(regions) < len(cases), "a case on a region and one on the whole scan"
    assert report["summary"]["located"] == {
        "region": len(regions),
        "whole_scan": len(cases) - len(regions),
    }
    assert "located" not in json.loads((whole / "summary.json").read_text())["cases"][0]
    for case in cases:
        record = case["located"]
        assert record["source"].startswith(f"locator {run_dir}")
        assert record["margin_mm"] == DEFAULT_MARGIN_MM
        name = f"{case['case']}_seg.nii.gz"
        everywhere = read_scan(whole / "predictions" / name).array
        there = read_scan(located / "predictions" / name).array
        if record["region"] is None:  # the whole scan, as without a locator
            assert record["fallback"] == "no liver found"
            assert case["grid_dice"]["liver"] is not None
            np.testing.assert_array_equal(there, everywhere)
            continue
        assert record["fallback"] is None and case["grid_dice"]["liver"] is None
        inside = tuple(
            slice(lo, hi)
            for lo, hi in zip(record["region"]["lo"], record["region"]["hi"], strict=True)
        )
        np.testing.assert_array_equal(there[inside], everywhere[inside])
        outside = np.ones(there.shape, bool)
        outside[inside] = False
        assert outside.any() and not there[outside].any()
