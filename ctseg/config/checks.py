"""The relations between a config's keys, checked before anything runs: one-line errors
naming the key (a mesh that does not divide the grid, a frozen share of 1, …)."""

from __future__ import annotations

import dataclasses
import math
import typing

from ctseg.config.sections import (
    AugmentConfig,
    Config,
    DataConfig,
    MeshConfig,
    ModelConfig,
    TrainConfig,
)
from ctseg.config.tile import TileRequest
from ctseg.errors import CtsegError, OptionError

# JAX computes with 32-bit integers (its default, without x64): a step count, a seed, an
# index into a volume. Every integer key stays within them, and so does a volume's voxel
# count, or XLA's indexing overflows (an OverflowError, or wrong addresses, mid-run).
LARGEST_INT = 2**31 - 1
# The finest and coarsest voxels of any CT scan, in mm: a grid finer than 0.1 mm would
# hold thousands of voxels per scan side (terabytes), one coarser than 50 mm no organ.
SPACING_MM = (0.1, 50.0)
# HU values beyond these are no tissue (air −1000, metal a few thousand): the window's and
# a contrast phase's bounds.
HU_RANGE = (-2000.0, 10000.0)


def check_seed(name: str, value: int) -> None:
    """A seed numpy's and JAX's generators both take: 0 … 2^31 − 1 (one definition, for the
    config's seeds and the API's `seed` arguments). `name` as the caller spells it."""
    if value < 0:
        raise OptionError(f"`{name}` must not be negative, got {value}")
    if value > LARGEST_INT:
        raise OptionError(
            f"`{name}` must be a seed from 0 to {LARGEST_INT} (2^31 − 1), got {value}"
        )


def grid_problem(shape: typing.Sequence[int]) -> str | None:
    """Why a volume of `shape` voxels is too large for JAX to index, in words after "…
    would be"; None when it is not."""
    voxels = math.prod(int(n) for n in shape)
    if voxels <= LARGEST_INT:
        return None
    sides = "×".join(str(int(n)) for n in shape)
    return (
        f"{sides} = {voxels:.3g} voxels, beyond the 2^31 − 1 a volume can hold (JAX indexes "
        "it with 32-bit integers)"
    )


def check(config: Config) -> None:
    """Check the relations between fields; raise CtsegError naming the key."""
    _validate_data(config.data)
    _validate_model(config.model)
    _validate_mesh(config)
    _validate_train(config.train, config.mesh)
    _validate_augment(config.augment)
    _validate_predict(config)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise CtsegError(message)


def _validate_data(d: DataConfig) -> None:
    _require(d.resolution >= 1, f"data.resolution must be positive, got {d.resolution}")
    problem = grid_problem((d.resolution,) * 3)
    _require(
        problem is None,
        f"data.resolution = {d.resolution} is too large: an R³ box would be {problem}; "
        "R is at most 1290",
    )
    low, high = SPACING_MM
    _require(
        all(math.isfinite(v) and v > 0 for v in d.spacing),
        f"data.spacing = {list(d.spacing)} must be three positive voxel sizes in mm",
    )
    _require(
        all(low <= v <= high for v in d.spacing),
        f"data.spacing = {list(d.spacing)} must be voxel sizes from {low:g} to {high:g} mm, "
        "as CT scans have: a finer grid would not fit any machine's memory",
    )
    _require(
        all(HU_RANGE[0] <= v <= HU_RANGE[1] for v in d.hu_window),
        f"data.hu_window = {list(d.hu_window)} must lie within {HU_RANGE[0]:g} … "
        f"{HU_RANGE[1]:g} HU",
    )
    _require(
        d.hu_window[0] < d.hu_window[1],
        # No "[low, high]": the CLI prints errors as rich markup, which would eat it as a tag.
        f"data.hu_window = {list(d.hu_window)} must be a low and a high HU with low < high",
    )
    _require(
        0.0 <= d.val_fraction < 1.0, f"data.val_fraction must be in [0, 1), got {d.val_fraction}"
    )
    check_seed("data.split_seed", d.split_seed)
    _require(
        d.folds == 0 or d.folds >= 2,
        f"data.folds must be 0 (none) or at least 2, got {d.folds}",
    )


