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


CT_IMAGE = "1.2.840.10008.5.1.4.1.1.2"
RT_DOSE = "1.2.840.10008.5.1.4.1.1.481.2"


def write_dicom_slice(
    path: Path,
    series_uid: str = "1.2.826.0.1.3680043.2.1125.1.7",
    sop_class: str = CT_IMAGE,
    modality: str = "CT",
    position=(0.0, 0.0, 0.0),
    orientation=(1.0, 0.0, 0.0, 0.0, 1.0, 0.0),
    image_type: str = "ORIGINAL\\PRIMARY\\AXIAL",
    size: int = 8,
) -> Path:
    """One 8×8 slice written by pydicom as other tools write theirs: any SOP class and
    modality, any place and orientation. An RT dose gets its dose tags and one frame (a
    single-frame dose, on which GDCM's series listing throws)."""
    import numpy as np
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = sop_class
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID = sop_class, meta.MediaStorageSOPInstanceUID
    ds.Modality, ds.ImageType, ds.PatientID = modality, image_type.split("\\"), "test"
    ds.StudyInstanceUID, ds.SeriesInstanceUID = "1.2.826.0.1.3680043.2.1125.2.7", series_uid
    ds.Rows = ds.Columns = size
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 1
    ds.ImagePositionPatient, ds.ImageOrientationPatient = list(position), list(orientation)
    ds.PixelSpacing, ds.SliceThickness = [0.8, 0.8], 2.0
    ds.RescaleIntercept, ds.RescaleSlope = 0, 1
    if sop_class == RT_DOSE:
        ds.NumberOfFrames, ds.GridFrameOffsetVector = 1, [0.0]
        ds.FrameIncrementPointer = (0x3004, 0x000C)
        ds.DoseUnits, ds.DoseType, ds.DoseSummationType = "GY", "PHYSICAL", "PLAN"
        ds.DoseGridScaling = 1.0
    ds.PixelData = np.full((size, size), 40, np.int16).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=True)
    return path


def write_pydicom_series(folder: Path, slices: int = 4, spacing: float = 2.0, **options) -> Path:
    """`slices` axial slices of `write_dicom_slice` (its `options`), one series."""
    for z in range(slices):
        write_dicom_slice(folder / f"slice{z:03d}.dcm", position=(0.0, 0.0, z * spacing), **options)
    return folder
