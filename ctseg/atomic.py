"""Atomic file writes: a killed command never leaves a half-written file under a final name."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ctseg.errors import CtsegError, OptionError
from ctseg.reading import read_json


def _read_umask() -> int:
    # os.umask can only be read by setting it; done once, at import, before any thread starts.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# mkstemp creates files 0600 and os.replace keeps that mode: outputs get the mode any
# other new file of the user gets instead, so that colleagues can read shared results.
_FILE_MODE = 0o666 & ~_read_umask()
# Every temporary file starts so: a killed command's leftovers are recognisably ours, and the
# next command that takes the folder's lock (`ctseg.lock.hold`) removes them.
TEMP_PREFIX = ".ctseg-tmp."
LOCK_NAME = ".ctseg-lock"  # the file `ctseg.lock.hold` locks in a folder being written


def _temporary(path: Path) -> Path:
    """A new empty file beside `path` that will replace it."""
    output_folder(path.parent)
    # Keep the suffix so that libraries which choose a format by extension still work.
    try:
        fd, tmp = tempfile.mkstemp(
            prefix=f"{TEMP_PREFIX}{path.name}.", suffix="".join(path.suffixes), dir=path.parent
        )
    except OSError as exc:
        raise CtsegError(f"could not write {path}: {exc.strerror or exc}") from exc
    os.fchmod(fd, _FILE_MODE)
    os.close(fd)
    return Path(tmp)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it replaces `path` in one step.

    On any failure (including a full disk) the temporary file is removed and
    whatever stood at `path` before is left untouched.
    """
    with atomic_group([Path(path)]) as (tmp,):
        yield tmp


@contextlib.contextmanager
def atomic_group(paths: Sequence[Path]) -> Iterator[list[Path]]:
    """Temporary paths for files that appear together; the last of `paths` commits them.

    On success the last file (the commit marker, e.g. a scan's stats) is removed
    first, the others replace their files, and the marker comes last: whoever
    finds the marker finds the whole group of this write, and a kill half-way
    leaves no marker, so the group counts as unfinished. On failure every
    temporary file is removed and the old files stay.
    """
    paths = [Path(p) for p in paths]
    temporaries: list[Path] = []
    try:
        for path in paths:
            temporaries.append(_temporary(path))
        yield temporaries
        paths[-1].unlink(missing_ok=True)
        for tmp, path in zip(temporaries, paths, strict=True):
            os.replace(tmp, path)
    except OSError as exc:
        for tmp in temporaries:
            tmp.unlink(missing_ok=True)
        what = paths[0] if len(paths) == 1 else f"{paths[-1]} and the files that go with it"
        raise CtsegError(f"could not write {what}: {exc.strerror or exc}") from exc
    except BaseException:
        for tmp in temporaries:
            tmp.unlink(missing_ok=True)
        raise


def _is_temporary(path: Path) -> bool:
    return path.name.startswith(TEMP_PREFIX)


def remove_temporaries(folder: Path) -> None:
    """Remove the temporary files a killed command of ours left in `folder` (not below it).

    Only while holding the folder's lock: another command's temporaries are alive.
    """
    for tmp in Path(folder).iterdir():
        if _is_temporary(tmp) and tmp.is_file():
            tmp.unlink(missing_ok=True)


def _outside_checkpoints(path: Path) -> None:
    """CtsegError if `path` is or lies in a run's checkpoints folder: orbax takes every
    folder there for a checkpoint, and a file there is no one's to find."""
    for folder in (path.resolve(), *path.resolve().parents):
        if folder.name == "checkpoints" and (folder.parent / "config.toml").is_file():
            raise CtsegError(
                f"{path} lies in the checkpoints folder of the run {folder.parent}, which "
                "holds only checkpoints; give another folder"
            )


def check_writable(path: str | Path) -> None:
    """CtsegError if `path` cannot be a folder this process writes in (a file, a folder it
    cannot write in, or inside one), found before anything is made rather than as a
    traceback later. Creates nothing."""
    existing = Path(path).resolve()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise CtsegError(f"{existing} is a file, not a folder: give a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise CtsegError(f"cannot write in {existing}: {exc.strerror or exc}") from None


def output_folder(path: str | Path) -> Path:
    """Create folder `path` (with its parents) for outputs; CtsegError if it cannot be one.

    Never among a run's checkpoints (`_outside_checkpoints`).
    """
    path = Path(path)
    _outside_checkpoints(path)
    if path.exists() and not path.is_dir():
        raise CtsegError(f"{path} is a file, not a folder: give a folder for the outputs")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CtsegError(f"could not create the folder {path}: {exc.strerror or exc}") from exc
    return path


def claim_folder(path: str | Path, markers: tuple[str, ...], force: bool | None = False) -> Path:
    """Create `path` for a command's outputs, refusing a folder that holds others' files.

    An existing folder is written into only when it is empty, holds one of `markers`
    (a file or folder the command writes there first: the folder is its own, and a
    killed run may resume into it), or `force` (None: the caller has no such choice).
    """
    path = output_folder(path)
    own = any((path / marker).exists() for marker in markers)
    # The folder's lock file (`ctseg.lock`) and our temporaries are no one else's files.
    others = (p for p in path.iterdir() if not (p.name == LOCK_NAME or _is_temporary(p)))
    if not (own or force) and any(others):
        alternative = "" if force is None else ", or `force` to write among them"
        raise OptionError(
            f"{path} already holds files that ctseg did not write; give an empty or new "
            f"folder{alternative}"
        )
    return path


def claim_report(
    path: str | Path,
    ours: Callable[[Path], bool],
    inputs: Iterable[str | Path] = (),
    force: bool = False,
) -> Path:
    """Check, before the work, that a command may write its report file at `path`.

    Never one of the command's `inputs` (files and folders it reads, compared
    resolved), even with `force`. An existing file only when `ours` recognises
    it as a report of the same kind (a re-run replaces its own report), or with
    `force`.
    """
    path = Path(path)
    if path.resolve() in {Path(item).resolve() for item in inputs}:
        raise CtsegError(f"{path} is an input of this command; write the report elsewhere")
    if path.is_dir():
        raise CtsegError(f"{path} is a folder: give a file name for the report")
    _outside_checkpoints(path.parent)
    if path.exists() and not force and not ours(path):
        raise OptionError(
            f"{path} exists and is not a report this command wrote; give another file name, "
            "or `force` to replace it"
        )
    return path


def is_json_with(path: Path, keys: Iterable[str]) -> bool:
    """Whether `path` holds a JSON object with (at least) these top-level keys (a FIFO,
    a file past a record's size or JSON nested past Python's recursion holds none)."""
    try:
        obj = read_json(path, "report")
    except (OSError, CtsegError):
        return False
    return isinstance(obj, dict) and set(keys) <= set(obj)


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2) + "\n")


def write_npy(path: str | Path, array: np.ndarray) -> None:
    with atomic_path(path) as tmp:
        np.save(tmp, array, allow_pickle=False)
