"""What several test modules share: tiny models, label maps, scans and one trained run.

Test modules import from here, never from each other (a module imported by another
would run its module fixtures twice).
"""

from pathlib import Path

import jax
import nibabel as nib
import numpy as np
import SimpleITK as sitk

from ctseg import config as cfg
from ctseg import infer, unet
from ctseg.store import prepare
from ctseg.train import train_and_evaluate
from data_prep.synth import write_dataset

RESOLUTION = 32  # the grid of `random_model`'s models

# Hand-built label maps (`labels`) and their voxels' size.
SPACING = (0.8, 0.8, 2.0)
SHAPE = (16, 16, 8)


def random_model(
    depth: int, dtype: str = "float32", spatial: tuple[int, int, int] = (2, 2, 1)
) -> infer.Model:
    """An untrained tiny model whose batch-norm running statistics are not the identity."""
    config = cfg.from_dict(
        {
            "data": {"resolution": RESOLUTION},
            "model": {"base_filters": 2, "depth": depth, "dtype": dtype},
            "mesh": {"spatial": list(spatial)},
        }
    )
    graphdef, params, stats = unet.create(config.model, seed=3)
    rng = np.random.default_rng(0)

    def perturb(path, leaf):
        name = jax.tree_util.keystr(path)
        if "head" in name:
            return leaf  # a large class bias would make every voxel one class
        if "var" in name:
            return np.asarray(rng.uniform(0.5, 2.0, leaf.shape), np.float32)
        if "mean" in name or "bias" in name:
            return np.asarray(rng.normal(0, 0.3, leaf.shape), np.float32)
        return leaf

    stats = jax.tree_util.tree_map_with_path(perturb, stats)
    params = jax.tree_util.tree_map_with_path(perturb, params)
    return infer.Model(config, graphdef, params, stats, step=0)


def labels(tumour: bool = True, shift: int = 0) -> np.ndarray:
    """A liver block with a tumour inside; `shift` moves the liver only."""
    volume = np.zeros(SHAPE, np.uint8)
    volume[3 + shift : 12 + shift, 3:12, 2:6] = 1
    if tumour:
        volume[5:8, 5:8, 3:5] = 2
    return volume


def save(path: Path, volume: np.ndarray, spacing=SPACING, origin=(0.0, 0.0, 0.0)) -> Path:
    affine = np.diag([*spacing, 1.0])
    affine[:3, 3] = origin
    nib.save(nib.Nifti1Image(volume, affine), path)
    return path


def rotation_z(degrees: float) -> np.ndarray:
    t = np.deg2rad(degrees)
    return np.array([[np.cos(t), -np.sin(t), 0], [np.sin(t), np.cos(t), 0], [0, 0, 1]])


def itk_image(data: np.ndarray) -> sitk.Image:
    """`data` [x, y, z] as an oblique ITK image (0.7 × 0.9 × 2 mm, rotated 15° about z)."""
    image = sitk.GetImageFromArray(data.transpose(2, 1, 0))  # ITK wants [z, y, x]
    image.SetSpacing((0.7, 0.9, 2.0))
    image.SetOrigin((-5.0, 12.0, 40.0))
    image.SetDirection(tuple(rotation_z(15).ravel()))
    return image


def write_trained_run(root: Path) -> tuple[Path, Path, Path]:
    """(run_dir, store_dir, raw_dir) of a 2-step run of a tiny model on a 16³ grid."""
    config = cfg.load(
        None,
        [
            "data.resolution=16",
            "model.base_filters=2",
            "model.depth=3",
            "mesh.spatial=[2,2,1]",
            "train.steps=2",
            "train.eval_every=2",
            "train.checkpoint_every=2",
        ],
    )
    write_dataset(root / "raw", cases=3, size=32, seed=0)
    prepare(root / "raw", root / "store", config)
    train_and_evaluate(config, root / "store", root / "run")
    return root / "run", root / "store", root / "raw"
