"""`ctseg synth` and `ctseg preprocess` end to end, as a user runs them."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import SimpleITK as sitk
from dicom_series import write_dicom_series
from typer.testing import CliRunner

import ctseg.cli.main  # noqa: F401  (registers the commands)
from ctseg.cli.app import app
from ctseg.data.grids import image_to_grid
from ctseg.data.store import Store
from ctseg.errors import CtsegError

runner = CliRunner()


def _ctseg(*args):
    """Run the CLI as a user does (own process), so exit codes and stderr are the real ones."""
    # Wide enough that rich does not wrap the long temporary paths in the messages.
    return subprocess.run(
        [sys.executable, "-m", "ctseg.cli.main", *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "300"},
    )


def test_synth_then_preprocess(tmp_path):
    raw, prep = tmp_path / "raw", tmp_path / "prep"
    result = runner.invoke(app, ["synth", str(raw), "--cases", "3", "--size", "24", "--seed", "2"])
    assert result.exit_code == 0, result.output
    assert "wrote 3 synthetic cases" in result.output
    assert sorted(p.name for p in raw.glob("[!.]*"))[:2] == [
        "segmentation-0.nii.gz",
        "segmentation-1.nii.gz",
    ]

    args = ["preprocess", str(raw), str(prep), "--set", "data.resolution=16"]
    result = runner.invoke(app, [*args, "--workers", "2"])
    assert result.exit_code == 0, result.output
    assert "lits-0" in result.output and "prepared" in result.output
    assert "prepared store: 3 case(s) (2 train / 1 val), 16³ cube" in result.output
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


# --- DICOM series in a predict-only folder -------------------------------------------------

SPACING, ORIGIN = (0.75, 0.5, 2.0), (-5.0, 12.0, 40.0)  # ITK: LPS, identity direction


def _write_dicom_series(folder: Path, data: np.ndarray, series: int) -> None:
    """`data` [x, y, z] int16 as a DICOM series with the spacing and origin above."""
    image = sitk.GetImageFromArray(data.transpose(2, 1, 0))  # ITK wants [z, y, x]
    image.SetSpacing(SPACING)
    image.SetOrigin(ORIGIN)
    write_dicom_series(folder, image, series)


def _ct(seed: int, shape=(12, 10, 5)) -> np.ndarray:
    return np.random.default_rng(seed).integers(-1000, 1500, shape).astype(np.int16)


def test_preprocess_dicom_series_folders(tmp_path, monkeypatch):
    raw, prep = tmp_path / "raw", tmp_path / "prep"
    scan_a, scan_b = _ct(0), _ct(1)
    _write_dicom_series(raw / "patient_a", scan_a, series=1)
    _write_dicom_series(raw / "nested" / "patient_b", scan_b, series=2)
    # The same scan as patient_a, as NIfTI: ITK's LPS identity geometry is this RAS affine.
    affine = np.diag([-SPACING[0], -SPACING[1], SPACING[2], 1.0])
    affine[:3, 3] = [-ORIGIN[0], -ORIGIN[1], ORIGIN[2]]
    nib.save(nib.Nifti1Image(scan_a, affine), raw / "patient_a_nifti.nii.gz")

    args = ["preprocess", str(raw), str(prep), "--set", "data.resolution=8"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "prepared store: 3 case(s) (3 test)" in result.output
    store = Store.open(prep)
    assert [c.id for c in store.cases] == ["patient-b", "patient-a", "patient-a-nifti"]
    dicom, nifti = store.case("patient-a"), store.case("patient-a-nifti")
    assert dicom.image_source == str((raw / "patient_a").resolve())
    assert dicom.label_source is None and dicom.split == "test"
    assert dicom.original_shape == nifti.original_shape == scan_a.shape
    for key in ("original_affine", "canonical_affine", "spacing"):
        np.testing.assert_allclose(getattr(dicom, key), getattr(nifti, key), atol=1e-4)
    np.testing.assert_array_equal(store.image("patient-a"), store.image("patient-a-nifti"))
    # RAS canonical order flips the LPS x and y axes; 8³ is no plain copy of either scan.
    canonical_b = scan_b[::-1, ::-1, :].astype(np.float32)
    np.testing.assert_array_equal(store.image("patient-b"), image_to_grid(canonical_b, 8))

    # Resume compares the recorded folder sources: nothing is redone.
    result = runner.invoke(app, args)
    assert result.exit_code == 0 and result.output.count("resumed") == 3, result.output

    # RAW itself one DICOM series, given as ".": one case named after the folder.
    monkeypatch.chdir(raw / "patient_a")
    result = runner.invoke(app, ["preprocess", ".", str(tmp_path / "one"), *args[3:]])
    assert result.exit_code == 0, result.output
    assert [c.id for c in Store.open(tmp_path / "one").cases] == ["patient-a"]


def test_preprocess_duplicate_case_ids_are_an_error(tmp_path):
    raw = tmp_path / "raw"
    _write_dicom_series(raw / "patient_a", _ct(0, (4, 4, 2)), series=1)
    (raw / "patient-a.nii.gz").write_bytes(b"")  # never read: discovery refuses first
    args = ["preprocess", str(raw), str(tmp_path / "prep")]
    result = runner.invoke(app, args)
    assert isinstance(result.exception, CtsegError)
    message = str(result.exception)
    assert "\n" not in message and message.endswith(
        "would both become case 'patient-a'; rename one of them"
    )
    assert not (tmp_path / "prep").exists()

    (raw / "patient-a.nii.gz").rename(raw / "PATIENT_A.nii.gz")  # one store folder on macOS
    result = runner.invoke(app, args)
    assert "cases 'PATIENT-A' and 'patient-a', which differ only in letter case" in str(
        result.exception
    )


def test_failure_reasons_are_folded_not_cut_in_a_narrow_terminal(tmp_path):
    raw = tmp_path / "raw"
    assert runner.invoke(app, ["synth", str(raw), "--cases", "1", "--size", "16"]).exit_code == 0
    (raw / "volume-7.nii.gz").write_bytes(b"")  # a training image without its label
    result = subprocess.run(
        [sys.executable, "-m", "ctseg.cli.main", "preprocess", str(raw), str(tmp_path / "p")]
        + ["--set", "data.resolution=8"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "60"},
    )
    assert result.returncode == 1, result.stderr
    assert "…" not in result.stdout  # rich cuts a long word with an ellipsis unless folded
    assert "failed: training case" in result.stdout


def test_library_log_lines_are_kept_off_the_terminal(monkeypatch):
    import logging

    from ctseg.cli.main import main

    monkeypatch.setattr(sys, "argv", ["ctseg", "--version"])
    with pytest.raises(SystemExit):
        main()
    assert logging.getLogger("absl").getEffectiveLevel() == logging.ERROR
    assert logging.getLogger("matplotlib").getEffectiveLevel() == logging.ERROR


def test_matplotlib_waits_for_the_first_picture():
    """Prediction and training import it with their first picture, not before their first
    scan or step (0.3 s on 2 cores)."""
    pipelines = "ctseg.inference.files, ctseg.training.loop"
    code = f"import sys, {pipelines}; sys.exit('matplotlib' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_an_error_line_keeps_the_brackets_of_a_path(tmp_path):
    """Messages are plain text: rich would take `[final]` for a markup tag and drop it."""
    raw = tmp_path / "scans[final]"
    result = _ctseg("preprocess", raw, tmp_path / "prep")
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: ") and "scans[final]" in result.stderr
