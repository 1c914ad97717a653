"""Scans that real archives hold: each unreadable or implausible one is a one-line error."""

import errno
import gzip
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import SimpleITK as sitk
from dicom_series import write_dicom_series
from helpers import prepare_store
from typer.testing import CliRunner

import ctseg.cli.main  # noqa: F401  (registers the commands)
from ctseg import config as cfg
from ctseg.cli.app import app
from ctseg.data.manifest import is_case_id
from ctseg.data.store import Store
from ctseg.data_prep import build
from ctseg.data_prep.raw import find_cases
from ctseg.data_prep.workers import usable_workers
from ctseg.errors import CtsegError
from ctseg.io import readers
from ctseg.io.pictures import plot_preview
from ctseg.io.scans import find_scans, read_scan
from ctseg.synth.dataset import write_dataset

AFFINE = np.diag([0.8, 0.8, 2.5, 1.0])
NO_AFFINE = "has no usable geometry"


def _nifti(path: Path, data=None, **fields) -> Path:
    """A NIfTI file with a valid sform and qform, then `fields` set in its header as they are."""
    data = np.zeros((6, 5, 4), np.int16) if data is None else data
    header = nib.Nifti1Image(data, AFFINE).header.copy()
    header.set_qform(AFFINE, code=1)
    header.set_sform(AFFINE, code=1)
    for key, value in fields.items():
        header[key] = value
    nib.save(nib.Nifti1Image(data, None, header=header), path)
    return path


_ZERO_SFORM = {"srow_x": [0] * 4, "srow_y": [0] * 4, "srow_z": [0] * 4}


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"srow_x": [np.nan, 0, 0, 0]}, AFFINE),  # a NaN sform: the valid qform is used
        (_ZERO_SFORM, AFFINE),  # a zero sform with sform_code 1: likewise
        ({"sform_code": 0, "quatern_b": np.nan}, NO_AFFINE),
        ({"srow_x": [np.nan, 0, 0, 0], "quatern_b": np.nan}, NO_AFFINE),
        ({**_ZERO_SFORM, "qform_code": 0}, NO_AFFINE),
    ],
)
def test_nifti_geometry_sform_else_qform_else_refused(tmp_path, fields, expected):
    path = _nifti(tmp_path / "scan.nii.gz", **fields)
    if isinstance(expected, str):
        with pytest.raises(CtsegError, match=expected) as info:
            read_scan(path)
        assert "\n" not in str(info.value)
        return
    scan = read_scan(path)
    np.testing.assert_allclose(scan.original_affine, expected)
    # Results carry only the transform that was used, not the broken one.
    header = scan.header
    assert int(header["sform_code"]) == 0 and int(header["qform_code"]) == 1


def test_complex_and_rgb_voxels_are_refused(tmp_path):
    nib.save(nib.Nifti1Image(np.zeros((4, 4, 4), np.complex64), AFFINE), tmp_path / "c.nii.gz")
    rgb = np.zeros((4, 4, 4), dtype=[("R", "u1"), ("G", "u1"), ("B", "u1")])
    nib.save(nib.Nifti1Image(rgb, AFFINE), tmp_path / "rgb.nii.gz")
    with pytest.raises(CtsegError, match=r"holds complex \(complex64\) voxels; ctseg expects"):
        read_scan(tmp_path / "c.nii.gz")
    with pytest.raises(CtsegError, match=r"holds 3-component \(R, G, B\) voxels"):
        read_scan(tmp_path / "rgb.nii.gz")


def test_a_pipe_or_device_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "fifo.nii.gz")  # opening it to read would wait for a writer
    (tmp_path / "null.nii").symlink_to("/dev/null")
    # Found in a folder and given by name alike, then refused one by one.
    assert find_scans([tmp_path]).scans == [tmp_path / "fifo.nii.gz", tmp_path / "null.nii"]
    assert find_scans([tmp_path / "fifo.nii.gz"]).scans == [tmp_path / "fifo.nii.gz"]
    for name in ("fifo.nii.gz", "null.nii"):
        with pytest.raises(CtsegError, match="is not a regular file"):
            read_scan(tmp_path / name)


def _huge_header_tiny_file(path: Path) -> Path:
    """A .nii.gz whose header says 1200³ int16 (3.2 GiB) but that holds almost nothing."""
    header = nib.Nifti1Header()
    header.set_data_shape((1200, 1200, 1200))
    header.set_data_dtype(np.int16)
    header.set_sform(AFFINE, code=1)
    with gzip.open(path, "wb") as handle:
        handle.write(header.binaryblock + b"\0" * 4 + b"\0" * 1024)
    return path


