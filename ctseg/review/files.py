"""The bytes the review server may send for a case's file, checked when asked.

A request names a case and a kind of file (`batch.SEG`, `PREVIEW`, `SCAN`, `REFERENCE`),
never a path: the path is the one the folder's records give (`Case.files`). Checked
again on each request, since the folder may have changed since it was read:

- an output (the labels, the preview) must be a regular file inside the folder, not a
  link out of it;
- a scan or a reference must be a regular file, or a DICOM series folder. NIfTI is sent
  as it is; any other format (NRRD, MHA, a DICOM series) is read by ctseg's reader and
  sent as NIfTI in the scan's own geometry, the format the viewer reads.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ctseg.errors import CtsegError
from ctseg.reading import NotRegularFile, check_regular
from ctseg.review.batch import PREVIEW, REFERENCE, SCAN, SEG, Case

NIFTI_SUFFIXES = (".nii", ".nii.gz")
OUTPUT_KINDS = (SEG, PREVIEW)
SOURCE_KINDS = (SCAN, REFERENCE)


class Refused(Exception):
    """A file the server will not send: `status` 403 (not the folder's to give) or 404."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


@dataclass(frozen=True)
class Sendable:
    """A file to send as it is (`path`), or bytes made from it (`data`), with its name."""

    name: str  # what the viewer reads the format from: x.nii.gz, x.nii, x.png
    path: Path | None = None
    data: bytes | None = None


def sendable(folder: Path, case: Case, kind: str) -> Sendable:
    """What to send for `case`'s file of `kind`; `Refused` otherwise."""
    path = case.files.get(kind)
    if path is None:
        raise Refused(404, f"{case.name} has no {kind} file")
    name = served_name(kind, path)
    if kind in OUTPUT_KINDS:
        _check_inside(folder, path)
        _check_file(path)
        return Sendable(name, path=path)
    if kind not in SOURCE_KINDS:
        raise Refused(404, f"no such file kind {kind!r}")
    if _is_nifti(path):
        _check_file(path)
        return Sendable(name, path=path)
    if not path.exists():
        raise Refused(404, f"{path} is gone")
    if not path.is_dir():  # a DICOM series is a folder; any other scan a regular file
        _check_file(path)
    return Sendable(name, data=_as_nifti(str(path), *_identity(path)))


def served_name(kind: str, path: Path) -> str:
    """The name a case's file is asked for and sent as (the viewer reads the format from
    it): `seg.nii.gz`, `scan.nii` (NIfTI as it is, anything else made NIfTI), `preview.png`."""
    if kind == PREVIEW:
        return f"{kind}.png"
    if _is_nifti(path) and path.name.lower().endswith(".gz"):
        return f"{kind}.nii.gz"
    return f"{kind}.nii"


def _is_nifti(path: Path) -> bool:
    return path.name.lower().endswith(NIFTI_SUFFIXES)


def _check_inside(folder: Path, path: Path) -> None:
    """403 unless `path` is inside `folder` (an evaluation's labels are in predictions/),
    following every link on the way."""
    if not path.resolve().is_relative_to(Path(folder).resolve()):
        raise Refused(403, f"{path.name} leads out of the folder")


def _check_file(path: Path) -> None:
    try:
        check_regular(path)
    except NotRegularFile as exc:
        raise Refused(403, str(exc)) from None
    except OSError:
        raise Refused(404, f"{path.name} is gone") from None


def _identity(path: Path) -> tuple[int, int]:
    """The file's (or series folder's) modification time and size: a scan read again once
    it changed."""
    info = os.stat(path)
    return info.st_mtime_ns, info.st_size


@functools.lru_cache(maxsize=2)  # the scan on the screen and the one before it
def _as_nifti(path: str, _mtime: int, _size: int) -> bytes:
    """A scan of another format as NIfTI bytes, in its own voxel order and geometry."""
    # SimpleITK and nibabel: imported with the first such scan.
    from ctseg.io import scans
    from ctseg.io.readers import one_line

    try:
        scan = scans.read_scan(path)
    except CtsegError as exc:
        raise Refused(404, str(exc)) from None
    except Exception as exc:  # a reader library's failure on a strange file: no scan here
        raise Refused(404, f"{path} cannot be read: {one_line(exc)}") from None
    voxels = scans.to_original_order(scan, scan.array)
    integral = np.array_equal(voxels, np.round(voxels))
    fits = integral and voxels.min() >= -32768 and voxels.max() <= 32767
    image = scans.nifti_image(scan, voxels, np.int16 if fits else np.float32)
    return image.to_bytes()
