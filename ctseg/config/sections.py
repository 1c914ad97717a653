"""The config's sections as frozen dataclasses: every key, its type, default and meaning.

Every field carries a one-sentence ``doc`` in its metadata, from which the
configuration reference is generated (`ctseg.config.reference`).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from ctseg.config.tile import TileRequest


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
    frozen_norm_share: float = _f(
        0.0,
        "The share of train.steps, at the end, that train with batch norm in inference mode "
        "(round(share × steps) steps): the population statistics are computed once when "
        "they begin and frozen, so that the weights adapt to the statistics inference uses "
        "instead of each box's own; 0 = none.",
    )
    ema_decay: float = _f(
        0.0,
        "Decay of an exponential moving average of the weights (Polyak averaging) that "
        "validation, the batch-norm statistics and prediction use instead of the last "
        "step's weights; 0 = none. Its reach is about 1 / (1 − decay) steps.",
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

    @property
    def frozen_norm_steps(self) -> int:
        """The last steps that train on frozen batch-norm statistics (`frozen_norm_share`)."""
        return round(self.frozen_norm_share * self.steps)

    @property
    def frozen_from(self) -> int:
        """The first step (counted from 0) that trains on frozen batch-norm statistics;
        `steps` where none does."""
        return self.steps - self.frozen_norm_steps


# nnU-Net's values (nnUNetTrainer.get_training_transforms) are each range's default and
# each probability's reference; the probabilities default to 0, so that a config that does
# not name them trains, and resumes, as before. The shipped LiTS configs set nnU-Net's.
@dataclass(frozen=True)
class AugmentConfig:
    rotation_p: float = _f(
        0.0, "Probability of a random rotation of a training box (nnU-Net: 0.2)."
    )
    rotation_degrees: float = _f(
        30.0, "Largest rotation in degrees about each rotated axis (nnU-Net: 30)."
    )
    rotation_axes: Literal["xyz", "z"] = _f(
        "xyz",
        "xyz: about all three axes (nnU-Net's choice for isotropic data); z: in-plane only, "
        "about the slice axis (nnU-Net's choice for anisotropic data).",
    )
    scaling_p: float = _f(0.0, "Probability of a random zoom of a training box (nnU-Net: 0.2).")
    scaling: tuple[float, float] = _f(
        (0.7, 1.4),
        "Zoom [low, high] drawn uniformly, the same on every axis: above 1 the patient looks "
        "larger (nnU-Net: 0.7–1.4).",
    )
    noise_p: float = _f(0.0, "Probability of additive Gaussian noise (nnU-Net: 0.1).")
    noise_std: tuple[float, float] = _f(
        (0.0, 0.05),
        "Standard deviation [low, high] of the noise, in units of the scaled HU window "
        "(1 = half the window, 225 HU by default); nnU-Net's variance 0–0.1 of z-scored "
        "intensities is a standard deviation up to 0.32 of the liver's (≈ 40 HU): ≈ 0.05.",
    )
    # nnU-Net draws its blur and low resolution for a sample (p) and then for each channel
    # (p_per_channel = 0.5): on one-channel CT a sample is changed with probability p / 2.
    blur_p: float = _f(
        0.0, "Probability of a Gaussian blur (nnU-Net: 0.2 per sample × 0.5 per channel = 0.1)."
    )
    blur_sigma: tuple[float, float] = _f(
        (0.5, 1.0), "Blur sigma [low, high] in voxels, drawn for each axis (nnU-Net: 0.5–1)."
    )
    brightness_p: float = _f(
        0.0, "Probability of a multiplicative brightness change (nnU-Net: 0.15)."
    )
    brightness: tuple[float, float] = _f(
        (0.75, 1.25), "Brightness factor [low, high] (nnU-Net: 0.75–1.25)."
    )
    contrast_p: float = _f(0.0, "Probability of a contrast change (nnU-Net: 0.15).")
    contrast: tuple[float, float] = _f(
        (0.75, 1.25),
        "Contrast factor [low, high] about the box's mean, clipped to the box's range "
        "(nnU-Net: 0.75–1.25).",
    )
    low_resolution_p: float = _f(
        0.0,
        "Probability of simulated low resolution (nnU-Net: 0.25 per sample × 0.5 per "
        "channel = 0.125).",
    )
    low_resolution: tuple[float, float] = _f(
        (0.5, 1.0),
        "Zoom [low, high] of the simulated coarser scan, one for every axis: nearest "
        "down, linear back up (nnU-Net v2: 0.5–1, the same on every axis, nearest down, "
        "linear up).",
    )
    gamma_p: float = _f(0.0, "Probability of a gamma change (nnU-Net: 0.3).")
    gamma_inverted_p: float = _f(
        0.0, "Probability of a gamma change of the inverted image, before it (nnU-Net: 0.1)."
    )
    gamma: tuple[float, float] = _f(
        (0.7, 1.5),
        "Gamma [low, high], on the box's range, keeping its mean and standard deviation "
        "(nnU-Net: 0.7–1.5).",
    )

    # Not nnU-Net's: its intensity transforms scale the whole box, while a contrast phase
    # moves the liver against everything else (docs/experiments/robustness.md).
    phase_p: float = _f(
        0.0,
        "Probability of a contrast-phase change: the liver (by its label) moved to another "
        "phase's HU, its tumours by a share of that shift, the rest of the box as it was.",
    )
    phase_liver_hu: tuple[float, float] = _f(
        (50.0, 135.0),
        "The liver's mean HU after a phase change [low, high], drawn uniformly: unenhanced "
        "livers measure about 50–65 HU, portal venous ones 100–135 HU.",
    )
    phase_tumour_share: tuple[float, float] = _f(
        (0.3, 1.2),
        "The tumours' shift as a share [low, high] of the liver's: hypovascular tumours "
        "take up less contrast than the liver, hypervascular ones as much or more.",
    )

    @property
    def warps(self) -> bool:
        """Whether boxes are resampled (rotation or zoom) rather than rearranged."""
        return self.rotation_p > 0 or self.scaling_p > 0

    @property
    def on_device(self) -> bool:
        """Whether any transform runs on the devices (any probability above 0)."""
        return any(
            getattr(self, f.name) > 0 for f in dataclasses.fields(self) if f.name.endswith("_p")
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
    tile: TileRequest | None = None  # automatic, the whole volume, or cores of a size
    backend: str | None = None  # "jax" or "onnx"
    device: str = "auto"  # auto, cpu, gpu or tpu
    tta: bool | None = None  # mirrored test-time augmentation


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
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


SECTION_TYPES: dict[str, type] = typing.get_type_hints(Config)
SECTIONS = tuple(SECTION_TYPES)
