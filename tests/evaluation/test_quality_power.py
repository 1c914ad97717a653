"""The prediction quality against the truth (`ctseg.evaluation.calibration`): the AUROC by hand,
the bad cases' rules, and each case's quality beside its Dice in `ctseg evaluate`'s
reports (a run on a store's split, and `--pred/--ref` beside `ctseg predict`'s stats)."""

import json

import numpy as np
import pytest
from helpers import SPACING, labels, liver_with_tumour, save
from scipy.stats import rankdata

from ctseg.evaluation import calibration as power
from ctseg.evaluation.scoring import evaluate_folders, is_cases_csv, write_reports


def test_auroc_by_hand():
    # Every bad case above every good one.
    assert power.auroc([0.1, 0.4, 0.35, 0.8], [False, True, False, True]) == 1.0
    # Bad {0.9, 0.3} against good {0.5, 0.1}: 0.9 beats both, 0.3 beats one: 3 of 4 pairs.
    assert power.auroc([0.9, 0.5, 0.3, 0.1], [True, False, True, False]) == 0.75
    # Bad {0.6} against good {0.2, 0.6, 0.9}: one win, one tie (½), one loss: 1.5 of 3.
    assert power.auroc([0.2, 0.6, 0.6, 0.9], [False, True, False, False]) == 0.5
    assert power.auroc([0.9, 0.1], [False, True]) == 0.0
    assert power.auroc([0.3, 0.4], [True, True]) is None  # no good case to compare with
    assert power.auroc([], []) is None


def test_auroc_is_the_mann_whitney_u_of_the_ranks():
    rng = np.random.default_rng(4)
    scores = rng.integers(0, 6, 40) / 5  # many ties
    bad = rng.random(40) < 0.3
    ranks = rankdata(scores)  # ties share their mean rank
    n_bad, n_good = bad.sum(), (~bad).sum()
    u = ranks[bad].sum() - n_bad * (n_bad + 1) / 2
    assert power.auroc(scores, bad) == pytest.approx(u / (n_bad * n_good))


def _case(name, liver, tumour, verdict, score, n_ref=1, n_detected=1, measurable=(1, 1)):
    n_ref_measurable, n_detected_measurable = measurable
    return {
        "case": name,
        "liver": {"dice": liver},
        "tumour": {"dice": tumour},
        "detection": {
            "n_ref": n_ref,
            "n_detected": n_detected,
            "n_ref_measurable": n_ref_measurable,
            "n_detected_measurable": n_detected_measurable,
        },
        "quality": {"verdict": verdict, "score": score, "liver": score, "tumour": score},
    }


def test_bad_cases_and_the_summary():
    assert power.liver_bad(_case("a", 0.84, 0.9, "ok", 0)) is True
    assert power.liver_bad(_case("a", 0.85, 0.9, "ok", 0)) is False
    assert power.tumour_bad(_case("a", 0.9, 0.49, "ok", 0)) is True
    assert power.tumour_bad(_case("a", 0.9, 0.8, "ok", 0, n_ref=2, n_detected=1)) is True  # missed
    assert power.tumour_bad(_case("a", 0.9, None, "ok", 0, n_ref=0, n_detected=0)) is None
    # Only a small tumour missed: bad, but not counting only the measurable ones.
    small_missed = _case("a", 0.9, 0.8, "ok", 0, n_ref=2, n_detected=1, measurable=(1, 1))
    assert power.tumour_bad(small_missed) is True
    assert power.measurable_tumour_bad(small_missed) is False
    large_missed = _case("a", 0.9, 0.8, "ok", 0, n_ref=2, n_detected=1, measurable=(1, 0))
    assert power.measurable_tumour_bad(large_missed) is True
    assert power.measurable_tumour_bad(_case("a", 0.9, 0.4, "ok", 0)) is True  # Dice < 0.5
    earlier = {**small_missed, "detection": {"n_ref": 2, "n_detected": 1}}  # an older report's
    assert power.tumour_bad(earlier) is True and power.measurable_tumour_bad(earlier) is None
    cases = [
        _case("good", 0.95, 0.8, "ok", 0.1),
        _case("flagged good", 0.93, 0.7, "review", 0.6),
        _case("bad liver", 0.80, 0.6, "review", 0.7),
        _case("failed liver", 0.30, 0.0, "ok", 0.2),  # a failure the verdict missed
        {"case": "no quality", "liver": {"dice": 0.9}, "tumour": {"dice": 0.9}},
    ]
    summary = power.summarize(cases)
    assert summary["n_cases"] == 4 and summary["thresholds"] == "unknown"  # none recorded
    assert summary["verdicts"] == {"ok": 2, "review": 2}
    liver = summary["liver"]
    assert (liver["n_bad"], liver["n_good"]) == (2, 2)
    # Bad {0.7, 0.2} against good {0.1, 0.6}: 0.7 beats both, 0.2 beats one.
    assert liver["auroc"] == 0.75 and liver["bad_flagged"] == 0.5
    assert summary["tumour"]["n_bad"] == 1  # the failed liver's tumour Dice of 0
    cases.append(_case("small tumour missed", 0.95, 0.8, "ok", 0.05, 2, 1, (1, 1)))
    summary = power.summarize(cases)
    assert summary["tumour"]["n_bad"] == 2 and summary["tumour_measurable"]["n_bad"] == 1
    assert summary["tumour_measurable"]["bad"] == "Dice < 0.5 or a tumour of 10 mm or more missed"
    # Bad {0.2} against good {0.1, 0.6, 0.7, 0.05}: 2 of 4 (counting every miss: bad
    # {0.2, 0.05} against good {0.1, 0.6, 0.7}, 1 of 6).
    assert summary["tumour_measurable"]["auroc"] == 0.5
    assert summary["tumour"]["auroc"] == pytest.approx(1 / 6)
    assert summary["good_flagged"] == 0.5
    assert summary["liver_below_0.5_not_flagged"] == ["failed liver"]
    assert power.summarize([{"case": "x", "liver": {}, "tumour": {}}]) is None


