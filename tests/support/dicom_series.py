"""Writing a small DICOM series for tests (ctseg itself only reads DICOM)."""

import locale
from pathlib import Path

import SimpleITK as sitk


def write_dicom_series(
    folder: Path, image: sitk.Image, series: int = 99, one_study: bool = False
) -> None:
    """`image` as one .dcm file per slice, a CT series with UID suffix `series`.

    GDCM gives each slice a study of its own and no frame of reference; `one_study`
    writes what a scanner writes: one study and one frame of reference for the series
    (what a DICOM SEG needs to reference it)."""
    folder.mkdir(parents=True)
    direction = image.GetDirection()
    writer = sitk.ImageFileWriter()
    writer.KeepOriginalImageUIDOn()
    # GDCM's writer sets the C locale to "C", after which every text file this test
    # process opens would be read as ASCII: put the locale back when done.
    saved = locale.setlocale(locale.LC_CTYPE)
    try:
        for z in range(image.GetDepth()):
            slice_ = image[:, :, z]
            slice_.SetMetaData("0020|000e", f"1.2.826.0.1.3680043.2.1125.1.{series}")  # series
            if one_study:
                slice_.SetMetaData("0020|000d", f"1.2.826.0.1.3680043.2.1125.2.{series}")
                slice_.SetMetaData("0020|0052", f"1.2.826.0.1.3680043.2.1125.3.{series}")
            slice_.SetMetaData("0008|0060", "CT")
            orientation = direction[0:7:3] + direction[1:8:3]
            slice_.SetMetaData("0020|0037", "\\".join(map(str, orientation)))
            point = image.TransformIndexToPhysicalPoint((0, 0, z))
            slice_.SetMetaData("0020|0032", "\\".join(map(str, point)))
            slice_.SetMetaData("0020|0013", str(z + 1))
            writer.SetFileName(str(folder / f"slice{z:03d}.dcm"))
            writer.Execute(slice_)
    finally:
        locale.setlocale(locale.LC_CTYPE, saved)
