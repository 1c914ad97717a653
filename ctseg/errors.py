"""The one error type for mistakes the user caused (bad file, bad config, bad flag).

The CLI prints such an error as ``error: <message>`` and exits with status 2,
without a traceback. Bugs keep raising their own exception types.
"""


class CtsegError(Exception):
    """A problem with the user's input, reported in one line."""
