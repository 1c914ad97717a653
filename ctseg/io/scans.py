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

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import nibabel as nib
import numpy as np
import SimpleITK as sitk
from nibabel import orientations as ornt_lib

from ctseg.atomic import atomic_path
from ctseg.errors import CtsegError
from ctseg.io.dicom import is_dicom_file, is_dicom_folder, read_dicom_series
from ctseg.io.readers import (
    check_extent,
    nifti_affine,
    nifti_header,
    read_itk_file,
    read_itk_image,
    read_nifti,
    scaled_voxels,
    usable_affine,
    voxel_sizes,
)

NIFTI_SUFFIXES = (".nii.gz", ".nii")
ITK_SUFFIXES = (".nrrd", ".nhdr", ".mha", ".mhd")
SCAN_SUFFIXES = NIFTI_SUFFIXES + ITK_SUFFIXES

_CANONICAL_ORNT = ornt_lib.axcodes2ornt(("R", "A", "S"))

# Two grids are one geometry when their affines agree to this (mm): headers written by
# different tools round the same geometry differently.
GEOMETRY_TOLERANCE_MM = 1e-3

# Fewest voxels along each axis of a scan, in every format: one or two slices are a
# picture or localizer views, not a volume (and the even spacing of a DICOM series takes
# three slices to tell).
MIN_SLICES = 3


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
        return voxel_size(self.affine)


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


# --- reading -----------------------------------------------------------------------------


def read_scan(path: str | Path, allow_non_ct: bool = False) -> Scan:
    """Read a NIfTI file, an NRRD/MHA file or a DICOM series folder into a canonical Scan.

    `allow_non_ct`: read a DICOM series of another modality than CT (refused otherwise).
    """
    path = Path(path)
    if not path.exists():
        raise CtsegError(f"scan not found: {path}")
    if not (path.is_dir() or path.is_file()):
        # A FIFO would block the reader for ever, a device (/dev/zero) never ends.
        raise CtsegError(f"{path} is not a regular file (a pipe, device or socket); give a scan")
    if path.is_dir():
        array, affine, header = read_dicom_series(path, allow_non_ct)
    elif _has_suffix(path, NIFTI_SUFFIXES):
        array, affine, header = read_nifti(path)
    elif _has_suffix(path, ITK_SUFFIXES):
        array, affine = read_itk_image(path, read_itk_file(path))
        header = None
    else:
        raise CtsegError(_unsupported(path))
    array = _squeeze_to_3d(array, path)
    _check_finite(array, path)
    _check_affine(affine, path, array.shape)
    return _canonical_scan(array, affine, header, path)


def nifti_geometry(path: str | Path) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
    """A NIfTI file's canonical shape and spacing, those of `read_scan`'s Scan, from its
    header alone (no voxels read), checked as a read checks it (`readers.nifti_header`:
    what the file can hold, memory, a CT's field of view); None where `path` is no
    3-D NIfTI file whose header passes: reading it says why, in its turn. A batch's
    canvases are sized from these, so one lying header cannot size them for the rest."""
    path = Path(path)
    if not (path.is_file() and _has_suffix(path, NIFTI_SUFFIXES)):
        return None
    try:
        image, _, affine = nifti_header(path)
    except CtsegError:
        return None
    shape = tuple(int(n) for n in image.shape)
    if len(shape) > 3 and all(n == 1 for n in shape[3:]):
        shape = shape[:3]
    return canonical_geometry(shape, affine) if len(shape) == 3 else None


def canonical_geometry(
    shape: Sequence[int], affine: np.ndarray | Sequence[Sequence[float]]
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The canonical (RAS) shape and spacing of a volume of `shape` voxels at `affine`
    (voxel → RAS mm): those of the Scan `read_scan` makes of it."""
    affine = np.asarray(affine, dtype=np.float64)
    ornt = ornt_lib.io_orientation(affine)
    canonical = [0, 0, 0]
    for axis, (to, _) in enumerate(ornt):
        canonical[int(to)] = int(shape[axis])
    return tuple(canonical), voxel_size(affine @ ornt_lib.inv_ornt_aff(ornt, tuple(shape)))


def voxel_size(affine: np.ndarray) -> tuple[float, float, float]:
    """Voxel size in mm along each voxel axis of `affine` (the lengths of its columns)."""
    return voxel_sizes(affine)


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
        array, affine = read_itk_image(where, image)
    elif isinstance(image, nib.spatialimages.SpatialImage):
        if isinstance(image, nib.Nifti1Image | nib.Nifti2Image):
            header = image.header.copy()
            affine = nifti_affine(header, where)
        else:
            affine = np.asarray(image.affine, dtype=float)
        array = scaled_voxels(image)
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
    _check_affine(affine, where, array.shape)
    return _canonical_scan(array, affine, header, where)


def _check_affine(affine: np.ndarray, path: Path, shape: Sequence[int]) -> None:
    """Any format's last check (NIfTI's header passed it before its voxels were read,
    `readers.nifti_header`): a usable affine, a CT's field of view."""
    if not usable_affine(affine):
        raise CtsegError(
            f"{path} has no usable geometry: its voxel-to-world matrix is not finite and invertible"
        )
    check_extent(path, shape, voxel_sizes(affine))


