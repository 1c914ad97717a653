"""Planning for a target from a command: the compile runs in a child process.

The compile-only plugins (JAX's CUDA plugin, libtpu) start with JAX in whatever process
imports them, and say so on standard error; the command's own process must stay as it is
without them (the same devices, no start-up lines). So the child (`ctseg.targets.child`)
gets its own environment: JAX_PLATFORMS=cpu (the CUDA plugin then registers without
looking for a GPU), and the accelerator type libtpu would otherwise ask the machine for.

The child dies with the command: it runs in a process group of its own, which the
command kills when it leaves `plan_on_target` for any reason (Ctrl-C, an exception, or
SIGTERM, which it turns into that while the child runs), and the child itself watches
the command (`ctseg.targets.child`: Linux's parent-death signal, else a thread polling
its parent), so that even a SIGKILL leaves no compile running.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from ctseg import config as cfg
from ctseg.errors import CtsegError
from ctseg.parallel.xla_options import add_options
from ctseg.targets.catalogue import EXTRA, Target

# What each platform's compile-only devices need installed (the `targets` extra).
_PLUGINS = {"cuda": "jax_cuda12_plugin", "tpu": "libtpu"}
# The command's process id, in the child's environment: the child ends when it is gone.
PARENT_ENV = "CTSEG_PARENT_PID"


def plugin_installed(platform: str) -> bool:
    return importlib.util.find_spec(_PLUGINS[platform]) is not None


def plan_on_target(config: cfg.Config, target: Target, search: bool = True) -> dict[str, Any]:
    """`ctseg.targets.compile.plan_target` in a child process; CtsegError in one line for a
    missing extra or a compile that failed for another reason than memory."""
    if not plugin_installed(target.platform):
        what = "JAX's CUDA plugin" if target.platform == "cuda" else "libtpu"
        raise CtsegError(
            f"compiling for {target.name} needs {what}, which is not installed: {EXTRA}"
        )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "CTSEG_COMPILE_CACHE": "off"}
    if target.accelerator_type:  # else libtpu asks the machine, and warns that it cannot
        env["TPU_ACCELERATOR_TYPE"] = target.accelerator_type
    env[PARENT_ENV] = str(os.getpid())  # the child dies when this process does
    add_options(env)  # compiled as a command would compile on the GPU
    request = {"config": cfg.to_dict(config), "target": asdict(target), "search": search}
    done = run_child([sys.executable, "-m", "ctseg.targets.child"], json.dumps(request), env)
    if done.returncode != 0 or not done.stdout.strip():
        raise CtsegError(f"compiling for {target.name} failed: {_cause(done)}")
    result = json.loads(done.stdout)
    if "error" in result:
        raise CtsegError(result["error"])
    return result


def run_child(command: list[str], stdin: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`subprocess.run(command)` with `stdin`, its output captured, in a process group of its
    own that is killed whenever this function leaves before the child has ended."""
    child = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own group: killed whole, children of its own too
    )
    try:
        with _sigterm_kills_child(child):
            stdout, stderr = child.communicate(stdin)
    except BaseException:
        _kill_group(child)
        raise
    return subprocess.CompletedProcess(command, child.returncode, stdout, stderr)


def _kill_group(child: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        child.wait(timeout=10)


@contextlib.contextmanager
def _sigterm_kills_child(child: subprocess.Popen) -> Iterator[None]:
    """While the child runs, SIGTERM to this process kills the child's group first, then
    does what it did before (by default: ends this process, as SIGTERM does)."""
    previous = signal.getsignal(signal.SIGTERM)
    if previous is None:  # a handler not set from Python: restored as the default
        previous = signal.SIG_DFL
    # Only the main thread may handle signals (the group is still killed on leaving), and
    # a process that ignores SIGTERM goes on ignoring it.
    if threading.current_thread() is not threading.main_thread() or previous == signal.SIG_IGN:
        yield
        return

    def terminated(signum: int, frame: object) -> None:
        _kill_group(child)
        signal.signal(signal.SIGTERM, previous)
        if callable(previous):
            previous(signum, frame)
        else:
            os.kill(os.getpid(), signal.SIGTERM)  # the default: die of it, as before

    signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is terminated:
            signal.signal(signal.SIGTERM, previous)


# Lines that libraries print on starting in the child (absl's and XLA's logging, the CUDA
# plugin's "Could not find cuda drivers"): never the cause of a failure.
_LOG_LINE = re.compile(
    r"^(?:[IWEF]\d{4} |WARNING: All log messages before|WARNING: Logging before)"
)


def _cause(done: subprocess.CompletedProcess) -> str:
    """The child's exception in one line: the traceback's last `…Error: …` line (JAX adds a
    note about its filtered frames after it); a child killed by a signal says which."""
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    lines = [line for line in lines if not _LOG_LINE.match(line)]
    errors = [line for line in lines if re.match(r"[\w.]+(Error|Exception)\b.*:", line)]
    if errors:
        return errors[-1]
    if done.returncode < 0:
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = f"signal {-done.returncode}"
        last = f" (its last words: {lines[-1]})" if lines else ""
        return (
            f"the compiler crashed with {name}{last}; the target's description may hold a "
            "value no device has"
        )
    return lines[-1] if lines else f"exit status {done.returncode}"
