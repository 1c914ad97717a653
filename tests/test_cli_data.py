"""`ctseg synth` and `ctseg preprocess` end to end, as a user runs them."""

import json
import os
import shutil
import subprocess
import sys

from typer.testing import CliRunner

import cli.main  # noqa: F401  (registers the commands)
from cli.app import app

runner = CliRunner()


def _ctseg(*args):
    """Run the CLI as a user does (own process), so exit codes and stderr are the real ones."""
    # Wide enough that rich does not wrap the long temporary paths in the messages.
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "300"},
    )


def test_synth_then_preprocess(tmp_path):
    raw, prep = tmp_path / "raw", tmp_path / "prep"
    result = runner.invoke(app, ["synth", str(raw), "--cases", "3", "--size", "24", "--seed", "2"])
    assert result.exit_code == 0, result.output
    assert "wrote 3 synthetic cases" in result.output
    assert sorted(p.name for p in raw.iterdir())[:2] == [
        "segmentation-0.nii.gz",
        "segmentation-1.nii.gz",
    ]

    args = ["preprocess", str(raw), str(prep), "--set", "data.resolution=16"]
    result = runner.invoke(app, [*args, "--workers", "2"])
    assert result.exit_code == 0, result.output
    assert "lits-0" in result.output and "prepared" in result.output
    assert "prepared store: 3 case(s) (2 train / 1 val) at 16³" in result.output
    manifest = json.loads((prep / "manifest.json").read_text())
    assert manifest["resolution"] == 16 and len(manifest["cases"]) == 3

    result = runner.invoke(app, args)
    assert result.exit_code == 0 and result.output.count("resumed") == 3, result.output

    result = runner.invoke(app, ["preprocess", str(raw), str(prep), "--set", "data.resolution=8"])
    assert result.exit_code != 0 and "--force" in str(result.exception)


def test_failed_case_exits_1_with_a_table(tmp_path):
    raw, prep = tmp_path / "raw", tmp_path / "prep"
    assert runner.invoke(app, ["synth", str(raw), "--cases", "2", "--size", "16"]).exit_code == 0
    (raw / "volume-5.nii.gz").write_bytes(b"garbage")
    shutil.copy(raw / "segmentation-0.nii.gz", raw / "segmentation-5.nii.gz")
    (raw / "volume-9.nii.gz").write_bytes(b"")  # a training image without its label

    result = _ctseg("preprocess", raw, prep, "--set", "data.resolution=8", "--workers", "2")
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any("lits-5" in line and "failed: cannot read" in line for line in lines)
    assert any("lits-9" in line and "training case without its label" in line for line in lines)
    assert "prepared store: 2 case(s)" in result.stdout
    assert "2 case(s) failed" in result.stdout
    manifest = json.loads((prep / "manifest.json").read_text())
    assert [c["id"] for c in manifest["cases"]] == ["lits-0", "lits-1"]


def test_predict_only_folder(tmp_path):
    raw, scans, prep = tmp_path / "raw", tmp_path / "scans", tmp_path / "prep"
    assert runner.invoke(app, ["synth", str(raw), "--cases", "1", "--size", "16"]).exit_code == 0
    scans.mkdir()
    shutil.copy(raw / "volume-0.nii.gz", scans / "test-volume-0.nii.gz")
    result = runner.invoke(app, ["preprocess", str(scans), str(prep), "--set", "data.resolution=8"])
    assert result.exit_code == 0, result.output
    assert "prepared store: 1 case(s) (1 test)" in result.output


def test_stopping_errors_exit_2_with_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    for folder, message in [
        (tmp_path / "missing", "error: raw data folder not found"),
        (tmp_path / "empty", "error: no scans found in"),
    ]:
        result = _ctseg("preprocess", folder, tmp_path / "p")
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().startswith(message)
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
