"""The error types for mistakes the user caused (bad file, bad config, bad option).

The CLI prints such an error as ``error: <message>`` and exits with status 2,
without a traceback. Bugs keep raising their own exception types.
"""

from __future__ import annotations

import re
from collections.abc import Mapping


class CtsegError(Exception):
    """A problem with the user's input, reported in one line."""


class OptionError(CtsegError):
    """A mistake in an option the caller gave, in the caller's words.

    The message names each option as the library spells it, in backquotes (`` `margin_mm`
    must not be negative``): an argument of the Python API or a config key. A command line
    spells its options as flags, and says the message with its own words for them
    (`respelled`), so that each reader sees the names they typed."""

    def respelled(self, spellings: Mapping[str, str]) -> str:
        """The message in a caller's words (`respelled`)."""
        return respelled(str(self), spellings)


def respelled(message: str, spellings: Mapping[str, str]) -> str:
    """`message` with each backquoted option that `spellings` knows in its spelling
    (`{"margin_mm": "--margin"}`); others keep the library's."""
    return re.sub(r"`([\w.]+)`", lambda m: spellings.get(m.group(1), m.group(0)), message)