def _unsupported(path: Path) -> str:
    """Why a file is no scan ctseg reads, in words."""
    if is_dicom_file(path):
        return (
            f"{path} is one DICOM file; give the folder of its series ({path.parent}), "
            "which ctseg reads as one volume"
        )
    return f"{path} is not a supported scan; use {', '.join(SCAN_SUFFIXES)} or a DICOM folder"


def _squeeze_to_3d(array: np.ndarray, path: Path) -> np.ndarray:
    if array.size == 0:
        raise CtsegError(f"{path} holds no voxels (shape {array.shape})")
    if array.ndim > 3 and all(n == 1 for n in array.shape[3:]):
        array = array.reshape(array.shape[:3])
    if array.ndim == 4:
        raise CtsegError(f"{path} is 4-D (shape {array.shape}); ctseg expects one 3-D CT volume")
    volume = f"one 3-D CT volume, of at least {MIN_SLICES} slices along each axis"
    if array.ndim != 3:
        raise CtsegError(f"{path} has {array.ndim} dimensions; ctseg expects {volume}")
    if min(array.shape) < MIN_SLICES:
        raise CtsegError(
            f"{path} has {min(array.shape)} slice(s) along an axis (shape {array.shape}); "
            f"ctseg expects {volume}"
        )
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


class Skipped(NamedTuple):
    """Files or subfolders of one folder that `find_scans` left out, and why, in a line."""

    line: str
    count: int


@dataclass
class FoundScans:
    """What `find_scans` found: the scans, and what it skipped, each named."""

    scans: list[Path]
    skipped: list[Skipped]


def find_scans(inputs: list[Path]) -> FoundScans:
    """Expand files, folders of scan files and DICOM series folders into a list of scans.

    A folder is one DICOM series when its files are DICOM files; beside NIfTI/NRRD/MHA
    scans, its DICOM files are skipped with a word (a series needs a folder of its own).
    DICOM series in its subfolders are scans too. Every other file or subfolder found is
    named in `skipped`: nothing is left out without a word.
    """
    found: list[Path] = []
    skipped: list[Skipped] = []
    for item in inputs:
        item = Path(item)
        if not item.exists():
            raise CtsegError(f"input not found: {item}")
        if item.is_dir():
            found.extend(_scans_in_folder(item, skipped))
        else:  # a pipe or device too: `read_scan` refuses it as that scan's failure
            if not _has_suffix(item, SCAN_SUFFIXES):
                raise CtsegError(_unsupported(item))
            found.append(item)
    unique = list(dict.fromkeys(found))
    if not unique:
        raise CtsegError(
            f"no scans found in {', '.join(str(p) for p in inputs)}"
            + (f" ({'; '.join(s.line for s in skipped)})" if skipped else "")
        )
    return FoundScans(unique, skipped)


def _scans_in_folder(folder: Path, skipped: list[Skipped]) -> list[Path]:
    # Hidden files (.DS_Store, a copy's temporaries) are nobody's scans, and not named.
    entries = [p for p in sorted(folder.iterdir()) if not p.name.startswith(".")]
    folders = [p for p in entries if p.is_dir()]
    files = [p for p in entries if not p.is_dir()]
    scans = [p for p in files if _has_suffix(p, SCAN_SUFFIXES)]
    dicom = [p for p in files if p not in scans and is_dicom_file(p)]
    others = [p for p in files if p not in scans and p not in dicom]
    series = [p for p in folders if is_dicom_folder(p)]
    if dicom and scans:
        line = (
            f"{folder}: skipped {_names(dicom, 'DICOM file')} beside {len(scans)} "
            "NIfTI/NRRD/MHA scan(s): a DICOM series needs a folder of its own"
        )
        skipped.append(Skipped(line, len(dicom)))
    if others:
        line = f"{folder}: skipped {_names(others, 'file')}: not scans"
        skipped.append(Skipped(line, len(others)))
    if len(folders) > len(series):
        empty = [p for p in folders if p not in series]
        line = (
            f"{folder}: skipped {_names(empty, 'subfolder')}: no DICOM series there (a folder "
            "of NIfTI/NRRD/MHA scans is searched when given as an input itself)"
        )
        skipped.append(Skipped(line, len(empty)))
    return ([folder] if dicom and not scans else scans) + series


def _names(paths: list[Path], what: str, shown: int = 3) -> str:
    """'2 files (a.txt, b.json)', naming the first `shown`."""
    names = ", ".join(p.name for p in paths[:shown]) + (", …" if len(paths) > shown else "")
    return f"{len(paths)} {what}{'s' * (len(paths) > 1)} ({names})"
