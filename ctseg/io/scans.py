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

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import numpy as np
import SimpleITK as sitk
from nibabel import orientations as ornt_lib

from ctseg.atomic import atomic_path
from ctseg.errors import CtsegError
from ctseg.parallel.devices import host_memory, human_bytes

NIFTI_SUFFIXES = (".nii.gz", ".nii")
ITK_SUFFIXES = (".nrrd", ".nhdr", ".mha", ".mhd")
SCAN_SUFFIXES = NIFTI_SUFFIXES + ITK_SUFFIXES

# ITK physical space is LPS; flipping the first two axes gives RAS.
_LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0])
_CANONICAL_ORNT = ornt_lib.axcodes2ornt(("R", "A", "S"))

# The scan is read whole, and `ctseg predict` then holds several arrays of its size at
# once (its canonical copy, three float32 class probabilities, the label map): a scan
# whose voxels alone take more than this share of the available memory is refused from
# its header, before anything is decompressed, instead of being killed minutes later.
_MEMORY_SHARE = 8
MAX_SCAN_BYTES_ENV = "CTSEG_MAX_SCAN_BYTES"
# Slice positions of a DICOM series may differ from even spacing by rounding in the
# headers; more than this fraction of the spacing is a missing (or extra) slice.
_SLICE_SPACING_TOLERANCE = 0.1
# Two grids are one geometry when their affines agree to this (mm): headers written by
# different tools round the same geometry differently.
GEOMETRY_TOLERANCE_MM = 1e-3


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


def geometry_difference(
    shape: Sequence[int], affine: np.ndarray, other_shape: Sequence[int], other_affine: np.ndarray
) -> str:
    """How two voxel grids differ, in words ("" when they are one geometry): the shapes
    first, then the largest difference of their affines (voxel → mm)."""
    if tuple(shape) != tuple(other_shape):
        return f"shape {tuple(shape)} vs {tuple(other_shape)}"
    difference = float(np.abs(np.asarray(affine) - np.asarray(other_affine)).max())
    if not difference <= GEOMETRY_TOLERANCE_MM:  # NaN counts as different
        return f"their affines differ by up to {difference:.4g} mm"
    return ""


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
    if not (path.is_dir() or path.is_file()):
        # A FIFO would block the reader for ever, a device (/dev/zero) never ends.
        raise CtsegError(f"{path} is not a regular file (a pipe, device or socket); give a scan")
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
    _check_affine(affine, path)
    return _canonical_scan(array, affine, header, path)


def scan_from_image(
    image: nib.spatialimages.SpatialImage | sitk.Image | np.ndarray,
    affine: np.ndarray | None = None,
    name: str = "scan",
) -> Scan:
    """An image in memory as a canonical Scan, checked as `read_scan` checks files: a
    nibabel image, a SimpleITK image, or a 3-D array with its 4×4 voxel → RAS affine (mm).
    `name` names the scan in messages and outputs."""
    where = Path(name)
    header = None
    if isinstance(image, sitk.Image):
        array, affine = _read_itk_image(where, image)
    elif isinstance(image, nib.spatialimages.SpatialImage):
        if isinstance(image, nib.Nifti1Image | nib.Nifti2Image):
            header = image.header.copy()
            affine = _nifti_affine(header, where)
        else:
            affine = np.asarray(image.affine, dtype=float)
        array = _scaled_voxels(image)
    elif isinstance(image, np.ndarray):
        if affine is None or np.shape(affine) != (4, 4):
            raise CtsegError(f"{name}: an array needs its 4×4 voxel-to-RAS affine (mm)")
        if image.dtype.kind not in "biuf":
            raise CtsegError(f"{name} holds {image.dtype} voxels; ctseg expects real numbers")
        array, affine = image, np.asarray(affine, dtype=float)
    else:
        raise CtsegError(
            f"{name}: give a file path, a nibabel image, a SimpleITK image or an array with "
            f"its affine, not {type(image).__name__}"
        )
    array = _squeeze_to_3d(array, where)
    _check_finite(array, where)
    _check_affine(affine, where)
    return _canonical_scan(array, affine, header, where)


