"""Entry point of the `ctseg` console script (and of `python -m ctseg`)."""

import logging
import sys

from ctseg.cli import interrupts

# The console script imports this module before it calls `main`, and these imports (typer,
# rich, every command's module) take a second: a Ctrl-C or SIGTERM among them ends the
# process with one line, not a traceback. Whoever else imports this module (a test) has its
# own signal handlers back afterwards.
with interrupts.importing():
    from rich.console import Console
    from rich.markup import escape

    # The commands' modules import no JAX (`ctseg --help` answers without it): each command
    # starts JAX itself (`ctseg.cli.options.start_jax`), holding what its plugins print.
    from ctseg.cli import (  # noqa: F401  (registers the commands)
        bench,
        evaluate,
        folds,
        plan,
        predict,
        preprocess,
        review,
        synth,
        train,
    )
    from ctseg.cli.app import app
    from ctseg.errors import CtsegError


def main() -> None:
    interrupts.handle()
    # Libraries log what is theirs to know (orbax: "Given directory is read only" on every
    # prediction; matplotlib, imported with the first picture: "building the font cache"
    # on a new machine); the user sees ctseg's own lines, and errors.
    for library in ("absl", "matplotlib"):
        logging.getLogger(library).setLevel(logging.ERROR)
    # ctseg's own warnings (a checkpoint skipped as unreadable, say) read as its other lines.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("warning: %(message)s"))
    handler.setLevel(logging.WARNING)
    logging.getLogger("ctseg").addHandler(handler)
    logging.getLogger("ctseg").propagate = False
    with interrupts.honoured():
        try:
            app()
        except CtsegError as exc:
            # Escaped: a message is plain text, and a path like x[final] must keep its brackets.
            console = Console(stderr=True, highlight=False, soft_wrap=True)
            console.print(f"[bold red]error:[/] {escape(str(exc))}")
            sys.exit(2)


if __name__ == "__main__":
    main()
