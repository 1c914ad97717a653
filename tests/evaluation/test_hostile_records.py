"""Hostile and careless records, round five: a run's quality.json, quality-ensemble.json,
fingerprint.json, fold.json and metrics.jsonl, an evaluation folder's own records, the
`_stats.json` beside a prediction, and the cases a calibration is given — edited by hand
(a 5,000-digit integer, deep nesting, wrong types, NaN) or replaced by a FIFO — are each
one line naming the file, never a traceback or a hang; a failed evaluation leaves the
earlier one whole."""

import json
import math
import os
import shutil
import threading

import pytest
from helpers import labels, save
from typer.testing import CliRunner

from ctseg.cli.main import app  # every command registered
from ctseg.errors import CtsegError
from ctseg.evaluation import calibration as power
from ctseg.inference.quality import scores, thresholds
from ctseg.run import evaluations, fingerprint, rundir

runner = CliRunner(env={"COLUMNS": "400"})

HUGE = "1" * 5000  # past Python's 4,300 digits: int() refuses it
DEEP = "[" * 100_000 + "]" * 100_000  # past Python's recursion limit
# Hostile contents of a JSON record: each must be one line naming the file.
HOSTILE = {
    "huge integer": '{"format": "ctseg-quality-thresholds", "n_cases": ' + HUGE + "}",
    "deep nesting": DEEP,
}


def _in_time(call, seconds=10):
    """`call()`'s result or the exception it raised; fails the test if it hangs (a FIFO)."""
    done = []

    def run():
        try:
            done.append(("value", call()))
        except BaseException as exc:  # noqa: BLE001  (handed back to the test)
            done.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert done, f"{call} hung"
    return done[0]


def _write(path, content):
    if content == "fifo":
        os.mkfifo(path)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)


def _one_line(outcome, path):
    kind, value = outcome
    assert kind == "raised" and isinstance(value, CtsegError), value
    assert str(path) in str(value) and "\n" not in str(value), str(value)
    return str(value)


# ---------------------------------------------------------------- a run's records


@pytest.mark.parametrize("ensemble", [False, True])
@pytest.mark.parametrize("content", [*HOSTILE.values(), "fifo"], ids=[*HOSTILE, "fifo"])
def test_a_hostile_thresholds_file_is_one_line(tmp_path, content, ensemble):
    path = thresholds.thresholds_path(tmp_path, ensemble)
    _write(path, content)
    _one_line(_in_time(lambda: thresholds.read_thresholds(tmp_path, ensemble)), path)
    # The same through what predict and evaluate read: the run's reference.
    _one_line(_in_time(lambda: scores.Reference.of_run(tmp_path, ensemble)), path)


@pytest.mark.parametrize(
    "content",
    [
        DEEP,
        "fifo",
        # A 400-digit integer is JSON and Python's, but no float: numpy overflows.
        json.dumps({"format": "ctseg-fingerprint", "version": 1, "liver_hu": None}).replace(
            "}", ', "spacing_mm": {"min": [1, 1, ' + "9" * 400 + '], "max": [1, 1, 1]}}'
        ),
    ],
    ids=["deep nesting", "fifo", "400-digit integer"],
)
def test_a_hostile_fingerprint_is_one_line(tmp_path, content):
    path = tmp_path / rundir.FINGERPRINT
    _write(path, content)
    _one_line(_in_time(lambda: fingerprint.load(tmp_path)), path)


