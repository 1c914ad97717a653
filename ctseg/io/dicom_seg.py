"""A prediction as a DICOM Segmentation object (SEG) that references its source CT series.

PACS and clinical viewers (OHIF, 3D Slicer, most vendors' workstations) take DICOM
SEG. `write_dicom_seg` writes one with highdicom: a BINARY segmentation with two
segments, frame by frame on the source series' own slices, and each frame
referencing the CT instance it was derived from::

    1 "Liver"         Anatomical Structure / Liver                 = labels >= 1
    2 "Liver tumour"  Morphologically Abnormal Structure / Neoplasm = labels == 2

The liver segment is the whole organ, tumour included (the segments overlap, and the
SEG says so): a tumour lies inside the liver, a viewer's or PACS's liver volume is
then the organ's volume (what resection planning and tumour burden need), and it is
the liver that the LiTS metric scores (label >= 1). BINARY rather than LABELMAP for
the same reason (a label map cannot overlap) and because LABELMAP (DICOM 2024) is not
yet taken by most viewers.

highdicom and pydicom are the optional extra ``ctseg[dicom]``; this module imports
them only when used, and says how to install them when they are missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

import ctseg
from ctseg.atomic import atomic_path
from ctseg.errors import CtsegError
from ctseg.io import dicom, scans
from ctseg.io.readers import LPS_TO_RAS, one_line
from ctseg.labels import LIVER, TUMOUR

if TYPE_CHECKING:
    from pydicom import Dataset

# The option of `ctseg predict` that asks for a SEG, named in the errors of this module.
OPTION = "--output-type dicom-seg"
INSTALL_HINT = "pip install 'ctseg[dicom]'"

SERIES_NUMBER = 900
SERIES_DESCRIPTION = "ctseg liver segmentation"
CONTENT_DESCRIPTION = "ctseg liver/tumour segmentation"
MANUFACTURER = "ctseg"
ALGORITHM_NAME = "ctseg"

# Segment numbers are the label values of ctseg's label maps.
SEGMENT_LABELS = {LIVER: "Liver", TUMOUR: "Liver tumour"}
# Display colours (sRGB): 3D Slicer's liver colour, and yellow for tumour.
_COLOURS = {LIVER: (221, 130, 101), TUMOUR: (255, 255, 0)}

# How far (in voxels, along each axis) an instance may lie from its slice's place on the
# scan's voxel grid.
_POSITION_TOLERANCE = 0.5
# DICOM requires a Device Serial Number in a SEG; software has none, so a fixed one.
_DEVICE_SERIAL_NUMBER = "0"
_FORMAT_NAMES = {
    ".nii": "a NIfTI file",
    ".nii.gz": "a NIfTI file",
    ".nrrd": "an NRRD file",
    ".nhdr": "an NRRD file",
    ".mha": "a MetaImage file",
    ".mhd": "a MetaImage file",
}


def check_dicom_source(path: str | Path) -> None:
    """CtsegError (one line) unless `path` is a folder of DICOM files and highdicom is
    installed: what ``--output-type dicom-seg`` needs of each input, checked before any
    prediction, on each scan that `scans.find_scans` found (a folder of series folders
    is no series itself). Whether the folder holds exactly one usable series is left to
    the reading (`scans.read_scan`) and to `write_dicom_seg`.
    """
    path = Path(path)
    if not path.exists():
        raise CtsegError(f"input not found: {path}")
    if not path.is_dir():
        lower = path.name.lower()
        kind = next(
            (name for suffix, name in _FORMAT_NAMES.items() if lower.endswith(suffix)),
            "a file, not a folder of DICOM files",
        )
        raise CtsegError(f"{OPTION} needs DICOM series as inputs; {path} is {kind}")
    if not dicom.is_dicom_folder(path):
        raise CtsegError(f"{OPTION} needs DICOM series as inputs; {path} holds no DICOM files")
    _libraries()


def write_dicom_seg(
    scan: scans.Scan,
    labels: np.ndarray,
    out_path: str | Path,
    *,
    algorithm_version: str | None = None,
    series_number: int = SERIES_NUMBER,
    verdict: str | None = None,
) -> None:
    """Write `labels` as a DICOM SEG file at `out_path` that references `scan`'s series.

    `scan` is what `scans.read_scan` read from a DICOM series folder (its `source`);
    `labels` are the uint8 0/1/2 label map in the scan's canonical order, the array
    `scans.write_labels` takes. The series is found again the way the reader found
    it (`dicom.dicom_series_files`: the folder's one series, other files ignored,
    several series refused) and its headers read with pydicom (no pixel data). Each
    source instance gets the slice of the label map at its own Image Position
    (Patient), whatever the file names' order. New series and instance UIDs; the
    study, patient and frame of reference are the source's. `algorithm_version`
    defaults to ctseg's version. `verdict`, the prediction's quality verdict
    (`ctseg.inference.quality.scores`: ok, review, unlike the training data), is written into the
    Content Description (`content_description`: a DICOM LO, 64 characters at most), where
    a viewer shows it beside the segments. The file appears complete or not at all
    (`atomic_path`). CtsegError, in one line, for a source that is no DICOM series,
    no longer matches the scan, or lacks what a SEG needs (one study, a frame of
    reference, slice positions), and when highdicom is not installed.
    """
    labels = np.asarray(labels)
    if labels.shape != scan.array.shape:
        raise ValueError(f"labels of shape {labels.shape} for a scan of {scan.array.shape}")
    if labels.size and int(labels.max()) > TUMOUR:
        raise ValueError(f"labels hold {int(labels.max())}; ctseg's label maps hold 0, 1 and 2")
    folder = Path(scan.source)
    check_dicom_source(folder)
    hd, pydicom = _libraries()
    files = dicom.dicom_series_files(folder)
    datasets = [_read_header(pydicom, Path(file)) for file in files]
    _check_series(folder, datasets)
    slices = _slice_indices(scan, datasets, files)

    original = scans.to_original_order(scan, labels)  # [columns, rows, slices], a view
    frames = original[:, :, slices].transpose(2, 1, 0)  # [instance, row, column]
    masks = np.empty((*frames.shape, 2), dtype=np.uint8)  # highdicom's stacked segments
    np.greater_equal(frames, LIVER, out=masks[..., 0], casting="unsafe")
    np.equal(frames, TUMOUR, out=masks[..., 1], casting="unsafe")
    del frames
    _fill_slice_thickness(datasets, scan)

    version = algorithm_version or ctseg.__version__
    try:
        seg = hd.seg.Segmentation(
            source_images=datasets,
            pixel_array=masks,
            segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
            segment_descriptions=_segment_descriptions(hd, version),
            series_instance_uid=hd.UID(),
            series_number=series_number,
            sop_instance_uid=hd.UID(),
            instance_number=1,
            manufacturer=MANUFACTURER,
            manufacturer_model_name=ALGORITHM_NAME,
            software_versions=version,
            device_serial_number=_DEVICE_SERIAL_NUMBER,
            series_description=SERIES_DESCRIPTION,
            content_description=content_description(verdict),
            content_qualification=hd.ContentQualificationValues.RESEARCH,
            # Frames without a voxel are left out; with none anywhere highdicom would
            # keep them all anyway (a SEG needs a frame), and log that it did.
            omit_empty_frames=bool(masks.any()),
        )
    except ValueError as exc:  # highdicom's word for sources it cannot derive a SEG from
        raise CtsegError(f"cannot write a DICOM SEG for {folder}: {one_line(exc)}") from None
    with atomic_path(out_path) as tmp:
        seg.save_as(tmp, enforce_file_format=True)


def content_description(verdict: str | None) -> str:
    """The SEG's Content Description: what it is, and the quality verdict where one is
    given, e.g. `ctseg liver/tumour segmentation, QC: review` (at most 64 characters, a
    DICOM LO)."""
    if verdict is None:
        return CONTENT_DESCRIPTION
    return f"{CONTENT_DESCRIPTION}, QC: {verdict}"[:64]


# --- helpers -----------------------------------------------------------------------------


def _libraries() -> tuple[Any, Any]:
    """(highdicom, pydicom), or CtsegError saying how to install them."""
    try:
        import highdicom
        import pydicom
    except ImportError:
        raise CtsegError(
            f"{OPTION} needs highdicom, which is not installed: {INSTALL_HINT}"
        ) from None
    return highdicom, pydicom


def _read_header(pydicom: Any, file: Path) -> Dataset:
    try:
        return pydicom.dcmread(file, stop_before_pixels=True)
    except (OSError, pydicom.errors.InvalidDicomError) as exc:
        raise CtsegError(f"cannot read {file}: {one_line(exc)}") from None


def _check_series(folder: Path, datasets: list[Dataset]) -> None:
    """CtsegError for what would make highdicom refuse the series, said plainly."""
    studies = {ds.get("StudyInstanceUID") for ds in datasets}
    if len(studies) > 1:  # GDCM groups the files by series, not by study
        raise CtsegError(
            f"the slices of DICOM series {folder} belong to {len(studies)} different studies "
            "(Study Instance UID); a DICOM SEG references the series of one study"
        )
    frames_of_reference = {ds.get("FrameOfReferenceUID") for ds in datasets}
    if None in frames_of_reference or "" in frames_of_reference:
        raise CtsegError(
            f"DICOM series {folder} has no Frame of Reference UID; a DICOM SEG needs one "
            "to place the segmentation on the scan"
        )
    if len(frames_of_reference) > 1:
        raise CtsegError(
            f"the slices of DICOM series {folder} lie in {len(frames_of_reference)} frames "
            "of reference; a DICOM SEG needs one"
        )
    multiframe = next((ds for ds in datasets if int(ds.get("NumberOfFrames") or 1) > 1), None)
    if multiframe is not None:
        raise CtsegError(
            f"DICOM series {folder} is a multi-frame (enhanced) image; {OPTION} takes "
            "series of single-slice files"
        )


def _slice_indices(scan: scans.Scan, datasets: list[Dataset], files: list[str]) -> np.ndarray:
    """For each source instance, the index of its slice in the scan's original voxel order.

    Found from the instance's Image Position (Patient) and the scan's original
    geometry, never from the file order; CtsegError unless every slice of the
    scan is matched by exactly one instance at its place (a folder changed since
    it was read, or a header the reader did not use).
    """
    columns, rows, depth = scan.original_shape
    if len(datasets) != depth:
        raise CtsegError(
            f"DICOM series {scan.source} has {len(datasets)} files, the scan read from it "
            f"{depth} slices; has the folder changed since?"
        )
    to_voxel = np.linalg.inv(scan.original_affine)
    slices = np.empty(len(datasets), dtype=np.int64)
    for n, (ds, file) in enumerate(zip(datasets, files, strict=True)):
        position = ds.get("ImagePositionPatient")
        if position is None or len(position) != 3:
            raise CtsegError(
                f"{file} has no Image Position (Patient); a DICOM SEG needs each slice's position"
            )
        if (int(ds.get("Columns") or 0), int(ds.get("Rows") or 0)) != (columns, rows):
            raise CtsegError(
                f"{file} is {ds.get('Columns')} × {ds.get('Rows')} pixels, the scan read from "
                f"{scan.source} {columns} × {rows}; has the folder changed since?"
            )
        lps = np.array([float(v) for v in position])
        i, j, k = (to_voxel @ np.append(LPS_TO_RAS @ lps, 1.0))[:3]
        slices[n] = round(k)
        if max(abs(i), abs(j), abs(k - slices[n])) > _POSITION_TOLERANCE or not (
            0 <= slices[n] < depth
        ):
            raise CtsegError(
                f"{file} lies at {_mm(lps)} mm, on none of the {depth} slices of the scan "
                f"read from {scan.source}; has the folder changed since?"
            )
    if len(set(slices.tolist())) != depth:
        raise CtsegError(
            f"two files of DICOM series {scan.source} lie on the same slice of the scan read "
            "from it; has the folder changed since?"
        )
    return slices


def _mm(point: np.ndarray) -> str:
    return "(" + ", ".join(f"{v:.2f}" for v in point) + ")"


def _fill_slice_thickness(datasets: list[Dataset], scan: scans.Scan) -> None:
    """Give the (in-memory) headers the slice spacing as Slice Thickness where it is
    missing or empty (DICOM type 2): highdicom copies the first instance's into the
    SEG's pixel measures, and fails on a header without one."""
    spacing = float(np.linalg.norm(scan.original_affine[:3, 2]))
    for ds in datasets:
        if ds.get("SliceThickness") in (None, ""):
            ds.SliceThickness = f"{spacing:.6g}"


def _segment_descriptions(hd: Any, version: str) -> list[Any]:
    from pydicom.sr.codedict import codes

    algorithm = hd.AlgorithmIdentificationSequence(
        name=ALGORITHM_NAME,
        family=codes.cid7162.ArtificialIntelligence,
        version=version,
    )
    # The coded concepts of DICOM's context groups for segmentations (PS3.16): CID 7150
    # for the categories, CID 7151 for the types, all SNOMED CT. The standard's Anatomical
    # Structure is SCT 91723000; older writers (dcmqi, TotalSegmentator) use 123037004,
    # which SNOMED CT now calls "Body structure".
    concepts = {
        LIVER: (codes.cid7150.AnatomicalStructure, codes.cid7151.Liver),
        TUMOUR: (codes.cid7150.MorphologicallyAbnormalStructure, codes.cid7151.Neoplasm),
    }
    return [
        hd.seg.SegmentDescription(
            segment_number=number,
            segment_label=SEGMENT_LABELS[number],
            segmented_property_category=category,
            segmented_property_type=kind,
            algorithm_type=hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC,
            algorithm_identification=algorithm,
            display_color=hd.color.CIELabColor.from_rgb(*_COLOURS[number]),
        )
        for number, (category, kind) in concepts.items()
    ]
