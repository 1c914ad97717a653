"""Stopping a training run cleanly: Ctrl-C, and `kill` or a job scheduler's time limit
(SIGTERM), both end in KeyboardInterrupt, after which the loop saves a checkpoint.

A signal that lands while a step runs is held until the step's new state is bound
(`interrupt_after_step`), so that there is always a whole state to save.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _stop(number: int, frame: Any) -> None:
    """SIGTERM's handler while training: stop as Ctrl-C does, the signal's number kept."""
    raise KeyboardInterrupt(number)


@contextlib.contextmanager
def handled(handlers: dict[int, Any]) -> Iterator[None]:
    """Signal handlers, in the main thread only (elsewhere the signals are not ours), except
    for a signal that is ignored (`nohup`, a background job): it stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {
        number: signal.signal(number, handler)
        for number, handler in handlers.items()
        if signal.getsignal(number) is not signal.SIG_IGN
    }
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def sigterm_stops() -> contextlib.AbstractContextManager[None]:
    """While training: SIGTERM raises KeyboardInterrupt(SIGTERM), as Ctrl-C raises it."""
    return handled({signal.SIGTERM: _stop})


@contextlib.contextmanager
def interrupt_after_step() -> Iterator[None]:
    """Hold a Ctrl-C or SIGTERM that lands during a step until the new state is bound.

    The step consumes (donates) the old state's buffers: interrupted inside it, the
    loop would have no whole state left to save, and Ctrl-C would end in a traceback.
    """
    received: list[int] = []
    with handled({number: lambda n, frame: received.append(n) for number in STOP_SIGNALS}):
        yield
    if received:
        raise KeyboardInterrupt(received[0])