def _validate_model(m: ModelConfig) -> None:
    _require(m.depth >= 1, f"model.depth must be at least 1, got {m.depth}")
    _require(m.base_filters >= 1, f"model.base_filters must be positive, got {m.base_filters}")
    _require(
        m.kernel_size >= 1 and m.kernel_size % 2 == 1,
        f"model.kernel_size must be odd and positive, got {m.kernel_size}",
    )
    _require(
        0.0 <= m.bn_momentum < 1.0, f"model.bn_momentum must be in [0, 1), got {m.bn_momentum}"
    )
    _require(0 < m.bn_epsilon <= 1, f"model.bn_epsilon must be in (0, 1], got {m.bn_epsilon}")
    _require(m.depth <= 16, f"model.depth must be at most 16, got {m.depth}")
    _require(m.kernel_size <= 15, f"model.kernel_size must be at most 15, got {m.kernel_size}")
    # The deepest level's convolution holds kernel³ × channels² weights: an array JAX indexes.
    deepest = m.base_filters * 2 ** (m.depth - 1)
    weights = m.kernel_size**3 * deepest**2
    _require(
        weights <= LARGEST_INT,
        f"model.base_filters = {m.base_filters} is too large for model.depth = {m.depth}: the "
        f"deepest level's {m.kernel_size}³ kernel of {deepest} channels would hold "
        f"{weights:.3g} weights, beyond the 2^31 − 1 an array can hold",
    )


def _validate_mesh(config: Config) -> None:
    """The mesh must cut the grid into blocks that every U-Net level can work on locally."""
    mesh = config.mesh
    _require(
        all(p >= 1 for p in mesh.spatial) and mesh.data >= 1,
        f"mesh.spatial and mesh.data must be positive, got {list(mesh.spatial)} and {mesh.data}",
    )
    problem = split_problem(config, mesh.spatial, (config.data.resolution,) * 3)
    _require(problem is None, f"mesh.spatial = {list(mesh.spatial)} {problem}")


def split_problem(
    config: Config, spatial: typing.Sequence[int], shape: typing.Sequence[int]
) -> str | None:
    """Why splitting a grid of `shape` into `spatial` blocks fails the U-Net (invariant 3),
    in words after "mesh.spatial = [...]"; None when every level's blocks are even and at
    least as thick as the halo."""
    halo = config.model.kernel_size // 2
    cube = len(set(shape)) == 1
    for axis, parts, size in zip("xyz", spatial, shape, strict=True):
        step = parts * config.alignment
        what = f"data.resolution = {size}" if cube else f"a {size}-voxel {axis} side"
        if size % step:
            return (
                f"does not fit {what}: along {axis}, {size} / {parts} partitions must be "
                f"divisible by 2^(model.depth-1) = {config.alignment} so that every U-Net "
                f"level pools evenly; use a resolution that is a multiple of {step}"
            )
        # The halo exchange reaches only the direct neighbour, so the neighbour's block
        # must be at least as thick as the halo even at the deepest, smallest level.
        deepest = size // step
        if parts > 1 and deepest < halo:
            return (
                f"is too fine for {what} and model.depth = {config.model.depth}: at the "
                f"deepest level a block is {deepest} voxel(s) thick along {axis}, less than "
                f"the {halo} halo voxels of a {config.model.kernel_size}³ kernel; use fewer "
                f"partitions along {axis}, a larger resolution or a smaller depth"
            )
    return None


