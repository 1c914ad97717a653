"""Find (image, label) pairs in the folder layouts that public liver data sets ship in.

- LiTS: ``volume-N.nii[.gz]`` with ``segmentation-N.nii[.gz]``, anywhere below the
  folder (the challenge splits them over "Training Batch 1" and "Training Batch 2").
  Case id ``lits-N``.
- Medical Segmentation Decathlon Task03_Liver: ``imagesTr/liver_N.nii.gz`` with
  ``labelsTr/liver_N.nii.gz``. Case id ``msd-N``.

Case ids hold only letters, digits and ``-``, so they are safe as folder names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ctseg.errors import CtsegError

_LITS_IMAGE = re.compile(r"^volume-(\d+)\.nii(\.gz)?$")
_LITS_LABEL = re.compile(r"^segmentation-(\d+)\.nii(\.gz)?$")
_MSD_FILE = re.compile(r"^[A-Za-z]+_(\d+)\.nii(\.gz)?$")


@dataclass(frozen=True)
class CasePair:
    case_id: str
    image: Path
    label: Path


@dataclass(frozen=True)
class Layout:
    pairs: list[CasePair]
    unlabelled: list[Path]  # images found without a matching label


def find_cases(raw_dir: str | Path) -> Layout:
    """All LiTS and MSD cases under `raw_dir`, sorted by layout and case number."""
    raw_dir = Path(raw_dir)
    if not raw_dir.is_dir():
        raise CtsegError(f"raw data folder not found: {raw_dir}")
    files = [p for p in raw_dir.rglob("*") if not p.name.startswith(".") and p.is_file()]
    lits = _pair_up("lits", _numbered(files, _LITS_IMAGE), _numbered(files, _LITS_LABEL))
    msd_images, msd_labels = _msd_files(files)
    msd = _pair_up("msd", msd_images, msd_labels)
    layout = Layout(pairs=lits.pairs + msd.pairs, unlabelled=lits.unlabelled + msd.unlabelled)
    if not layout.pairs:
        raise CtsegError(
            f"no LiTS volume-N/segmentation-N pairs or MSD imagesTr/labelsTr found in {raw_dir}"
            + _unlabelled_note(layout.unlabelled)
        )
    return layout


def _unlabelled_note(unlabelled: list[Path]) -> str:
    if not unlabelled:
        return ""
    names = ", ".join(p.name for p in unlabelled[:5])
    more = f" and {len(unlabelled) - 5} more" if len(unlabelled) > 5 else ""
    return f" (images without labels: {names}{more})"


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


def _msd_files(files: list[Path]) -> tuple[dict[int, Path], dict[int, Path]]:
    images = _numbered((p for p in files if p.parent.name == "imagesTr"), _MSD_FILE)
    labels = _numbered((p for p in files if p.parent.name == "labelsTr"), _MSD_FILE)
    return images, labels


def _pair_up(prefix: str, images: dict[int, Path], labels: dict[int, Path]) -> Layout:
    pairs = [
        CasePair(f"{prefix}-{number}", images[number], labels[number])
        for number in sorted(images)
        if number in labels
    ]
    unlabelled = [images[number] for number in sorted(images) if number not in labels]
    return Layout(pairs=pairs, unlabelled=unlabelled)
