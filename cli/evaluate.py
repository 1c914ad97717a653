"""`ctseg evaluate`."""

from cli.app import app
from ctseg.errors import CtsegError


@app.command(hidden=False)
def evaluate() -> None:
    """Not implemented yet."""
    raise CtsegError("`ctseg evaluate` is not implemented yet")
