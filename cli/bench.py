"""`ctseg bench`."""

from cli.app import app
from ctseg.errors import CtsegError


@app.command(hidden=False)
def bench() -> None:
    """Not implemented yet."""
    raise CtsegError("`ctseg bench` is not implemented yet")
