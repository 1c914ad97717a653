"""Worker processes for per-case work (`write_store`'s `workers`), which end with their
parent however it ends, and never outnumber the CPUs this process may run on."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from ctseg.errors import OptionError

Item = TypeVar("Item")
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def usable_workers(requested: int) -> int:
    """`requested` worker processes, but at most one per CPU this process may run on.

    More would only share the CPUs (and multiply the memory), and were measured slower
    (docs/experiments/design-figures.md#worker-processes). OptionError below 1.
    """
    if requested < 1:
        raise OptionError(f"`workers` must be at least 1, got {requested}")
    try:
        cpus = len(os.sched_getaffinity(0))  # what taskset or a container's cpuset leaves
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return min(requested, cpus)


def each_in_workers(
    work: Callable[[Item], Any], items: Sequence[Item], workers: int, died: Any
) -> Iterator[tuple[Item, Any]]:
    """`work(item)` for every item, in this process or in a pool of `workers` processes;
    yields each item with its result as it finishes. `work` must be a module-level
    function (it is pickled); an item whose worker died (killed for memory) yields `died`.
    """
    if workers == 1 or len(items) <= 1:
        for item in items:
            yield item, work(item)
        return
    # 'spawn': forking a parent that may have started JAX's threads can deadlock the child.
    pool = ProcessPoolExecutor(
        max_workers=min(workers, len(items)),
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_end_with_parent,
        initargs=(os.getpid(),),
    )
    try:
        futures = {pool.submit(work, item): item for item in items}
        for future in as_completed(futures):
            yield futures[future], _result(future, died)
    finally:
        # On Ctrl-C, start no further item; those running finish (their writes are atomic).
        pool.shutdown(wait=True, cancel_futures=True)


def _result(future: Future, died: Any) -> Any:
    try:
        return future.result()
    except BrokenProcessPool:
        return died


def _end_with_parent(parent: int) -> None:
    """Pool initializer: this worker ends when `parent` does, even killed by SIGKILL.

    A worker busy with a case outlives a killed parent otherwise, and keeps the
    multiprocessing resource tracker (which waits for every holder of its pipe) alive.
    """
    try:  # Linux: the kernel sends the signal, whatever the worker is doing
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (AttributeError, OSError):  # elsewhere: a thread watches for the parent
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # it died before the signal was asked for
        os._exit(1)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)
