"""Calibrating the prediction quality's thresholds
(`ctseg.evaluation.calibration.choose_thresholds`) on hand-built cases; the thresholds file
(`ctseg.inference.quality.thresholds.Thresholds`) and a run's own
thresholds (`Reference.of_run`); `ctseg evaluate RUN --calibrate`."""

import dataclasses
import json

import numpy as np
import pytest
from helpers import SPACING, labels, tiny_config
from typer.testing import CliRunner

import ctseg.cli.main  # noqa: F401  (registers the commands)
from ctseg.cli.app import app
from ctseg.errors import CtsegError
from ctseg.evaluation import calibration as power
from ctseg.evaluation.scoring import evaluate_arrays
from ctseg.inference.quality import scores, thresholds
from ctseg.run import rundir

runner = CliRunner()


def _case(name, liver, tumour=0.8, missed=False, checks=(), **values):
    """An evaluated case: its Dice and its recorded quality, with the concerns' raw values
    (judged by the defaults, as `ctseg predict` would have recorded them)."""
    values = {"liver_uncertainty": 0.03, "intensity": 0.1, "liver_volume": 1.0, **values}
    concerns = {
        name: {
            "structure": "liver" if name != "tumour_uncertainty" else "tumour",
            "value": value,
            "concern": 0.0,
            "reason": f"{name} is {value}",
        }
        for name, value in values.items()
    }
    recorded = {"concerns": concerns, "checks": list(checks), "verdict": "ok"}
    judged = scores.rejudged(recorded, thresholds.DEFAULT_THRESHOLDS).to_json()
    return {
        "case": name,
        "liver": {"dice": liver},
        "tumour": {"dice": tumour},
        "detection": {"n_ref": 2, "n_detected": 1 if missed else 2},
        "quality": judged,
    }


def _cohort(failed_value=None):
    """20 good cases, 6 bad livers (their intensity far off), and with `failed_value` a
    liver of Dice 0.3 whose only sign is that liver uncertainty."""
    rng = np.random.default_rng(0)
    cases = [
        _case(
            f"good{i}",
            0.93,
            liver_uncertainty=float(rng.uniform(0.02, 0.05)),
            intensity=float(rng.uniform(0.0, 0.3)),
            liver_volume=float(rng.uniform(1.0, 1.3)),
        )
        for i in range(20)
    ]
    cases[0]["quality"]["concerns"]["intensity"]["value"] = 0.9  # one odd good case
    cases += [_case(f"bad{i}", 0.8, intensity=0.8 + 0.1 * i) for i in range(6)]
    cases += [_case("missed", 0.92, missed=True, tumour_uncertainty=0.6)]
    if failed_value is not None:
        cases.append(_case("failed", 0.3, liver_uncertainty=failed_value))
    return cases


def test_choosing_thresholds_keeps_good_cases_out_of_review_where_it_can():
    chosen = power.choose_thresholds(_cohort(), "hand-built")
    summary = chosen.summary
    assert summary["good_flagged"] <= power.GOOD_FLAGGED_TARGET
    assert summary["liver"]["bad_flagged"] == 1.0  # every bad liver: its intensity
    assert summary["tumour"]["bad_flagged"] == 1.0  # the missed tumour: its uncertainty
    # Between the good cases' intensities (≤ 0.3, and the odd 0.9) and the bad ones' 0.8:
    # the odd good case is the one in ten the target allows.
    assert 0.3 < chosen.thresholds.intensity_sd <= 0.8
    assert chosen.thresholds.calibrated_on == "hand-built" and chosen.thresholds.n_cases == 27
    assert chosen.notes == ()
    assert summary["liver_below_0.5_not_flagged"] == []


def test_choosing_thresholds_flags_every_failed_liver_whatever_it_costs():
    # The failed liver's uncertainty (0.04) lies among the good ones' (0.02–0.05).
    chosen = power.choose_thresholds(_cohort(failed_value=0.04), "hand-built")
    assert chosen.summary["liver_below_0.5_not_flagged"] == []
    assert chosen.thresholds.liver_uncertainty <= 0.04
    assert chosen.summary["good_flagged"] > power.GOOD_FLAGGED_TARGET
    assert any("above the target" in note for note in chosen.notes)
    # A failure no concern sees (no liver uncertainty measured, nothing off) is reported.
    blind = _cohort()
    blind.append(_case("blind", 0.2, liver_uncertainty=0.0, intensity=0.0, liver_volume=1.0))
    del blind[-1]["quality"]["concerns"]["liver_uncertainty"]
    chosen = power.choose_thresholds(blind, "hand-built")
    assert any("blind" in note and "cannot be flagged" in note for note in chosen.notes)


