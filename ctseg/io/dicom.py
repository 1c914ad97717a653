"""DICOM series: telling a series folder from others, listing its one series, reading it
as one evenly spaced CT volume (SimpleITK / GDCM)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import SimpleITK as sitk

from ctseg.errors import CtsegError
from ctseg.io.readers import check_size, image_information, itemsize, one_line, read_itk_image
from ctseg.reading import NotRegularFile, open_regular

# Slice positions of a DICOM series may differ from even spacing by rounding in the
# headers; more than this fraction of the spacing is a missing (or extra) slice.
_SLICE_SPACING_TOLERANCE = 0.1
# Direction cosines of one volume's slices agree to the headers' rounding; a slice
# tilted further belongs to another stack (a localizer's orthogonal views, say).
_ORIENTATION_TOLERANCE = 1e-3

# SOP classes that hold no image to segment: these UIDs and those below them (DICOM
# PS3.4, annex B).
_NOT_IMAGES = {
    "1.2.840.10008.5.1.4.1.1.66": "a segmentation or other derived object (SEG, registration)",
    "1.2.840.10008.5.1.4.1.1.481": "a radiotherapy object (RT dose, structure set, plan)",
    "1.2.840.10008.5.1.4.1.1.7": "a secondary capture (a picture, not a scan)",
    "1.2.840.10008.5.1.4.1.1.88": "a structured report",
    "1.2.840.10008.5.1.4.1.1.104": "an encapsulated document",
    "1.2.840.10008.5.1.4.1.1.11": "a presentation state",
}
_SOP_CLASS, _MODALITY, _IMAGE_TYPE = "0008|0016", "0008|0060", "0008|0008"
_POSITION, _ORIENTATION = "0020|0032", "0020|0037"
# Said where a non-CT series is refused: the option of `ctseg predict` that reads it anyway.
ALLOW_NON_CT = "--allow-non-ct"


def read_dicom_series(
    folder: Path, allow_non_ct: bool = False
) -> tuple[np.ndarray, np.ndarray, None]:
    """The folder's one series as voxels and a RAS affine; CtsegError (one line) for a
    series that is no CT volume: an object that is no image (SEG, RT dose, secondary
    capture), a localizer, slices of several orientations or uneven spacing, and, unless
    `allow_non_ct`, another modality than CT (MR, PET, X-ray)."""
    files = dicom_series_files(folder)
    try:
        first = image_information(files[0])
    except RuntimeError as exc:
        raise CtsegError(f"cannot read DICOM series {folder}: {one_line(exc)}") from None
    _check_kind(folder, first, allow_non_ct)
    try:
        columns, rows = first.GetSize()[:2]
        check_size(folder, (columns, rows, len(files)), itemsize(first))
        reader = sitk.ImageSeriesReader()
        reader.SetFileNames(files)
        reader.MetaDataDictionaryArrayUpdateOn()  # each slice's tags, read on the way
        image = reader.Execute()
    except RuntimeError as exc:
        raise CtsegError(f"cannot read DICOM series {folder}: {one_line(exc)}") from None
    _check_slices(folder, reader)
    return (*read_itk_image(folder, image), None)


def dicom_series_files(folder: Path) -> list[str]:
    """File names of the folder's one series, in slice order; CtsegError if not exactly one.

    Never a choice among several (a scout beside the CT, two reconstructions of one
    scan): the wrong one would be segmented without a word.
    """
    try:
        series = {
            series_id: sitk.ImageSeriesReader.GetGDCMSeriesFileNames(str(folder), series_id)
            for series_id in sitk.ImageSeriesReader.GetGDCMSeriesIDs(str(folder))
        }
    except RuntimeError as exc:  # GDCM throws on some objects (single-frame RT dose)
        raise CtsegError(
            f"cannot list the DICOM series in {folder}: GDCM failed on its files ({one_line(exc)})"
        ) from None
    if not series:
        raise CtsegError(f"no DICOM series found in {folder}")
    if len(series) > 1:
        listed = "; ".join(
            f"{series_id} ({_series_description(files[0])}{len(files)} files)"
            for series_id, files in sorted(series.items())
        )
        raise CtsegError(
            f"{folder} holds {len(series)} DICOM series: {listed}; move the one to segment "
            "into a folder of its own and give that folder"
        )
    return list(next(iter(series.values())))


def _series_description(file: str) -> str:
    """'"ABDOMEN 5mm", ' from the file's Series Description, or ''."""
    try:
        info = image_information(file)
    except RuntimeError:
        return ""
    key = "0008|103e"
    return f'"{info.GetMetaData(key).strip()}", ' if info.HasMetaDataKey(key) else ""


