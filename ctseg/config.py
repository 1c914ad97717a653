"""Experiment configuration: TOML files parsed into frozen dataclasses.

A config has the sections ``data``, ``model``, ``mesh``, ``train`` and
``predict``. Every field carries a one-sentence ``doc`` in its metadata; the
README's configuration reference is generated from it (`reference_markdown`),
and a test keeps the two in sync.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ctseg.errors import CtsegError


def _f(default: Any, doc: str) -> Any:
    if isinstance(default, (list, dict)):
        raise TypeError("use tuples for sequence defaults: configs are frozen")
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class DataConfig:
    resolution: int = _f(
        128,
        "Side R of the R³ box the network trains on: the whole scan stretched onto it "
        "(grid = cube), or a box of the scan at data.spacing (grid = spacing).",
    )
    grid: Literal["cube", "spacing"] = _f(
        "cube",
        "cube: every scan's field of view stretched onto R³ (the Mesh-TensorFlow LiTS "
        "model's choice); spacing: every scan resampled to data.spacing and kept whole, "
        "training on R³ boxes drawn on it (`train.liver_boxes` of them around the liver) "
        "and predicting over the scan's whole extent; the shipped configs use it.",
    )
    spacing: tuple[float, float, float] = _f(
        (1.5, 1.5, 1.5), "Voxel size [x, y, z] in mm of the spacing grid (grid = spacing)."
    )
    hu_window: tuple[float, float] = _f(
        (-200.0, 250.0),
        "Hounsfield window [low, high] clipped and scaled to [-1, 1] when a batch is made.",
    )
    val_fraction: float = _f(0.2, "Share of cases put in the validation split by `preprocess`.")
    split_seed: int = _f(
        0, "Seed of the train/validation split (and of the folds) made by `preprocess`."
    )
    folds: int = _f(
        0,
        "Cross-validation folds of the labelled cases, assigned by `preprocess` (seed "
        "data.split_seed); 0 = none, or keep the store's own (`ctseg folds` changes them).",
    )


@dataclass(frozen=True)
class ModelConfig:
    base_filters: int = _f(32, "Filters of the first U-Net level; doubled at every level below.")
    depth: int = _f(4, "Number of U-Net levels (resolutions), as in the TPU unet3d model.")
    kernel_size: int = _f(3, "Side of the cubic convolution kernels (odd).")
    dtype: Literal["float32", "bfloat16"] = _f(
        "float32", "Compute dtype; parameters and normalisation statistics stay float32."
    )
    remat: bool = _f(
        False, "Recompute each level's activations in the backward pass (saves memory)."
    )
    bn_momentum: float = _f(
        0.9,
        "Momentum of the batch-norm running averages (inference uses them if "
        "train.bn_population_volumes = 0).",
    )
    bn_epsilon: float = _f(1e-5, "Epsilon added to the batch-norm variance.")


@dataclass(frozen=True)
class MeshConfig:
    spatial: tuple[int, int, int] = _f(
        (1, 1, 1), "Partitions of each volume along x, y and z (e.g. [4, 4, 1] for 16-way)."
    )
    data: int = _f(1, "Data-parallel replicas; each holds a share of the batch.")
    partitioner: Literal["halo", "gspmd"] = _f(
        "halo",
        "`halo`: explicit halo exchange in shard_map; `gspmd`: XLA partitions a plain jit.",
    )


@dataclass(frozen=True)
class TrainConfig:
    steps: int = _f(2000, "Optimiser steps to train for.")
    batch_size: int = _f(1, "Volumes per step (global, across data replicas).")
    learning_rate: float = _f(1e-3, "Peak learning rate of AdamW.")
    warmup_steps: int = _f(50, "Linear warm-up steps before the cosine decay.")
    weight_decay: float = _f(1e-4, "AdamW weight decay.")
    grad_clip: float = _f(1.0, "Global gradient-norm clipping threshold.")
    # 1/8/16 for background/liver/tumour come from the Mesh-TensorFlow LiTS U-Net.
    class_weights: tuple[float, float, float] = _f(
        (1.0, 8.0, 16.0), "Cross-entropy weights of background, liver and tumour."
    )
    dice_weight: float = _f(1.0, "Weight of the soft Dice term (liver and tumour) in the loss.")
    flip: bool = _f(True, "Random flips along each axis.")
    rotate90: bool = _f(False, "Random in-plane 90° rotations.")
    intensity_scale: float = _f(0.1, "Random intensity scale is drawn from 1 ± this.")
    intensity_shift: float = _f(0.1, "Random intensity shift is drawn from ± this (after scaling).")
    # nnU-Net's foreground oversampling: a third of its patches hold foreground.
    liver_boxes: float = _f(
        0.33,
        "On the spacing grid: the share of training boxes centred on the liver (shifted by up "
        "to a quarter box); the others lie anywhere on the scan.",
    )
    bn_population_volumes: int = _f(
        16,
        "Training volumes whose batch-norm statistics are pooled for inference at every "
        "validation and checkpoint; 0 = running averages (model.bn_momentum).",
    )
    held_norm_steps: int = _f(
        0,
        "The last this many steps train with batch norm in inference mode: the population "
        "statistics are computed once when they begin and held, so that the weights adapt "
        "to the statistics inference uses instead of each box's own; 0 = none.",
    )
    checkpoint_every: int = _f(100, "Save a checkpoint every this many steps.")
    eval_every: int = _f(100, "Validate every this many steps.")
    keep_checkpoints: int = _f(3, "Keep this many latest checkpoints, plus the best.")
    log_every: int = _f(10, "Write a metrics.jsonl entry every this many steps.")
    seed: int = _f(0, "Seed of initialisation, batch order and augmentation.")
    fold: int = _f(
        -1,
        "Cross-validation fold to train (`ctseg train --fold`): validate on that fold of the "
        "store, train on its other labelled cases; -1 = the store's train/val split.",
    )


@dataclass(frozen=True)
class PredictConfig:
    tile: int = _f(
        -1,
        "Core size in voxels (even) of level-wise tiles, at every U-Net level; "
        "0 = whole volume; -1 = choose from available memory.",
    )
    keep_largest_liver: bool = _f(True, "Keep only the largest connected liver component.")
    tumour_inside_liver: bool = _f(True, "Drop tumour voxels outside the (post-processed) liver.")
    save_probabilities: bool = _f(False, "Also write the class probabilities as a NIfTI.")
    tta: bool = _f(
        False,
        "Test-time augmentation: average the probabilities of the 8 mirrorings of the grid "
        "(8× the inference time; models trained with train.flip only).",
    )


@dataclass(frozen=True)
class InferenceOptions:
    """What a command asks of a trained run's model, built once from its options and passed
    down whole (`ctseg predict`, `ctseg evaluate RUN_DIR`, the Python API).

    None leaves the choice to the run's config (`tile`, `tta`: its predict section) or to
    the device policy (`backend`: JAX on accelerators, else ONNX Runtime when installed).
    """

    checkpoint: str = "best"  # best, latest or a step number
    tile: int | None = None  # core size of level-wise tiles; 0 whole volume; -1 automatic
    backend: str | None = None  # "jax" or "onnx"
    device: str = "auto"  # auto, cpu, gpu or tpu
    tta: bool | None = None  # mirrored test-time augmentation


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    predict: PredictConfig = field(default_factory=PredictConfig)

    @property
    def num_partitions(self) -> int:
        x, y, z = self.mesh.spatial
        return x * y * z

    @property
    def num_devices(self) -> int:
        return self.num_partitions * self.mesh.data

    @property
    def alignment(self) -> int:
        """Every local block side must be a multiple of this (2^(depth-1))."""
        return 2 ** (self.model.depth - 1)


_SECTION_TYPES: dict[str, type] = typing.get_type_hints(Config)
SECTIONS = tuple(_SECTION_TYPES)


def _closest(name: str, allowed: list[str]) -> str:
    match = difflib.get_close_matches(name, allowed, n=1)
    hint = f"; did you mean '{match[0]}'?" if match else ""
    return f"allowed: {', '.join(allowed)}{hint}"


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check `value` against the annotation `hint`; return it in the field's type."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise CtsegError(f"{key} = {value!r} is not allowed; choose one of {list(choices)}")
        return value
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise CtsegError(f"{key} must be a list of {len(args)} values, got {value!r}")
        return tuple(
            _coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args, strict=True))
        )
    if hint is bool:
        if not isinstance(value, bool):
            raise CtsegError(f"{key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise CtsegError(f"{key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CtsegError(f"{key} must be a number, got {value!r}")
        # TOML has nan and inf; no setting means anything with them.
        if not math.isfinite(value):
            raise CtsegError(f"{key} must be a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise CtsegError(f"{key} must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config annotation {hint!r} for {key}")  # a bug, not user error


def _build_section(name: str, values: dict[str, Any]) -> Any:
    cls = _SECTION_TYPES[name]
    hints = typing.get_type_hints(cls, include_extras=True)
    allowed = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in allowed:
            raise CtsegError(f"unknown config key '{name}.{key}'; {_closest(key, allowed)}")
        kwargs[key] = _coerce(f"{name}.{key}", value, hints[key])
    return cls(**kwargs)


def from_dict(raw: dict[str, Any]) -> Config:
    """Build and validate a Config from nested plain values (as TOML gives them)."""
    sections = {}
    for name, values in raw.items():
        if name not in SECTIONS:
            raise CtsegError(f"unknown config section '{name}'; {_closest(name, list(SECTIONS))}")
        if not isinstance(values, dict):
            raise CtsegError(f"config section '{name}' must be a table")
        sections[name] = _build_section(name, values)
    config = Config(**sections)
    validate(config)
    return config


def to_dict(config: Config) -> dict[str, dict[str, Any]]:
    return {
        section: {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
        for section, values in dataclasses.asdict(config).items()
    }


def with_mesh(
    config: Config,
    spatial: typing.Sequence[int] | None = None,
    data: int | None = None,
    partitioner: str | None = None,
) -> Config:
    """`config` with another layout (the arguments given), checked as a config file is."""
    raw = to_dict(config)
    changes = {"spatial": None if spatial is None else list(spatial), "data": data}
    changes["partitioner"] = partitioner
    raw["mesh"].update({key: value for key, value in changes.items() if value is not None})
    return from_dict(raw)


def _parse_override(item: str) -> tuple[str, str, Any]:
    if "=" not in item:
        raise CtsegError(f"--set expects section.key=value, got '{item}'")
    dotted, text = item.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2:
        raise CtsegError(f"--set expects section.key=value, got '{item}'")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word such as `gspmd` is a string
    return parts[0], parts[1], value


def load(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Load a TOML config (or the defaults) and apply `--set section.key=value` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise CtsegError(f"{path} is a folder, not a config file (see configs/)")
        if not path.is_file():
            raise CtsegError(f"config file not found: {path}")
        try:
            # TOML is UTF-8 whatever the locale (GDCM's writer, for one, can set it to C).
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise CtsegError(f"{path} is not valid TOML: {exc}") from None
        except UnicodeDecodeError as exc:
            raise CtsegError(
                f"{path} is not a TOML file: byte {exc.start} is not UTF-8 text"
            ) from None
        except OSError as exc:
            raise CtsegError(f"cannot read {path}: {exc.strerror or exc}") from None
    for item in overrides:
        section, key, value = _parse_override(item)
        if section not in SECTIONS:
            raise CtsegError(
                f"unknown config section '{section}'; {_closest(section, list(SECTIONS))}"
            )
        raw.setdefault(section, {})[key] = value
    return from_dict(raw)


def validate(config: Config) -> None:
    """Check the relations between fields; raise CtsegError naming the key."""
    _validate_data(config.data)
    _validate_model(config.model)
    _validate_mesh(config)
    _validate_train(config.train, config.mesh)
    _validate_predict(config)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise CtsegError(message)


def _validate_data(d: DataConfig) -> None:
    _require(d.resolution >= 1, f"data.resolution must be positive, got {d.resolution}")
    _require(
        all(math.isfinite(v) and v > 0 for v in d.spacing),
        f"data.spacing = {list(d.spacing)} must be three positive voxel sizes in mm",
    )
    _require(
        d.hu_window[0] < d.hu_window[1],
        # No "[low, high]": the CLI prints errors as rich markup, which would eat it as a tag.
        f"data.hu_window = {list(d.hu_window)} must be a low and a high HU with low < high",
    )
    _require(
        0.0 <= d.val_fraction < 1.0, f"data.val_fraction must be in [0, 1), got {d.val_fraction}"
    )
    # numpy's generators, which draw the split and the augmentation, take no negative seeds.
    _require(d.split_seed >= 0, f"data.split_seed must not be negative, got {d.split_seed}")
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
    _require(m.bn_epsilon > 0, f"model.bn_epsilon must be positive, got {m.bn_epsilon}")


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
        "seed",
        "bn_population_volumes",
        "held_norm_steps",
    ):
        value = getattr(t, key)
        _require(value >= 0, f"train.{key} must not be negative, got {value}")
    # At least one step normalises by its own batch, so the held statistics are pooled
    # through trained weights, never the initial ones.
    _require(
        t.held_norm_steps < t.steps,
        f"train.held_norm_steps = {t.held_norm_steps} must be below train.steps = {t.steps}",
    )
    _require(
        t.fold >= -1,
        f"train.fold must be a fold number (0, 1, …) or -1 (the store's split), got {t.fold}",
    )
    _require(
        0 <= t.intensity_scale < 1,
        f"train.intensity_scale must be in [0, 1), got {t.intensity_scale}",
    )
    _require(
        min(t.class_weights) >= 0 and max(t.class_weights) > 0,
        f"train.class_weights must be non-negative and not all 0, got {list(t.class_weights)}",
    )


def _validate_predict(config: Config) -> None:
    tile = config.predict.tile
    _require(tile >= -1, f"predict.tile must be -1 (auto), 0 (whole volume) or a size, got {tile}")
    _require(
        tile <= 0 or tile % 2 == 0,
        f"predict.tile = {tile} must be even: level-wise tiles are pooled in pairs of voxels",
    )


def to_toml(config: Config) -> str:
    """The fully resolved config as TOML text (written into every run directory)."""
    lines = []
    for section, values in to_dict(config).items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " \\| ".join(f'"{c}"' for c in typing.get_args(hint))
    if origin is tuple:
        return "[" + ", ".join(_type_name(a) for a in typing.get_args(hint)) + "]"
    if isinstance(hint, types.GenericAlias):
        return str(hint)
    return hint.__name__


def reference_markdown() -> str:
    """The configuration reference table, as it appears in the README."""
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    defaults = to_dict(Config())
    for section, cls in _SECTION_TYPES.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = _toml_value(defaults[section][f.name])
            rows.append(
                f"| `{section}.{f.name}` | {_type_name(hints[f.name])} | `{default}` | "
                f"{f.metadata['doc']} |"
            )
    return "\n".join(rows)
