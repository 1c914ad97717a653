"""Hostile and careless use of `ctseg predict`, round five: a scan is known by its content,
not its file name (a different or changed scan is predicted again, saying why), an output
is ctseg's only while its content is what ctseg wrote, a scan's name is never empty, and a
`--roi` that is no regular file is one line, never a hang."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import nibabel as nib
import numpy as np
import pytest
from dicom_series import write_dicom_series
from helpers import itk_image
from typer.testing import CliRunner

from ctseg.cli.main import app
from ctseg.inference.outputs_record import OUTPUTS_RECORD

runner = CliRunner(env={"COLUMNS": "400"})  # no reason folded over lines
CHANGED = "the scan changed since its prediction"


def _predict(run_dir, *args) -> tuple[int, str]:
    result = runner.invoke(app, ["predict", str(run_dir), *map(str, args), "--tile", "0"])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return 2, str(result.exception)  # a usage error: `error: …` in the console script
    return result.exit_code, " ".join(result.output.split())


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _stats(out, name="volume-0"):
    return json.loads((out / f"{name}_stats.json").read_text())


@pytest.fixture(scope="module")
def scans(trained):
    run_dir, _, raw = trained
    return run_dir, raw


# ---------------------------------------------------------------- a scan's identity


def test_another_scan_of_the_same_name_is_predicted_again_saying_why(scans, tmp_path):
    run_dir, raw = scans
    out = tmp_path / "out"
    assert _predict(run_dir, raw / "volume-0.nii.gz", "--out", out)[0] == 0
    request = _stats(out)["request"]
    assert request["scan"] == {
        "sha256": _sha256(raw / "volume-0.nii.gz"),
        "bytes": (raw / "volume-0.nii.gz").stat().st_size,
    }
    # Another patient's scan that bears the same file name, from another folder.
    other = tmp_path / "elsewhere" / "volume-0.nii.gz"
    other.parent.mkdir()
    shutil.copy(raw / "volume-1.nii.gz", other)
    code, output = _predict(run_dir, other, "--out", out)
    assert code == 0 and "done earlier" not in output and CHANGED in output, output
    assert _stats(out)["request"]["scan"]["sha256"] == _sha256(other)
    # Now it is the same scan: done earlier.
    code, output = _predict(run_dir, other, "--out", out)
    assert code == 0 and "done earlier" in output and CHANGED not in output, output


def test_a_scan_replaced_in_place_is_predicted_again(scans, tmp_path):
    run_dir, raw = scans
    scan = shutil.copy(raw / "volume-0.nii.gz", tmp_path / "scan.nii.gz")
    out = tmp_path / "out"
    assert _predict(run_dir, scan, "--out", out)[0] == 0
    before = nib.load(out / "scan_seg.nii.gz").shape
    image = nib.load(scan)  # new content, new shape, the same name
    nib.save(nib.Nifti1Image(np.asarray(image.dataobj)[:, :, :-4], image.affine), scan)
    code, output = _predict(run_dir, scan, "--out", out)
    assert code == 0 and CHANGED in output, output
    assert nib.load(out / "scan_seg.nii.gz").shape == before[:2] + (before[2] - 4,)


def test_a_dicom_series_is_known_by_its_files_and_named_from_inside(scans, tmp_path, monkeypatch):
    """`ctseg predict RUN .` inside a series folder names the scan after the folder; a slice
    changed in place makes it another scan."""
    run_dir, _ = scans
    rng = np.random.default_rng(5)
    ct = rng.normal(0, 300, (14, 12, 9)).clip(-1000, 1500).astype(np.int16)
    series = tmp_path / "chest_ct"
    write_dicom_series(series, itk_image(ct))
    out = tmp_path / "out"
    monkeypatch.chdir(series)
    code, output = _predict(run_dir, ".", "--out", out)
    assert code == 0, output
    names = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert names == ["chest_ct_preview.png", "chest_ct_seg.nii.gz", "chest_ct_stats.json"]
    assert _predict(run_dir, ".", "--out", out)[1].count("done earlier") == 1
    slice_ = sorted(series.iterdir())[3]
    slice_.write_bytes(slice_.read_bytes()[:-2] + b"\x01\x02")  # one voxel, a new value
    code, output = _predict(run_dir, ".", "--out", out)
    assert code == 0 and CHANGED in output, output


def test_a_scan_with_an_empty_name_is_a_failed_row(scans, tmp_path):
    run_dir, raw = scans
    nameless = shutil.copy(raw / "volume-0.nii.gz", tmp_path / ".nii.gz")
    out = tmp_path / "out"
    code, output = _predict(run_dir, nameless, raw / "volume-1.nii.gz", "--out", out)
    assert code == 1 and "failed" in output and "empty name" in output, output
    assert not any(p.name.startswith("_") for p in out.iterdir())
    assert (out / "volume-1_seg.nii.gz").exists()


# ---------------------------------------------------------------- ownership by content


def test_a_label_map_corrected_by_hand_is_never_replaced_without_force(scans, tmp_path):
    run_dir, raw = scans
    volume = raw / "volume-0.nii.gz"
    out = tmp_path / "out"
    assert _predict(run_dir, volume, "--out", out)[0] == 0
    entry = json.loads((out / OUTPUTS_RECORD).read_text())["outputs"]["volume-0_seg.nii.gz"]
    seg = out / "volume-0_seg.nii.gz"
    assert entry["sha256"] == _sha256(seg) and entry["bytes"] == seg.stat().st_size
    assert entry["scan"] == str(volume.resolve())
    # The user corrects the label map and saves it over ctseg's; the preview, then the
    # stats, are deleted: ctseg would have predicted the scan again over the correction.
    image = nib.load(seg)
    corrected = np.asarray(image.dataobj).copy()
    corrected[:4] = 2
    nib.save(nib.Nifti1Image(corrected, image.affine, image.header), seg)
    kept = seg.read_bytes()
    for deleted in ("volume-0_preview.png", "volume-0_stats.json"):
        (out / deleted).unlink()
        code, output = _predict(run_dir, volume, "--out", out)
        assert code == 1 and f"{seg} was changed since ctseg predict wrote it" in output, output
        assert "--force" in output and seg.read_bytes() == kept
    code, output = _predict(run_dir, volume, "--out", out, "--force")
    assert code == 0, output
    assert (
        _sha256(seg)
        == json.loads((out / OUTPUTS_RECORD).read_text())["outputs"]["volume-0_seg.nii.gz"][
            "sha256"
        ]
    )


def test_records_of_an_earlier_ctseg_still_read(scans, tmp_path):
    """An outputs record without digests: its files are ctseg's by name, as they were; a
    stats file whose request records no scan: the scan is predicted again, saying why."""
    run_dir, raw = scans
    volume = raw / "volume-0.nii.gz"
    out = tmp_path / "out"
    assert _predict(run_dir, volume, "--out", out)[0] == 0
    record = json.loads((out / OUTPUTS_RECORD).read_text())
    for entry in record["outputs"].values():
        del entry["sha256"], entry["bytes"]
    (out / OUTPUTS_RECORD).write_text(json.dumps(record))
    stats = _stats(out)
    del stats["request"]["scan"]
    (out / "volume-0_stats.json").write_text(json.dumps(stats))
    code, output = _predict(run_dir, volume, "--out", out)
    assert code == 0 and "its scan's content is not recorded" in output, output
    assert (
        "sha256" in json.loads((out / OUTPUTS_RECORD).read_text())["outputs"]["volume-0_seg.nii.gz"]
    )
    assert _predict(run_dir, volume, "--out", out)[1].count("done earlier") == 1


# ---------------------------------------------------------------- a --roi that is no file


def test_a_roi_that_is_a_fifo_is_one_line_not_a_hang(scans, tmp_path):
    run_dir, raw = scans
    fifo = tmp_path / "mask.nii.gz"
    os.mkfifo(fifo)
    masks = tmp_path / "masks"
    masks.mkdir()
    os.mkfifo(masks / "volume-0.nii.gz")
    for roi in (fifo, masks):
        args = [run_dir, raw / "volume-0.nii.gz", "--out", tmp_path / "out", "--roi", roi]
        try:
            done = subprocess.run(
                [sys.executable, "-m", "ctseg", "predict", *map(str, args)],
                capture_output=True,
                text=True,
                timeout=60,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"--roi {roi} (a FIFO) hung ctseg predict")
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, done.stdout + done.stderr
        assert lines[-1].startswith("error: --roi") and "FIFO" in lines[-1], done.stderr
        assert not (tmp_path / "out" / "volume-0_stats.json").exists()
