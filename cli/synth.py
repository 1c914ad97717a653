"""`ctseg synth`."""

from cli.app import app
from ctseg.errors import CtsegError


@app.command(hidden=False)
def synth() -> None:
    """Not implemented yet."""
    raise CtsegError("`ctseg synth` is not implemented yet")
