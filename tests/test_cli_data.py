"""`ctseg synth` and `ctseg preprocess` end to end, as a user runs them."""

import json
import subprocess
import sys

from typer.testing import CliRunner

import cli.main  # noqa: F401  (registers the commands)
from cli.app import app

runner = CliRunner()


def test_synth_then_preprocess(tmp_path):
    raw, prep = tmp_path / "raw", tmp_path / "prep"
    result = runner.invoke(app, ["synth", str(raw), "--cases", "3", "--size", "24", "--seed", "2"])
    assert result.exit_code == 0, result.output
    assert "wrote 3 synthetic cases" in result.output
    assert sorted(p.name for p in raw.iterdir())[:2] == [
        "segmentation-0.nii.gz",
        "segmentation-1.nii.gz",
    ]

    (raw / "volume-9.nii.gz").write_bytes(b"")  # an image without a label is reported
    result = runner.invoke(app, ["preprocess", str(raw), str(prep), "--set", "data.resolution=16"])
    assert result.exit_code == 0, result.output
    assert "warning: skipped 1 image(s) without labels: volume-9.nii.gz" in result.output
    assert "train / val" in result.output and "16³" in result.output
    manifest = json.loads((prep / "manifest.json").read_text())
    assert manifest["resolution"] == 16 and len(manifest["cases"]) == 3

    result = runner.invoke(app, ["preprocess", str(raw), str(prep), "--set", "data.resolution=8"])
    assert result.exit_code != 0 and "--force" in str(result.exception)


def test_bad_input_exits_2_with_one_line(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli.main",
            "preprocess",
            str(tmp_path / "missing"),
            str(tmp_path / "p"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: raw data folder not found")
    assert "Traceback" not in result.stderr
