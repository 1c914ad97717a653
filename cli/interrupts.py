"""Ctrl-C (SIGINT) and SIGTERM from a command's first instant: one line on stderr, the
shell's status for the signal (130, 143), never a traceback, never a signal swallowed.

While the command starts (its imports: `importing`; JAX's start: `starting`) nothing is
written yet, and a KeyboardInterrupt raised there is unsafe: a gc callback of JAX's
swallows it ("Exception ignored in _xla_gc_callback": the command runs on and exits 0),
and raised through JAX's native start it has ended in SIGABRT or SIGSEGV. So a signal then
ends the process at once, dying of it. Once the command runs (`handle`), a signal raises
KeyboardInterrupt, as Ctrl-C always did (SIGTERM too, its number in the args), so that
`with` blocks remove their temporaries and release their locks, and training saves a
checkpoint; one swallowed where Python cannot raise it (a gc callback, a `__del__`) is
delivered again, and a command that ends after a signal ends as interrupted (`honoured`).

Only the standard library here (and training's stdlib-only signals): this is imported
before everything else.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from ctseg.training.signals import STOP_SIGNALS  # the standard library only, as here

# A gc callback or `__del__` that swallowed an interruption returns within this, as a rule.
_REDELIVERY_SECONDS = 0.05

_received: int | None = None  # the first stop signal the handler saw
_at_once = False  # a signal ends the process at once (nothing is written meanwhile)


@contextlib.contextmanager
def importing() -> Iterator[None]:
    """While the command line's modules are imported: a signal ends the process at once,
    with one line. The handlers are put back afterwards: a test importing the command line
    keeps its own, and `handle` installs the command's."""
    if not _ours_to_handle():
        yield
        return
    previous = _install()
    try:
        with _ending_at_once():
            yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def handle() -> None:
    """Handle SIGINT and SIGTERM in this process from now on: a command runs."""
    if _ours_to_handle():
        _install()
        sys.unraisablehook = _delivered_again(sys.unraisablehook)


def starting() -> contextlib.AbstractContextManager[None]:
    """While JAX starts: a signal ends the process at once, as during the imports."""
    return _ending_at_once()


@contextlib.contextmanager
def honoured() -> Iterator[None]:
    """Around the command: after a signal, one line, and the shell's status for it.

    A command's own status for the signal (128 + its number: `ctseg train`'s, its checkpoint
    saved) stands; any other ending (Typer's 130 for every KeyboardInterrupt, SIGTERM's
    too, or a status 0 from a command that ran on) is a death by the signal, which a
    shell's loop needs to stop, as Python ends on an uncaught KeyboardInterrupt. Once the
    command is over, a signal while Python shuts down (JAX's threads joined: a second or
    more) ends the process at once, not in a traceback.
    """
    global _at_once
    try:
        yield
    except (KeyboardInterrupt, SystemExit) as end:
        _at_once = True
        if _received is None:
            raise
        _say(_received)
        if isinstance(end, SystemExit) and end.code == 128 + _received:
            raise
        _die(_received)
    _at_once = True
    if _received is not None:
        _say(_received)
        _die(_received)


@contextlib.contextmanager
def _ending_at_once() -> Iterator[None]:
    global _at_once
    before, _at_once = _at_once, True
    try:
        yield
    finally:
        _at_once = before


def _ours_to_handle() -> bool:
    """Signals are the main thread's to handle, and not a worker process's (`preprocess
    --workers` imports the command line again in each): its parent says the line."""
    if threading.current_thread() is not threading.main_thread():
        return False
    multiprocessing = sys.modules.get("multiprocessing")  # imported first in a worker
    return multiprocessing is None or multiprocessing.current_process().name == "MainProcess"


def _install() -> dict[int, Any]:
    """`_on_signal` for SIGINT and SIGTERM, except for a signal that is ignored (`nohup`, a
    background job's Ctrl-C): it stays ignored. The handlers it replaced."""
    return {
        number: signal.signal(number, _on_signal)
        for number in STOP_SIGNALS
        if signal.getsignal(number) is not signal.SIG_IGN
    }


def _on_signal(number: int, frame: Any) -> None:
    global _received
    if _received is None:
        _received = number
    if _at_once:
        _say(number)
        _die(number)
    raise KeyboardInterrupt(number)


def _say(number: int) -> None:
    with contextlib.suppress(Exception):  # no stderr left to say it on
        sys.stderr.write(f"interrupted ({signal.Signals(number).name})\n")
        sys.stderr.flush()


def _die(number: int) -> None:
    """End the process now as a death by signal `number`: no finalisation, in which
    JAX's threads have crashed the process after an interruption."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    signal.signal(number, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [number])
    os.kill(os.getpid(), number)
    os._exit(128 + number)  # not reached: the signal's default action ends the process


def _delivered_again(previous: Any) -> Any:
    """An unraisable-exception hook that delivers a swallowed interruption again."""

    def hook(unraisable: Any) -> None:
        if not issubclass(unraisable.exc_type, KeyboardInterrupt):
            previous(unraisable)
            return
        args = getattr(unraisable.exc_value, "args", ())
        number = args[0] if args and args[0] in STOP_SIGNALS else signal.SIGINT
        # Not `threading`: its start waits for the thread, and the signal would land in
        # this hook. At interpreter shutdown no thread starts: the command is over.
        with contextlib.suppress(RuntimeError):
            _thread.start_new_thread(_deliver_later, (number,))

    return hook


def _deliver_later(number: int) -> None:
    """Send `number` to the main thread again once it is out of the callback that swallowed
    it (raised there again, it would be swallowed again). Where it lands in another such
    callback, the hook runs again, until it lands in the command's own code. A signal, not
    `_thread.interrupt_main`: a main thread asleep or waiting wakes to it."""
    time.sleep(_REDELIVERY_SECONDS)
    with contextlib.suppress(OSError):  # the main thread is gone: the process is ending
        signal.pthread_kill(threading.main_thread().ident, number)
