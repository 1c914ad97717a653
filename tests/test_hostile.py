"""Hostile and careless inputs: report files over inputs or others' files, two writers at
once, interrupted work. Every file a command writes is its own, never an input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_evaluate import labels, save
from typer.testing import CliRunner

import cli.main  # noqa: F401  (registers the commands)
from cli.app import app
from ctseg import atomic, lock
from ctseg.errors import CtsegError

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


# ---------------------------------------------------------------- report files


def test_claim_report_never_takes_an_input_and_others_files_only_with_force(tmp_path):
    scan, report = tmp_path / "scan.nii.gz", tmp_path / "report.json"
    scan.write_bytes(b"scan")
    never = lambda path: False  # noqa: E731
    for force in (False, True):
        with pytest.raises(CtsegError, match="is an input of this command"):
            atomic.claim_report(tmp_path / "." / "scan.nii.gz", never, [scan], force)
    with pytest.raises(CtsegError, match="is not a report this command wrote.*--force"):
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


@pytest.mark.parametrize("command", ["bench", "plan"])
def test_bench_and_plan_json_never_replace_a_config_or_a_scan(command, tmp_path):
    config = tmp_path / "run" / "config.toml"
    config.parent.mkdir()
    config.write_text('[data]\nresolution = 16\n[model]\nbase_filters = 2\ndepth = 2\n')
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
    # Released cleanly: no lock file is left, and the folder is free again.
    assert list(folder.iterdir()) == []
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
