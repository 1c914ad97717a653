"""DICOM series: telling a series folder from others, listing its one series, reading it
as one evenly spaced volume (SimpleITK / GDCM)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import SimpleITK as sitk

from ctseg.errors import CtsegError
from ctseg.io.readers import check_size, image_information, itemsize, one_line, read_itk_image

# Slice positions of a DICOM series may differ from even spacing by rounding in the
# headers; more than this fraction of the spacing is a missing (or extra) slice.
_SLICE_SPACING_TOLERANCE = 0.1


def read_dicom_series(folder: Path) -> tuple[np.ndarray, np.ndarray, None]:
    files = dicom_series_files(folder)
    try:
        first = image_information(files[0])
        columns, rows = first.GetSize()[:2]
        check_size(folder, (columns, rows, len(files)), itemsize(first))
        reader = sitk.ImageSeriesReader()
        reader.SetFileNames(files)
        reader.MetaDataDictionaryArrayUpdateOn()  # each slice's tags, read on the way
        image = reader.Execute()
    except RuntimeError as exc:
        raise CtsegError(f"cannot read DICOM series {folder}: {one_line(exc)}") from None
    _check_slice_spacing(folder, reader)
    return (*read_itk_image(folder, image), None)


def dicom_series_files(folder: Path) -> list[str]:
    """File names of the folder's one series, in slice order; CtsegError if not exactly one.

    Never a choice among several (a scout beside the CT, two reconstructions of one
    scan): the wrong one would be segmented without a word.
    """
    series = {
        series_id: sitk.ImageSeriesReader.GetGDCMSeriesFileNames(str(folder), series_id)
        for series_id in sitk.ImageSeriesReader.GetGDCMSeriesIDs(str(folder))
    }
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


def _check_slice_spacing(folder: Path, reader: sitk.ImageSeriesReader) -> None:
    """CtsegError naming the first gap (or doubled slice) of a series that is not evenly spaced.

    ITK reads such a series as if evenly spaced, at the mean spacing: every
    distance and volume measured on it would be wrong. The tags come from `reader`,
    which read them with the slices.
    """
    positions = []
    for index in range(len(reader.GetFileNames())):
        tags = [(index, key) for key in ("0020|0032", "0020|0037")]  # position, orientation
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
        positions.append(float(origin @ np.cross(cosines[:3], cosines[3:])))
    if len(positions) < 3:
        return
    order = np.sort(np.array(positions))
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
        if not path.is_file() or path.name.startswith("."):
            continue
        if path.suffix.lower() == ".dcm" or _has_dicom_preamble(path):
            return True
    return False


def _has_dicom_preamble(path: Path) -> bool:
    try:
        with path.open("rb") as handle:
            head = handle.read(132)
    except OSError:  # unreadable: not taken for DICOM, and reported if given as a scan
        return False
    return head[128:132] == b"DICM"