def _tag(info: sitk.ImageFileReader, key: str) -> str:
    return info.GetMetaData(key).strip().strip("\0").strip() if info.HasMetaDataKey(key) else ""


def _check_kind(folder: Path, first: sitk.ImageFileReader, allow_non_ct: bool) -> None:
    """CtsegError for a series that is no CT volume, from its first file's tags."""
    sop_class = _tag(first, _SOP_CLASS)
    for uid, what in _NOT_IMAGES.items():
        if sop_class == uid or sop_class.startswith(uid + "."):
            raise CtsegError(
                f"{folder} holds {what} (SOP class {sop_class}), not a CT scan to segment"
            )
    image_type = _tag(first, _IMAGE_TYPE).upper()
    if "LOCALIZER" in image_type or "SCOUT" in image_type:
        raise CtsegError(
            f"{folder} is a localizer (scout) series (Image Type {image_type}), not a CT "
            "volume; give the folder of the CT series itself"
        )
    modality = _tag(first, _MODALITY).upper()
    if modality and modality != "CT" and not allow_non_ct:
        raise CtsegError(
            f"{folder} is no CT series but modality {modality}: the model "
            f"segments CT; predict it anyway with {ALLOW_NON_CT}"
        )


def _check_slices(folder: Path, reader: sitk.ImageSeriesReader) -> None:
    """CtsegError unless the slices make one volume: every slice in the first one's
    orientation, evenly spaced along its normal.

    ITK stacks whatever it is given: orthogonal localizer views would be read as a
    volume with their distance as the slice spacing, and an unevenly spaced series at
    its mean spacing; every distance and volume measured on it would be wrong. The
    tags come from `reader`, which read them with the slices.
    """
    geometry = []
    for index in range(len(reader.GetFileNames())):
        tags = [(index, key) for key in (_POSITION, _ORIENTATION)]
        if not all(reader.HasMetaDataKey(*tag) for tag in tags):
            return  # no slice geometry to check (ITK then reads the files as they come)
        try:
            origin, cosines = (
                np.array([float(v) for v in reader.GetMetaData(*tag).split("\\")]) for tag in tags
            )
        except ValueError:
            return
        if origin.shape != (3,) or cosines.shape != (6,):
            return
        geometry.append((origin, cosines))
    if not geometry:
        return
    first = geometry[0][1]
    for index, (_, cosines) in enumerate(geometry):
        if np.abs(cosines - first).max() > _ORIENTATION_TOLERANCE:
            raise CtsegError(
                f"DICOM series {folder} is no single volume: slice {index + 1} of "
                f"{len(geometry)} lies in another orientation ({_cosines(cosines)}) than "
                f"slice 1 ({_cosines(first)}), as localizer views or several stacks do"
            )
    normal = np.cross(first[:3], first[3:])
    _check_spacing(folder, np.array([origin @ normal for origin, _ in geometry]))


def _cosines(cosines: np.ndarray) -> str:
    return "\\".join(f"{c:.3g}" for c in cosines)


def _check_spacing(folder: Path, positions: np.ndarray) -> None:
    """CtsegError naming the first gap (or doubled slice) of slices not evenly spaced."""
    if len(positions) < 3:
        return  # two slices are evenly spaced; too few slices are refused by `read_scan`
    order = np.sort(positions)
    steps = np.diff(order)
    spacing = float(np.median(steps))
    where = (
        np.flatnonzero(steps <= 0.0)
        if spacing <= 0.0
        else np.flatnonzero(np.abs(steps - spacing) > _SLICE_SPACING_TOLERANCE * spacing)
    )
    if where.size:
        i = int(where[0])
        raise CtsegError(
            f"DICOM series {folder} is not evenly spaced: slices {i + 1} and {i + 2} of "
            f"{len(order)} (at {order[i]:.2f} and {order[i + 1]:.2f} mm along the slice "
            f"normal) are {steps[i]:.2f} mm apart, the others {spacing:.2f} mm; a slice is "
            "missing or doubled, so the series' geometry would be wrong"
        )


def is_dicom_folder(folder: Path) -> bool:
    """True when the folder directly holds .dcm files or files with the DICOM preamble."""
    for path in sorted(folder.iterdir())[:50]:  # a few files decide; series are homogeneous
        if not path.name.startswith(".") and is_dicom_file(path):
            return True
    return False


def is_dicom_file(path: Path) -> bool:
    """A regular file named .dcm or starting with the DICOM preamble."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".dcm":
        return True
    try:
        with open_regular(path) as handle:  # swapped for a FIFO since: no wait
            head = handle.read(132)
    except (OSError, NotRegularFile):  # not taken for DICOM; reported if given as a scan
        return False
    return head[128:132] == b"DICM"
