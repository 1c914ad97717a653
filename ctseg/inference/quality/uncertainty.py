"""The model's own uncertainty about a prediction: a few sums over the scan's voxels.

Two measures, each reduced where the probabilities are (on the devices under JAX: only
the sums come back), by the way back to the scan (`ctseg.inference.scan.way_back`) and for
every prediction alike — a lone run's, an ensemble's, a region's:

- **the Dice the probabilities expect** of each predicted structure (`Uncertainty.expected`):
  (2·Σ_pred p + s) / (|pred| + Σ_{p ≥ floor} p + s), the probability that a voxel is the
  structure summed where the argmax predicted it and wherever it is likely. Mirrored TTA's
  and an ensemble's disagreement show in the mean as probabilities near ½ and lower it
  (so an ensemble's expected Dice is on its own scale, with its own thresholds:
  `ctseg.inference.quality.thresholds`);
- **the members' agreement** where several predictions are averaged (an ensemble's
  members; `Uncertainty.agreement`): the Dice of each member's argmax with every other
  member's, pooled over the pairs, from each voxel's vote count k (how many members
  predicted the structure there): Σ k(k − 1) / ((M − 1)·Σ k). One member alone agrees
  with itself (None: not measured).

The structures are the liver as an organ (labels ≥ 1) and the tumours (label 2). The
smoothing s is `SMOOTH_VOXELS` voxels of the run's grid, in the scan's voxels (`smoothing`),
so that the measure does not depend on how finely the scan samples the grid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# How the uncertainty is measured is fixed: the calibrated thresholds are on its scale.
# Probabilities below this are left out of Σ p: a model's faint probability spread over a
# whole scan would otherwise swamp a small structure. At most ⅓, so that every voxel an
# argmax predicts counts (its class has ≥ ⅓) and the expected Dice stays ≤ 1.
PROBABILITY_FLOOR = 0.25
# Added to both sides of the expected Dice and the agreement (voxels of the grid), as soft
# Dice's smoothing: a faint trace where nothing was predicted is not a missed structure.
SMOOTH_VOXELS = 8.0

STRUCTURES = ("liver", "tumour")  # the order of the sums' rows


def predicted(probabilities: Any) -> tuple[Any, Any]:
    """Where the argmax of probabilities [..., 3] is the organ (liver or tumour) and where
    the tumour, by comparisons (ties to the lower class, as the argmax breaks them): an
    argmax over a last axis of 3 is many times slower in NumPy."""
    background, liver, tumour = (probabilities[..., c] for c in range(3))
    organ = (liver > background) | (tumour > background)
    return organ, (tumour > background) & (tumour > liver)


def probability_sums(probabilities: Any, xp: Any, inside: Any = None) -> Any:
    """[Σ_pred p, |pred|, Σ_{p ≥ floor} p] of the organ and of the tumours: six numbers, in
    `xp` (numpy or jax.numpy) where the array is. `inside`: the voxels that count (None:
    all)."""
    p = probabilities if probabilities.dtype == xp.float32 else probabilities.astype(xp.float32)
    found = []
    for prob, where in zip((p[..., 1] + p[..., 2], p[..., 2]), predicted(p), strict=True):
        likely = prob >= PROBABILITY_FLOOR
        if inside is not None:
            where, likely = where & inside, likely & inside
        found += [
            xp.sum(xp.where(where, prob, 0.0)),
            xp.sum(where.astype(xp.float32)),
            xp.sum(xp.where(likely, prob, 0.0)),
        ]
    return xp.stack(found)


def votes(probabilities: Any, xp: Any) -> Any:
    """One member's votes [..., 2] uint8: its argmax is the organ, is the tumour."""
    organ, tumour = predicted(probabilities)
    return xp.stack([organ, tumour], axis=-1).astype(xp.uint8)


def vote_sums(counts: Any, xp: Any, inside: Any = None) -> Any:
    """[Σ k(k − 1), Σ k] of the organ's and the tumours' vote counts k [..., 2] (the sums
    of `votes`): four numbers."""
    k = counts.astype(xp.float32)
    if inside is not None:
        k = xp.where(inside[..., None], k, 0.0)
    pairs, total = xp.sum(k * (k - 1.0), axis=(0, 1, 2)), xp.sum(k, axis=(0, 1, 2))
    return xp.stack([pairs[0], total[0], pairs[1], total[1]])


def box_inside(shape: Sequence[int], lo: Any, hi: Any, xp: Any) -> Any:
    """The voxels [lo, hi) per axis of a box of `shape` (x, y, z), as a mask."""
    x, y, z = (xp.arange(n) for n in shape[:3])
    return (
        ((x >= lo[0]) & (x < hi[0]))[:, None, None]
        & ((y >= lo[1]) & (y < hi[1]))[None, :, None]
        & ((z >= lo[2]) & (z < hi[2]))[None, None, :]
    )


def smoothing(scan_shape: Sequence[int], grid: Sequence[int]) -> float:
    """`SMOOTH_VOXELS` voxels of the grid in voxels of the scan (a scan of twice the grid's
    voxels along each axis: 8× as many)."""
    return SMOOTH_VOXELS * float(np.prod([s / g for s, g in zip(scan_shape, grid, strict=True)]))


@dataclass(frozen=True)
class Uncertainty:
    """The sums a prediction's uncertainty is judged from (`ctseg.inference.quality.scores`)."""

    sums: (
        np.ndarray
    )  # [6]: `probability_sums` (of the members' mean), the organ's then the tumours'
    smooth: float = SMOOTH_VOXELS  # the smoothing, in the voxels the sums count
    agreement_sums: np.ndarray | None = None  # [4]: `vote_sums` of `members` members
    members: int = 1

    @classmethod
    def of(
        cls,
        sums: Any,
        smooth: float = SMOOTH_VOXELS,
        agreement_sums: Any = None,
        members: int = 1,
    ) -> Uncertainty:
        """From sums fetched from wherever they were reduced."""
        agreement = None if agreement_sums is None else np.asarray(agreement_sums, np.float64)
        return cls(np.asarray(sums, np.float64), float(smooth), agreement, members)

    def expected(self, structure: str) -> float:
        """The Dice the probabilities expect of the predicted `structure` ("liver", "tumour");
        1 where nothing is predicted and nothing likely."""
        inside, count, mass = self.sums.reshape(2, 3)[STRUCTURES.index(structure)]
        return float((2.0 * inside + self.smooth) / (count + mass + self.smooth))

    def predicted_voxels(self, structure: str) -> float:
        return float(self.sums.reshape(2, 3)[STRUCTURES.index(structure)][1])

    def agreement(self, structure: str) -> float | None:
        """The members' pooled pairwise Dice of `structure`; None for one member."""
        if self.agreement_sums is None or self.members < 2:
            return None
        pairs, total = self.agreement_sums.reshape(2, 2)[STRUCTURES.index(structure)]
        return float((pairs + self.smooth) / ((self.members - 1) * total + self.smooth))
