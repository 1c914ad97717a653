"""`ctseg review`: a browser page for reviewing a batch of predictions."""

import getpass
import os
import secrets
import threading
import webbrowser
from pathlib import Path
from typing import Annotated

import typer

from ctseg.cli.app import app
from ctseg.errors import CtsegError


def _default_reviewer() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a container's user without a passwd entry
        return os.environ.get("USER", "unknown")


@app.command()
def review(
    out_dir: Annotated[
        Path,
        typer.Argument(
            help="Folder of `ctseg predict --out`, or of `ctseg evaluate` (Dice shown too).",
            metavar="OUT_DIR",
        ),
    ],
    port: Annotated[
        int, typer.Option(help="Port to listen on (0: a free one).", min=0, max=65535)
    ] = 0,
    host: Annotated[
        str,
        typer.Option(
            help="Address to listen on. Anything but 127.0.0.1 lets other machines reach "
            "the page (with the link's token)."
        ),
    ] = "127.0.0.1",
    reviewer: Annotated[
        str | None,
        typer.Option(help="Name recorded with each mark. Default: the user's login name."),
    ] = None,
    open_browser: Annotated[
        bool, typer.Option("--open", help="Open the page in the default browser.")
    ] = False,
) -> None:
    """Review a batch of predictions in the browser, the worst first, marks kept.

    The page lists the scans by verdict (review, unlike the training data,
    ok) and score, shows each scan with its labels in 2-D and 3-D (NiiVue),
    and keeps your marks (accept, reject, needs correction, a comment) in
    OUT_DIR/review.json. It starts a local web server and prints one line
    with the page's link, which carries a random token: the server answers
    nothing without it. Needs the review extra: pip install
    'ctseg\\[review]'. Ctrl-C stops it.
    """
    try:
        from ctseg.review import server
    except ImportError as exc:
        raise CtsegError(
            f"ctseg review needs the review extra ({exc.name} is missing): "
            "pip install 'ctseg[review]'"
        ) from None
    name = reviewer if reviewer is not None else _default_reviewer()
    if not name.strip() or len(name) > 100:
        raise CtsegError("--reviewer needs a name of 1 to 100 characters")
    token = secrets.token_urlsafe(24)
    # The batch and its marks are read before anything listens: a bad folder is one line.
    application = server.make_app(out_dir, token, name)
    sock = server.bind(host, port)
    url = server.review_url(host, sock.getsockname()[1], token)
    exposed = "" if host in server.LOOPBACK else f" — listening on {host}, not only this machine"
    typer.echo(f"review: {url}  (Ctrl-C stops){exposed}", err=False)
    if open_browser:
        threading.Timer(0.5, webbrowser.open, (url,)).start()
    server.serve(sock, application)
