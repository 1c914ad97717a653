"""Hostile and careless inputs: report files over inputs or others' files, two writers at
once, interrupted work. Every file a command writes is its own, never an input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, labels, prepare_store, save
from typer.testing import CliRunner

import ctseg.cli.main  # noqa: F401  (registers the commands)
from ctseg import atomic, lock
from ctseg.cli.app import app
from ctseg.errors import CtsegError

runner = CliRunner()


# ---------------------------------------------------------------- report files


def test_claim_report_never_takes_an_input_and_others_files_only_with_force(tmp_path):
    scan, report = tmp_path / "scan.nii.gz", tmp_path / "report.json"
    scan.write_bytes(b"scan")
    never = lambda path: False  # noqa: E731
    for force in (False, True):
        with pytest.raises(CtsegError, match="is an input of this command"):
            atomic.claim_report(tmp_path / "." / "scan.nii.gz", never, [scan], force)
    with pytest.raises(CtsegError, match="is not a report this command wrote.*`force`"):
        atomic.claim_report(scan, never)
    assert atomic.claim_report(scan, never, force=True) == scan
    with pytest.raises(CtsegError, match="is a folder"):
        atomic.claim_report(tmp_path, never, force=True)
    report.write_text('{"results": []}')
    assert atomic.claim_report(report, lambda p: atomic.is_json_with(p, ["results"])) == report
    assert not atomic.is_json_with(scan, ["results"])


@pytest.fixture
def label_folders(tmp_path):
    pred, ref = tmp_path / "pred", tmp_path / "ref"
    pred.mkdir()
    ref.mkdir()
    save(ref / "case0.nii.gz", labels())
    save(pred / "case0.nii.gz", labels(shift=1))
    return pred, ref


def test_evaluate_reports_never_replace_a_label_map_even_with_force(label_folders):
    pred, ref = label_folders
    kept = {path: path.read_bytes() for path in (pred / "case0.nii.gz", ref / "case0.nii.gz")}
    base = ["evaluate", "--pred", str(pred), "--ref", str(ref)]
    for args in (
        ["--json", str(ref / "case0.nii.gz")],
        ["--csv", str(pred / "case0.nii.gz"), "--force"],
        ["--json", str(ref)],
    ):
        result = runner.invoke(app, [*base, *args])
        assert isinstance(result.exception, CtsegError), (args, result.output)
    assert {path: path.read_bytes() for path in kept} == kept


def test_evaluate_replaces_its_own_reports_and_others_files_only_with_force(
    label_folders, tmp_path
):
    pred, ref = label_folders
    json_path, csv_path = tmp_path / "r.json", pred / "cases.csv"  # a report beside inputs
    args = ["evaluate", "--pred", str(pred), "--ref", str(ref)]
    args += ["--json", str(json_path), "--csv", str(csv_path)]
    for _ in range(2):  # a re-run replaces its own reports
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    foreign = [*args[:5], "--json", str(notes)]
    result = runner.invoke(app, foreign)
    assert "is not a report this command wrote" in str(result.exception)
    assert notes.read_text() == '{"mine": 1}'
    assert runner.invoke(app, [*foreign, "--force"]).exit_code == 0
    assert "summary" in json.loads(notes.read_text())
    same = runner.invoke(app, [*args[:5], "--json", str(json_path), "--csv", str(json_path)])
    assert "name the same file" in str(same.exception)


def test_one_folder_as_prediction_and_reference_is_refused(label_folders):
    _, ref = label_folders
    result = runner.invoke(app, ["evaluate", "--pred", str(ref), "--ref", str(ref / ".")])
    assert "--pred and --ref are the same folder" in str(result.exception)


def test_predictions_of_several_models_in_one_folder_are_not_averaged(tmp_path):
    pred, ref = tmp_path / "pred", tmp_path / "ref"
    pred.mkdir()
    ref.mkdir()
    for scan, step in (("a", 2), ("b", 2)):
        save(ref / f"{scan}.nii.gz", labels())
        save(pred / f"{scan}_seg.nii.gz", labels())
        stats = {"run_dir": "/runs/r1", "run_step": step, "tta": False}
        (pred / f"{scan}_stats.json").write_text(json.dumps(stats))
    args = ["evaluate", "--pred", str(pred), "--ref", str(ref)]
    assert runner.invoke(app, args).exit_code == 0
    (pred / "b_stats.json").write_text(json.dumps({"run_dir": "/runs/r1", "run_step": 4}))
    result = runner.invoke(app, args)
    assert "holds predictions of 2 models" in str(result.exception)


@pytest.mark.parametrize("command", ["bench", "plan"])
def test_bench_and_plan_json_never_replace_a_config_or_a_scan(command, tmp_path):
    config = tmp_path / "run" / "config.toml"
    config.parent.mkdir()
    config.write_text("[data]\nresolution = 16\n[model]\nbase_filters = 2\ndepth = 2\n")
    scan = tmp_path / "scan.nii.gz"
    save(scan, labels())
    kept = {path: path.read_bytes() for path in (config, scan)}
    cases = [
        (["--config", str(config), "--json", str(config), "--force"], "is an input"),
        (["--json", str(config)], "is not a report this command wrote"),
        (["--json", str(scan)], "is not a report this command wrote"),
    ]
    for args, message in cases:
        result = runner.invoke(app, [command, *args])
        assert message in str(result.exception), (args, result.output)
    assert {path: path.read_bytes() for path in kept} == kept


# ---------------------------------------------------------------- locks


def _holding(folder: Path) -> subprocess.Popen:
    """Another process that holds `folder`'s lock until its stdin closes."""
    code = (
        "import sys; from ctseg import lock\n"
        f"with lock.hold({str(folder)!r}):\n"
        "    print('held', flush=True); sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "held\n"
    return proc


def test_a_second_writer_gets_one_line_naming_the_holder(tmp_path):
    folder = tmp_path / "out"
    proc = _holding(folder)
    try:
        with pytest.raises(CtsegError, match=rf"being written by another command \(pid {proc.pid}"):
            with lock.hold(folder):
                pass
    finally:
        proc.communicate("")
    # Released cleanly: no lock file is left; the holder created the folder and wrote
    # nothing into it, so it is gone too. The folder is free again.
    assert not folder.exists()
    with lock.hold(folder):
        assert (folder / atomic.LOCK_NAME).is_file()


def test_a_dead_holders_lock_and_temporaries_are_taken_over_with_a_warning(tmp_path):
    folder = tmp_path / "out"
    proc = _holding(folder)
    (folder / f"{atomic.TEMP_PREFIX}a_seg.nii.gz.x1.nii.gz").write_bytes(b"half")
    (folder / ".hidden-but-not-ours").write_bytes(b"")
    proc.kill()
    proc.wait()
    warnings: list[str] = []
    with lock.hold(folder, warnings.append):
        pass
    assert len(warnings) == 1 and f"left by pid {proc.pid}" in warnings[0]
    assert "died" in warnings[0]
    assert [p.name for p in folder.iterdir()] == [".hidden-but-not-ours"]


def test_the_lock_file_and_our_temporaries_do_not_make_a_folder_foreign(tmp_path):
    with lock.hold(tmp_path / "out") as folder:
        (folder / f"{atomic.TEMP_PREFIX}x.json.y.json").write_text("")
        assert atomic.claim_folder(folder, ("summary.json",)) == folder


def test_a_killed_group_write_leaves_no_marker_and_a_failed_one_no_temporaries(tmp_path):
    paths = [tmp_path / "a_seg.nii.gz", tmp_path / "a_stats.json"]
    paths[1].write_text("old stats")
    with pytest.raises(RuntimeError):
        with atomic.atomic_group(paths) as temporaries:
            for tmp in temporaries:
                tmp.write_text("new")
            raise RuntimeError
    assert os.listdir(tmp_path) == ["a_stats.json"] and paths[1].read_text() == "old stats"
    with atomic.atomic_group(paths) as temporaries:
        for tmp in temporaries:
            tmp.write_text("new")
    assert sorted(os.listdir(tmp_path)) == ["a_seg.nii.gz", "a_stats.json"]


# ---------------------------------------------------------------- commands on a trained run


def test_a_rerun_skips_finished_scans_and_redoes_an_interrupted_one(trained, tmp_path):
    run_dir, _, raw = trained
    out = tmp_path / "out"
    args = ["predict", str(run_dir), str(raw / "volume-0.nii.gz"), str(raw / "volume-1.nii.gz")]
    args += ["--out", str(out), "--tile", "0"]
    assert runner.invoke(app, args).exit_code == 0
    finished = (out / "volume-0_seg.nii.gz").stat().st_mtime_ns
    # As a kill half-way through writing volume-1 leaves it: outputs without their stats
    # (the commit marker) and a temporary file.
    (out / "volume-1_stats.json").unlink()
    stray = out / f"{atomic.TEMP_PREFIX}volume-1_preview.png.x1.png"
    stray.write_bytes(b"half")
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    words = again.output.split()  # "done earlier" may be folded in a narrow table
    assert "done" in words and "earlier" in words
    assert (out / "volume-0_seg.nii.gz").stat().st_mtime_ns == finished
    assert (out / "volume-1_stats.json").is_file() and not stray.exists()
    # No temporary file, no lock left behind: only the record of what predict wrote.
    assert [path.name for path in out.glob(".ctseg*")] == [".ctseg-outputs.json"]
    stats = json.loads((out / "volume-1_stats.json").read_text())
    assert stats["run_dir"] == str(run_dir.resolve()) and stats["tta"] is False
    # Outputs of another checkpoint are never silently kept beside this one's.
    stats["run_step"] = 999
    (out / "volume-1_stats.json").write_text(json.dumps(stats))
    other = runner.invoke(app, args)
    assert other.exit_code == 1 and "is of another prediction" in " ".join(other.output.split())
    assert "earlier" in other.output.split()  # volume-0 still is done
    (out / "volume-1_stats.json").write_text("{")  # cut short by hand, or another tool's
    unreadable = " ".join(runner.invoke(app, args).output.split())
    assert "cannot be read as the stats of an earlier prediction; use --force" in unreadable
    forced = runner.invoke(app, [*args, "--force"])
    assert forced.exit_code == 0 and "earlier" not in forced.output.split()
    assert json.loads((out / "volume-1_stats.json").read_text())["run_step"] == 2


def test_a_second_predict_into_one_out_is_refused_naming_the_first(trained, tmp_path):
    run_dir, _, raw = trained
    out = tmp_path / "out"
    proc = _holding(out)
    try:
        result = runner.invoke(app, ["predict", str(run_dir), str(raw), "--out", str(out)])
    finally:
        proc.communicate("")
    assert f"being written by another command (pid {proc.pid}" in str(result.exception)
    assert not out.exists()  # the holder made it and wrote nothing: nothing is left


def test_outputs_are_never_put_among_a_runs_checkpoints(trained, tmp_path):
    from ctseg import config as cfg
    from ctseg.training.loop import train_and_evaluate

    run_dir, store, raw = trained
    inside = run_dir / "checkpoints" / "out"
    message = f"lies in the checkpoints folder of the run {run_dir}"
    for args in (
        ["predict", str(run_dir), str(raw), "--out", str(inside)],
        ["evaluate", str(run_dir), "--data", str(store), "--out", str(inside)],
        ["synth", str(inside / "raw")],
        ["bench", "--json", str(inside / "bench.json")],
    ):
        result = runner.invoke(app, args)
        assert message in str(result.exception), (args, result.output)
    with pytest.raises(CtsegError, match=message):
        train_and_evaluate(cfg.load(run_dir / "config.toml"), store, inside)
    assert not inside.exists()


def test_predict_never_writes_into_a_run_a_store_or_an_evaluation(trained, tmp_path):
    run_dir, store, raw = trained
    evaluation = tmp_path / "eval"
    evaluation.mkdir()
    (evaluation / "evaluated.json").write_text("{}")
    for out, what in (
        (run_dir, "a run directory"),
        (store, "a prepared store"),
        (evaluation, "the folder of a `ctseg evaluate RUN_DIR`"),
    ):
        before = sorted(p.name for p in out.iterdir())
        result = runner.invoke(app, ["predict", str(run_dir), str(raw), "--out", str(out)])
        assert isinstance(result.exception, CtsegError), result.output
        assert f"--out {out} is {what}" in str(result.exception)
        assert sorted(p.name for p in out.iterdir()) == before  # not even a lock file


def test_an_evaluation_of_another_run_is_replaced_only_with_force_and_never_mixed(
    trained, tmp_path
):
    run_dir, store, _ = trained
    out = tmp_path / "eval"
    args = ["evaluate", str(run_dir), "--data", str(store), "--split", "train", "--out", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    assert runner.invoke(app, args).exit_code == 0  # the same evaluation again: replaced
    # As if another run had written the folder, with a case this one does not have.
    record = json.loads((out / "evaluated.json").read_text())
    record["run_dir"] = "/runs/other"
    (out / "evaluated.json").write_text(json.dumps(record))
    save(out / "predictions" / "other-case_seg.nii.gz", labels())
    summary = (out / "summary.json").read_text()
    result = runner.invoke(app, args)
    assert "holds the evaluation of /runs/other" in str(result.exception)
    assert "--force" in str(result.exception)
    assert (out / "summary.json").read_text() == summary
    assert runner.invoke(app, [*args, "--force"]).exit_code == 0
    cases = {case["case"] for case in json.loads((out / "summary.json").read_text())["cases"]}
    assert {p.name for p in (out / "predictions").iterdir()} == {f"{c}_seg.nii.gz" for c in cases}
    assert json.loads((out / "evaluated.json").read_text())["run_dir"] == str(run_dir.resolve())


def test_an_unfinished_evaluation_does_not_block_the_next_one(trained, tmp_path):
    """A crash or a stop mid-evaluation leaves its record and some predictions but no
    summary: the next evaluation, of whatever, goes ahead without --force; a foreign
    folder named like predictions does not count as ctseg's."""
    run_dir, store, _ = trained
    out = tmp_path / "eval"
    args = ["evaluate", str(run_dir), "--data", str(store), "--split", "train", "--out", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    record = json.loads((out / "evaluated.json").read_text())
    record["locate"] = {"run_dir": "/runs/locator", "checkpoint_step": 3, "margin_mm": 20.0}
    (out / "evaluated.json").write_text(json.dumps(record))
    (out / "summary.json").unlink()
    (out / "metrics.csv").unlink()
    assert runner.invoke(app, args).exit_code == 0
    assert "locate" not in json.loads((out / "evaluated.json").read_text())
    assert (out / "summary.json").is_file()

    foreign = tmp_path / "foreign"
    (foreign / "predictions").mkdir(parents=True)
    save(foreign / "predictions" / "mine_seg.nii.gz", labels())
    result = runner.invoke(app, [*args[:-1], str(foreign)])
    assert "--force" in str(result.exception)
    assert (foreign / "predictions" / "mine_seg.nii.gz").is_file()


def test_a_second_train_on_one_workdir_is_refused_before_it_writes(trained, tmp_path):
    from ctseg import config as cfg
    from ctseg.training.loop import train_and_evaluate

    run_dir, store, _ = trained
    workdir = tmp_path / "run"
    proc = _holding(workdir)
    try:
        with pytest.raises(CtsegError, match=f"being written by another command \\(pid {proc.pid}"):
            train_and_evaluate(cfg.load(run_dir / "config.toml"), store, workdir)
    finally:
        proc.communicate("")
    assert not workdir.exists()  # the holder made it and wrote nothing: nothing is left


def test_a_second_synth_into_one_folder_is_refused(tmp_path):
    proc = _holding(tmp_path / "raw")
    try:
        result = runner.invoke(app, ["synth", str(tmp_path / "raw"), "--cases", "1"])
    finally:
        proc.communicate("")
    assert "being written by another command" in str(result.exception)


def test_a_second_preprocess_into_one_store_is_refused(tmp_path):
    from ctseg import config as cfg
    from ctseg.synth.dataset import write_dataset

    write_dataset(tmp_path / "raw", cases=1, size=16, seed=0)
    proc = _holding(tmp_path / "prep")
    try:
        with pytest.raises(CtsegError, match="being written by another command"):
            prepare_store(
                tmp_path / "raw", tmp_path / "prep", cfg.load(None, ["data.resolution=16"])
            )
    finally:
        proc.communicate("")
    assert not (tmp_path / "prep" / "manifest.json").exists()


def test_a_command_that_fails_before_it_starts_leaves_no_empty_folder(trained, tmp_path):
    run_dir, _, raw = trained
    out = tmp_path / "new" / "out"
    args = ["predict", str(run_dir), str(raw), "--out", str(out), "--checkpoint", "999"]
    result = runner.invoke(app, args)
    assert isinstance(result.exception, CtsegError) and "999" in str(result.exception)
    assert not out.exists()


def _read_only_folder(tmp_path: Path) -> Path:
    """A folder no command can write into: permission bits do not stop root, sysfs does."""
    if os.geteuid() == 0:
        return Path("/sys/kernel/ctseg-out")
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o555)
    return folder / "out"


def test_a_read_only_output_folder_is_one_line_in_every_writing_command(trained, tmp_path):
    run_dir, store, raw = trained
    out = _read_only_folder(tmp_path)
    scan = str(raw / "volume-0.nii.gz")
    for args in (
        ["predict", str(run_dir), scan, "--out", str(out)],
        ["evaluate", str(run_dir), "--data", str(store), "--out", str(out)],
        ["synth", str(out), "--cases", "1", "--size", "16"],
        ["preprocess", str(raw), str(out)],
        ["train", "--data", str(store), "--workdir", str(out), "--set", "data.resolution=16"],
    ):
        result = runner.invoke(app, args)
        assert isinstance(result.exception, CtsegError), (args[0], result.output)
        assert str(out) in str(result.exception), args[0]