@pytest.mark.parametrize(
    "name, content",
    [
        (rundir.FOLD, DEEP),
        (rundir.FOLD, "fifo"),
        (rundir.METRICS, "fifo"),
        (rundir.METRICS, '{"step": ' + HUGE + "}\n"),
        (rundir.METRICS, '{"step": 2}\n[1, 2]\n'),
        (rundir.METRICS, '{"step": "2"}\n'),
        (rundir.METRICS, '{"step": 2, "loss": 0.5, "val_dice_liver": "0.9"}\n'),
        (rundir.LAYOUTS, "fifo"),
    ],
)
def test_a_hostile_run_record_is_one_line(tmp_path, name, content):
    path = tmp_path / name
    _write(path, content)
    read = {
        rundir.FOLD: lambda: rundir.read_fold(tmp_path),
        rundir.METRICS: lambda: rundir.MetricsLog.read(tmp_path),
        rundir.LAYOUTS: lambda: rundir.last_layout(tmp_path),
    }[name]
    _one_line(_in_time(read), path)


def test_a_checkpoints_metrics_that_is_a_fifo_is_one_line(trained, tmp_path):
    """orbax reads every step's metrics as it opens a run's checkpoints."""
    from ctseg.run.checkpoints import Checkpoints

    run = tmp_path / "run"
    shutil.copytree(trained[0] / rundir.CHECKPOINTS, run / rundir.CHECKPOINTS)
    (metrics,) = (run / rundir.CHECKPOINTS).glob("*/metrics/metrics")
    metrics.unlink()
    os.mkfifo(metrics)
    _one_line(_in_time(lambda: Checkpoints(run, keep=1, read_only=True)), metrics)


# ---------------------------------------------------------------- an evaluation's folder


@pytest.mark.parametrize("name", [evaluations.EVALUATED, "summary.json"])
@pytest.mark.parametrize("content", [DEEP, "fifo"], ids=["deep nesting", "fifo"])
def test_an_evaluation_folder_whose_record_is_hostile_is_refused_in_one_line(
    tmp_path, name, content
):
    out = tmp_path / "eval"
    out.mkdir()
    _write(out / name, content)
    record = evaluations.evaluation_record([tmp_path / "run"], [2], tmp_path / "store", "val")
    kind, value = _in_time(lambda: evaluations.claim(out, record, force=False))
    assert kind == "raised" and isinstance(value, CtsegError), value
    assert "cannot be read" in str(value) and "\n" not in str(value)


def _contents(folder):
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != ".ctseg-lock"
    }


