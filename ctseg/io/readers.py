"""The file readers under `ctseg.io.scans.read_scan`: NIfTI through nibabel, NRRD/MHA
(and DICOM slices, `ctseg.io.dicom`) through SimpleITK, each returning voxels and a
voxel → RAS affine, with the checks a file's header allows before its voxels are read:
a regular file, a size that fits memory and that the file can hold, real-valued voxels,
a usable affine, a CT's field of view.

ITK's physical space is LPS; the affines returned here are RAS, nibabel's convention.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import nibabel as nib
import numpy as np
import SimpleITK as sitk

from ctseg.errors import CtsegError
from ctseg.memory import host_memory, human_bytes
from ctseg.reading import check_regular

# ITK physical space is LPS; flipping the first two axes gives RAS.
LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0])


# The scan is read whole, and `ctseg predict` then holds several arrays of its size at
# once (its canonical copy, three float32 class probabilities, the label map): a scan
# whose voxels alone take more than this share of the available memory is refused from
# its header, before anything is decompressed, instead of being killed minutes later.
_MEMORY_SHARE = 8


MAX_SCAN_BYTES_ENV = "CTSEG_MAX_SCAN_BYTES"

# What a CT can be: no scanner sees further than a whole body along one axis (a patient's
# height; whole-body scans are under 2 m long), nor further than its gantry's bore (under
# 0.9 m) along the others. A header past these lies (a voxel size in cm rather than mm,
# a field edited by hand), and would size everything after it: 100 mm voxels × 512 make
# a grid of 34,000 voxels a side at 1.5 mm. (Voxel sizes alone say less: a small
# synthetic volume has voxels of centimetres, `ctseg synth --size 16` of 31 mm.)
MAX_LENGTH_MM = 2000.0
MAX_WIDTH_MM = 1000.0

# Deflate (gzip's compression) emits at least one bit per 258-byte match plus its
# blocks' overhead: 1032 bytes out per byte in at most (zlib's technical notes); a header
# claiming more voxels than that lies, or the file was cut.
DEFLATE_RATIO = 1032
_GZIP_SLACK = 1024  # the gzip header, a NIfTI header and extensions


def one_line(exc: BaseException) -> str:
    """The most telling line of a library's (possibly multi-line) error message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def read_nifti(path: Path) -> tuple[np.ndarray, np.ndarray, nib.Nifti1Header]:
    image, header, affine = nifti_header(path)
    try:
        array = scaled_voxels(image)
    except Exception as exc:
        raise CtsegError(f"cannot read {path}: {one_line(exc)}") from None
    return array, affine, header


def nifti_header(path: Path) -> tuple[nib.spatialimages.SpatialImage, nib.Nifti1Header, np.ndarray]:
    """A NIfTI file's image (its voxels not read), header and voxel → RAS affine, once its
    header's claims are checked: a regular file, real voxels, a size that fits memory and
    that the file can hold, a usable affine, a CT's field of view. Every use of a
    NIfTI header goes through here: a full read (`read_nifti`) and the batch's canvases
    (`ctseg.io.scans.nifti_geometry`), so that a header no read would accept sizes nothing."""
    _check_file(path)
    try:
        image = nib.load(path)  # reads the header only
    except Exception as exc:  # nibabel raises many types for corrupt files
        raise CtsegError(f"cannot read {path}: {one_line(exc)}") from None
    if isinstance(image, nib.Cifti2Image):  # a NIfTI-2 file, but of surfaces, not voxels
        raise CtsegError(
            f"{path} is a CIFTI-2 file (brain surface and grayordinate data), not a CT volume"
        )
    if not isinstance(image, (nib.Nifti1Image, nib.Nifti2Image)):
        raise CtsegError(f"cannot read {path}: not a NIfTI image ({type(image).__name__})")
    dtype = image.get_data_dtype()
    if dtype.kind not in "biuf":  # complex, RGB (a record of three bytes), ...
        raise CtsegError(
            f"{path} holds {_dtype_name(dtype)} voxels; ctseg expects one real number per voxel"
        )
    proxy = image.dataobj
    scaled = (getattr(proxy, "slope", 1.0), getattr(proxy, "inter", 0.0)) != (1.0, 0.0)
    check_size(path, image.shape, 4 if scaled else dtype.itemsize)
    stored = math.prod(int(n) for n in image.shape) * dtype.itemsize
    check_stored_bytes(path, stored, int(getattr(proxy, "offset", 0)))
    header = image.header.copy()
    affine = nifti_affine(header, path)
    check_extent(path, image.shape[:3], voxel_sizes(affine))
    return image, header, affine


def _dtype_name(dtype: np.dtype) -> str:
    if dtype.kind == "c":
        return f"complex ({dtype.name})"
    if dtype.fields:
        return f"{len(dtype.fields)}-component ({', '.join(dtype.fields)})"
    return dtype.name


