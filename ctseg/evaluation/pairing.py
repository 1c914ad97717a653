"""Pairing predicted label maps with their references (`ctseg evaluate --pred P --ref R`).

By name first (`reference_candidates`: `ctseg predict`'s `<scan>_seg`, LiTS's names), any
case of extension (`.nii`, `.NII.GZ`); then by what the files are, where a name fits
several: a reference is a label map (whole numbers from 0, few of them), never the CT scan
that a LiTS folder keeps beside it (`holds_a_scan`). A prediction that is its reference
itself — a link to it, a hard link, the same file — is no prediction (`same_file`).
"""

from __future__ import annotations

import os
import re
import zlib
from pathlib import Path
from typing import NamedTuple

import nibabel as nib
import numpy as np
from nibabel.filebasedimages import ImageFileError

from ctseg.errors import CtsegError
from ctseg.reading import check_regular

NIFTI_SUFFIXES = (".nii.gz", ".nii")
# A label map holds few values (ctseg's 0–2; other tools' organ labels up to a few hundred);
# a middle slice of a CT holds thousands, and negative HU.
LABEL_VALUES_UP_TO = 255
# The largest slice read to tell a scan (a header claiming more is read in its turn, with
# the checks every scan read gets).
_PROBED_VOXELS = 1 << 24


class CasePair(NamedTuple):
    case: str  # the reference file name without extension, e.g. "segmentation-3"
    pred: Path
    ref: Path


def nifti_stem(path: Path) -> str | None:
    """The file name without .nii / .nii.gz in any case (`.NII.GZ`), or None for other
    files."""
    lower = path.name.lower()
    for suffix in NIFTI_SUFFIXES:
        if lower.endswith(suffix) and len(path.name) > len(suffix):
            return path.name[: -len(suffix)]
    return None


def natural_key(name: str) -> list:
    """Sort "segmentation-2" before "segmentation-10"."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _nifti_files(folder: Path, role: str) -> dict[str, Path]:
    """NIfTI names of `folder` by stem; two files with one stem (.nii and .nii.gz) are an
    error. Every entry but a folder counts: a dangling link or a pipe of a label map's
    name is a case that cannot be read (`read_scan` says why), never silently no case."""
    if not folder.is_dir():
        raise CtsegError(f"{role} folder {folder} does not exist or is not a folder")
    files: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        stem = nifti_stem(path)
        if stem is None or path.name.startswith(".") or path.is_dir():
            continue
        if stem in files:
            raise CtsegError(f"{role} folder holds both {files[stem].name} and {path.name}")
        files[stem] = path
    return files


# A LiTS scan's name (its prefix, its N): in a references' folder, the scan beside its
# segmentation-N, no reference.
LITS_SCAN = re.compile(r"(test-)?volume-(\d+)")


def reference_candidates(pred_stem: str) -> list[str]:
    """Reference stems a prediction may belong to, most specific first.

    `x` ↔ `x`; LiTS `test-segmentation-N` ↔ `segmentation-N`; a prediction named as its
    LiTS scan, `volume-N` ↔ `segmentation-N`; and what `ctseg predict` writes, `<scan>_seg`
    ↔ `<scan>`, where a LiTS scan name `volume-N` (or `test-volume-N`) stands for its
    `segmentation-N`: first, because a LiTS folder holds the scan `volume-N` itself beside
    it, which is no reference.
    """
    candidates = [pred_stem]
    if match := re.fullmatch(r"test-segmentation-(\d+)", pred_stem):
        candidates.append(f"segmentation-{match[1]}")
    if match := LITS_SCAN.fullmatch(pred_stem):
        candidates.append(f"{match[1] or ''}segmentation-{match[2]}")
    if pred_stem.endswith("_seg"):
        scan = pred_stem[: -len("_seg")]
        if match := LITS_SCAN.fullmatch(scan):
            candidates.append(f"{match[1] or ''}segmentation-{match[2]}")
        candidates.append(scan)
    return candidates


def holds_a_scan(path: Path) -> bool:
    """Whether a NIfTI file holds a scan rather than a label map, by its middle slice: a
    label map's voxels are whole numbers from 0, of at most `LABEL_VALUES_UP_TO` values; a
    CT's are HU, negative in the air and of thousands of values. False where it cannot be
    told (a file that cannot be read: reading it says why, in its turn)."""
    try:
        check_regular(path, "the reference")
        image = nib.load(path)
        shape = image.shape
        if len(shape) < 3 or shape[0] * shape[1] > _PROBED_VOXELS:
            return False
        middle = np.asarray(image.dataobj[:, :, shape[2] // 2])
    except (OSError, ValueError, EOFError, zlib.error, CtsegError, ImageFileError):
        return False
    values = np.unique(middle)
    return bool(
        values.size > LABEL_VALUES_UP_TO
        or (values < 0).any()
        or not np.all(np.isfinite(values) & (values == np.round(values)))
    )


def same_file(first: Path, second: Path) -> bool:
    """Whether two paths name one file: the same path resolved, a link to the other, or a
    hard link (one inode)."""
    if Path(first).resolve() == Path(second).resolve():
        return True
    try:
        return os.path.samefile(first, second)
    except OSError:
        return False


def pair_files(pred_dir: Path, ref_dir: Path) -> tuple[list[CasePair], list[str], list[str]]:
    """Match prediction files to reference files by name (see `reference_candidates`);
    where a name fits several references, the first that is a label map, never a scan
    (`holds_a_scan`).

    Returns the pairs (sorted by case name) and the file names left unpaired in
    each folder; a scan among the references (LiTS's `volume-N`, or one found so) is a
    scan beside them, no reference, and not listed. Two predictions claiming one reference
    are an error.
    """
    preds = _nifti_files(Path(pred_dir), "prediction")
    refs = _nifti_files(Path(ref_dir), "reference")
    scans = {stem for stem in refs if LITS_SCAN.fullmatch(stem)}
    claimed: dict[str, Path] = {}
    unpaired_pred = []
    for stem, pred_path in preds.items():
        present = [c for c in reference_candidates(stem) if c in refs]
        ref_stem = present[0] if len(present) == 1 else None
        for candidate in present if len(present) > 1 else ():
            if not holds_a_scan(refs[candidate]):
                ref_stem = candidate
                break
            scans.add(candidate)
        if ref_stem is None:
            unpaired_pred.append(pred_path.name)
        elif ref_stem in claimed:
            raise CtsegError(
                f"{claimed[ref_stem].name} and {pred_path.name} both match reference "
                f"{refs[ref_stem].name}; keep one of them"
            )
        else:
            claimed[ref_stem] = pred_path
    pairs = [CasePair(stem, claimed[stem], refs[stem]) for stem in claimed]
    pairs.sort(key=lambda pair: natural_key(pair.case))
    unpaired_ref = [refs[stem].name for stem in refs if stem not in claimed and stem not in scans]
    return pairs, sorted(unpaired_pred, key=natural_key), sorted(unpaired_ref, key=natural_key)
