"""Entry point of the `ctseg` console script."""

import logging
import sys

from rich.console import Console

from cli import bench, evaluate, plan, predict, preprocess, synth, train  # noqa: F401  (registers)
from cli.app import app
from ctseg.errors import CtsegError


def main() -> None:
    # Libraries log what is theirs to know (orbax: "Given directory is read only" on every
    # prediction); the user sees ctseg's own lines, and errors.
    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        app()
    except CtsegError as exc:
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]error:[/] {exc}")
        sys.exit(2)


if __name__ == "__main__":
    main()
