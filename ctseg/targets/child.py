"""The child process of `ctseg plan --target`: a request as JSON on standard input (the
config, the target, whether to search), `compile.plan_target`'s result as JSON on standard
output. A user's mistake is ``{"error": "…"}``; anything else fails with its traceback on
standard error, which the parent keeps for the message.

The child ends with its parent (`ctseg.targets.process` names it in CTSEG_PARENT_PID): on
Linux the kernel sends it SIGKILL when the parent dies (PR_SET_PDEATHSIG); elsewhere a
thread polls the parent's id. A compile for a command that is gone is no use to anyone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import signal
import sys
import threading
import time

from ctseg import config as cfg
from ctseg.errors import CtsegError
from ctseg.targets.catalogue import Target
from ctseg.targets.process import PARENT_ENV

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_POLL_SECONDS = 1.0


def die_with_parent(parent: int | None) -> None:
    """End this process when `parent` (a process id; None: nothing to watch) ends."""
    if parent is None:
        return
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the thread below still watches
    # The parent may have gone before the signal was asked for: then it never comes.
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="ctseg-parent-watch", daemon=True).start()


def _parent() -> int | None:
    try:
        return int(os.environ[PARENT_ENV])
    except (KeyError, ValueError):
        return None


def main() -> None:
    die_with_parent(_parent())
    request = json.load(sys.stdin)
    try:
        from ctseg.targets.compile import plan_target

        config = cfg.from_dict(request["config"])
        result = plan_target(config, Target(**request["target"]), request.get("search", True))
    except CtsegError as exc:
        result = {"error": str(exc)}
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
