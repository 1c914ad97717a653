"""Canvases: one shape a backend holds every scan in (and a member every box of its grid),
so that scans of every extent run the programs the first scan compiled.

A compiled program takes arrays of one shape. Fixed windows make the network's programs
independent of the box (`ctseg.inference.network.jax.windows`), but the programs around them
follow the scan's and the box's shapes: the way to the grid, the windows' driver, the
softmax, the way back. On an accelerator each new shape compiles them anew. A canvas
holds every scan, and every box of a member's grid, in the largest shape asked of it
so far, axis by axis. A scan no larger than an earlier one then reuses every program. A
larger one grows the canvas once. `Predictor.expect` sizes the canvases from a batch's
headers (or a store's manifest) before its first scan, so that nothing compiles after
the first scan's programs.

What one scan cannot do: size the canvas for the rest. A canvas never grows past the
largest scan ctseg reads (`readers.max_scan_bytes`, in CT's int16 voxels): a scan that
would grow it further is held in a shape of its own, compiling its own programs, and
fits or fails alone. `Predictor.expect` takes only headers that a read would accept
(`ctseg.io.scans.nifti_geometry`), and a scan that fails on its way to the grid leaves
the canvases as it found them (`Predictor.to_grid`).

What it costs: the programs around the network run over the canvas, not the scan. They
are memory-bound resampling and a softmax, milliseconds on an accelerator. The network's
windows cover only the grid's cone (`tiling.stage_spans`), whatever the canvas. The box
reaches the network's receptive field beyond the grid (`Member.to_grid`), so a voxel of
the grid sees the same air whatever canvas holds it, and a scan's labels do not depend
on the scans before it (the argument of `ctseg.inference.scan.region`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import numpy as np

from ctseg.data.grids import Shape
from ctseg.io.readers import max_scan_bytes


class Canvas:
    """A shape that only grows: on each axis, the largest of the shapes it was asked to
    hold, up to `most_voxels` (default: the largest scan ctseg reads, in int16 voxels).
    Thread-safe: scans are brought to the grid on a reader thread while a batch's headers
    may still be expected on another."""

    def __init__(self, most_voxels: int | None = None) -> None:
        self.shape: Shape | None = None
        if most_voxels is None:
            most_voxels = max_scan_bytes() // np.dtype(np.int16).itemsize
        self.most_voxels = most_voxels
        self._lock = threading.Lock()

    def holding(self, shape: Sequence[int]) -> Shape:
        """The canvas grown, where needed, to hold `shape`; `shape` itself, the canvas
        unchanged, where that would grow it past `most_voxels`."""
        shape = tuple(int(n) for n in shape)
        with self._lock:
            grown = shape
            if self.shape is not None:
                grown = tuple(max(a, b) for a, b in zip(self.shape, shape, strict=True))
            if math.prod(grown) > self.most_voxels:
                return shape
            self.shape = grown
            return grown

    def restore(self, shape: Shape | None) -> None:
        """Back to `shape`, an earlier shape of this canvas: a scan that grew it and then
        failed leaves it as it found it."""
        with self._lock:
            self.shape = shape