def test_a_scan_too_large_for_memory_is_refused_from_its_header(tmp_path, monkeypatch):
    path = _huge_header_tiny_file(tmp_path / "huge.nii.gz")
    monkeypatch.setattr(readers, "host_memory", lambda: 16 * 2**30)
    with pytest.raises(CtsegError) as info:
        read_scan(path)
    message = str(info.value)
    assert "1200 × 1200 × 1200 voxels, 3.2 GiB in memory, more than the 2.0 GiB" in message
    assert "set CTSEG_MAX_SCAN_BYTES=3456000000 to read it anyway" in message
    monkeypatch.setenv("CTSEG_MAX_SCAN_BYTES", "1000000")
    allows = "more than the 976.6 KiB that CTSEG_MAX_SCAN_BYTES allows"
    with pytest.raises(CtsegError, match=allows):
        read_scan(path)
    monkeypatch.setenv("CTSEG_MAX_SCAN_BYTES", "lots")
    with pytest.raises(CtsegError, match="CTSEG_MAX_SCAN_BYTES must be a number of bytes"):
        read_scan(path)
    # Within the limit, the file is still too small for what its header claims (deflate
    # packs at most 1032 bytes into one): refused, nothing decompressed.
    monkeypatch.setenv("CTSEG_MAX_SCAN_BYTES", str(4 * 2**30))
    monkeypatch.setattr(readers, "scaled_voxels", lambda image: pytest.fail("decompressed"))
    with pytest.raises(CtsegError, match="is cut short or its header lies: the header claims"):
        read_scan(path)


def test_itk_and_dicom_sizes_are_checked_before_reading(tmp_path, monkeypatch):
    sitk.WriteImage(_itk((6, 5, 4)), str(tmp_path / "scan.mha"))
    write_dicom_series(tmp_path / "series", _itk((6, 5, 4)))
    monkeypatch.setenv("CTSEG_MAX_SCAN_BYTES", "100")  # 120 voxels of int16: 240 bytes
    with pytest.raises(CtsegError, match=r"scan.mha is 6 × 5 × 4 voxels"):
        read_scan(tmp_path / "scan.mha")
    with pytest.raises(CtsegError, match=r"series is 6 × 5 × 4 voxels"):
        read_scan(tmp_path / "series")


def _itk(shape_xyz, seed=0, spacing=(0.7, 0.7, 4.83)) -> sitk.Image:
    data = np.random.default_rng(seed).integers(-1000, 1000, shape_xyz[::-1]).astype(np.int16)
    image = sitk.GetImageFromArray(data)
    image.SetSpacing(spacing)
    return image


def test_a_dicom_series_with_a_missing_slice_is_refused(tmp_path):
    write_dicom_series(tmp_path / "series", _itk((6, 5, 8)))
    assert read_scan(tmp_path / "series").spacing[2] == pytest.approx(4.83, abs=1e-3)
    (tmp_path / "series" / "slice003.dcm").unlink()
    with pytest.raises(CtsegError) as info:
        read_scan(tmp_path / "series")
    assert (
        "is not evenly spaced: slices 3 and 4 of 7 (at 9.66 and 19.32 mm along the slice "
        "normal) are 9.66 mm apart, the others 4.83 mm" in str(info.value)
    )


def test_a_folder_of_two_series_names_both(tmp_path):
    folder = tmp_path / "study"
    write_dicom_series(folder, _itk((6, 5, 4), seed=0), series=1)
    write_dicom_series(tmp_path / "other", _itk((6, 5, 4), seed=1), series=2)
    for file in (tmp_path / "other").iterdir():
        file.rename(folder / f"other_{file.name}")
    with pytest.raises(CtsegError) as info:
        read_scan(folder)
    message = str(info.value)
    assert "holds 2 DICOM series: 1.2.826.0.1.3680043.2.1125.1.1 (4 files);" in message
    assert "1.2.826.0.1.3680043.2.1125.1.2 (4 files); move the one to segment" in message


