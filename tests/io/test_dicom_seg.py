"""A prediction written as DICOM SEG (ctseg.io.dicom_seg), read back with highdicom.

The masks read back are compared with the NIfTI that `scans.write_labels` writes
for the same scan, placed on the source files by ITK's own geometry: never with
the module's mapping code.
"""

import os
import sys
from pathlib import Path

import highdicom as hd
import nibabel as nib
import numpy as np
import pydicom
import pytest
import SimpleITK as sitk
from dicom_series import write_dicom_series
from pydicom.sr.codedict import codes
from pydicom.uid import generate_uid

import ctseg
from ctseg.atomic import TEMP_PREFIX
from ctseg.errors import CtsegError
from ctseg.io import dicom_seg, scans

SHAPE = (24, 20, 12)  # ITK's x, y, z: columns, rows, slices
SPACING = (0.7, 0.9, 2.5)


def _direction() -> np.ndarray:
    """An oblique LPS direction whose axes are permuted and flipped against RAS."""
    angle = np.deg2rad(20.0)
    turn = np.array(
        [[np.cos(angle), -np.sin(angle), 0.0], [np.sin(angle), np.cos(angle), 0.0], [0, 0, 1]]
    )
    permuted = np.array([[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    return turn @ permuted


def _ct_series(folder: Path, *, shuffle: bool = False, uids: bool = True) -> None:
    """A CT series written with `write_dicom_series`, as a scanner would: one study and
    one frame of reference for every slice (`uids`; the helper gives each slice a study
    of its own and no frame of reference). `shuffle` renames the files so that the order
    of their names is not the order of the slices."""
    data = np.random.default_rng(0).integers(-1000, 1500, SHAPE[::-1]).astype(np.int16)
    image = sitk.GetImageFromArray(data)
    image.SetSpacing(SPACING)
    image.SetOrigin((-30.0, 12.0, 400.0))
    image.SetDirection(_direction().ravel().tolist())
    write_dicom_series(folder, image)
    files = sorted(folder.iterdir())
    if uids:
        study, frame_of_reference = generate_uid(), generate_uid()
        for file in files:
            ds = pydicom.dcmread(file)
            ds.StudyInstanceUID = study
            ds.FrameOfReferenceUID = frame_of_reference
            ds.PatientID = "CTSEG-TEST"
            ds.save_as(file)
    if shuffle:
        order = np.random.default_rng(1).permutation(len(files))
        for file, n in zip(files, order, strict=True):
            file.rename(folder / f"tmp{n:03d}")
        for n in range(len(files)):
            (folder / f"tmp{n:03d}").rename(folder / f"IM{(n * 7) % len(files):04d}.dcm")


def _labels(scan: scans.Scan, tumour: bool = True) -> np.ndarray:
    """Labels in canonical order, different in every voxel's neighbourhood, so that any
    flip, transposition or slice shift of the mapping shows."""
    rng = np.random.default_rng(2)
    return rng.choice(3 if tumour else 2, size=scan.array.shape).astype(np.uint8)


def _expected_frames(scan: scans.Scan, labels: np.ndarray, tmp_path: Path) -> dict[str, np.ndarray]:
    """SOP Instance UID → [rows, columns] labels of that source file, from the NIfTI
    written by `scans.write_labels` and the file's position in ITK's reading of it."""
    nifti = tmp_path / "labels.nii.gz"
    scans.write_labels(scan, labels, nifti)
    image = sitk.ReadImage(str(nifti))
    array = sitk.GetArrayFromImage(image)  # [slice, row, column]
    frames = {}
    for file in scan.source.glob("*.dcm"):
        ds = pydicom.dcmread(file, stop_before_pixels=True)
        index = image.TransformPhysicalPointToIndex([float(v) for v in ds.ImagePositionPatient])
        assert index[:2] == (0, 0)
        frames[ds.SOPInstanceUID] = array[index[2]]
    assert len(frames) == SHAPE[2]
    return frames


def _masks(seg: hd.seg.Segmentation, uids: list[str]) -> np.ndarray:
    return seg.get_pixels_by_source_instance(
        uids, segment_numbers=[1, 2], assert_missing_frames_are_empty=True
    )


@pytest.mark.parametrize("shuffle", [False, True], ids=["sorted-names", "shuffled-names"])
def test_seg_matches_the_nifti_labels_frame_by_frame(tmp_path, shuffle):
    folder = tmp_path / "series"
    _ct_series(folder, shuffle=shuffle)
    (folder / "notes.txt").write_text("not DICOM: ignored, as the reader ignores it\n")
    scan = scans.read_scan(folder)
    labels = _labels(scan)
    out = tmp_path / "out" / "case_seg.dcm"
    dicom_seg.write_dicom_seg(scan, labels, out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["case_seg.dcm"]  # no temporaries

    seg = hd.seg.segread(out)
    assert seg.SOPClassUID == "1.2.840.10008.5.1.4.1.1.66.4"  # Segmentation Storage
    assert seg.SegmentationType == "BINARY" and seg.SegmentsOverlap == "YES"
    assert (seg.Modality, seg.Manufacturer) == ("SEG", "ctseg")
    assert (seg.SeriesNumber, seg.SeriesDescription) == (900, "ctseg liver segmentation")

    sources = [pydicom.dcmread(f, stop_before_pixels=True) for f in folder.glob("*.dcm")]
    assert seg.StudyInstanceUID == sources[0].StudyInstanceUID
    assert seg.FrameOfReferenceUID == sources[0].FrameOfReferenceUID
    assert seg.PatientID == "CTSEG-TEST"
    assert seg.SeriesInstanceUID != sources[0].SeriesInstanceUID
    (referenced,) = seg.ReferencedSeriesSequence
    assert referenced.SeriesInstanceUID == sources[0].SeriesInstanceUID
    uids = [ds.SOPInstanceUID for ds in sources]
    referenced_uids = [
        item.ReferencedSOPInstanceUID for item in referenced.ReferencedInstanceSequence
    ]
    assert sorted(referenced_uids) == sorted(uids)
    assert seg.SOPInstanceUID not in uids
    # No Slice Thickness in these headers: the slice spacing stands in for it.
    measures = seg.SharedFunctionalGroupsSequence[0].PixelMeasuresSequence[0]
    assert float(measures.SliceThickness) == pytest.approx(SPACING[2])
    np.testing.assert_allclose([float(v) for v in measures.PixelSpacing], SPACING[1::-1])

    expected = _expected_frames(scan, labels, tmp_path)
    masks = _masks(seg, uids)  # [instance, row, column, segment]
    for uid, mask in zip(uids, masks, strict=True):
        np.testing.assert_array_equal(mask[..., 0], expected[uid] >= 1, err_msg=f"liver {uid}")
        np.testing.assert_array_equal(mask[..., 1], expected[uid] == 2, err_msg=f"tumour {uid}")
    assert masks[..., 1].any() and (masks[..., 0] & ~masks[..., 1]).any()


def test_segments_are_liver_and_tumour_with_their_coded_concepts(tmp_path):
    _ct_series(tmp_path / "series")
    scan = scans.read_scan(tmp_path / "series")
    dicom_seg.write_dicom_seg(scan, _labels(scan), tmp_path / "seg.dcm", algorithm_version="9.8.7")
    seg = hd.seg.segread(tmp_path / "seg.dcm")
    liver, tumour = seg.get_segment_description(1), seg.get_segment_description(2)
    assert (liver.segment_label, tumour.segment_label) == ("Liver", "Liver tumour")
    assert liver.segmented_property_category == codes.cid7150.AnatomicalStructure
    assert liver.segmented_property_type == codes.SCT.Liver
    assert tumour.segmented_property_category == codes.SCT.MorphologicallyAbnormalStructure
    assert tumour.segmented_property_type == codes.SCT.Neoplasm
    assert (liver.segmented_property_type.value, tumour.segmented_property_type.value) == (
        "10200004",
        "108369006",
    )
    # DICOM's CID 7150 codes: Anatomical Structure and Morphologically Abnormal Structure.
    assert liver.segmented_property_category.value == "91723000"
    assert tumour.segmented_property_category.value == "49755003"
    for description in (liver, tumour):
        assert description.algorithm_type == hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC
        algorithm = description.algorithm_identification
        assert (algorithm.name, algorithm.version) == ("ctseg", "9.8.7")
        assert algorithm.family == codes.DCM.ArtificialIntelligence
    # The version defaults to the package's.
    dicom_seg.write_dicom_seg(scan, _labels(scan), tmp_path / "seg2.dcm")
    seg = hd.seg.segread(tmp_path / "seg2.dcm")
    algorithm = seg.get_segment_description(1).algorithm_identification
    assert algorithm.version == ctseg.__version__ and seg.SoftwareVersions == ctseg.__version__


def test_an_empty_tumour_and_an_empty_liver_still_make_a_valid_seg(tmp_path):
    _ct_series(tmp_path / "series")
    scan = scans.read_scan(tmp_path / "series")
    uids = [pydicom.dcmread(f).SOPInstanceUID for f in (tmp_path / "series").iterdir()]
    labels = _labels(scan, tumour=False)
    labels[:, :, :3] = 0  # some slices hold no liver either: their frames are left out
    dicom_seg.write_dicom_seg(scan, labels, tmp_path / "no_tumour.dcm")
    seg = hd.seg.segread(tmp_path / "no_tumour.dcm")
    assert [s.SegmentNumber for s in seg.SegmentSequence] == [1, 2]
    masks = _masks(seg, uids)
    assert not masks[..., 1].any() and masks[..., 0].any()
    assert seg.NumberOfFrames < len(uids)  # no tumour frames, no empty liver frames
    np.testing.assert_array_equal(masks[..., 0].sum(), np.count_nonzero(labels))

    dicom_seg.write_dicom_seg(scan, np.zeros_like(labels), tmp_path / "empty.dcm")
    seg = hd.seg.segread(tmp_path / "empty.dcm")
    assert [s.SegmentNumber for s in seg.SegmentSequence] == [1, 2]
    assert not _masks(seg, uids).any()


def test_inputs_that_are_not_dicom_series_are_refused_in_one_line(tmp_path):
    nifti = tmp_path / "scan.nii.gz"
    nib.save(nib.Nifti1Image(np.zeros((4, 4, 4), np.int16), np.eye(4)), nifti)
    (tmp_path / "scan.nrrd").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    refused = "--output-type dicom-seg needs DICOM series as inputs; {} "
    cases = {
        nifti: refused + "is a NIfTI file",
        tmp_path / "scan.nrrd": refused + "is an NRRD file",
        tmp_path / "empty": refused + "holds no DICOM files",
        tmp_path / "missing": "input not found: {}",
    }
    for path, message in cases.items():
        with pytest.raises(CtsegError) as info:
            dicom_seg.check_dicom_source(path)
        assert str(info.value) == message.format(path)
    _ct_series(tmp_path / "series")
    dicom_seg.check_dicom_source(tmp_path / "series")

    # The writer refuses a scan that was not read from a DICOM series, before writing.
    scan = scans.read_scan(nifti)
    with pytest.raises(CtsegError, match="is a NIfTI file"):
        dicom_seg.write_dicom_seg(scan, np.zeros(scan.array.shape, np.uint8), tmp_path / "s.dcm")
    assert not (tmp_path / "s.dcm").exists()


def test_missing_highdicom_is_one_line(tmp_path, monkeypatch):
    _ct_series(tmp_path / "series")
    monkeypatch.setitem(sys.modules, "highdicom", None)  # import highdicom: ImportError
    with pytest.raises(CtsegError) as info:
        dicom_seg.check_dicom_source(tmp_path / "series")
    assert str(info.value) == (
        "--output-type dicom-seg needs highdicom, which is not installed: "
        "pip install 'ctseg[dicom]'"
    )


def test_series_that_a_seg_cannot_reference_are_refused_in_one_line(tmp_path):
    # As the test helper writes them: every slice a study of its own, no frame of reference.
    _ct_series(tmp_path / "raw", uids=False)
    scan = scans.read_scan(tmp_path / "raw")
    with pytest.raises(CtsegError) as info:
        dicom_seg.write_dicom_seg(scan, _labels(scan), tmp_path / "seg.dcm")
    assert "belong to 12 different studies" in str(info.value)
    assert "\n" not in str(info.value)

    for file in (tmp_path / "raw").iterdir():
        ds = pydicom.dcmread(file)
        ds.StudyInstanceUID = "1.2.3"
        ds.save_as(file)
    with pytest.raises(CtsegError, match="has no Frame of Reference UID; a DICOM SEG needs one"):
        dicom_seg.write_dicom_seg(scan, _labels(scan), tmp_path / "seg.dcm")
    assert not (tmp_path / "seg.dcm").exists()


def test_a_series_folder_changed_since_it_was_read_is_refused(tmp_path):
    folder = tmp_path / "series"
    _ct_series(folder)
    scan = scans.read_scan(folder)
    labels = _labels(scan)
    # Another series beside it: refused as the reader refuses it.
    _ct_series(tmp_path / "other")
    for file in (tmp_path / "other").iterdir():
        ds = pydicom.dcmread(file)
        ds.SeriesInstanceUID = "1.2.826.0.1.3680043.2.1125.1.98"
        ds.save_as(folder / f"other_{file.name}")
    with pytest.raises(CtsegError, match="holds 2 DICOM series"):
        dicom_seg.write_dicom_seg(scan, labels, tmp_path / "seg.dcm")
    for file in folder.glob("other_*"):
        file.unlink()
    # Slices moved.
    saved = {file: file.read_bytes() for file in folder.iterdir()}
    for file in folder.iterdir():
        ds = pydicom.dcmread(file)
        ds.ImagePositionPatient = [float(v) + 5.0 for v in ds.ImagePositionPatient]
        ds.save_as(file)
    with pytest.raises(CtsegError, match="mm, on none of the 12 slices of the scan read from"):
        dicom_seg.write_dicom_seg(scan, labels, tmp_path / "seg.dcm")
    for file, data in saved.items():
        file.write_bytes(data)
    # A slice gone.
    sorted(folder.iterdir())[5].unlink()
    with pytest.raises(CtsegError, match="has 11 files, the scan read from it 12 slices"):
        dicom_seg.write_dicom_seg(scan, labels, tmp_path / "seg.dcm")
    assert not (tmp_path / "seg.dcm").exists()


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    _ct_series(tmp_path / "series")
    scan = scans.read_scan(tmp_path / "series")
    out = tmp_path / "out" / "seg.dcm"

    def fail(self, *args, **kwargs):
        Path(args[0]).write_bytes(b"half a SEG")
        raise RuntimeError("killed while writing")

    monkeypatch.setattr(hd.seg.Segmentation, "save_as", fail)
    with pytest.raises(RuntimeError, match="killed while writing"):
        dicom_seg.write_dicom_seg(scan, _labels(scan), out)
    assert os.listdir(out.parent) == []
    assert not any(p.name.startswith(TEMP_PREFIX) for p in tmp_path.rglob("*"))
