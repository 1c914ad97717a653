"""`ctseg preprocess`."""

from cli.app import app
from ctseg.errors import CtsegError


@app.command(hidden=False)
def preprocess() -> None:
    """Not implemented yet."""
    raise CtsegError("`ctseg preprocess` is not implemented yet")
