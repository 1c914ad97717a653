"""How long-running library calls report progress to whoever drives them (the CLI's bars).

Every progress callback the library takes has its signature here, named once, so that a
caller can see what it will be handed; no other module spells one. Most work goes item
by item and reports `Progress`. The others carry what their work is made of:

- `Progress(done, total, item)`: items done of all, and the name of the one now under
  way (cases prepared or scored, synthetic cases written, layouts timed).
- `Status(message)`: what is under way, in words, where there is nothing to count (the
  programs `ctseg plan` compiles).
- `TrainingProgress(StepProgress)`: a training step done, with its loss and speed and
  the latest validation Dice (`ctseg train`'s bar).
- `TileProgress(done, total)`: one network pass's windows done of all (tiled inference).
- `StageProgress(stage, done, total)`: one scan's prediction, stage by stage ("read",
  "infer" with its windows, "postprocess", "write").
- `FileProgress(scan, stage, done, total)`: `StageProgress` of each of several scans,
  named by the scan (`ctseg predict`'s files).

Plain Python: no JAX, nothing above the ground.
"""

from collections.abc import Callable
from dataclasses import dataclass

Progress = Callable[[int, int, str], None]
"""(done, total, name of the item now under way): work that goes item by item."""

Status = Callable[[str], None]
"""(what is under way, in words): work with nothing to count."""


@dataclass
class StepProgress:
    """What the training loop reports after each step (the CLI turns it into a progress bar)."""

    step: int
    total: int
    loss: float
    steps_per_second: float
    val_dice: dict[str, float] | None  # the latest validation's {"liver", "tumour"}; None before
    frozen_norm: bool = False  # normalised by frozen statistics (`train.frozen_norm_share`)
    validated: bool = False  # a validation followed this step (`val_dice` is its)


TrainingProgress = Callable[[StepProgress], None]
"""(the step just done): training, step by step."""

TileProgress = Callable[[int, int], None]
"""(windows done, windows in total): one network pass over tiles."""

StageProgress = Callable[[str, int, int], None]
"""(stage, done, total): one scan's prediction; "infer" counts its windows."""

FileProgress = Callable[[str, str, int, int], None]
"""(scan name, stage, done, total): `StageProgress` of each of several scans."""