def nifti_affine(header: nib.Nifti1Header, path: Path) -> np.ndarray:
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
    if sform_code and not usable_affine(sform):
        header.set_sform(None, code=0)
    if qform_code and not usable_affine(qform):
        header.set_qform(None, code=0)
    if sform_code and usable_affine(sform):
        return sform
    if qform_code and usable_affine(qform):
        return qform
    if not (sform_code or qform_code):
        base = header.get_base_affine()  # no transform stored: nibabel's voxel-size affine
        if usable_affine(base):
            return base
    raise CtsegError(
        f"{path} has no usable geometry: its sform (code {sform_code}) and qform "
        f"(code {qform_code}) are not finite, invertible affines; fix the header"
    )


def usable_affine(affine: np.ndarray | None) -> bool:
    if affine is None or not np.isfinite(affine).all():
        return False
    return np.linalg.matrix_rank(affine[:3, :3]) == 3


def voxel_sizes(affine: np.ndarray) -> tuple[float, ...]:
    """Voxel size in mm along each voxel axis of `affine` (the lengths of its columns)."""
    return tuple(float(s) for s in np.sqrt((np.asarray(affine)[:3, :3] ** 2).sum(axis=0)))


def check_extent(
    path: Path, shape: Sequence[int], spacing: Sequence[float], remedy: str = "fix its header"
) -> None:
    """CtsegError when a scan of `shape` voxels of `spacing` mm covers more than a CT can:
    over `MAX_LENGTH_MM` along an axis, or over `MAX_WIDTH_MM` along two (whatever the
    order of its axes). A header that says so is wrong, and would size grids of thousands
    of voxels a side."""
    extent = [int(n) * float(s) for n, s in zip(shape, spacing, strict=False)]
    length, *widths = sorted(extent, reverse=True)
    if length <= MAX_LENGTH_MM and all(w <= MAX_WIDTH_MM for w in widths):
        return
    raise CtsegError(
        f"{path} claims a field of view of {' × '.join(f'{e:.4g}' for e in extent)} mm "
        f"(voxels of {' × '.join(f'{s:.4g}' for s in spacing[: len(extent)])} mm): no CT's "
        f"(up to {MAX_LENGTH_MM:g} mm along one axis, {MAX_WIDTH_MM:g} mm along the "
        f"others); {remedy}"
    )


def check_stored_bytes(path: Path, voxel_bytes: int, offset: int = 0) -> None:
    """CtsegError when the file `path` is too small to hold `voxel_bytes` of voxels after
    `offset` bytes of header: a file cut short, or a header that lies. A gzip file
    (`.gz`) holds at most `DEFLATE_RATIO` times its size (deflate's limit)."""
    size = os.stat(path).st_size
    compressed = path.name.lower().endswith(".gz")
    room = size * DEFLATE_RATIO + _GZIP_SLACK if compressed else size - offset
    if voxel_bytes <= room:
        return
    holds = (
        f"{human_bytes(size)} compressed, at most {human_bytes(room)}"
        if compressed
        else (human_bytes(max(room, 0)))
    )
    raise CtsegError(
        f"{path} is cut short or its header lies: the header claims "
        f"{human_bytes(voxel_bytes)} of voxels, the file holds {holds}"
    )


def check_size(path: Path, shape: tuple[int, ...], itemsize: int) -> None:
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


def max_scan_bytes() -> int:
    """The most bytes of voxels a scan read may take (`check_size`'s limit)."""
    return _max_scan_bytes()[0]


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


def scaled_voxels(image: nib.spatialimages.SpatialImage) -> np.ndarray:
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


def read_itk_image(path: Path, image: sitk.Image) -> tuple[np.ndarray, np.ndarray]:
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
    affine[:3, :3] = LPS_TO_RAS @ direction @ np.diag(image.GetSpacing())
    affine[:3, 3] = LPS_TO_RAS @ np.array(image.GetOrigin())
    return array, affine


def _check_file(path: Path) -> None:
    """CtsegError unless `path` is a regular file that can be opened (never a FIFO's hang)."""
    try:
        check_regular(path, "scan")
    except OSError as exc:
        raise CtsegError(f"cannot read {path}: {exc.strerror or exc}") from None


def read_itk_file(path: Path) -> sitk.Image:
    _check_file(path)
    try:
        info = image_information(str(path))
        check_size(path, info.GetSize(), itemsize(info))
        check_extent(path, info.GetSize()[:3], info.GetSpacing()[:3])
        return sitk.ReadImage(str(path))
    except RuntimeError as exc:
        raise CtsegError(f"cannot read {path}: {one_line(exc)}") from None


def image_information(file: str) -> sitk.ImageFileReader:
    """A reader that has read `file`'s header only (RuntimeError if it cannot)."""
    reader = sitk.ImageFileReader()
    reader.SetFileName(file)
    reader.ReadImageInformation()
    return reader


def itemsize(info: sitk.ImageFileReader) -> int:
    """Bytes per voxel of the image `info` describes, once read."""
    component = sitk.Image([1] * info.GetDimension(), info.GetPixelID())
    return component.GetSizeOfPixelComponent() * component.GetNumberOfComponentsPerPixel()
