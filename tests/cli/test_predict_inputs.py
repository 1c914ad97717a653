"""`ctseg predict` on a batch of what real archives hold: every input is a row or a
warning, a bad one never ends the batch, and the reasons are readable in full."""

import logging
import os
import shutil
from pathlib import Path

from dicom_series import RT_DOSE, write_dicom_slice, write_pydicom_series
from typer.testing import CliRunner

import ctseg.cli.main  # noqa: F401  (registers the commands)
from ctseg.cli import library_output
from ctseg.cli.app import app
from ctseg.inference import files

runner = CliRunner()
MR_IMAGE = "1.2.840.10008.5.1.4.1.1.4"


def test_a_library_exception_fails_its_scan_and_the_batch_goes_on(trained, tmp_path, monkeypatch):
    run_dir, _, raw = trained
    # A single-frame RT dose, on which GDCM's series listing throws.
    write_dicom_slice(tmp_path / "dose" / "RD.dcm", sop_class=RT_DOSE, modality="RTDOSE")
    write_pydicom_series(tmp_path / "mr", sop_class=MR_IMAGE, modality="MR")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(raw / "volume-1.nii.gz", mixed / "volume-1.nii.gz")
    write_dicom_slice(mixed / "stray.dcm")
    # Any library's exception while reading (here a made-up one) is that scan's row.
    broken = shutil.copy(raw / "volume-2.nii.gz", tmp_path / "broken.nii.gz")
    read_scan = files.read_scan

    def failing_read(path, *args):
        if path.name == "broken.nii.gz":
            raise ValueError("buffer is smaller than requested size")
        return read_scan(path, *args)

    monkeypatch.setattr(files, "read_scan", failing_read)
    inputs = [raw / "volume-0.nii.gz", tmp_path / "dose", broken, tmp_path / "mr", mixed]
    out = tmp_path / "out"
    args = ["predict", str(run_dir), *map(str, inputs), "--out", str(out), "--tile", "0"]
    result = runner.invoke(app, args, env={"COLUMNS": "80"})
    assert result.exit_code == 1, result.output
    # The scans after the bad ones are predicted, and the table is printed.
    assert (out / "volume-0_stats.json").is_file() and (out / "volume-1_stats.json").is_file()
    assert not (out / "broken_stats.json").exists() and not (out / "dose_stats.json").exists()
    assert "Predictions" in result.output
    table, below = result.output.split("Predictions", 1)[1].split("failed:", 1)
    assert table.count("failed") == 3
    # Each reason in full below the table, one paragraph each, not folded in a column.
    reasons = [" ".join(p.split()) for p in ("failed:" + below).split("failed:")[1:]]
    assert any(r.startswith("dose: cannot list the DICOM series") for r in reasons), reasons
    assert any(
        r.startswith("broken: reading failed on")
        and r.endswith("ValueError: buffer is smaller than requested size")
        for r in reasons
    )
    assert any("modality MR" in r and "--allow-non-ct" in r for r in reasons)
    # The stray DICOM file beside a NIfTI is named, and counted in the first line.
    flat = " ".join(result.output.split())
    assert "skipped 1 DICOM file (stray.dcm) beside 1 NIfTI/NRRD/MHA scan(s)" in flat
    assert "5 scan(s), 1 file(s) skipped" in flat
    # Forced, the MR series is segmented as if it were CT.
    forced = runner.invoke(
        app, ["predict", str(run_dir), str(tmp_path / "mr"), "--out", str(out), "--allow-non-ct"]
    )
    assert forced.exit_code == 0, forced.output
    assert (out / "mr_stats.json").is_file()


def test_library_output_is_held_and_shown_only_when_verbose(capfd, monkeypatch):
    # A library's logger with no handler (pytest's own, on the root, left aside).
    monkeypatch.setattr(logging.getLogger("somelibrary"), "propagate", False)
    for show in (False, True):
        with library_output.held(show=show):
            os.write(2, b"gdcm: Warning: some JPEG decoder complaint\n")  # as C++ writes
            logging.getLogger("somelibrary").warning("a library's log line")
        captured = capfd.readouterr()
        assert ("JPEG decoder complaint" in captured.err) == show
        assert ("a library's log line" in captured.err) == show


def test_only_inference_out_of_memory_advises_a_smaller_tile():
    def exhausted():
        raise MemoryError("Unable to allocate 86.0 GiB for an array")

    for doing in (files._READING, files._INFERENCE, files._WRITING):
        outcome = files.ScanOutcome(Path("scan.nii.gz"), "scan")
        assert files._guarded(outcome, doing, exhausted) is None
        assert outcome.error.startswith(f"{doing} ran out of memory")
        assert ("smaller tile" in outcome.error) == (doing == files._INFERENCE)
