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


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it replaces `path` in one step.

    On any failure (including a full disk) the temporary file is removed and
    whatever stood at `path` before is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Keep the suffix so that libraries which choose a format by extension still work.
    fd, tmp = tempfile.mkstemp(
        prefix=f".{path.name}.", suffix="".join(path.suffixes), dir=path.parent
    )
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


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2) + "\n")


def write_npy(path: str | Path, array: np.ndarray) -> None:
    with atomic_path(path) as tmp:
        np.save(tmp, array, allow_pickle=False)
