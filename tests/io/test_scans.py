"""Scans keep their geometry: canonical reading, exact write-back, NRRD/MHA/DICOM, errors."""

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import SimpleITK as sitk
from dicom_series import write_dicom_series
from helpers import itk_image, rotation_z

from ctseg.errors import CtsegError
from ctseg.io.scans import find_scans, nifti_geometry, read_scan, write_labels, write_volume

SHAPE = (6, 7, 5)


def _affine(linear: np.ndarray, offset=(10.0, -20.0, 30.0)) -> np.ndarray:
    affine = np.eye(4)
    affine[:3, :3] = linear
    affine[:3, 3] = offset
    return affine


AFFINES = {
    "RAS": _affine(np.diag([0.8, 0.8, 2.5])),
    "LPS": _affine(np.diag([-0.7, -0.7, 3.0])),
    # Oblique, with the first two voxel axes swapped, so reorientation permutes axes.
    "oblique": _affine(rotation_z(20) @ np.array([[0, -0.9, 0], [0.6, 0, 0], [0, 0, -2.0]])),
}


def _write_nifti(path: Path, data: np.ndarray, affine: np.ndarray, sform: bool = True) -> Path:
    image = nib.Nifti1Image(data, affine)
    if not sform:  # a qform-only header: the affine comes from the quaternion
        image.set_sform(None, code=0)
        image.set_qform(affine, code=1)
    nib.save(image, path)
    return path


