"""The prepared store's manifest.json: found, read (format and version checked) and written.

Its content is described in `ctseg.data.store`. This module knows the file and its
fields: it finds, reads and writes it (the store's builder, `ctseg.data_prep.build`, and
`ctseg folds`, `ctseg.data_prep.splits.write_folds`, write it alike), and checks every
entry that `Store.open` reads (`check_entries`, `check_folds`): nothing an edited
manifest says may lead outside the store.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ctseg.atomic import write_json
from ctseg.data.grids import GridSpec
from ctseg.errors import CtsegError
from ctseg.reading import read_json


class Entry(Protocol):
    """What the checks read of a case entry (`ctseg.data.store.CaseEntry`)."""

    id: str
    split: str
    fold: int | None
    image_source: str
    label_source: str | None

    @property
    def labelled(self) -> bool: ...


FORMAT = "ctseg-store"
VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val", "test")
GRIDS = ("cube", "spacing")
# The remedy for a store this ctseg cannot read as it is, in words every caller follows
# (the command line's user and the Python API's).
PREPARE_AGAIN = "prepare the store again, replacing it (ctseg preprocess, forced)"
_CASE_ID = re.compile(r"[A-Za-z0-9-]+")


def is_case_id(value: object) -> bool:
    """Whether `value` is a case id (letters, digits and '-': safe as a folder name)."""
    return isinstance(value, str) and _CASE_ID.fullmatch(value) is not None


def manifest_file(path: Path) -> Path | None:
    """PATH/manifest.json, None if there is none; CtsegError if something else stands there."""
    file = path / MANIFEST
    if not file.exists():
        return None
    if not file.is_file():
        raise CtsegError(f"{file} is not a file; move it away (it is where the manifest goes)")
    return file


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest's content, None if there is none; CtsegError if it is not a store's."""
    file = manifest_file(path)
    if file is None:
        return None
    try:  # never a FIFO's wait, a 5,000-digit number's or deep nesting's traceback
        manifest = read_json(file, "store manifest")
    except FileNotFoundError:
        return None  # removed since it was found
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CtsegError(f"{file} is not a ctseg store manifest")
    if manifest.get("version") != VERSION:
        raise CtsegError(
            f"{file} has store version {manifest.get('version')}; this ctseg reads version "
            f"{VERSION}; {PREPARE_AGAIN}"
        )
    return manifest


def grid_keys(grid: GridSpec) -> dict[str, Any]:
    """The manifest's description of the grid: resolution, grid and (spacing grid) spacing."""
    keys: dict[str, Any] = {"resolution": grid.resolution, "grid": grid.kind}
    if grid.kind == "spacing":
        keys["spacing"] = list(grid.spacing)
    return keys


def write_manifest(
    out_dir: Path,
    grid: GridSpec,
    cases: Sequence[dict[str, Any]],
    folds: int,
    fold_seed: int | None,
) -> None:
    """Write OUT_DIR/manifest.json (atomically) listing `cases`, each an entry's JSON."""
    write_json(
        out_dir / MANIFEST,
        {
            "format": FORMAT,
            "version": VERSION,
            **grid_keys(grid),
            "folds": folds,
            "fold_seed": fold_seed,
            "cases": list(cases),
        },
    )


def check_entries(manifest: Path, cases: Sequence[Entry]) -> None:
    """CtsegError naming the key of the first entry that could lead outside the store.

    Ids become paths below the store (and output names of `ctseg evaluate`); sources
    are read by `ctseg evaluate`, which checks that each is still the scan prepared.
    """
    seen: set[str] = set()
    for index, case in enumerate(cases):
        where = f"{manifest}: cases[{index}]"
        if not is_case_id(case.id):
            raise CtsegError(
                f"{where}.id = {case.id!r} is not a case id (letters, digits and '-' only)"
            )
        if case.id.lower() in seen:
            raise CtsegError(f"{where}.id = {case.id!r} appears twice")
        seen.add(case.id.lower())
        if case.split not in SPLITS:
            raise CtsegError(f"{where}.split = {case.split!r} is not one of {list(SPLITS)}")
        sources = {"image_source": case.image_source, "label_source": case.label_source}
        for key, source in sources.items():
            if not (source is None and key == "label_source") and not _is_source(source):
                raise CtsegError(
                    f"{where}.{key} = {source!r} is not an absolute, normalised path of a scan"
                )
        _check_numbers(where, case)


def check_folds(path: Path, folds: Any, seed: Any, cases: Sequence[Entry]) -> None:
    """CtsegError naming the first fold key of the manifest that is not what it must be.

    With k folds every labelled case is in one of 0 … k-1 and no fold is empty; a
    label-free case, or any case of a store without folds, is in none.
    """
    where = path / MANIFEST
    redo = "assign the folds again (ctseg folds, forced)"

    def whole(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not whole(folds) or folds < 0 or folds == 1:
        raise CtsegError(f"{where}: folds = {folds!r} is not 0 (none) or a count ≥ 2; {redo}")
    if not (seed is None or (whole(seed) and seed >= 0)):
        raise CtsegError(f"{where}: fold_seed = {seed!r} is not a seed; {redo}")
    for index, case in enumerate(cases):
        allowed = folds > 0 and case.labelled
        if (case.fold is not None or allowed) and not (
            allowed and whole(case.fold) and 0 <= case.fold < folds
        ):
            should = f"one of 0–{folds - 1}" if allowed else "null"
            raise CtsegError(
                f"{where}: cases[{index}].fold = {json.dumps(case.fold)} should be {should}; "
                + redo
            )
    empty = sorted(set(range(folds)) - {case.fold for case in cases})
    if empty:
        raise CtsegError(f"{where}: fold {empty[0]} holds no case; {redo}")


# Numeric fields of an entry: (shape, whole numbers, lowest allowed value, in words).
_NUMBERS = {
    "original_shape": ((3,), True, 1, "3 voxel counts"),
    "canonical_shape": ((3,), True, 1, "3 voxel counts"),
    "original_affine": ((4, 4), False, -math.inf, "a 4×4 matrix of finite numbers"),
    "canonical_affine": ((4, 4), False, -math.inf, "a 4×4 matrix of finite numbers"),
    "spacing": ((3,), False, math.ulp(0.0), "3 positive numbers (mm)"),
    "label_counts": ((3,), True, 0, "3 voxel counts"),
    "grid_shape": ((3,), True, 1, "3 voxel counts"),
    "box_offset": ((3,), True, -math.inf, "3 whole numbers"),
}


def _check_numbers(where: str, case: Any) -> None:
    """CtsegError naming the first numeric field of an entry that is not what it must be.

    `ctseg evaluate` compares shapes and affines with the scan's own header: a field
    edited into something else would fail there with a traceback, or match nothing.
    """
    for key, (shape, whole, lowest, words) in _NUMBERS.items():
        value = getattr(case, key)
        if key == "label_counts" and value is None and not case.labelled:
            continue
        array = np.array(value, dtype=object)
        items = array.ravel().tolist()
        kind = int if whole else (int, float)
        if not (
            array.shape == shape
            and all(isinstance(v, kind) and not isinstance(v, bool) for v in items)
            and all(math.isfinite(v) and v >= lowest for v in items)
        ):
            shown = json.dumps(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise CtsegError(f"{where}.{key} = {shown} is not {words}; {PREPARE_AGAIN}")


def _is_source(value: object) -> bool:
    return isinstance(value, str) and os.path.isabs(value) and os.path.normpath(value) == value
