"""Canvases: one shape a backend holds every scan in (and a member every box of its grid),
so that scans of every extent run the programs the first scan compiled.

A compiled program takes arrays of one shape. Fixed windows make the network's programs
independent of the box (`ctseg.inference.jax_windows`), but the programs around them
follow the scan's and the box's shapes: the way to the grid, the windows' driver, the
softmax, the way back. On an accelerator each new shape compiles them anew. A canvas
holds every scan, and every box of a member's grid, in the largest shape asked of it
so far, axis by axis. A scan no larger than an earlier one then reuses every program. A
larger one grows the canvas once. `Predictor.expect` sizes the canvases from a batch's
headers (or a store's manifest) before its first scan, so that nothing compiles after
the first scan's programs.

What it costs: the programs around the network run over the canvas, not the scan. They
are memory-bound resampling and a softmax, milliseconds on an accelerator. The network's
windows cover only the grid's cone (`tiling.stage_spans`), whatever the canvas. The box
reaches the network's receptive field beyond the grid (`Member.to_grid`), so a voxel of
the grid sees the same air whatever canvas holds it, and a scan's labels do not depend
on the scans before it (the argument of `ctseg.inference.region`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

Shape = tuple[int, ...]


class Canvas:
    """A shape that only grows: on each axis, the largest of the shapes it was asked to
    hold. Thread-safe: scans are brought to the grid on a reader thread while a batch's
    headers may still be expected on another."""

    def __init__(self) -> None:
        self.shape: Shape | None = None
        self._lock = threading.Lock()

    def holding(self, shape: Sequence[int]) -> Shape:
        """The canvas grown, where needed, to hold `shape`."""
        shape = tuple(int(n) for n in shape)
        with self._lock:
            if self.shape is not None:
                shape = tuple(max(a, b) for a, b in zip(self.shape, shape, strict=True))
            self.shape = shape
            return shape