def test_a_failed_evaluation_leaves_the_earlier_one_whole(trained, tmp_path, monkeypatch):
    """A run whose quality.json is corrupt fails before anything is touched; an evaluation
    stopped half-way leaves the earlier one as it was; the re-run finishes over both."""
    from ctseg.evaluation import skeleton

    run_dir, store, _ = trained
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    out = tmp_path / "out"
    args = ["evaluate", str(run), "--data", str(store), "--out", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    before = _contents(out)
    assert "summary.json" in before and any(name.endswith("_seg.nii.gz") for name in before)

    (run / thresholds.THRESHOLDS_FILE).write_text(DEEP)
    result = runner.invoke(app, args)
    assert isinstance(result.exception, CtsegError), result.output
    assert "quality.json" in str(result.exception) and "\n" not in str(result.exception)
    assert _contents(out) == before
    (run / thresholds.THRESHOLDS_FILE).unlink()

    class Stopped(Exception):
        """Whatever stops an evaluation half-way that is no case's failure."""

    def stopped(*_, **__):
        raise Stopped

    with monkeypatch.context() as patched:
        patched.setattr(skeleton, "evaluate_case", stopped)
        result = runner.invoke(app, args)
    assert isinstance(result.exception, Stopped), result.output
    assert _contents(out) == before
    again = runner.invoke(app, args)  # the re-run finishes, over its own leftovers
    assert again.exit_code == 0, again.output
    assert not [p for p in out.iterdir() if p.name.startswith(".ctseg-tmp")]


# ---------------------------------------------------------------- --pred/--ref's stats


@pytest.mark.parametrize(
    "stats",
    [
        DEEP,
        '{"run_dir": ["a", "list"], "run_step": 2}',
        '{"quality": {"verdict": "ok", "score": 1e400, "liver": 0.1, "tumour": 0.1}}',
        '{"quality": {"verdict": 3, "score": "0.3", "liver": null, "tumour": 0.1}}',
    ],
    ids=["deep nesting", "unhashable run", "infinite score", "wrong types"],
)
def test_a_hand_edited_stats_file_is_a_warning_and_the_case_still_scores(tmp_path, stats):
    pred, ref = tmp_path / "pred", tmp_path / "ref"
    pred.mkdir()
    ref.mkdir()
    save(ref / "scan.nii.gz", labels())
    save(pred / "scan_seg.nii.gz", labels())
    (pred / "scan_stats.json").write_text(stats)
    report = tmp_path / "report.json"
    args = ["evaluate", "--pred", str(pred), "--ref", str(ref), "--json", str(report)]
    outcome = _in_time(lambda: runner.invoke(app, args))
    result = outcome[1]
    assert result.exception is None, result.output
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert "warning" in output and "scan_stats.json" in output, output
    written = json.loads(report.read_text())
    assert written["summary"]["n_cases"] == 1 and "quality" not in written["cases"][0]


@pytest.mark.parametrize(
    "option, content",
    [("--json", "fifo"), ("--json", DEEP), ("--csv", "fifo")],
    ids=["json fifo", "json deep nesting", "csv fifo"],
)
def test_a_report_file_that_is_hostile_is_refused_without_force(tmp_path, option, content):
    pred, ref = tmp_path / "pred", tmp_path / "ref"
    pred.mkdir()
    ref.mkdir()
    save(ref / "scan.nii.gz", labels())
    save(pred / "scan_seg.nii.gz", labels())
    report = tmp_path / "report"
    _write(report, content)
    args = ["evaluate", "--pred", str(pred), "--ref", str(ref), option, str(report)]
    result = _in_time(lambda: runner.invoke(app, args))[1]
    assert isinstance(result.exception, CtsegError), result.output
    assert "is not a report this command wrote" in str(result.exception)
    assert runner.invoke(app, [*args, "--force"]).exit_code == 0
    assert report.is_file()


# ---------------------------------------------------------------- calibration


def _case(name, liver_dice, **values):
    """An evaluated case whose quality records these concerns' raw values."""
    concerns = {
        concern: {"structure": "liver", "value": value, "concern": 0.0, "reason": concern}
        for concern, value in values.items()
    }
    judged = scores.rejudged({"concerns": concerns, "checks": []}, thresholds.HAND_CHOSEN)
    return {
        "case": name,
        "liver": {"dice": liver_dice},
        "tumour": {"dice": None},
        "detection": {"n_ref": 0, "n_detected": 0},
        "quality": judged.to_json(),
    }


def _cohort(spoilt):
    """16 good cases, 6 bad ones (their intensity far off); the first `spoilt` good ones'
    concerns NaN or missing."""
    cases = [_case(f"good{i}", 0.95, liver_uncertainty=0.03, intensity=0.1) for i in range(16)]
    cases += [_case(f"bad{i}", 0.7, liver_uncertainty=0.03, intensity=2.0 + i) for i in range(6)]
    for i, case in enumerate(cases[:spoilt]):
        concerns = case["quality"]["concerns"]
        if i % 2:
            concerns["intensity"]["value"] = math.nan
        else:
            del concerns["intensity"]["value"]
    return cases


def test_calibration_leaves_out_cases_whose_concerns_are_nan_or_missing_and_says_so():
    chosen = power.choose_thresholds(_cohort(4), "hand-built")
    assert chosen.thresholds.n_cases == 18 and chosen.summary["n_cases"] == 18
    assert any("4 case(s)" in note and "left out" in note for note in chosen.notes), chosen.notes


def test_calibration_refuses_when_too_few_cases_remain():
    with pytest.raises(CtsegError, match="left out") as caught:
        power.choose_thresholds(_cohort(22)[:12], "hand-built")
    assert "\n" not in str(caught.value)
