"""Atomic file writes: a killed command never leaves a half-written file under a final name."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ctseg.errors import CtsegError


def _read_umask() -> int:
    # os.umask can only be read by setting it; done once, at import, before any thread starts.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# mkstemp creates files 0600 and os.replace keeps that mode: outputs get the mode any
# other new file of the user gets instead, so that colleagues can read shared results.
_FILE_MODE = 0o666 & ~_read_umask()


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it replaces `path` in one step.

    On any failure (including a full disk) the temporary file is removed and
    whatever stood at `path` before is left untouched.
    """
    path = Path(path)
    output_folder(path.parent)
    # Keep the suffix so that libraries which choose a format by extension still work.
    fd, tmp = tempfile.mkstemp(
        prefix=f".{path.name}.", suffix="".join(path.suffixes), dir=path.parent
    )
    os.fchmod(fd, _FILE_MODE)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    except OSError as exc:
        tmp_path.unlink(missing_ok=True)
        raise CtsegError(f"could not write {path}: {exc.strerror or exc}") from exc
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def output_folder(path: str | Path) -> Path:
    """Create folder `path` (with its parents) for outputs; CtsegError if it cannot be one."""
    path = Path(path)
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
    killed run may resume into it), or `force` (None: the command has no --force).
    """
    path = output_folder(path)
    own = any((path / marker).exists() for marker in markers)
    if not (own or force) and any(path.iterdir()):
        alternative = "" if force is None else ", or --force to write among them"
        raise CtsegError(
            f"{path} already holds files that ctseg did not write; give an empty or new "
            f"folder{alternative}"
        )
    return path


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2) + "\n")


def write_npy(path: str | Path, array: np.ndarray) -> None:
    with atomic_path(path) as tmp:
        np.save(tmp, array, allow_pickle=False)
