"""Find the cases of a raw data folder in the layouts that public liver data sets ship in.

A folder that holds any label file is a *training* folder; its cases are

- LiTS: ``volume-N.nii[.gz]`` with ``segmentation-N.nii[.gz]``, anywhere below the
  folder (the challenge splits them over "Training Batch 1" and "Training Batch 2").
  Case id ``lits-N``.
- Medical Segmentation Decathlon Task03_Liver: ``imagesTr/liver_N.nii.gz`` with
  ``labelsTr/liver_N.nii.gz``. Case id ``msd-N``.

A training image without its label is still listed (with ``label=None``), so that
`ctseg preprocess` reports it as a failed case instead of silently dropping it.
Test-set images (LiTS ``test-volume-N``, MSD ``imagesTs/``) and other scans in a
training folder are not cases of it.

A folder without any label file is a *predict-only* folder: every scan file below
it (any name, e.g. LiTS ``test-volume-N.nii``) and every DICOM series folder below it
(or the folder itself, if it is one) is a case without a label, with its file or
folder name (`ctseg.io.scans.scan_name`) as case id (letters of other scripts spelled as their
code points: ``肝臓_01`` is ``u809d-u81d3-01``). Two scans that would get the same case
id (also when the ids differ only in letter case) are an error, never an overwrite.

Case ids hold only letters, digits and ``-``, so they are safe as folder names.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ctseg.errors import CtsegError
from ctseg.io.dicom import is_dicom_folder
from ctseg.io.scans import SCAN_SUFFIXES, scan_name

_LITS_IMAGE = re.compile(r"^volume-(\d+)\.nii(\.gz)?$")
_LITS_LABEL = re.compile(r"^segmentation-(\d+)\.nii(\.gz)?$")
_MSD_FILE = re.compile(r"^[A-Za-z]+_(\d+)\.nii(\.gz)?$")
_NOT_IN_ID = re.compile(r"[^A-Za-z0-9-]+")


@dataclass(frozen=True)
class RawCase:
    """A case of a raw data set, as a store is built from it."""

    case_id: str
    image: Path
    label: Path | None  # None: a predict-only case, or a training image whose label is missing


@dataclass(frozen=True)
class RawLayout:
    """The cases a raw data-set folder holds."""

    cases: list[RawCase]
    predict_only: bool  # the folder holds no labels at all: every case is label-free


def find_cases(raw_dir: str | Path) -> RawLayout:
    """The cases under `raw_dir`: LiTS and MSD training cases, or else plain scans."""
    raw_dir = Path(raw_dir)
    if raw_dir.exists() and not raw_dir.is_dir():
        raise CtsegError(f"{raw_dir} is a file, not a folder: give the folder that holds the scans")
    if not raw_dir.is_dir():
        raise CtsegError(f"raw data folder not found: {raw_dir}")
    all_files, folders = _tree(raw_dir)
    # Not only regular files: a pipe or a dangling link named as a scan is a case that
    # fails with its reason, not one that silently goes missing.
    files = [p for p in all_files if not p.name.startswith(".")]
    lits_labels = _numbered(files, _LITS_LABEL)
    msd_labels = _numbered(_in_folder(files, "labelsTr"), _MSD_FILE)
    if not lits_labels and not msd_labels:
        return RawLayout(cases=_plain_scans(raw_dir, files, folders), predict_only=True)
    cases = _pair_up("lits", _numbered(files, _LITS_IMAGE), lits_labels) + _pair_up(
        "msd", _numbered(_in_folder(files, "imagesTr"), _MSD_FILE), msd_labels
    )
    if not cases:
        raise CtsegError(
            f"{raw_dir} holds labels but no LiTS volume-N or MSD imagesTr/ images to go with them"
        )
    return RawLayout(cases=cases, predict_only=False)


def _tree(raw_dir: Path) -> tuple[list[Path], list[Path]]:
    """Files and folders below `raw_dir`, symlinked folders followed, each real folder once.

    `Path.rglob` does not follow symlinked folders (before Python 3.13): a RAW folder
    made of links to where the scans really lie would silently lose them. A link back
    up the tree (a loop), or a second link to one folder, is walked no further.
    """
    files: list[Path] = []
    folders: list[Path] = []
    seen: set[str] = set()
    for top, subfolders, names in os.walk(raw_dir, followlinks=True):
        real = os.path.realpath(top)
        if real in seen:
            subfolders.clear()
            continue
        seen.add(real)
        subfolders.sort()  # the first of two links to one folder wins, the same every run
        folders.append(Path(top))
        files.extend(Path(top) / name for name in names)
    return sorted(files), sorted(folders[1:])


def _numbered(files: Iterable[Path], pattern: re.Pattern[str]) -> dict[int, Path]:
    """Case number -> file, for the files whose name matches `pattern`."""
    found: dict[int, Path] = {}
    for path in files:
        match = pattern.match(path.name)
        if not match:
            continue
        number = int(match.group(1))
        if number in found:
            raise CtsegError(f"case {number} appears twice: {found[number]} and {path}")
        found[number] = path
    return found


def _in_folder(files: Iterable[Path], folder: str) -> list[Path]:
    return [p for p in files if p.parent.name == folder]


def _pair_up(prefix: str, images: dict[int, Path], labels: dict[int, Path]) -> list[RawCase]:
    return [
        RawCase(f"{prefix}-{number}", images[number], labels.get(number))
        for number in sorted(images)
    ]


def _plain_scans(raw_dir: Path, files: list[Path], folders: list[Path]) -> list[RawCase]:
    scans = sorted(
        [p for p in files if p.name.lower().endswith(SCAN_SUFFIXES)]
        + _dicom_series(raw_dir, folders)
    )
    if not scans:
        raise CtsegError(
            f"no scans found in {raw_dir}: expected LiTS volume-N/segmentation-N, "
            f"MSD imagesTr/labelsTr, scan files ({', '.join(SCAN_SUFFIXES)}) "
            "or DICOM series folders"
        )
    # Keyed by the lower-case id: case folders of the store must differ on case-insensitive
    # file systems (macOS, Windows), too.
    by_key: dict[str, tuple[str, Path]] = {}
    for path in scans:
        # abspath: RAW given as "." (itself a DICOM series) is named after its folder.
        name = scan_name(Path(os.path.abspath(path)))
        case_id = _case_id_of(name)
        if case_id.lower() in by_key:
            other_id, other = by_key[case_id.lower()]
            same = (
                f"both become case '{case_id}'"
                if other_id == case_id
                else f"become cases '{other_id}' and '{case_id}', which differ only in letter case"
            )
            raise CtsegError(f"{other} and {path} would {same}; rename one of them")
        by_key[case_id.lower()] = (case_id, path)
    return [RawCase(case_id, path, None) for case_id, path in by_key.values()]


def _case_id_of(name: str) -> str:
    """A scan's name as a case id: letters and digits outside ASCII become their code
    points (u809d), so that names in other scripts stay apart; anything else a '-'."""
    # The spaces around a code point join the run of characters replaced by one '-'.
    spelled = "".join(f" u{ord(c):04x} " if c.isalnum() and not c.isascii() else c for c in name)
    return _NOT_IN_ID.sub("-", spelled).strip("-") or "scan"


def _dicom_series(raw_dir: Path, folders: list[Path]) -> list[Path]:
    """`raw_dir` and the `folders` below it that hold a DICOM series.

    Each such folder is one scan: `read_scan` reads the series directly in it (and refuses
    several), as `ctseg predict` does with the folders `find_scans` gives.
    Hidden folders (and what is below them) and unreadable ones (``lost+found``) are skipped.
    """
    below = (
        p for p in folders if not any(part.startswith(".") for part in p.relative_to(raw_dir).parts)
    )
    return [p for p in [raw_dir, *below] if _is_dicom_folder(p)]


def _is_dicom_folder(folder: Path) -> bool:
    try:
        return is_dicom_folder(folder)
    except OSError:
        return False