def test_choosing_thresholds_refuses_too_few_cases_or_no_bad_ones():
    with pytest.raises(CtsegError, match="at least 10 labelled cases"):
        power.choose_thresholds(_cohort()[:5], "x")
    good = [case for case in _cohort() if case["case"].startswith("good")]
    with pytest.raises(CtsegError, match="none of the 20 cases is bad"):
        power.choose_thresholds(good, "x")
    bad = [_case(f"bad{i}", 0.5) for i in range(12)]
    with pytest.raises(CtsegError, match="no good case"):
        power.choose_thresholds(bad, "x")


def test_a_case_judged_again_and_the_always_flagged_ones():
    case = _case("c", 0.9, intensity=0.5)
    assert case["quality"]["verdict"] == scores.REVIEW  # 0.5 SD: beyond the default's
    lenient = thresholds.DEFAULT_THRESHOLDS.replace(intensity=1.0)
    again = scores.rejudged(case["quality"], lenient)
    assert again.verdict == scores.OK and again.concerns[1].concern == pytest.approx(0.25)
    unlike = _case("u", 0.9, checks=["a spacing far outside the training data's"])
    assert scores.rejudged(unlike["quality"], lenient).verdict == scores.UNLIKE
    old = {"verdict": scores.UNLIKE, "reason": "far", "concerns": {}}  # no "checks" recorded
    assert scores.rejudged(old, lenient).reason == "far"
    none = {"verdict": "review", "concerns": {"no_liver": {"value": 1.0, "concern": 1.0}}}
    assert scores.rejudged(none, lenient).verdict == scores.REVIEW


def test_the_thresholds_file_round_trip_and_malformed_ones(tmp_path):
    mine = thresholds.Thresholds(0.05, 0.3, 0.6, 2.0, 0.2, calibrated_on="mine", n_cases=12)
    path = tmp_path / "quality.json"
    mine.write(path)
    assert thresholds.Thresholds.read(path) == mine
    assert thresholds.Thresholds.from_json(json.loads(path.read_text())) == mine
    assert thresholds.Thresholds() == thresholds.DEFAULT_THRESHOLDS
    assert mine.of("liver_volume") == 2.0 and mine.of("no_liver") is None

    good = mine.to_json()
    broken = [
        ({**good, "format": "something else"}, "its format"),
        ({**good, "version": 99}, "version 99"),
        ({**good, "thresholds": {"intensity": 1.0}}, "must name exactly"),
        ({**good, "thresholds": {**good["thresholds"], "fragments": -1}}, "fragments is -1, "),
        ({**good, "thresholds": {**good["thresholds"], "liver_volume": 1.0}}, "above 1"),
        ({**good, "thresholds": {**good["thresholds"], "intensity": True}}, "number, not true"),
        ({**good, "thresholds": {**good["thresholds"], "intensity": "1"}}, 'number, not "1"'),
        ({**good, "calibrated_on": 3}, "calibrated_on"),
        ([1, 2], "its format"),
    ]
    for raw, why in broken:
        path.write_text(json.dumps(raw))
        with pytest.raises(CtsegError, match=why) as caught:
            thresholds.Thresholds.read(path)
        assert "\n" not in str(caught.value) and str(path) in str(caught.value)
    path.write_text("{not json")
    with pytest.raises(CtsegError, match="not valid JSON"):
        thresholds.Thresholds.read(path)


def test_a_first_version_thresholds_file_reads_with_the_ensembles_defaults(tmp_path):
    # Version 1 had no thresholds for an ensemble's disagreement.
    mine = thresholds.Thresholds(0.05, 0.3, 0.6, 2.0, 0.2, calibrated_on="mine", n_cases=12)
    raw = mine.to_json()
    for name in ("liver_disagreement", "tumour_disagreement"):
        del raw["thresholds"][name]
    path = tmp_path / "quality.json"
    path.write_text(json.dumps({**raw, "version": 1}))
    assert thresholds.Thresholds.read(path) == mine


