"""What several test modules share: tiny models, label maps, scans and one trained run.

Test modules import from here, never from each other (a module imported by another
would run its module fixtures twice).
"""

import contextlib
from pathlib import Path

import jax
import nibabel as nib
import numpy as np
import SimpleITK as sitk
from scipy import ndimage

from ctseg import config as cfg
from ctseg.data_prep.build import PrepareResult, write_store
from ctseg.data_prep.raw import find_cases
from ctseg.model import unet
from ctseg.run.trained import TrainedModel
from ctseg.synth.dataset import write_dataset
from ctseg.training.loop import train_and_evaluate

REPO = Path(__file__).resolve().parents[2]  # the checkout: configs/, scripts/, docs/
RESOLUTION = 32  # the grid of `random_model`'s models
# The smallest model worth testing, as `--set` overrides (the CLI's own words).
TINY = ("data.resolution=16", "model.base_filters=2", "model.depth=2")

# Hand-built label maps (`labels`) and their voxels' size.
SPACING = (0.8, 0.8, 2.0)
SHAPE = (16, 16, 8)


def shard_global(mesh, array, spec=None) -> jax.Array:
    """Place a host array on the mesh (activations' sharding by default)."""
    from jax.sharding import NamedSharding

    from ctseg.parallel.partition import ACTIVATION_SPEC

    return jax.device_put(array, NamedSharding(mesh, ACTIVATION_SPEC if spec is None else spec))


def liver_with_tumour(labels: np.ndarray, *options) -> np.ndarray:
    """A stand-in for post-processing (`postprocess.clean_labels`) that returns a liver
    with a tumour, whatever a barely trained model saw."""
    out = np.zeros_like(labels)
    x, y, z = (n // 4 for n in labels.shape)
    out[x : 3 * x, y : 3 * y, z : 3 * z] = 1
    out[x : 2 * x, y : 2 * y, z : 2 * z] = 2
    return out


def tiny_config(*overrides: str) -> cfg.Config:
    """`TINY` (a base-2, depth-2 U-Net on a 16³ grid, one device) with `--set`-style
    overrides on top, e.g. `tiny_config("model.depth=3", "train.steps=4")`."""
    return cfg.load(None, [*TINY, *overrides])


def random_model(
    depth: int, dtype: str = "float32", spatial: tuple[int, int, int] = (2, 2, 1)
) -> TrainedModel:
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
    return TrainedModel(config, graphdef, params, stats, step=0)


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


def fixed_windows_everywhere(monkeypatch) -> None:
    """Every JAX backend made from now on runs fixed windows, as on an accelerator (and so
    holds its scans in canvases), here on the CPU's devices."""
    from ctseg.inference.network.jax import backend as jax_backend

    made = jax_backend.JaxBackend.__init__

    def with_windows(self, devices=None, fixed_windows=None, **kwargs):
        made(self, devices, True, **kwargs)

    monkeypatch.setattr(jax_backend.JaxBackend, "__init__", with_windows)


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


def prepare_store(raw_dir: Path, out_dir: Path, config: cfg.Config, **options) -> PrepareResult:
    """`ctseg preprocess RAW_DIR OUT_DIR`: the store of the cases found in `raw_dir`."""
    return write_store(find_cases(raw_dir), out_dir, config, **options)


def write_trained_run(root: Path) -> tuple[Path, Path, Path]:
    """(run_dir, store_dir, raw_dir) of a 2-step run of a tiny model on a 16³ grid."""
    config = tiny_config(
        "model.depth=3",
        "mesh.spatial=[2,2,1]",
        "train.steps=2",
        "train.eval_every=2",
        "train.checkpoint_every=2",
    )
    write_dataset(root / "raw", cases=3, size=32, seed=0)
    prepare_store(root / "raw", root / "store", config)
    train_and_evaluate(config, root / "store", root / "run")
    return root / "run", root / "store", root / "raw"


@contextlib.contextmanager
def no_host_transfers():
    """Fail on any transfer between host and devices, explicit or not (prediction stays on
    the devices once the grid is sent)."""
    with (
        jax.transfer_guard_host_to_device("disallow_explicit"),
        jax.transfer_guard_device_to_host("disallow_explicit"),
    ):
        yield


def from_grid(grid_array: np.ndarray, shape, order: int = 1) -> np.ndarray:
    """The reference way back: an [R,R,R] or [R,R,R,C] grid array resampled onto the scan's
    `shape` by scipy (float64 inside), voxel centres as `ctseg.data.grids` places them."""
    scale = np.array(grid_array.shape[:3], float) / np.array(shape, float)

    def one(array: np.ndarray) -> np.ndarray:
        return ndimage.affine_transform(
            array, scale, offset=0.5 * scale - 0.5, output_shape=tuple(shape),
            output=np.float32 if order > 0 else array.dtype, order=order, mode="nearest",
        )  # fmt: skip

    if grid_array.ndim == 3:
        return one(grid_array)
    return np.stack([one(grid_array[..., c]) for c in range(grid_array.shape[3])], axis=-1)


def from_run(run_dirs, options=None):
    """`Predictor.from_run` on the backend `options` ask for, started as the API starts it."""
    from ctseg.config import InferenceOptions
    from ctseg.inference.network.choice import start_backend
    from ctseg.inference.predictor import Predictor

    options = options or InferenceOptions()
    return Predictor.from_run(run_dirs, start_backend(options), options)
