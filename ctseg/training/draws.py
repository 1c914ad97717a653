"""A training sample's augmentation, drawn on the host from (seed, step, sample) alone, so
that a resumed run and any mesh layout draw the same: its flips, quarter turns and
intensity scale and shift (`draw_augmentation`, an `Augmentation`: read by index
arithmetic, on the host or as the warp's matrix), and with `[augment]` its rotation,
zoom and intensity transforms (`draw_sample`, a `SampleDraw`). What makes the batch from
the draws: `ctseg.training.augment.Augmenter`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ctseg.config import Config
from ctseg.data.grids import hu_to_unit
from ctseg.parallel.partition import SPATIAL_AXES
from ctseg.training import warp


@dataclass(frozen=True)
class Augmentation:
    """A voxel-exact rearrangement plus an intensity change.

    Output axis k reads input axis ``source_axis[k]``, reversed where
    ``reverse[k]``; the group of in-plane 90° rotations and flips is exactly
    {swap x/y or not} × {reverse each axis or not}.
    """

    source_axis: tuple[int, int, int] = (0, 1, 2)
    reverse: tuple[bool, bool, bool] = (False, False, False)
    scale: float = 1.0
    shift: float = 0.0

    def matrix(self) -> np.ndarray:
        """The rearrangement as a map of offsets from the box's centre: output offset
        along axis k is source offset ±1 along `source_axis[k]` (−1 where reversed)."""
        matrix = np.zeros((3, 3))
        for k, (axis, rev) in enumerate(zip(self.source_axis, self.reverse, strict=True)):
            matrix[axis, k] = -1.0 if rev else 1.0
        return matrix

    def read(self, volume: np.ndarray, index: Sequence[slice]) -> np.ndarray:
        """Block `index` (slices over x, y, z) of the augmented volume; reads only that block."""
        n = volume.shape
        source = [slice(None)] * 3
        for sl, axis, rev in zip(index, self.source_axis, self.reverse, strict=True):
            start, stop, _ = sl.indices(n[axis])
            source[axis] = slice(n[axis] - stop, n[axis] - start) if rev else slice(start, stop)
        block = np.asarray(volume[tuple(source)])
        # Put the block's axes in output order, then reverse the flipped ones.
        block = np.transpose(block, self.source_axis)
        flips = tuple(k for k, rev in enumerate(self.reverse) if rev)
        return np.flip(block, flips) if flips else block


# In-plane rotation by k·90° as (source axes, reversed output axes):
# np.rot90(v, k, axes=(0, 1)) reads out[i, j] = v[j, n-1-i] for k = 1.
_ROTATIONS = (
    ((0, 1, 2), (False, False, False)),
    ((1, 0, 2), (True, False, False)),
    ((0, 1, 2), (True, True, False)),
    ((1, 0, 2), (False, True, False)),
)


def draw_augmentation(config: Config, step: int, sample: int) -> Augmentation:
    """The sample's augmentation: a rotation (if enabled), then flips (if enabled)."""
    t = config.train
    rng = np.random.default_rng([t.seed, step, sample, 1])
    source_axis, rotated = _ROTATIONS[int(rng.integers(4)) if t.rotate90 else 0]
    flips = [bool(t.flip and rng.random() < 0.5) for _ in range(3)]
    reverse = tuple(r != f for r, f in zip(rotated, flips, strict=True))  # flipping twice undoes it
    scale = 1.0 + rng.uniform(-t.intensity_scale, t.intensity_scale)
    shift = rng.uniform(-t.intensity_shift, t.intensity_shift)
    return Augmentation(source_axis, reverse, float(scale), float(shift))


@dataclass(frozen=True)
class SampleDraw:
    """One sample's spatial matrix (output offset -> source offset, voxel units) and its
    intensity parameters (`intensity.apply`'s names; flags are 1.0 or 0.0); `warped`:
    whether it rotates or zooms (else the matrix only flips and turns by quarters)."""

    matrix: np.ndarray
    params: dict[str, float] = field(default_factory=dict)
    warped: bool = False


def _factor(rng: np.random.Generator, low: float, high: float) -> float:
    """nnU-Net's draw of a factor around 1: below or above 1 with even odds where the
    range spans 1, so shrinking and growing are equally likely."""
    if low < 1 < high and rng.random() < 0.5:
        return float(rng.uniform(low, 1.0))
    return float(rng.uniform(max(low, 1.0) if low < 1 < high else low, high))


def draw_sample(config: Config, step: int, sample: int, base: Augmentation) -> SampleDraw:
    """The sample's rotation and zoom (composed after `base`, its flips, quarter turns,
    intensity scale and shift) and its intensity transforms, from streams of their own, so
    that a probability of 0 leaves the other draws, and `base`, as they were."""
    a, t = config.augment, config.train
    rng = np.random.default_rng([t.seed, step, sample, 4])
    angles = np.zeros(3)
    if rng.random() < a.rotation_p:
        about = 3 if a.rotation_axes == "xyz" else 1
        angles[3 - about :] = rng.uniform(-a.rotation_degrees, a.rotation_degrees, about)
        angles = angles if about == 3 else np.array([0.0, 0.0, angles[2]])
    zoom = float(rng.uniform(*a.scaling)) if rng.random() < a.scaling_p else 1.0
    warped = a.warps and (bool(np.any(angles)) or zoom != 1.0)
    # Output offsets read source offsets: a patient zoomed by s reads 1/s as far out.
    matrix = base.matrix()
    spatial = matrix @ warp.rotation_matrix(angles) / zoom if a.warps else matrix

    rng = np.random.default_rng([t.seed, step, sample, 5])
    params = {"scale": base.scale, "shift": base.shift}

    def flag(p: float) -> float:
        return float(rng.random() < p)

    params["noise_on"] = flag(a.noise_p)
    params["noise_std"] = float(rng.uniform(*a.noise_std))
    params["blur_on"] = flag(a.blur_p)
    for axis in SPATIAL_AXES:
        params[f"blur_sigma_{axis}"] = float(rng.uniform(*a.blur_sigma))
    params["brightness_on"] = flag(a.brightness_p)
    params["brightness"] = float(rng.uniform(*a.brightness))
    params["contrast_on"] = flag(a.contrast_p)
    params["contrast"] = _factor(rng, *a.contrast)
    params["low_on"] = flag(a.low_resolution_p)
    zoom = float(rng.uniform(*a.low_resolution))  # one for every axis, as nnU-Net's
    for axis in SPATIAL_AXES:
        params[f"zoom_{axis}"] = zoom
    params["gamma_inverted_on"] = flag(a.gamma_inverted_p)
    params["gamma_inverted"] = _factor(rng, *a.gamma)
    params["gamma_on"] = flag(a.gamma_p)
    params["gamma"] = _factor(rng, *a.gamma)
    params["phase_on"] = flag(a.phase_p)
    liver_hu = rng.uniform(*a.phase_liver_hu)
    params["phase_liver"] = float(hu_to_unit(liver_hu, config.data.hu_window))
    params["phase_tumour_share"] = float(rng.uniform(*a.phase_tumour_share))
    return SampleDraw(warp.exact_matrix(spatial), params, warped)
