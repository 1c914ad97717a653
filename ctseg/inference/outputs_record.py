"""The record, in an output folder, of the files `ctseg predict` wrote there (`OwnOutputs`,
`.ctseg-outputs.json`): what a later call may replace.

Each file is listed with the scan it was predicted from and its content as written (size
and sha256), so that a file is ctseg's only while its content is what ctseg wrote: a label
map corrected by hand and saved over `NAME_seg.nii.gz` is the user's, replaced only with
--force, whatever else of the scan's outputs was deleted. Entries of an earlier ctseg have
no content: their files are ctseg's by name, as they were (`compat.outputs_entry`).

A file is listed before it appears under its name: its content is recorded as pending
(`claim`) before the renames that put the scan's outputs in place, and as written once they
are (`confirm`), so a kill in between leaves no file of ours unlisted, and either content
counts as ours until the next write.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ctseg import atomic, compat
from ctseg.errors import CtsegError, OptionError
from ctseg.reading import Record, sha256_of

OUTPUTS_RECORD = ".ctseg-outputs.json"
_WHAT = "predict's record"

Content = tuple[int, str]  # (size in bytes, sha256 in hex)


@dataclass(frozen=True)
class Written:
    """One file of the record: the scan it was predicted from, its content as written
    (None: an earlier ctseg recorded none), and content about to replace it (`pending`)."""

    scan: str
    content: Content | None
    pending: Content | None = None

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"scan": self.scan}
        if self.content is not None:
            entry["bytes"], entry["sha256"] = self.content
        if self.pending is not None:
            entry["pending"] = {"bytes": self.pending[0], "sha256": self.pending[1]}
        return entry


def _content(record: Record) -> Content | None:
    """(bytes, sha256), both or neither (an earlier ctseg's entry)."""
    size, sha256 = record.integer("bytes", optional=True, low=0), record.sha256("sha256", True)
    if size is None and sha256 is None:
        return None
    return record.integer("bytes", low=0), record.sha256("sha256")  # the other names itself


def _entry(value: Any, path: Path, name: str) -> Written:
    key = f"outputs.{name}"
    raw = compat.outputs_entry(value) if isinstance(value, dict) else value
    record = Record(raw, path, _WHAT, key)
    pending = record.record("pending", optional=True)
    return Written(record.text("scan"), _content(record), pending and _content(pending))


class OwnOutputs:
    """The files `ctseg predict` wrote in `out_dir`, as its record lists them.

    Whoever writes holds the folder's lock (`ctseg.lock`); threads of one call share one
    record. A record that cannot be read is `problem` (nothing is ours; the writer refuses
    the folder without force, `check`); an entry that cannot be read makes its file not
    ours (`bad`), and is kept as it was when the record is written again."""

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / OUTPUTS_RECORD
        self._lock = threading.Lock()
        self.files: dict[str, Written] = {}
        self.bad: dict[str, str] = {}  # file name -> why its entry cannot be read
        self._raw: dict[str, Any] = {}  # those entries, as they were
        self.problem: str | None = None
        try:
            record = Record.read(self.path, _WHAT)
            record.text("written_by", optional=True)
            outputs = record.record("outputs")
        except FileNotFoundError:
            return  # none yet: nothing here is ours
        except CtsegError as exc:
            self.problem = str(exc)
            return
        for name, value in outputs.value.items():
            try:
                self.files[name] = _entry(value, self.path, name)
            except CtsegError as exc:
                self.bad[name], self._raw[name] = str(exc), value

    def check(self, force: bool) -> None:
        """CtsegError, one line, if the record cannot be read and not `force` (which
        starts a new record: what the old one listed is then no longer ctseg's)."""
        if self.problem is not None and not force:
            raise OptionError(
                f"{self.problem}; it says which files of {self.path.parent} ctseg wrote: "
                f"fix or remove it, or use `force` to start a new record"
            )

    def _here(self, path: Path) -> bool:
        return Path(path).parent.resolve() == self.path.parent.resolve()

    def listed(self, path: Path) -> bool:
        """Whether the record names `path` (a file of `out_dir`), whatever its content: an
        output of ctseg predict, not a scan or a mask."""
        with self._lock:
            name = Path(path).name
            return self._here(path) and (name in self.files or name in self.bad)

    def refusal(self, paths: Sequence[Path]) -> str | None:
        """Why the first of `paths` that exists (a dangling link too) is not ctseg's to
        replace, in one line; None when every one that exists is."""
        for path in map(Path, paths):
            if os.path.lexists(path) and (why := self._not_ours(path)):
                return f"{path} {why}; use --force to replace it, or another --out"
        return None

    def _not_ours(self, path: Path) -> str | None:
        with self._lock:
            entry = self.files.get(path.name) if self._here(path) else None
            bad = self.bad.get(path.name) if self._here(path) else None
        if bad is not None:
            return f"is not known to be ctseg's ({bad})"
        if entry is None:
            return (
                f"was not written by ctseg predict (the folder's record {self.path.name} "
                "does not list it; earlier versions kept none)"
            )
        if entry.content is None:
            return None  # an earlier ctseg's entry: ours by name
        accepted = {entry.content, entry.pending}
        try:
            size = path.stat().st_size
            if not any(c is not None and c[0] == size for c in accepted):
                return self._changed()
            return None if sha256_of(path, "output") in accepted else self._changed()
        except (OSError, CtsegError) as exc:
            return f"cannot be read to tell whether ctseg wrote it ({exc})"

    def _changed(self) -> str:
        return (
            f"was changed since ctseg predict wrote it (its content is not what the folder's "
            f"record {self.path.name} lists)"
        )

    def claim(self, contents: dict[Path, Content], source: Path) -> None:
        """List the files of `contents` as ctseg's, the outputs of the scan read from
        `source`, with the content each is about to have (pending until `confirm`)."""
        scan = str(Path(source).resolve())
        with self._lock:
            for path, content in contents.items():
                earlier = self.files.get(path.name)
                kept = None if earlier is None else earlier.content  # on disk until renamed
                self.files[path.name] = Written(scan, kept, content)
                self.bad.pop(path.name, None)
                self._raw.pop(path.name, None)
            self._write()

    def confirm(self, paths: Sequence[Path]) -> None:
        """The pending content of `paths` is now theirs (they were renamed into place)."""
        with self._lock:
            for path in map(Path, paths):
                entry = self.files[path.name]
                self.files[path.name] = Written(entry.scan, entry.pending or entry.content)
            self._write()

    def _write(self) -> None:
        outputs = {**self._raw, **{name: w.to_json() for name, w in self.files.items()}}
        atomic.write_json(self.path, {"written_by": "ctseg predict", "outputs": outputs})