def _validate_train(t: TrainConfig, mesh: MeshConfig) -> None:
    _require(t.batch_size >= 1, f"train.batch_size must be at least 1, got {t.batch_size}")
    _require(
        t.batch_size % mesh.data == 0,
        f"train.batch_size = {t.batch_size} must be divisible by mesh.data = {mesh.data}",
    )
    for key in ("steps", "checkpoint_every", "eval_every", "keep_checkpoints", "log_every"):
        value = getattr(t, key)
        _require(value >= 1, f"train.{key} must be at least 1, got {value}")
    _require(t.learning_rate > 0, f"train.learning_rate must be positive, got {t.learning_rate}")
    # A clipping threshold ≤ 0 turns every gradient into zero or reverses it: training uphill.
    _require(t.grad_clip > 0, f"train.grad_clip must be positive, got {t.grad_clip}")
    _require(
        0.0 <= t.liver_boxes <= 1.0, f"train.liver_boxes must be in [0, 1], got {t.liver_boxes}"
    )
    for key in (
        "warmup_steps",
        "weight_decay",
        "dice_weight",
        "intensity_shift",
        "bn_population_volumes",
    ):
        value = getattr(t, key)
        _require(value >= 0, f"train.{key} must not be negative, got {value}")
    check_seed("train.seed", t.seed)
    # Beyond these the loss or the weights leave float32's range: NaN, not training.
    for key, most in (("weight_decay", 1.0), ("dice_weight", 1000.0), ("intensity_shift", 2.0)):
        value = getattr(t, key)
        _require(value <= most, f"train.{key} must be at most {most:g}, got {value}")
    # At least one step normalises by its own batch, so the frozen statistics are pooled
    # through trained weights, never the initial ones.
    _require(
        0.0 <= t.frozen_norm_share < 1.0 and t.frozen_norm_steps < t.steps,
        f"train.frozen_norm_share = {t.frozen_norm_share} must be in [0, 1) and leave at least "
        f"one of train.steps = {t.steps} to train on each box's own statistics",
    )
    _require(
        t.fold >= -1,
        f"train.fold must be a fold number (0, 1, …) or -1 (the store's split), got {t.fold}",
    )
    _require(
        0 <= t.intensity_scale < 1,
        f"train.intensity_scale must be in [0, 1), got {t.intensity_scale}",
    )
    _require(0 <= t.ema_decay < 1, f"train.ema_decay must be in [0, 1), got {t.ema_decay}")
    _require(
        min(t.class_weights) >= 0 and max(t.class_weights) > 0,
        f"train.class_weights must be non-negative and not all 0, got {list(t.class_weights)}",
    )
    _require(
        max(t.class_weights) <= 1000,
        f"train.class_weights must be at most 1000 each, got {list(t.class_weights)}",
    )


def _validate_augment(a: AugmentConfig) -> None:
    for f in dataclasses.fields(a):
        value = getattr(a, f.name)
        if f.name.endswith("_p"):
            _require(0.0 <= value <= 1.0, f"augment.{f.name} must be in [0, 1], got {value}")
        elif isinstance(value, tuple):
            _require(
                0 <= value[0] <= value[1],
                f"augment.{f.name} must be a range (low, high) with 0 ≤ low ≤ high, "
                f"got {list(value)}",
            )
    # Beyond a right angle the bound on a rotated slab's source box no longer holds, and
    # rotations by multiples of 90° are train.rotate90's, exact.
    _require(
        0 <= a.rotation_degrees <= 90,
        f"augment.rotation_degrees must be in [0, 90], got {a.rotation_degrees}",
    )
    for key in ("scaling", "low_resolution", "brightness", "contrast", "gamma"):
        low = getattr(a, key)[0]
        _require(low > 0, f"augment.{key} must be above 0, got {list(getattr(a, key))}")
    _require(
        a.low_resolution[1] <= 1,
        f"augment.low_resolution is a zoom down: at most 1, got {list(a.low_resolution)}",
    )
    _require(
        a.blur_sigma[1] <= 3,
        f"augment.blur_sigma must be at most 3 voxels, got {list(a.blur_sigma)}",
    )
    # Every other range within what still looks like CT (nnU-Net's ranges are well inside):
    # beyond, intensities leave float32's range and the loss is NaN.
    for key, low, high, unit in _AUGMENT_RANGES:
        value = list(getattr(a, key))
        _require(
            low <= value[0] and value[1] <= high,
            f"augment.{key} must lie within {low:g} … {high:g}{unit}, got {value}",
        )


# [augment]'s ranges: key, lowest low, highest high, unit (nnU-Net's ranges lie inside).
_AUGMENT_RANGES = (
    ("scaling", 0.25, 4.0, " (a zoom)"),
    ("noise_std", 0.0, 1.0, " (1 = half the HU window)"),
    ("brightness", 0.1, 10.0, " (a factor)"),
    ("contrast", 0.1, 10.0, " (a factor)"),
    ("gamma", 0.1, 10.0, ""),
    ("phase_liver_hu", 0.0, 1000.0, " HU"),
    ("phase_tumour_share", 0.0, 10.0, ""),
)


def _validate_predict(config: Config) -> None:
    TileRequest.from_int(config.predict.tile, "predict.tile")  # the one check of a tile