def test_preprocess_reports_a_refused_scan_and_stores_the_others(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    ct = np.random.default_rng(0).integers(-1000, 1000, (6, 5, 4)).astype(np.int16)
    _nifti(raw / "good.nii.gz", ct)
    _nifti(raw / "broken.nii.gz", ct, sform_code=0, quatern_b=np.nan)
    os.mkfifo(raw / "pipe.nii.gz")
    (raw / "dangling.nii").symlink_to(tmp_path / "gone.nii")
    result = prepare_store(raw, tmp_path / "prep", cfg.load(None, ["data.resolution=8"]))
    outcomes = {o.case_id: o for o in result.outcomes}
    assert outcomes["good"].status == "prepared"
    assert outcomes["broken"].status == "failed" and NO_AFFINE in outcomes["broken"].reason
    assert "is not a regular file" in outcomes["pipe"].reason
    assert "scan not found" in outcomes["dangling"].reason
    assert [case.id for case in Store.open(tmp_path / "prep").cases] == ["good"]


# --- preprocess workers --------------------------------------------------------------------


def _live_children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (zombies, already ended, left out)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            except (OSError, ValueError):
                continue
            if int(parent) == pid and state != "Z":
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_workers_end_when_preprocess_is_killed(tmp_path):
    write_dataset(tmp_path / "raw", cases=6, size=24, seed=0)
    script = (
        "from ctseg import config; from ctseg.data_prep.build import write_store; "
        "from ctseg.data_prep.raw import find_cases; "
        f"write_store(find_cases({str(tmp_path / 'raw')!r}), {str(tmp_path / 'prep')!r}, "
        "config.load(None, ['data.resolution=160']), workers=2)"
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while len(_live_children(parent.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # two workers and multiprocessing's resource tracker
        children = _live_children(parent.pid)
        assert len(children) >= 3 and parent.poll() is None
        time.sleep(0.5)  # the workers are at their cases
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while any(map(_alive, children)) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in children if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "processes of a killed preprocess are still running"


def test_workers_are_capped_at_the_cpus(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert usable_workers(1) == 1 and usable_workers(1000) == 2
    with pytest.raises(CtsegError, match="`workers` must be at least 1, got 0"):
        usable_workers(0)
    write_dataset(tmp_path / "raw", cases=1, size=16, seed=0)
    args = ["preprocess", str(tmp_path / "raw"), str(tmp_path / "prep"), "--workers", "1000"]
    result = CliRunner().invoke(app, [*args, "--set", "data.resolution=8"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == "--workers 1000: 2 CPU(s) here, so 2 worker(s)"


# --- output folders that cannot take the store ---------------------------------------------


def _one_case(tmp_path: Path) -> Path:
    write_dataset(tmp_path / "raw", cases=1, size=16, seed=0)
    return tmp_path / "raw"


def test_a_read_only_store_folder_is_one_line_before_any_case(tmp_path, monkeypatch):
    raw = _one_case(tmp_path)

    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    # As root (CI containers) chmod does not stop writes: refuse them where the probe goes.
    monkeypatch.setattr(build.tempfile, "TemporaryFile", refused)
    result = CliRunner().invoke(
        app, ["preprocess", str(raw), str(tmp_path / "prep"), "--set", "data.resolution=8"]
    )
    assert isinstance(result.exception, CtsegError)
    assert str(result.exception) == f"cannot write in {tmp_path / 'prep'}: Permission denied"


@pytest.mark.parametrize(
    "failure",
    [
        OSError("32768 requested and 6080 written"),  # numpy's short write, without errno
        OSError(errno.ENOSPC, "No space left on device"),
    ],
)
def test_a_full_disk_is_said_as_such(tmp_path, monkeypatch, failure):
    raw = _one_case(tmp_path)

    def full(*args, **kwargs):
        raise failure

    monkeypatch.setattr(np, "save", full)
    result = prepare_store(raw, tmp_path / "prep", cfg.load(None, ["data.resolution=8"]))
    (outcome,) = result.outcomes
    assert outcome.status == "failed" and result.store is None
    assert re.fullmatch(
        r"cannot write .*label\.npy: no space left on the device of .*lits-0 \(0 MiB to "
        r"write, \d+ MiB free\); free some space and run the same command: finished cases "
        r"are kept",
        outcome.reason,
    ), outcome.reason


# --- names ---------------------------------------------------------------------------------


@pytest.mark.filterwarnings("error")  # matplotlib's "Glyph … missing from font(s)"
@pytest.mark.parametrize("name", ["肝臓スキャン_01", "a$^^{$b", "cost $5 and $6", "emoji 🫁"])
def test_any_scan_name_titles_a_preview_without_warning_or_error(tmp_path, name):
    hu = np.zeros((8, 8, 8), np.int16)
    plot_preview(hu, hu.astype(np.uint8), (1.0, 1.0, 1.0), tmp_path / "p.png", title=name)
    assert (tmp_path / "p.png").stat().st_size > 0


def test_scans_named_in_other_scripts_are_cases_of_their_own(tmp_path):
    for name in ("肝臓_01.nii.gz", "肝臓_02.nii.gz", "patient é.nii.gz"):
        (tmp_path / name).write_bytes(b"")
    ids = sorted(case.case_id for case in find_cases(tmp_path).cases)
    assert ids == ["patient-u00e9", "u809d-u81d3-01", "u809d-u81d3-02"]
    assert all(is_case_id(i) for i in ids)


def test_a_scan_without_voxels_is_one_line(tmp_path):
    nib.save(nib.Nifti1Image(np.zeros((0, 5, 5), np.int16), AFFINE), tmp_path / "empty.nii.gz")
    with pytest.raises(CtsegError, match=r"empty.nii.gz holds no voxels \(shape"):
        read_scan(tmp_path / "empty.nii.gz")
