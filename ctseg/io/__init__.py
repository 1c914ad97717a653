"""Files in and out: scans with their geometry (NIfTI, NRRD/MHA, DICOM series), predictions
as DICOM SEG, and pictures (training curves, prediction previews)."""
