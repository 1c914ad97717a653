"""The child process of `ctseg plan --target`: a request as JSON on standard input (the
config, the target, whether to search), `compile.plan_target`'s result as JSON on standard
output. A user's mistake is ``{"error": "…"}``; anything else fails with its traceback on
standard error, which the parent keeps for the message."""

from __future__ import annotations

import json
import sys

from ctseg import config as cfg
from ctseg.errors import CtsegError
from ctseg.targets.catalogue import Target


def main() -> None:
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
