"""`ctseg train`."""

from cli.app import app
from ctseg.errors import CtsegError


@app.command(hidden=False)
def train() -> None:
    """Not implemented yet."""
    raise CtsegError("`ctseg train` is not implemented yet")