def _read_nifti(path: Path) -> tuple[np.ndarray, np.ndarray, nib.Nifti1Header]:
    try:
        image = nib.load(path)  # reads the header only
    except Exception as exc:  # nibabel raises many types for corrupt files
        raise CtsegError(f"cannot read {path}: {_one_line(exc)}") from None
    if not isinstance(image, (nib.Nifti1Image, nib.Nifti2Image)):
        raise CtsegError(f"cannot read {path}: not a NIfTI image")
    dtype = image.get_data_dtype()
    if dtype.kind not in "biuf":  # complex, RGB (a record of three bytes), ...
        raise CtsegError(
            f"{path} holds {_dtype_name(dtype)} voxels; ctseg expects one real number per voxel"
        )
    proxy = image.dataobj
    scaled = (getattr(proxy, "slope", 1.0), getattr(proxy, "inter", 0.0)) != (1.0, 0.0)
    _check_size(path, image.shape, 4 if scaled else dtype.itemsize)
    header = image.header.copy()
    affine = _nifti_affine(header, path)
    try:
        array = _scaled_voxels(image)
    except Exception as exc:
        raise CtsegError(f"cannot read {path}: {_one_line(exc)}") from None
    return array, affine, header


def _dtype_name(dtype: np.dtype) -> str:
    if dtype.kind == "c":
        return f"complex ({dtype.name})"
    if dtype.fields:
        return f"{len(dtype.fields)}-component ({', '.join(dtype.fields)})"
    return dtype.name


def _nifti_affine(header: nib.Nifti1Header, path: Path) -> np.ndarray:
    """The voxel -> RAS affine as nibabel picks it (sform, else qform, else the voxel
    sizes), skipping a transform that is not finite and invertible.

    `header` loses the transforms skipped, so that results written with it carry only
    the one used. CtsegError when none is usable.
    """
    sform, sform_code = header.get_sform(coded=True)
    try:
        qform, qform_code = header.get_qform(coded=True)
    except Exception:  # a NaN quaternion can make nibabel's conversion fail
        qform, qform_code = None, int(header["qform_code"])
    if sform_code and not _usable_affine(sform):
        header.set_sform(None, code=0)
    if qform_code and not _usable_affine(qform):
        header.set_qform(None, code=0)
    if sform_code and _usable_affine(sform):
        return sform
    if qform_code and _usable_affine(qform):
        return qform
    if not (sform_code or qform_code):
        base = header.get_base_affine()  # no transform stored: nibabel's voxel-size affine
        if _usable_affine(base):
            return base
    raise CtsegError(
        f"{path} has no usable geometry: its sform (code {sform_code}) and qform "
        f"(code {qform_code}) are not finite, invertible affines; fix the header"
    )


def _usable_affine(affine: np.ndarray | None) -> bool:
    if affine is None or not np.isfinite(affine).all():
        return False
    return np.linalg.matrix_rank(affine[:3, :3]) == 3


def _check_affine(affine: np.ndarray, path: Path) -> None:
    """Any format's last check; NIfTI's affine was already chosen usable (`_nifti_affine`)."""
    if not _usable_affine(affine):
        raise CtsegError(
            f"{path} has no usable geometry: its voxel-to-world matrix is not finite and invertible"
        )


def _check_size(path: Path, shape: tuple[int, ...], itemsize: int) -> None:
    """CtsegError when a scan of `shape` would take too much memory once read.

    The limit is 1/8 of the memory available now, or $CTSEG_MAX_SCAN_BYTES.
    """
    need = math.prod(int(n) for n in shape) * itemsize
    limit, source = _max_scan_bytes()
    if need > limit:
        raise CtsegError(
            f"{path} is {' × '.join(str(int(n)) for n in shape)} voxels, {human_bytes(need)} in "
            f"memory, more than the {human_bytes(limit)} {source}; if the header is right, set "
            f"{MAX_SCAN_BYTES_ENV}={need} to read it anyway"
        )


