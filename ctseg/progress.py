"""How long-running library calls report progress to whoever drives them (the CLI's bars).

One signature for work that goes item by item (cases prepared, scored, written; layouts
timed): `progress(done, total, name of the item now under way)`.
"""

from collections.abc import Callable

Progress = Callable[[int, int, str], None]
