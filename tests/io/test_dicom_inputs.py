"""DICOM and NIfTI files as other tools write them: each that is no CT volume is refused
in one line that names it and says why (`ctseg.io.dicom`, `ctseg.io.scans`)."""

import nibabel as nib
import numpy as np
import pytest
from dicom_series import RT_DOSE, write_dicom_slice, write_pydicom_series
from helpers import save

from ctseg.errors import CtsegError
from ctseg.io.scans import MIN_SLICES, find_scans, read_scan

SECONDARY_CAPTURE = "1.2.840.10008.5.1.4.1.1.7"
SEG = "1.2.840.10008.5.1.4.1.1.66.4"
MR_IMAGE = "1.2.840.10008.5.1.4.1.1.4"


def _refused(path, match: str, **options) -> str:
    with pytest.raises(CtsegError, match=match) as info:
        read_scan(path, **options)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


def test_a_folder_gdcm_throws_on_while_listing_is_one_line(tmp_path):
    # GDCM's series listing throws on a single-frame RT dose (a C++ exception from
    # SimpleITK): the folder's own error, not a traceback.
    write_dicom_slice(tmp_path / "dose" / "RD.dcm", sop_class=RT_DOSE, modality="RTDOSE")
    _refused(tmp_path / "dose", "cannot list the DICOM series in .*GDCM failed")


@pytest.mark.parametrize(
    "sop_class, modality, what",
    [
        (SECONDARY_CAPTURE, "OT", "secondary capture"),
        (SEG, "SEG", "segmentation"),
    ],
)
def test_objects_that_are_no_images_to_segment_are_refused(tmp_path, sop_class, modality, what):
    folder = write_pydicom_series(tmp_path / "object", sop_class=sop_class, modality=modality)
    for allow_non_ct in (False, True):  # no option makes them a CT scan
        _refused(folder, what, allow_non_ct=allow_non_ct)


def test_a_non_ct_series_is_refused_unless_allowed(tmp_path):
    folder = write_pydicom_series(tmp_path / "mr", sop_class=MR_IMAGE, modality="MR")
    _refused(folder, "no CT series but modality MR.*--allow-non-ct")
    assert read_scan(folder, allow_non_ct=True).array.shape == (8, 8, 4)


def test_localizers_are_refused_whether_tagged_or_only_orthogonal(tmp_path):
    # Two orthogonal views, 374 mm apart, in one series: no volume.
    write_dicom_slice(tmp_path / "views" / "a.dcm")
    axial_to_coronal = (1.0, 0.0, 0.0, 0.0, 0.0, -1.0)
    write_dicom_slice(
        tmp_path / "views" / "b.dcm", position=(0, 0, 374), orientation=axial_to_coronal
    )
    _refused(tmp_path / "views", "no single volume: slice 2 of 2 lies in another orientation")
    # Slices of one volume but a tilted one among them: likewise.
    folder = write_pydicom_series(tmp_path / "tilted", slices=4)
    write_dicom_slice(
        folder / "slice002.dcm", position=(0, 0, 4.0), orientation=(1, 0, 0, 0, 0.9, 0.43589)
    )
    _refused(folder, "no single volume")
    scout = write_pydicom_series(tmp_path / "scout", image_type="ORIGINAL\\PRIMARY\\LOCALIZER")
    _refused(scout, "is a localizer")


def test_one_or_two_slices_are_refused_alike_in_dicom_and_nifti(tmp_path):
    for slices in range(1, MIN_SLICES):
        folder = write_pydicom_series(tmp_path / f"dicom{slices}", slices=slices)
        _refused(folder, f"at least {MIN_SLICES} slices")
        nifti = save(tmp_path / f"nifti{slices}.nii.gz", np.zeros((8, 8, slices), np.int16))
        _refused(nifti, f"at least {MIN_SLICES} slices")
    flat = save(tmp_path / "flat.nii.gz", np.zeros((8, 8), np.int16))  # 2-D
    _refused(flat, f"at least {MIN_SLICES} slices")
    assert (
        read_scan(write_pydicom_series(tmp_path / "three", slices=MIN_SLICES)).array.shape[2] == 3
    )


def test_a_dcm_file_points_at_its_series_folder(tmp_path):
    folder = write_pydicom_series(tmp_path / "series")
    for call in (find_scans, lambda path: read_scan(path[0])):
        with pytest.raises(CtsegError, match="is one DICOM file; give the folder of its series"):
            call([folder / "slice000.dcm"])


def test_a_folder_of_niftis_with_one_dcm_predicts_the_niftis_and_names_the_rest(tmp_path):
    for name in ("a.nii.gz", "b.nii.gz"):
        save(tmp_path / name, np.zeros((8, 8, 4), np.int16))
    write_dicom_slice(tmp_path / "stray.dcm")
    (tmp_path / "notes.txt").write_text("read me")
    (tmp_path / "empty").mkdir()
    found = find_scans([tmp_path])
    assert found.scans == [tmp_path / "a.nii.gz", tmp_path / "b.nii.gz"]
    lines = " | ".join(s.line for s in found.skipped)
    assert "skipped 1 DICOM file (stray.dcm) beside 2 NIfTI/NRRD/MHA scan(s)" in lines
    assert "skipped 1 file (notes.txt): not scans" in lines
    assert "skipped 1 subfolder (empty): no DICOM series there" in lines
    assert sum(s.count for s in found.skipped) == 3
    # A folder of DICOM files alone is one series.
    series = write_pydicom_series(tmp_path / "series")
    assert find_scans([series]).scans == [series]


def test_a_cifti_file_is_called_cifti(tmp_path):
    from nibabel import cifti2

    mask = np.zeros((3, 3, 3), bool)
    mask[1, 1, :] = True
    brain = cifti2.BrainModelAxis.from_mask(mask, affine=np.eye(4), name="thalamus_left")
    scalars = cifti2.ScalarAxis(["value"])
    image = cifti2.Cifti2Image(np.zeros((1, 3), np.float32), header=(scalars, brain))
    nib.save(image, tmp_path / "surface.dscalar.nii")
    _refused(tmp_path / "surface.dscalar.nii", "is a CIFTI-2 file")
