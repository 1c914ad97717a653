"""Reading files ctseg did not just write: only regular files, and records through a schema.

Every file ctseg reads may have been replaced by something else: a FIFO (whose `open`
blocks until a writer comes: a command hung for good), a device, a folder, or a record
edited by hand (a number as a string, a key removed, a 5,000-digit integer, nesting deep
enough to exhaust Python's recursion). Here a file is opened without blocking and kept
only if it is a regular file (`open_regular`), and a JSON record is read whole within a
size limit (`read_json`) and then taken apart key by key (`Record`), so that a bad file is
one line naming the file and the key (`CtsegError`), never a hang or a traceback.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

from ctseg.errors import CtsegError

# The records ctseg writes (stats, quality, fingerprints, reports) are kilobytes; a larger
# file is none of them, and is not read whole to find out.
RECORD_BYTES = 64 << 20

T = TypeVar("T")
_SHA256 = re.compile("[0-9a-f]{64}")


class NotRegularFile(CtsegError):
    """A path that names a FIFO, a device, a socket or a folder where a file was expected."""


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def open_regular(path: str | Path, what: str = "file") -> IO[bytes]:
    """`path` opened for reading in binary, if it is (or links to) a regular file.

    Opened without blocking (a FIFO's open would wait for a writer forever), then checked
    on the open descriptor, so that nothing swapped in between the check and the read gets
    through. NotRegularFile (a CtsegError naming `what`) otherwise; a missing or unreadable
    file raises its OSError, for callers to whom absence means something.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(f"{what} {path} is {_kind(mode)}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_regular(path: str | Path, what: str = "file") -> None:
    """NotRegularFile unless `path` is (or links to) a regular file; OSError if it cannot be
    opened. For paths handed to a library that opens them itself (nibabel, SimpleITK)."""
    open_regular(path, what).close()


def read_bytes(path: str | Path, what: str = "file", limit: int | None = None) -> bytes:
    """The bytes of the regular file `path`; CtsegError past `limit` bytes."""
    with open_regular(path, what) as f:
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise CtsegError(f"{what} {path} is over {limit >> 20} MiB: not one of ctseg's records")
    return data


def sha256_of(path: str | Path, what: str = "file") -> tuple[int, str]:
    """(size in bytes, sha256 in hex) of the regular file `path`, read once in blocks:
    what ctseg knows a scan or an output of its own by (its content, not its name)."""
    with open_regular(path, what) as f:
        digest = hashlib.file_digest(f, "sha256")
        return f.tell(), digest.hexdigest()


def read_text(path: str | Path, what: str = "file", limit: int | None = RECORD_BYTES) -> str:
    """The UTF-8 text of the regular file `path` (a record, a log of JSON lines).

    A missing file raises FileNotFoundError; anything else that keeps it from being read
    — not a regular file, unreadable, past `limit` bytes, not UTF-8 — is a CtsegError
    naming the file.
    """
    try:
        data = read_bytes(path, what, limit)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CtsegError(f"{what} {path} cannot be read: {exc.strerror or exc}") from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CtsegError(f"{what} {path} is not valid JSON ({_first_line(exc)})") from exc


def parse_json(text: str, path: str | Path, what: str = "record") -> Any:
    """The JSON value of `text` (read from `path`), one line of CtsegError naming the file
    if it has none: not JSON, integers past Python's digit limit, nesting past its
    recursion limit."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else "not valid JSON"
        raise CtsegError(f"{what} {path} is {reason} ({_first_line(exc)})") from exc


def read_json(path: str | Path, what: str = "record") -> Any:
    """The JSON value in the regular file `path`, one line of CtsegError if it has none.

    A missing file raises FileNotFoundError (absence often means "none yet"); anything else
    that keeps it from being read — not a regular file, unreadable, too large, not UTF-8,
    not JSON, integers past Python's digit limit, nesting past its recursion limit — is a
    CtsegError naming the file.
    """
    return parse_json(read_text(path, what), path, what)


def _first_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:120]


def _describe(value: Any) -> str:
    text = json.dumps(value) if _plain(value) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "…"


def _plain(value: Any) -> bool:
    return (
        value is None
        or isinstance(value, bool | str)
        or (isinstance(value, int | float) and len(str(value)) <= 40)
    )


class Record:
    """A JSON object read from a file, taken apart key by key with its types checked.

    Each accessor returns the value or raises CtsegError naming the file and the key's
    path (`request.region.sha256`), so that a record edited by hand is one line, never a
    KeyError or TypeError deep in the code that uses it.
    """

    def __init__(self, value: Any, path: str | Path, what: str = "record", key: str = ""):
        self.path, self.what, self.key = Path(path), what, key
        if not isinstance(value, dict):
            self._fail(None, f"must be an object, not {_describe(value)}")  # self.key names it
        self.value: dict[str, Any] = value

    @classmethod
    def read(cls, path: str | Path, what: str = "record") -> Record:
        """The record in the file `path` (`read_json`: FileNotFoundError if there is none)."""
        return cls(read_json(path, what), path, what)

    def _name(self, key: str | None) -> str:
        return ".".join(k for k in (self.key, key) if k)

    def _fail(self, key: str | None, problem: str) -> None:
        where = f"key {self._name(key)!r}" if key or self.key else "its top level"
        raise CtsegError(f"{self.what} {self.path}: {where} {problem}")

    def __contains__(self, key: str) -> bool:
        return key in self.value

    def _get(self, key: str, optional: bool) -> Any:
        if key not in self.value:
            if optional:
                return None
            self._fail(key, "is missing")
        value = self.value[key]
        if value is None and not optional:
            self._fail(key, "is null")
        return value

    def text(self, key: str, optional: bool = False) -> str | None:
        """A string (None for a missing or null key, where `optional`)."""
        value = self._get(key, optional)
        if value is not None and not isinstance(value, str):
            self._fail(key, f"must be a string, not {_describe(value)}")
        return value

    def sha256(self, key: str, optional: bool = False) -> str | None:
        """A SHA-256 digest, as `sha256_of` gives it: 64 lower-case hex digits."""
        value = self.text(key, optional)
        if value is not None and not _SHA256.fullmatch(value):
            self._fail(key, f"must be a sha256 (64 hex digits), not {_describe(value)}")
        return value

    def flag(self, key: str, optional: bool = False) -> bool | None:
        """A boolean."""
        value = self._get(key, optional)
        if value is not None and not isinstance(value, bool):
            self._fail(key, f"must be true or false, not {_describe(value)}")
        return value

    def integer(
        self, key: str, optional: bool = False, low: int | None = None, high: int | None = None
    ) -> int | None:
        """An integer within [low, high]."""
        value = self._get(key, optional)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self._fail(key, f"must be an integer, not {_describe(value)}")
        self._check_range(key, value, low, high)
        return value

    def number(
        self,
        key: str,
        optional: bool = False,
        low: float | None = None,
        high: float | None = None,
    ) -> float | None:
        """A finite number (an integer too) within [low, high], as a float."""
        value = self._get(key, optional)
        return None if value is None else self._finite(key, value, low, high)

    def _finite(self, key: str, value: Any, low: float | None, high: float | None) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            self._fail(key, f"must be a number, not {_describe(value)}")
        if isinstance(value, int) and value.bit_length() > 1000 or not math.isfinite(value):
            self._fail(key, f"must be a finite number, not {_describe(value)}")
        self._check_range(key, value, low, high)
        return float(value)

    def _check_range(self, key: str, value: float, low: float | None, high: float | None) -> None:
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"[{'' if low is None else low}, {'' if high is None else high}]"
            self._fail(key, f"must lie in {bounds}, not {_describe(value)}")

    def numbers(
        self,
        key: str,
        optional: bool = False,
        length: int | None = None,
        low: float | None = None,
        high: float | None = None,
    ) -> list[float] | None:
        """A list of `length` finite numbers, each within [low, high], as floats."""
        items = self.items(key, optional)
        if items is None:
            return None
        if length is not None and len(items) != length:
            self._fail(key, f"must be a list of {length} numbers, not of {len(items)} items")
        return [self._finite(f"{key}[{i}]", item, low, high) for i, item in enumerate(items)]

    def record(self, key: str, optional: bool = False) -> Record | None:
        """A nested object, as a Record whose errors name its whole key path."""
        value = self._get(key, optional)
        return None if value is None else Record(value, self.path, self.what, self._name(key))

    def items(self, key: str, optional: bool = False) -> list[Any] | None:
        """A list, its items unchecked (see `records`, `texts`)."""
        value = self._get(key, optional)
        if value is not None and not isinstance(value, list):
            self._fail(key, f"must be a list, not {_describe(value)}")
        return value

    def texts(self, key: str, optional: bool = False) -> list[str] | None:
        """A list of strings."""
        value = self.items(key, optional)
        if value is not None and not all(isinstance(v, str) for v in value):
            self._fail(key, "must be a list of strings")
        return value

    def records(self, key: str, optional: bool = False) -> Iterator[Record]:
        """A list of objects, each as a Record (`key[i]` in errors)."""
        for i, value in enumerate(self.items(key, optional) or []):
            yield Record(value, self.path, self.what, f"{self._name(key)}[{i}]")
