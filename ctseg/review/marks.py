"""The reviewer's marks: `OUT/review.json`, and its CSV export.

```json
{"written_by": "ctseg review", "version": 1,
 "marks": {"NAME": {"mark": "accept" | "reject" | "needs correction" | null,
                    "comment": "…", "reviewer": "who", "at": "2026-11-28T03:04:05Z"}}}
```

Each save reads the file, changes one scan's mark and writes the whole file atomically
(`ctseg.atomic`), under a lock: two browser tabs marking different scans keep both marks,
and a crash never leaves half a file. A mark cleared (`null` with no comment) is removed.
"""

from __future__ import annotations

import csv
import io
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ctseg import atomic
from ctseg.errors import CtsegError
from ctseg.reading import Record

MARKS_FILE = "review.json"
VERSION = 1
MARKS = ("accept", "reject", "needs correction")
COMMENT_CHARS = 2000  # a paragraph; the request's body limit is the server's


class BadMark(ValueError):
    """A mark the page sent that is none of `MARKS`, or a comment too long."""


@dataclass(frozen=True)
class Mark:
    mark: str | None
    comment: str
    reviewer: str
    at: str

    def to_json(self) -> dict[str, Any]:
        return {"mark": self.mark, "comment": self.comment, "reviewer": self.reviewer,
                "at": self.at}  # fmt: skip


class Marks:
    """The marks of one folder, saved to its `review.json` by whoever serves it."""

    def __init__(self, folder: Path, reviewer: str):
        self.path = Path(folder) / MARKS_FILE
        self.reviewer = reviewer
        self._lock = threading.Lock()
        self.read()  # a malformed file is one line now, not an error on the first save

    def read(self) -> dict[str, Mark]:
        """Every scan's mark; none yet if there is no file."""
        try:
            record = Record.read(self.path, "review marks")
        except FileNotFoundError:
            return {}
        if record.text("written_by", optional=True) != "ctseg review":
            raise CtsegError(f"{self.path} was not written by ctseg review; move it away")
        marks = {}
        for name, value in (record.record("marks") or Record({}, self.path)).value.items():
            entry = Record(value, self.path, "review marks", f"marks.{name}")
            mark = entry.text("mark", optional=True)
            if mark is not None and mark not in MARKS:
                _fail_mark(entry, mark)
            marks[name] = Mark(
                mark,
                entry.text("comment", optional=True) or "",
                entry.text("reviewer", optional=True) or "",
                entry.text("at", optional=True) or "",
            )
        return marks

    def save(self, name: str, mark: str | None, comment: str) -> Mark | None:
        """Set `name`'s mark and comment, by this reviewer now; the mark kept (None where
        both are empty: the scan's mark removed)."""
        if mark is not None and mark not in MARKS:
            raise BadMark(f"mark must be one of {', '.join(MARKS)} or null, not {mark!r}")
        if len(comment) > COMMENT_CHARS:
            raise BadMark(f"a comment has at most {COMMENT_CHARS} characters")
        at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        kept = Mark(mark, comment, self.reviewer, at) if mark or comment.strip() else None
        with self._lock:  # read, change one, write: another tab's save is never lost
            marks = self.read()
            if kept is None:
                marks.pop(name, None)
            else:
                marks[name] = kept
            record = {
                "written_by": "ctseg review",
                "version": VERSION,
                "marks": {n: m.to_json() for n, m in sorted(marks.items())},
            }
            atomic.write_json(self.path, record)
        return kept

    def to_csv(self, names: Iterable[str]) -> str:
        """One row per scan, in the page's order: name, mark, comment, reviewer, when."""
        marks = self.read()
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(["scan", "mark", "comment", "reviewer", "at"])
        for name in names:
            mark = marks.get(name)
            if mark is None:
                writer.writerow([name, "", "", "", ""])
            else:
                row = [name, mark.mark or "", mark.comment, mark.reviewer, mark.at]
                writer.writerow([_inert(cell) for cell in row])
        return out.getvalue()


def _inert(cell: str) -> str:
    """A cell a spreadsheet shows as text: a comment starting with = + - @ would be run as a
    formula by Excel or LibreOffice when the export is opened."""
    return "'" + cell if cell[:1] in ("=", "+", "-", "@", "\t", "\r") else cell


def _fail_mark(entry: Record, mark: str) -> None:
    raise CtsegError(
        f"review marks {entry.path}: key {entry.key + '.mark'!r} must be one of "
        f"{', '.join(MARKS)}, not {mark!r}"
    )