def test_pred_ref_reports_carry_the_quality_ctseg_predict_recorded(tmp_path):
    pred, ref = tmp_path / "pred", tmp_path / "ref"
    pred.mkdir(), ref.mkdir()
    for index, (shift, verdict, score) in enumerate([(0, "ok", 0.1), (4, "review", 0.8)]):
        save(ref / f"case{index}.nii.gz", labels())
        save(pred / f"case{index}_seg.nii.gz", labels(shift=shift), SPACING)
        quality = {"verdict": verdict, "reason": None, "score": score, "liver": score}
        quality["tumour"] = score
        (pred / f"case{index}_stats.json").write_text(json.dumps({"quality": quality}))
    save(ref / "case2.nii.gz", labels())
    save(pred / "case2_seg.nii.gz", labels())  # predicted before verdicts: no stats file
    result = evaluate_folders(pred, ref)
    qualities = [case.quality for case in result.cases]
    assert [q and q["verdict"] for q in qualities] == ["ok", "review", None]
    summary = result.summary.quality
    assert summary["n_cases"] == 2 and summary["verdicts"] == {"ok": 1, "review": 1}
    assert result.cases[1].metrics["liver"]["dice"] < power.LIVER_BAD_BELOW
    assert summary["liver"]["auroc"] == 1.0  # the shifted liver scores higher
    write_reports(result, tmp_path / "summary.json", tmp_path / "metrics.csv")
    header, *rows = (tmp_path / "metrics.csv").read_text().splitlines()
    columns = header.split(",")
    assert {"quality_verdict", "quality_score", "quality_liver", "quality_tumour"} <= set(columns)
    assert rows[1].split(",")[columns.index("quality_verdict")] == "review"
    assert rows[2].split(",")[columns.index("quality_verdict")] == ""
    assert is_cases_csv(tmp_path / "metrics.csv")


def test_evaluate_run_records_each_cases_quality_beside_its_dice(trained, tmp_path, monkeypatch):
    from ctseg.evaluation.runs import evaluate_run
    from ctseg.inference.scan import postprocess

    monkeypatch.setattr(postprocess, "clean_labels", liver_with_tumour)  # a liver to judge
    run_dir, store, _ = trained
    out = tmp_path / "eval"
    report = evaluate_run(run_dir, store, split="train", out_dir=out)
    written = json.loads((out / "summary.json").read_text())
    assert written["cases"] and all(
        case["quality"]["verdict"] in ("ok", "review", "unlike the training data")
        for case in written["cases"]
    )
    for case in written["cases"]:  # compared with the run's fingerprint and probabilities
        concerns = case["quality"]["concerns"]
        assert {"liver_uncertainty", "intensity", "liver_volume", "fragments"} <= set(concerns)
    assert written["summary"]["quality"]["n_cases"] == len(written["cases"])
    assert report.summary.quality == written["summary"]["quality"]
    assert report.to_json() == written  # the report is what summary.json holds
    header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "quality_score" in header and "liver_dice" in header


def test_the_evaluate_line_gives_each_auroc_with_its_bad_and_good_cases():
    from ctseg.cli.evaluate_report import quality_line

    def power(auroc, n_bad, n_good):
        return {"auroc": auroc, "n_bad": n_bad, "n_good": n_good}

    quality = {
        "liver": power(None, 0, 5),
        "tumour": power(0.25, 4, 1),
        "tumour_measurable": power(0.0, 3, 2),
        "good_flagged": 0.0,
        "thresholds": "ctseg's default",
    }
    line = quality_line(quality)
    assert "AUROC liver – (0 / 5), tumour 0.25 (4 / 1), 0.00 (3 / 2) counting only" in line
