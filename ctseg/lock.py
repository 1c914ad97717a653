"""One writer per output folder: `hold(folder)` while a command writes into it.

Two commands writing one folder at once mix their files silently (a label map
from one checkpoint, its stats from another; metrics logged twice). Every
command that writes a folder (predict --out, train --workdir, evaluate --out,
synth OUT; `ctseg preprocess` can take its PREP the same way) holds the
folder's lock while it writes::

    with lock.hold(out_dir, warn=print_warning_line):
        ...  # write into out_dir

The lock is `fcntl.flock` on ``FOLDER/.ctseg-lock``: the kernel releases it when
its holder dies, however it dies, so a killed command never blocks the next one.
The file records its holder (pid, host, command line) for the one-line error a
second writer gets, and for the warning when a dead holder's lock is taken over.
Taking the lock also removes the temporary files a killed command left there
(`atomic.remove_temporaries`). Only the writing process of a multi-host job
locks: the others write nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from ctseg import atomic
from ctseg.errors import CtsegError


def _holder(fd: int) -> dict | None:
    """The holder recorded in an open lock file, or None when it records nothing readable."""
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 65536).decode(errors="replace")
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        return None
    return holder if isinstance(holder, dict) else None


def _describe(holder: dict | None) -> str:
    if holder is None:
        return "a ctseg command that recorded nothing"
    command = holder.get("command", "?")
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}: `{command}`"


def _open_locked(path: Path) -> int:
    """An open descriptor of `path` holding its lock, or CtsegError naming the holder."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise CtsegError(f"could not lock {path.parent}: {exc.strerror or exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise CtsegError(
                f"{path.parent} is being written by another command ({_describe(holder)}); "
                "wait for it to finish or give another folder"
            ) from None
        except OSError as exc:  # a file system without locks (ENOLCK, some network mounts)
            os.close(fd)
            raise CtsegError(f"could not lock {path.parent}: {exc.strerror or exc}") from exc
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        # The holder we waited on removed the file on release: lock the file there now.
        os.close(fd)


@contextlib.contextmanager
def hold(folder: str | Path, warn: Callable[[str], None] | None = None) -> Iterator[Path]:
    """Create `folder` if need be and hold its lock; yields the folder.

    CtsegError (one line, naming the holder) when another process holds it. A
    lock file whose holder died is taken over, and `warn` gets a line saying so.
    A folder this call created is removed again if nothing was written into it
    (a command that failed before it started leaves no empty folder behind).
    """
    created = not Path(folder).exists()
    folder = atomic.output_folder(folder)
    path = folder / atomic.LOCK_NAME
    fd = _open_locked(path)
    try:
        # A released lock leaves no file (see below): a recorded holder here died holding it.
        if os.fstat(fd).st_size and warn is not None:
            warn(f"took over the lock of {folder} left by {_describe(_holder(fd))}, which died")
        me = {"pid": os.getpid(), "host": socket.gethostname(), "command": shlex.join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        atomic.remove_temporaries(folder)
        yield folder
    finally:
        # Removed while still locked, so that no one locks a file about to disappear.
        path.unlink(missing_ok=True)
        os.close(fd)
        if created:
            with contextlib.suppress(OSError):  # not empty (or taken meanwhile): it stays
                folder.rmdir()