def test_a_runs_own_thresholds_change_its_verdicts(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert scores.Reference.of_run(run_dir).thresholds == thresholds.DEFAULT_THRESHOLDS
    liver = np.zeros((20, 20, 10), np.uint8)
    liver[4:16, 4:16, 2:8] = 1
    hu = np.where(liver > 0, 80.0, -100.0).astype(np.float32)  # 20 HU off: 0.67 SD
    affine = np.diag([2.0, 2.0, 5.0, 1.0])

    def judged(reference):
        training = dataclasses.replace(reference, liver_hu_median=60.0, liver_hu_sd=30.0)
        return scores.assess(liver, affine, hu, reference=training)

    assert judged(scores.Reference.of_run(run_dir)).verdict == scores.REVIEW
    own = thresholds.DEFAULT_THRESHOLDS.replace(intensity=1.0, calibrated_on="the user's cases")
    own.write(thresholds.thresholds_path(run_dir))
    reference = scores.Reference.of_run(run_dir)
    assert reference.thresholds == own
    verdict = judged(reference)
    assert verdict.verdict == scores.OK and verdict.to_json()["thresholds"] == "the user's cases"
    thresholds.thresholds_path(run_dir).write_text('{"format": "ctseg-quality-thresholds"}')
    with pytest.raises(CtsegError, match="quality.json is not a ctseg quality thresholds"):
        scores.Reference.of_run(run_dir)


def _evaluated(cases):
    """What `evaluate_run` returns, for `cases` of `_case` (fast: nothing predicted)."""
    from ctseg.evaluation.reports import HowPredicted, RunHead, RunReport, Summary

    records = []
    for case in cases:
        record = evaluate_arrays(case["case"], labels(), labels(), SPACING)
        record.metrics["liver"]["dice"], record.metrics["tumour"]["dice"] = (
            case["liver"]["dice"],
            0.8,
        )
        record.metrics["detection"].update(case["detection"])
        no_grid = {"liver": None, "tumour": None}
        records.append(dataclasses.replace(record, quality=case["quality"], grid_dice=no_grid))
    engine = HowPredicted("whole volume", "jax", False, "CPU")
    head = RunHead("run", 2, "store", "val", None, engine)
    return RunReport(records, Summary.of(records), [], run=head)


def test_evaluate_calibrate_writes_refuses_without_force_and_replaces_with_it(
    tmp_path, monkeypatch
):
    import ctseg.cli.evaluate as command

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rundir.write_or_check_config(run_dir, tiny_config())
    evaluated = []
    cohort = _cohort()

    def evaluate_run(*args, **kwargs):
        evaluated.append(args)
        return _evaluated(cohort)

    monkeypatch.setattr(command, "evaluate_run", evaluate_run)
    args = ["evaluate", str(run_dir), "--data", str(tmp_path / "store"), "--calibrate"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    path = thresholds.thresholds_path(run_dir)
    written = thresholds.Thresholds.read(path)
    assert written.n_cases == 27 and "'val' split" in written.calibrated_on
    cases = [case.to_json() for case in _evaluated(cohort).cases]
    again = power.choose_thresholds(cases, written.calibrated_on)
    assert written == again.thresholds
    output = " ".join(result.output.split())
    assert "quality thresholds chosen on 27 case(s)" in output and "intensity" in output
    summary = again.summary  # each AUROC with its bad / good cases
    liver = f"{summary['liver']['n_bad']} / {summary['liver']['n_good']})"
    assert "Under them (bad / good cases): AUROC liver " in output and liver in output

    before = path.read_text()
    refused = runner.invoke(app, args)  # nothing predicted, nothing written
    assert isinstance(refused.exception, CtsegError) and len(evaluated) == 1
    assert "give --force to replace them" in str(refused.exception)  # exit 2 from ctseg's main
    assert path.read_text() == before

    cohort = _cohort(failed_value=0.04)  # other cases: other thresholds
    replaced = runner.invoke(app, [*args, "--force"])
    assert replaced.exit_code == 0, replaced.output
    assert thresholds.Thresholds.read(path).liver_uncertainty <= 0.04 < written.liver_uncertainty

    cohort = cohort[:5]  # too few to calibrate on: said, nothing replaced
    before = path.read_text()
    few = runner.invoke(app, [*args, "--force"])
    assert isinstance(few.exception, CtsegError)
    assert "at least 10 labelled cases" in str(few.exception)
    assert path.read_text() == before


def test_an_ensembles_thresholds_are_its_own_and_calibrate_into_its_first_run(
    tmp_path, monkeypatch
):
    import ctseg.cli.evaluate as command

    runs = [tmp_path / "a", tmp_path / "b"]
    for run_dir in runs:
        run_dir.mkdir()
        rundir.write_or_check_config(run_dir, tiny_config())
    # Without files of their own: a lone run's defaults, and an ensemble's.
    assert scores.Reference.of_run(runs[0]).thresholds == thresholds.DEFAULT_THRESHOLDS
    ensemble = scores.Reference.of_run(runs[0], ensemble=True).thresholds
    assert ensemble == thresholds.DEFAULT_ENSEMBLE_THRESHOLDS != thresholds.DEFAULT_THRESHOLDS
    monkeypatch.setattr(command, "evaluate_run", lambda *a, **k: _evaluated(_cohort()))
    args = ["evaluate", *map(str, runs), "--data", str(tmp_path / "s"), "--out", str(tmp_path)]
    result = runner.invoke(app, [*args, "--calibrate"])
    assert result.exit_code == 0, result.output
    path = thresholds.thresholds_path(runs[0], ensemble=True)
    output = "".join(result.output.split())  # the terminal wraps long paths
    assert path.name == "quality-ensemble.json" and "quality-ensemble.json:" in output
    assert not thresholds.thresholds_path(runs[0]).exists()  # the run alone: as it was
    written = thresholds.Thresholds.read(path)
    assert "an ensemble of 2 runs led by a" in written.calibrated_on
    assert scores.Reference.of_run(runs[0], ensemble=True).thresholds == written
    assert scores.Reference.of_run(runs[0]).thresholds == thresholds.DEFAULT_THRESHOLDS
    refused = runner.invoke(app, [*args, "--calibrate"])
    assert "of the ensembles it leads already" in str(refused.exception)


def test_calibrate_applies_to_one_run_only(tmp_path):
    wrong = [
        (["--pred", "p", "--ref", "r", "--calibrate"], "--calibrate only apply with RUN_DIR"),
        (["run", "--cross-validation", "--out", "o", "--calibrate"], "not apply to --cross"),
    ]
    for args, message in wrong:
        result = runner.invoke(app, ["evaluate", *args])
        assert isinstance(result.exception, CtsegError) and message in str(result.exception)


def test_the_scans_the_model_was_not_made_for():
    from ctseg.synth.reacquire import CHANGES, OTHER_SCANS, reacquire

    hu = np.full((8, 8, 40), -1000.0, np.float32)
    hu[2:6, 2:6, :] = -100.0  # fat
    hu[3:5, 3:5, 10:30] = 60.0  # liver
    seg = np.zeros(hu.shape, np.uint8)
    seg[3:5, 3:5, 10:30] = 1
    affine = np.diag([2.0, 2.0, 2.0, 1.0])  # head towards +z
    assert not set(OTHER_SCANS) & set(CHANGES)  # not in the robustness set
    mr, labels, same = reacquire("mr", hu, seg, affine, seed=None)
    assert (labels == seg).all() and (same == affine).all() and mr.min() >= 0
    assert mr[0, 0, 0] == 0 and mr[2, 2, 0] > mr[3, 3, 15] > 0  # air dark, fat brightest
    image, labels, moved = reacquire("chest", hu, seg, affine)
    assert image.shape[2] == labels.shape[2] == 40 - 17  # 13 slices (25 mm) of the liver kept
    assert labels[..., :13].all(axis=2)[3, 3] and not labels[..., 13:].any()  # dome, then chest
    assert moved[2, 3] == 17 * 2.0  # where the first kept slice lies
    flipped = np.diag([2.0, 2.0, -2.0, 1.0])  # head towards −z: the dome is at low k
    image, labels, moved = reacquire("chest", hu, seg, flipped)
    assert image.shape[2] == 10 + 13 and labels[..., 10:].any() and not labels[..., :10].any()
