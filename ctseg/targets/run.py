"""Planning for a target from a command: the compile runs in a child process.

The compile-only plugins (JAX's CUDA plugin, libtpu) start with JAX in whatever process
imports them, and say so on standard error; the command's own process must stay as it is
without them (the same devices, no start-up lines). So the child (`ctseg.targets.child`)
gets its own environment: JAX_PLATFORMS=cpu (the CUDA plugin then registers without
looking for a GPU), and the accelerator type libtpu would otherwise ask the machine for.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict
from typing import Any

from ctseg import config as cfg
from ctseg.errors import CtsegError
from ctseg.targets.catalogue import EXTRA, Target

# What each platform's compile-only devices need installed (the `targets` extra).
_PLUGINS = {"cuda": "jax_cuda12_plugin", "tpu": "libtpu"}


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
    request = {"config": cfg.to_dict(config), "target": asdict(target), "search": search}
    done = subprocess.run(
        [sys.executable, "-m", "ctseg.targets.child"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
    )
    if done.returncode != 0 or not done.stdout.strip():
        raise CtsegError(f"compiling for {target.name} failed: {_cause(done)}")
    result = json.loads(done.stdout)
    if "error" in result:
        raise CtsegError(result["error"])
    return result


def _cause(done: subprocess.CompletedProcess) -> str:
    """The child's exception in one line: the traceback's last `…Error: …` line (JAX adds a
    note about its filtered frames after it)."""
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"[\w.]+(Error|Exception)\b.*:", line)]
    if errors:
        return errors[-1]
    return lines[-1] if lines else f"exit status {done.returncode}"
