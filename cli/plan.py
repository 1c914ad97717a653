"""`ctseg plan`."""

from cli.app import app
from ctseg.errors import CtsegError


@app.command(hidden=False)
def plan() -> None:
    """Not implemented yet."""
    raise CtsegError("`ctseg plan` is not implemented yet")
