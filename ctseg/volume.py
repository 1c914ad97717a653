"""Reading and writing scans with their geometry (NIfTI, NRRD/MHA, DICOM series).

A `Scan` holds the voxels in canonical RAS order (as `nibabel.as_closest_canonical`
gives them) together with the geometry of the file they came from. Whatever
ctseg computes on the canonical array is written back with `write_labels` /
`write_volume` in the file's own voxel order and affine, so it overlays on the
original scan in any viewer.

Affines follow nibabel's RAS convention: voxel index (i, j, k, 1) ↦ RAS
millimetres. ITK's LPS geometry (NRRD, MHA, DICOM) is converted on reading.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import numpy as np
import SimpleITK as sitk
from nibabel import orientations as ornt_lib

from ctseg.atomic import atomic_path
from ctseg.errors import CtsegError

NIFTI_SUFFIXES = (".nii.gz", ".nii")
ITK_SUFFIXES = (".nrrd", ".nhdr", ".mha", ".mhd")
SCAN_SUFFIXES = NIFTI_SUFFIXES + ITK_SUFFIXES

# ITK physical space is LPS; flipping the first two axes gives RAS.
_LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0])
_CANONICAL_ORNT = ornt_lib.axcodes2ornt(("R", "A", "S"))


@dataclass
class Scan:
    """One CT volume: canonical voxels plus everything needed to write results back."""

    array: np.ndarray  # 3-D, canonical RAS voxel order
    affine: np.ndarray  # 4x4 voxel -> RAS mm of `array`
    original_shape: tuple[int, int, int]
    original_affine: np.ndarray  # 4x4 voxel -> RAS mm, as stored in the file
    header: nib.Nifti1Header | None  # reused when writing results for NIfTI input
    source: Path
    name: str

    @property
    def spacing(self) -> tuple[float, float, float]:
        """Voxel size in mm along the canonical x, y and z axes."""
        return tuple(float(s) for s in np.sqrt((self.affine[:3, :3] ** 2).sum(axis=0)))


def scan_name(path: Path) -> str:
    """The file name without its scan suffix (or a DICOM folder's name)."""
    lower = path.name.lower()
    for suffix in SCAN_SUFFIXES:
        if lower.endswith(suffix):
            return path.name[: -len(suffix)]
    return path.name


def _has_suffix(path: Path, suffixes: tuple[str, ...]) -> bool:
    return path.name.lower().endswith(suffixes)


def _one_line(exc: BaseException) -> str:
    """The most telling line of a library's (possibly multi-line) error message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


# --- reading -----------------------------------------------------------------------------


def read_scan(path: str | Path) -> Scan:
    """Read a NIfTI file, an NRRD/MHA file or a DICOM series folder into a canonical Scan."""
    path = Path(path)
    if not path.exists():
        raise CtsegError(f"scan not found: {path}")
    if path.is_dir():
        array, affine, header = _read_dicom_series(path)
    elif _has_suffix(path, NIFTI_SUFFIXES):
        array, affine, header = _read_nifti(path)
    elif _has_suffix(path, ITK_SUFFIXES):
        array, affine = _read_itk_image(path, _read_itk_file(path))
        header = None
    else:
        raise CtsegError(
            f"{path} is not a supported scan; use {', '.join(SCAN_SUFFIXES)} or a DICOM folder"
        )
    array = _squeeze_to_3d(array, path)
    _check_finite(array, path)
    return _canonical_scan(array, affine, header, path)


def _read_nifti(path: Path) -> tuple[np.ndarray, np.ndarray, nib.Nifti1Header]:
    try:
        image = nib.load(path)
        array = _scaled_voxels(image)
    except Exception as exc:  # nibabel raises many types for corrupt files
        raise CtsegError(f"cannot read {path}: {_one_line(exc)}") from None
    if not isinstance(image, (nib.Nifti1Image, nib.Nifti2Image)):
        raise CtsegError(f"cannot read {path}: not a NIfTI image")
    return array, image.affine.copy(), image.header.copy()


def _scaled_voxels(image: nib.spatialimages.SpatialImage) -> np.ndarray:
    """Voxels with scl_slope/scl_inter applied, in float32 rather than nibabel's float64.

    Unscaled data (labels, most NRRD-converted files) keep their stored dtype.
    """
    proxy = image.dataobj
    slope, inter = getattr(proxy, "slope", 1.0), getattr(proxy, "inter", 0.0)
    if slope == 1.0 and inter == 0.0:
        return np.asanyarray(proxy)
    # Scale in place in float32 (exact for CT's integer HU): nibabel's get_fdata scales
    # through float64 temporaries, 3 GiB at peak for a 512×512×1000 int16 scan.
    voxels = np.empty(proxy.shape, dtype=np.float32)
    voxels[...] = proxy.get_unscaled()
    voxels *= np.float32(slope)
    voxels += np.float32(inter)
    return voxels


def _read_itk_image(path: Path, image: sitk.Image) -> tuple[np.ndarray, np.ndarray]:
    """Voxels in (x, y, z) order and the RAS affine of an ITK image (`path` names errors).

    Shared by NRRD/MHA files and DICOM series, which arrive as an already-read image.
    """
    if image.GetNumberOfComponentsPerPixel() != 1:
        raise CtsegError(f"{path} has vector voxels; ctseg expects one 3-D CT volume")
    size = image.GetSize()
    if image.GetDimension() == 4 and size[3] == 1:
        image = sitk.Extract(image, (*size[:3], 0), (0, 0, 0, 0))
    if image.GetDimension() != 3:
        raise CtsegError(
            f"{path} is {image.GetDimension()}-D (shape {size}); ctseg expects one 3-D CT volume"
        )
    # ITK arrays come out as [z, y, x].
    array = sitk.GetArrayFromImage(image).transpose(2, 1, 0)
    direction = np.array(image.GetDirection()).reshape(3, 3)
    affine = np.eye(4)
    affine[:3, :3] = _LPS_TO_RAS @ direction @ np.diag(image.GetSpacing())
    affine[:3, 3] = _LPS_TO_RAS @ np.array(image.GetOrigin())
    return array, affine


def _read_itk_file(path: Path) -> sitk.Image:
    try:
        return sitk.ReadImage(str(path))
    except RuntimeError as exc:
        raise CtsegError(f"cannot read {path}: {_one_line(exc)}") from None


def _read_dicom_series(folder: Path) -> tuple[np.ndarray, np.ndarray, None]:
    files = _largest_dicom_series(folder)
    if not files:
        raise CtsegError(f"no DICOM series found in {folder}")
    reader = sitk.ImageSeriesReader()
    reader.SetFileNames(files)
    try:
        image = reader.Execute()
    except RuntimeError as exc:
        raise CtsegError(f"cannot read DICOM series {folder}: {_one_line(exc)}") from None
    return (*_read_itk_image(folder, image), None)


def _largest_dicom_series(folder: Path) -> list[str]:
    """File names of the series with the most files (a folder may hold scouts, too)."""
    series = [
        sitk.ImageSeriesReader.GetGDCMSeriesFileNames(str(folder), series_id)
        for series_id in sitk.ImageSeriesReader.GetGDCMSeriesIDs(str(folder))
    ]
    return list(max(series, key=len)) if series else []


def _squeeze_to_3d(array: np.ndarray, path: Path) -> np.ndarray:
    if array.ndim > 3 and all(n == 1 for n in array.shape[3:]):
        array = array.reshape(array.shape[:3])
    if array.ndim == 4:
        raise CtsegError(f"{path} is 4-D (shape {array.shape}); ctseg expects one 3-D CT volume")
    if array.ndim != 3:
        raise CtsegError(f"{path} has {array.ndim} dimensions; ctseg expects one 3-D CT volume")
    return array


def _check_finite(array: np.ndarray, path: Path) -> None:
    if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
        raise CtsegError(f"{path} contains NaN or infinite voxels")


def _canonical_scan(
    array: np.ndarray, affine: np.ndarray, header: nib.Nifti1Header | None, path: Path
) -> Scan:
    ornt = ornt_lib.io_orientation(affine)
    return Scan(
        array=ornt_lib.apply_orientation(array, ornt),
        affine=affine @ ornt_lib.inv_ornt_aff(ornt, array.shape),
        original_shape=tuple(int(n) for n in array.shape),
        original_affine=affine,
        header=header,
        source=path,
        name=scan_name(path),
    )


# --- writing -----------------------------------------------------------------------------


def to_original_order(scan: Scan, array: np.ndarray) -> np.ndarray:
    """Undo the canonical reorientation: canonical voxel order -> the file's voxel order.

    `array` has the canonical shape, optionally followed by channel axes.
    """
    if array.shape[:3] != scan.array.shape:
        raise ValueError(f"array shape {array.shape} does not match the scan {scan.array.shape}")
    ornt = ornt_lib.io_orientation(scan.original_affine)
    return ornt_lib.apply_orientation(array, ornt_lib.ornt_transform(_CANONICAL_ORNT, ornt))


def write_labels(scan: Scan, labels: np.ndarray, path: str | Path) -> None:
    """Write a canonical label map as a uint8 NIfTI in the scan's own geometry."""
    write_volume(scan, labels, path, np.uint8)


def write_volume(scan: Scan, array: np.ndarray, path: str | Path, dtype: np.dtype) -> None:
    """Write a canonical array (3-D, or 4-D with channels last) as NIfTI in the scan's geometry."""
    data = np.asarray(to_original_order(scan, array), dtype=dtype)
    image = nib.Nifti1Image(data, None, header=_output_header(scan, dtype))
    with atomic_path(path) as tmp:
        nib.save(image, tmp)


def _output_header(scan: Scan, dtype: np.dtype) -> nib.Nifti1Header:
    """The input's header (or a fresh one) carrying exactly the scan's original affine."""
    header = scan.header.copy() if isinstance(scan.header, nib.Nifti1Header) else nib.Nifti1Header()
    sform_code = int(header["sform_code"])
    qform_code = int(header["qform_code"])
    if scan.header is None or (sform_code == 0 and qform_code == 0):
        # No usable transform in the input header: store the affine in both, as scanner space.
        header.set_sform(scan.original_affine, code=1)
        header.set_qform(scan.original_affine, code=1)
    # Otherwise the copied sform/qform fields already encode the original affine exactly;
    # rewriting them would round the qform-derived affine through float32.
    header.set_data_dtype(dtype)
    header.set_slope_inter(None, None)  # values are stored as they are
    header["cal_min"] = 0
    header["cal_max"] = 0
    return header


# --- finding scans -----------------------------------------------------------------------


def find_scans(inputs: list[Path]) -> list[Path]:
    """Expand files, folders of scan files and DICOM series folders into a list of scans."""
    found: list[Path] = []
    for item in inputs:
        item = Path(item)
        if not item.exists():
            raise CtsegError(f"input not found: {item}")
        if item.is_file():
            if not _has_suffix(item, SCAN_SUFFIXES):
                raise CtsegError(f"{item} is not a supported scan ({', '.join(SCAN_SUFFIXES)})")
            found.append(item)
        else:
            found.extend(_scans_in_folder(item))
    unique = list(dict.fromkeys(found))
    if not unique:
        raise CtsegError(f"no scans found in {', '.join(str(p) for p in inputs)}")
    return unique


def _scans_in_folder(folder: Path) -> list[Path]:
    if is_dicom_folder(folder):
        return [folder]
    entries = sorted(folder.iterdir())
    files = [p for p in entries if p.is_file() and _has_suffix(p, SCAN_SUFFIXES)]
    series = [p for p in entries if p.is_dir() and is_dicom_folder(p)]
    return [p for p in files if not p.name.startswith(".")] + series


def is_dicom_folder(folder: Path) -> bool:
    """True when the folder directly holds .dcm files or files with the DICOM preamble."""
    for path in sorted(folder.iterdir())[:50]:  # a few files decide; series are homogeneous
        if not path.is_file() or path.name.startswith("."):
            continue
        if path.suffix.lower() == ".dcm" or _has_dicom_preamble(path):
            return True
    return False


def _has_dicom_preamble(path: Path) -> bool:
    with path.open("rb") as handle:
        head = handle.read(132)
    return head[128:132] == b"DICM"
