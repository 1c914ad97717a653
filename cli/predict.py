"""`ctseg predict`."""

from cli.app import app
from ctseg.errors import CtsegError


@app.command(hidden=False)
def predict() -> None:
    """Not implemented yet."""
    raise CtsegError("`ctseg predict` is not implemented yet")