def _volume(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(-1000, 1000, SHAPE).astype(np.int16)


@pytest.mark.parametrize("sform", [True, False])
@pytest.mark.parametrize("orientation", sorted(AFFINES))
def test_nifti_labels_overlay_exactly(tmp_path, orientation, sform):
    path = _write_nifti(tmp_path / "scan.nii.gz", _volume(), AFFINES[orientation], sform)
    stored = nib.load(path)
    scan = read_scan(path)

    canonical = nib.as_closest_canonical(stored)
    np.testing.assert_array_equal(scan.array, canonical.get_fdata())
    np.testing.assert_allclose(scan.affine, canonical.affine)
    assert scan.name == "scan" and scan.original_shape == SHAPE

    labels = np.zeros(scan.array.shape, np.uint8)
    marked = np.array([1, 2, 3])
    labels[tuple(marked)] = 2
    write_labels(scan, labels, tmp_path / "labels.nii.gz")

    written = nib.load(tmp_path / "labels.nii.gz")
    assert written.shape == SHAPE
    np.testing.assert_array_equal(written.affine, stored.affine)
    assert written.get_data_dtype() == np.uint8
    assert written.dataobj.slope == 1 and written.dataobj.inter == 0
    voxel = np.argwhere(np.asarray(written.dataobj) == 2)
    assert len(voxel) == 1
    world_written = written.affine @ np.append(voxel[0], 1)
    world_marked = scan.affine @ np.append(marked, 1)
    np.testing.assert_allclose(world_written, world_marked, atol=1e-4)


@pytest.mark.parametrize("orientation", sorted(AFFINES))
def test_a_nifti_header_gives_the_scan_s_canonical_shape_and_spacing(tmp_path, orientation):
    """`nifti_geometry` (the header alone, for sizing a batch's canvases) against the Scan
    `read_scan` makes; None for what is no readable 3-D NIfTI file."""
    for sform in (True, False):
        path = _write_nifti(tmp_path / "scan.nii.gz", _volume(), AFFINES[orientation], sform)
        scan = read_scan(path)
        shape, spacing = nifti_geometry(path)
        assert shape == scan.array.shape and spacing == pytest.approx(scan.spacing, abs=1e-9)
    squeezable = np.zeros((*SHAPE, 1), np.int16)
    assert nifti_geometry(_write_nifti(tmp_path / "1.nii", squeezable, np.eye(4)))[0] == SHAPE
    four_d = _write_nifti(tmp_path / "4d.nii", np.zeros((*SHAPE, 2), np.int16), np.eye(4))
    (tmp_path / "junk.nii.gz").write_bytes(np.random.default_rng(0).bytes(2000))
    itk = tmp_path / "scan.nrrd"
    sitk.WriteImage(sitk.GetImageFromArray(_volume()), str(itk))
    for unusable in (four_d, tmp_path / "junk.nii.gz", itk, tmp_path / "missing.nii", tmp_path):
        assert nifti_geometry(unusable) is None


def test_write_volume_keeps_channels(tmp_path):
    scan = read_scan(_write_nifti(tmp_path / "s.nii", _volume(), AFFINES["oblique"]))
    probabilities = np.random.default_rng(1).random((*scan.array.shape, 3)).astype(np.float32)
    write_volume(scan, probabilities, tmp_path / "p.nii.gz", np.float32)
    written = nib.load(tmp_path / "p.nii.gz")
    assert written.shape == (*SHAPE, 3)
    canonical = nib.as_closest_canonical(written).get_fdata()
    np.testing.assert_allclose(canonical, probabilities)


def _assert_itk_geometry(scan, image: sitk.Image, data: np.ndarray) -> None:
    """Each original voxel maps to ITK's physical point (LPS flipped to RAS), and the
    canonical voxel at that point holds the same value."""
    for index in [(0, 0, 0), (5, 1, 4), (2, 6, 3)]:
        lps = np.array(image.TransformIndexToPhysicalPoint(index))
        ras = scan.original_affine @ np.append(index, 1)
        np.testing.assert_allclose(ras[:3], lps * [-1, -1, 1], atol=1e-4)
        canonical_index = np.rint(np.linalg.solve(scan.affine, ras)[:3]).astype(int)
        assert scan.array[tuple(canonical_index)] == data[index]


@pytest.mark.parametrize("suffix", [".nrrd", ".mha"])
def test_itk_file_round_trip(tmp_path, suffix):
    data = _volume(2)
    image = itk_image(data)
    sitk.WriteImage(image, str(tmp_path / f"scan{suffix}"))
    scan = read_scan(tmp_path / f"scan{suffix}")
    assert scan.header is None and scan.name == "scan"
    _assert_itk_geometry(scan, image, data)

    write_labels(scan, (scan.array > 0).astype(np.uint8), tmp_path / "labels.nii.gz")
    written = nib.load(tmp_path / "labels.nii.gz")
    np.testing.assert_allclose(written.affine, scan.original_affine, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(written.dataobj), data > 0)


def test_dicom_series(tmp_path):
    data = _volume(3)
    image = itk_image(data)
    write_dicom_series(tmp_path / "series", image)
    scan = read_scan(tmp_path / "series")
    assert scan.name == "series"
    _assert_itk_geometry(scan, image, data)
    np.testing.assert_allclose(sorted(scan.spacing), sorted(image.GetSpacing()), atol=1e-4)
    assert find_scans([tmp_path]).scans == [tmp_path / "series"]


def test_find_scans_expands_folders(tmp_path):
    for name in ("b.nii.gz", "a.nrrd", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    found = find_scans([tmp_path, tmp_path / "a.nrrd"])
    assert found.scans == [tmp_path / "a.nrrd", tmp_path / "b.nii.gz"]
    # The file that is no scan is named, never left out without a word.
    assert [(s.count, "notes.txt" in s.line) for s in found.skipped] == [(1, True)]
    with pytest.raises(CtsegError, match="not found"):
        find_scans([tmp_path / "missing"])
    with pytest.raises(CtsegError, match="not a supported scan"):
        find_scans([tmp_path / "notes.txt"])


def test_missing_file(tmp_path):
    with pytest.raises(CtsegError, match="scan not found: .*nope.nii.gz"):
        read_scan(tmp_path / "nope.nii.gz")


@pytest.mark.parametrize("name", ["junk.nii.gz", "junk.nii", "junk.nrrd"])
def test_corrupt_file(tmp_path, name):
    (tmp_path / name).write_bytes(np.random.default_rng(0).bytes(2000))
    with pytest.raises(CtsegError, match=f"cannot read .*{name}") as info:
        read_scan(tmp_path / name)
    assert "\n" not in str(info.value)


def test_four_d(tmp_path):
    path = _write_nifti(tmp_path / "4d.nii.gz", np.zeros((4, 4, 4, 2), np.int16), np.eye(4))
    with pytest.raises(CtsegError, match=r"is 4-D \(shape \(4, 4, 4, 2\)\); ctseg expects one 3-D"):
        read_scan(path)
    squeezable = _write_nifti(tmp_path / "1.nii.gz", np.zeros((4, 4, 4, 1), np.int16), np.eye(4))
    assert read_scan(squeezable).array.shape == (4, 4, 4)


def test_nan_voxels(tmp_path):
    data = np.zeros(SHAPE, np.float32)
    data[1, 1, 1] = np.nan
    with pytest.raises(CtsegError, match="NaN"):
        read_scan(_write_nifti(tmp_path / "nan.nii.gz", data, np.eye(4)))


def test_scaling_is_applied(tmp_path):
    image = nib.Nifti1Image(np.full(SHAPE, 24, np.int16), np.eye(4))
    image.header.set_slope_inter(1.0, -1024.0)
    nib.save(image, tmp_path / "ct.nii.gz")
    scan = read_scan(tmp_path / "ct.nii.gz")
    assert scan.array.dtype == np.float32 and np.all(scan.array == -1000)
