"""Hostile and careless use of `ctseg predict`, round five: a `_stats.json` or the folder's
`.ctseg-outputs.json` edited by hand is one line naming the file and the key, never a
traceback or nonsense, and the outputs it speaks for are not ctseg's to keep or to replace:
the scan is predicted again only with --force."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from ctseg.cli.main import app
from ctseg.errors import CtsegError
from ctseg.inference.outputs_record import OUTPUTS_RECORD

runner = CliRunner(env={"COLUMNS": "400"})  # no reason folded over lines


def _predict(run_dir, *args) -> tuple[int, str, BaseException | None]:
    result = runner.invoke(app, ["predict", str(run_dir), *map(str, args), "--tile", "0"])
    return result.exit_code, result.output, result.exception


def _failed_line(output: str, name: str = "volume-0") -> str:
    """The one line below the table that says why `name` failed."""
    lines = [line for line in output.splitlines() if line.startswith(f"failed: {name}:")]
    assert len(lines) == 1, output
    return lines[0]


@pytest.fixture(scope="module")
def predicted(trained, tmp_path_factory):
    """A folder where volume-0 was predicted, to be copied and edited by each test."""
    run_dir, _, raw = trained
    out = tmp_path_factory.mktemp("stats") / "out"
    code, output, _ = _predict(run_dir, raw / "volume-0.nii.gz", "--out", out)
    assert code == 0, output
    return run_dir, raw / "volume-0.nii.gz", out


def _edited(predicted, tmp_path, file, edit):
    run_dir, volume, out = predicted
    copy = shutil.copytree(out, tmp_path / "out")
    path = copy / file
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))
    return run_dir, volume, copy, path


def _set(*keys, value):
    def edit(record):
        for key in keys[:-1]:
            record = record[key]
        record[keys[-1]] = value

    return edit


def _remove(*keys):
    def edit(record):
        for key in keys[:-1]:
            record = record[key]
        del record[keys[-1]]

    return edit


STATS_EDITS = {
    "step-as-string": (_set("run_step", value="2"), "run_step"),
    "step-removed": (_remove("run_step"), "run_step"),
    "tta-null": (_set("tta", value=None), "tta"),
    "reason-a-number": (_set("quality", "reason", value=3), "quality.reason"),
    "verdict-removed": (_remove("quality", "verdict"), "quality.verdict"),
    "region-a-string": (_set("request", "region", value="the whole scan"), "request.region"),
    "backend-a-number": (_set("request", "backend", value=7), "request.backend"),
    "volume-a-string": (_set("liver_volume_ml", value="12.5"), "liver_volume_ml"),
    "count-negative": (_set("tumour_count", value=-1), "tumour_count"),
    "scan-hash-a-number": (_set("request", "scan", "sha256", value=12), "request.scan.sha256"),
    "request-a-list": (_set("request", value=[]), "request"),
    "ensemble-a-string": (_set("ensemble", value="two runs"), "ensemble"),
}


@pytest.mark.parametrize(("edit", "key"), STATS_EDITS.values(), ids=STATS_EDITS)
def test_a_stats_file_edited_by_hand_is_one_line_and_kept_until_force(
    predicted, tmp_path, edit, key
):
    run_dir, volume, out, path = _edited(predicted, tmp_path, "volume-0_stats.json", edit)
    kept = {p.name: p.read_bytes() for p in out.iterdir()}
    code, output, exception = _predict(run_dir, volume, "--out", out)
    assert exception is None or isinstance(exception, SystemExit), repr(exception)
    line = _failed_line(output)
    assert code == 1 and str(path) in line and repr(key) in line and "--force" in line, line
    assert "not the whole scan" not in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == kept
    code, output, _ = _predict(run_dir, volume, "--out", out, "--force")
    assert code == 0 and "done earlier" not in output, output
    assert json.loads(path.read_text())["run_step"] == 2


RECORD_EDITS = {
    "entry-a-string": (_set("outputs", "volume-0_seg.nii.gz", value="mine"), "volume-0_seg"),
    "digest-a-number": (_set("outputs", "volume-0_seg.nii.gz", "sha256", value=1), "sha256"),
    "size-a-string": (_set("outputs", "volume-0_stats.json", "bytes", value="9"), "bytes"),
    "scan-null": (_set("outputs", "volume-0_preview.png", "scan", value=None), "scan"),
}


@pytest.mark.parametrize(("edit", "key"), RECORD_EDITS.values(), ids=RECORD_EDITS)
def test_an_outputs_record_entry_edited_by_hand_keeps_its_files_until_force(
    predicted, tmp_path, edit, key
):
    run_dir, volume, out, path = _edited(predicted, tmp_path, OUTPUTS_RECORD, edit)
    kept = {p.name: p.read_bytes() for p in out.iterdir()}
    code, output, exception = _predict(run_dir, volume, "--out", out)
    assert exception is None or isinstance(exception, SystemExit), repr(exception)
    line = _failed_line(output)
    assert code == 1 and str(path) in line and key in line and "--force" in line, line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == kept
    code, output, _ = _predict(run_dir, volume, "--out", out, "--force")
    assert code == 0, output
    entry = json.loads(path.read_text())["outputs"]["volume-0_seg.nii.gz"]
    assert isinstance(entry["sha256"], str) and entry["scan"] == str(volume.resolve())


@pytest.mark.parametrize(
    "content",
    ["{not json", "[]", '{"outputs": []}', '{"outputs": {"a": 1}, "written_by": 5}'],
    ids=["not-json", "a-list", "outputs-a-list", "written-by-a-number"],
)
def test_an_unreadable_outputs_record_is_one_line_before_anything_is_written(
    predicted, tmp_path, content
):
    run_dir, volume, out = predicted
    out = shutil.copytree(out, tmp_path / "out")
    (out / OUTPUTS_RECORD).write_text(content)
    kept = {p.name: p.read_bytes() for p in out.iterdir()}
    code, output, exception = _predict(run_dir, volume, "--out", out)
    assert isinstance(exception, CtsegError), output
    message = str(exception)
    assert "\n" not in message and str(out / OUTPUTS_RECORD) in message, message
    assert "--force" in message
    assert {p.name: p.read_bytes() for p in out.iterdir()} == kept
    code, output, _ = _predict(run_dir, volume, "--out", out, "--force")
    assert code == 0, output
    assert "volume-0_seg.nii.gz" in json.loads((out / OUTPUTS_RECORD).read_text())["outputs"]


def test_a_record_or_stats_file_that_is_a_fifo_is_one_line_not_a_hang(predicted, tmp_path):
    """Run as the console script under a timeout: a FIFO's open for reading waits for a
    writer for ever (it hung predict, on the reader's thread or before any scan)."""
    run_dir, volume, out = predicted
    for file, code, where in ((OUTPUTS_RECORD, 2, "error: "), ("volume-0_stats.json", 1, "")):
        folder = shutil.copytree(out, tmp_path / file)
        (folder / file).unlink()
        os.mkfifo(folder / file)
        command = [sys.executable, "-m", "ctseg", "predict", str(run_dir), str(volume)]
        try:
            done = subprocess.run(
                [*command, "--out", str(folder), "--tile", "0"],
                capture_output=True,
                text=True,
                timeout=90,
                env={**os.environ, "COLUMNS": "400"},
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"{file} as a FIFO hung ctseg predict")
        output = done.stdout + done.stderr
        assert done.returncode == code, output
        line = f"{where}{'failed: volume-0: ' * (code == 1)}"
        lines = [text for text in output.splitlines() if text.startswith(line)]
        assert len(lines) == 1 and "pipe (FIFO)" in lines[0] and str(folder / file) in lines[0]
