"""Libraries' own lines on the terminal (ITK's warnings, GDCM's and the JPEG decoders'
complaints about a file, XLA's notes), kept out of it: ctseg says what matters in its
own words, and these would land after its tables."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tempfile
from collections.abc import Iterator

import SimpleITK as sitk


@contextlib.contextmanager
def held(show: bool) -> Iterator[None]:
    """Hold what the process writes to its stderr file descriptor (where C++ libraries
    write) and what Python libraries log without a handler of their own, in a temporary
    file; at the end, print it under a heading when `show`.

    Python's `sys.stderr` and ctseg's own log handlers (its warnings and errors) go on
    to the terminal.
    """
    warnings_shown = sitk.ProcessObject.GetGlobalWarningDisplay()
    sitk.ProcessObject.SetGlobalWarningDisplay(show)
    try:
        with _fd_held(show):
            yield
    finally:
        sitk.ProcessObject.SetGlobalWarningDisplay(warnings_shown)


@contextlib.contextmanager
def _fd_held(show: bool) -> Iterator[None]:
    try:
        terminal_fd = os.dup(2)
    except OSError:  # no stderr to hold
        yield
        return
    python_stderr, last_resort = sys.stderr, logging.lastResort
    with contextlib.ExitStack() as stack:
        held_lines = stack.enter_context(tempfile.TemporaryFile())
        python_stderr.flush()
        os.dup2(held_lines.fileno(), 2)
        library_log = stack.enter_context(_text(os.dup(2)))
        logging.lastResort = logging.StreamHandler(library_log)
        logging.lastResort.setLevel(logging.WARNING)
        retargeted = []
        if _writes_to_fd(python_stderr, 2):  # keep Python's own lines on the terminal
            sys.stderr = stack.enter_context(_text(os.dup(terminal_fd)))
            for handler in logging.getLogger("ctseg").handlers + logging.getLogger().handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream is python_stderr:
                    handler.setStream(sys.stderr)
                    retargeted.append(handler)
        try:
            yield
        finally:
            for handler in retargeted:
                handler.setStream(python_stderr)
            sys.stderr, logging.lastResort = python_stderr, last_resort
            library_log.flush()
            os.dup2(terminal_fd, 2)
            os.close(terminal_fd)
            held_lines.seek(0)
            text = held_lines.read().decode("utf-8", "replace").strip()
    if show and text:
        print("library output:", file=sys.stderr)
        print(text, file=sys.stderr)


def _text(fd: int) -> io.TextIOWrapper:
    return io.TextIOWrapper(os.fdopen(fd, "wb"), encoding="utf-8", line_buffering=True)


def _writes_to_fd(stream: object, fd: int) -> bool:
    try:
        return stream.fileno() == fd  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return False
