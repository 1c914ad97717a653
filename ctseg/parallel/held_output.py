"""What JAX's plugins print while they start, held out of the terminal (the library's way).

While JAX imports its plugins and starts its backends, what they print on the stderr file
descriptor and log without a handler of their own is held, then logged at debug level
under this module's logger: an API user's terminal shows ctseg's words, not the CUDA
plugin's "Could not find cuda drivers" on a machine without a GPU.

Why not one mechanism with the commands' `ctseg.cli.library_output.held`: that one holds
for the whole command, silences SimpleITK's warnings, keeps Python's `sys.stderr` and
ctseg's own handlers on the terminal and prints what it held under a heading with
--verbose; this one holds only JAX's start, logs what it held at debug level, and must
not import cli/ (the library sits below the commands). A command that holds the output
itself switches this off (`commands_hold_output`), so the two never nest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Iterator

_log = logging.getLogger(__name__)
# Whether JAX's start holds what its plugins print (the library's way); a command holds
# it itself, to show it with --verbose (`commands_hold_output`).
_hold_start_output = True
# One holder of the stderr descriptor at a time (API calls from several threads); nested
# holds in one thread are each other's.
_holding = threading.RLock()


def commands_hold_output() -> None:
    """Called by the commands before JAX starts: they hold what libraries print themselves
    (`ctseg.cli.library_output`), and show it with --verbose."""
    global _hold_start_output
    _hold_start_output = False


@contextlib.contextmanager
def held_start_output() -> Iterator[None]:
    """While JAX imports its plugins and starts its backends: what they print on the stderr
    file descriptor (the CUDA plugin's "Could not find cuda drivers" on a machine without a
    GPU, libtpu's TPU_WORKER_HOSTNAMES errors) and log without a handler of their own (JAX's
    "Jax plugin configuration error" traceback) is held, then logged at debug level here.

    The library's counterpart of the commands' `ctseg.cli.library_output.held`; a no-op
    where a command holds the output itself (`commands_hold_output`)."""
    if not _hold_start_output:
        yield
        return
    with _holding:
        yield from _held()


def _held() -> Iterator[None]:
    try:
        terminal = os.dup(2)
    except OSError:  # no stderr to hold
        yield
        return
    last_resort = logging.lastResort
    with tempfile.TemporaryFile() as held:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(held.fileno(), 2)
        log = open(os.dup(2), "w", encoding="utf-8", errors="replace")  # noqa: SIM115
        logging.lastResort = logging.StreamHandler(log)
        logging.lastResort.setLevel(logging.WARNING)
        try:
            yield
        finally:
            logging.lastResort = last_resort
            log.close()
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(terminal, 2)
            os.close(terminal)
            held.seek(0)
            text = held.read().decode("utf-8", "replace").strip()
    if text:
        _log.debug("what JAX and its plugins printed on starting:\n%s", text)