def _max_scan_bytes() -> tuple[int, str]:
    text = os.environ.get(MAX_SCAN_BYTES_ENV, "").strip()
    if not text:
        return (
            host_memory() // _MEMORY_SHARE,
            f"allowed (1/{_MEMORY_SHARE} of the memory available)",
        )
    try:
        limit = int(text)
    except ValueError:
        limit = -1
    if limit < 1:
        raise CtsegError(f"{MAX_SCAN_BYTES_ENV} must be a number of bytes, got {text!r}")
    return limit, f"that {MAX_SCAN_BYTES_ENV} allows"


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
        info = _image_information(str(path))
        _check_size(path, info.GetSize(), _itemsize(info))
        return sitk.ReadImage(str(path))
    except RuntimeError as exc:
        raise CtsegError(f"cannot read {path}: {_one_line(exc)}") from None


def _image_information(file: str) -> sitk.ImageFileReader:
    """A reader that has read `file`'s header only (RuntimeError if it cannot)."""
    reader = sitk.ImageFileReader()
    reader.SetFileName(file)
    reader.ReadImageInformation()
    return reader


def _itemsize(info: sitk.ImageFileReader) -> int:
    """Bytes per voxel of the image `info` describes, once read."""
    component = sitk.Image([1] * info.GetDimension(), info.GetPixelID())
    return component.GetSizeOfPixelComponent() * component.GetNumberOfComponentsPerPixel()


def _read_dicom_series(folder: Path) -> tuple[np.ndarray, np.ndarray, None]:
    files = dicom_series_files(folder)
    try:
        first = _image_information(files[0])
        columns, rows = first.GetSize()[:2]
        _check_size(folder, (columns, rows, len(files)), _itemsize(first))
        reader = sitk.ImageSeriesReader()
        reader.SetFileNames(files)
        reader.MetaDataDictionaryArrayUpdateOn()  # each slice's tags, read on the way
        image = reader.Execute()
    except RuntimeError as exc:
        raise CtsegError(f"cannot read DICOM series {folder}: {_one_line(exc)}") from None
    _check_slice_spacing(folder, reader)
    return (*_read_itk_image(folder, image), None)


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
        info = _image_information(file)
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


def _squeeze_to_3d(array: np.ndarray, path: Path) -> np.ndarray:
    if array.size == 0:
        raise CtsegError(f"{path} holds no voxels (shape {array.shape})")
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
    image = nifti_image(scan, to_original_order(scan, array), dtype)
    with atomic_path(path) as tmp:
        nib.save(image, tmp)


def nifti_image(scan: Scan, data: np.ndarray, dtype: np.dtype) -> nib.Nifti1Image:
    """`data`, in the scan's own voxel order, as a NIfTI image of exactly its geometry."""
    return nib.Nifti1Image(np.asarray(data, dtype=dtype), None, header=_output_header(scan, dtype))


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
        if item.is_dir():
            found.extend(_scans_in_folder(item))
        else:  # a pipe or device too: `read_scan` refuses it as that scan's failure
            if not _has_suffix(item, SCAN_SUFFIXES):
                raise CtsegError(f"{item} is not a supported scan ({', '.join(SCAN_SUFFIXES)})")
            found.append(item)
    unique = list(dict.fromkeys(found))
    if not unique:
        raise CtsegError(f"no scans found in {', '.join(str(p) for p in inputs)}")
    return unique


def _scans_in_folder(folder: Path) -> list[Path]:
    if is_dicom_folder(folder):
        return [folder]
    entries = sorted(folder.iterdir())
    files = [p for p in entries if not p.is_dir() and _has_suffix(p, SCAN_SUFFIXES)]
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
    try:
        with path.open("rb") as handle:
            head = handle.read(132)
    except OSError:  # unreadable: not taken for DICOM, and reported if given as a scan
        return False
    return head[128:132] == b"DICM"
