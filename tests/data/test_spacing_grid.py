"""The spacing grid: scans at a fixed voxel size, trained on R³ boxes around the liver,
predicted over their whole extent, written back in their own geometry."""

import jax
import nibabel as nib
import numpy as np
import pytest
from helpers import from_grid, from_run, prepare_store, rotation_z, tiny_config
from scipy import ndimage
from typer.testing import CliRunner

import ctseg.cli.main  # noqa: F401  (registers the commands)
from ctseg.cli.app import app
from ctseg.config import InferenceOptions
from ctseg.data import grids
from ctseg.data.store import Store
from ctseg.errors import CtsegError
from ctseg.io import scans
from ctseg.parallel.partition import make_mesh
from ctseg.run.trained import load_model
from ctseg.synth.dataset import write_dataset
from ctseg.training import pipeline
from ctseg.training.loop import train_and_evaluate

runner = CliRunner()
BOX = 16
SPACING = "data.spacing=[24.0,24.0,24.0]"  # phantoms of 290–900 mm: grids of 12–38 voxels
SPACING_GRID = ("data.grid=spacing", SPACING, f"data.resolution={BOX}", "model.depth=2")
TRAIN = ("train.steps=2", "train.eval_every=2", "train.checkpoint_every=2", "train.log_every=1")


def _liver_scan(path, shape, spacing, rotation, flip):
    """A label map with an ellipsoid liver (and a tumour in it) in the upper third of a
    scan of `shape` voxels, written with an oblique affine, axes 0/1 stored reversed when
    `flip` (LPS order); returns the array as stored."""
    grid = np.indices(shape).astype(float)
    centre = np.array(shape) * np.array([0.55, 0.5, 0.7])
    radii = np.array([0.22 * shape[0], 0.25 * shape[1], 5.0])
    inside = (((grid.T - centre) / radii) ** 2).sum(-1).T < 1
    labels = inside.astype(np.uint8)
    labels[(((grid.T - centre) / (radii / 3)) ** 2).sum(-1).T < 1] = 2
    affine = np.eye(4)
    affine[:3, :3] = rotation_z(rotation) @ np.diag(spacing)
    affine[:3, 3] = (-40.0, 12.0, 300.0)
    if flip:
        affine = affine @ np.diag([-1.0, -1.0, 1.0, 1.0])
        affine[:3, 3] += affine[:3, :3] @ -np.array([shape[0] - 1, shape[1] - 1, 0]) * -1
    nib.save(nib.Nifti1Image(labels, affine), path)
    return labels


def _round_trip(path, target, box):
    """The labels of `path` on the spacing grid, boxed around the liver as for training,
    put back on the grid and written in the file's geometry; (original, back, in box)."""
    scan = scans.read_scan(path)
    grid = grids.spacing_grid(scan.array.shape, scan.spacing, target)
    present = [np.flatnonzero(np.any(scan.array > 0, axis=o)) for o in ((1, 2), (0, 2), (0, 1))]
    scale = np.array(grid) / np.array(scan.array.shape)
    liver = (
        [int((p[0] + 0.5) * s - 0.5) for p, s in zip(present, scale, strict=True)],
        [int(np.ceil((p[-1] + 0.5) * s - 0.5)) + 1 for p, s in zip(present, scale, strict=True)],
    )
    offset = grids.training_offset(grid, box, liver)
    boxed = grids.to_box(scan.array, grid, offset, (box,) * 3, order=0)
    on_grid = np.zeros(grid, np.uint8)
    region = tuple(slice(max(o, 0), min(o + box, g)) for o, g in zip(offset, grid, strict=True))
    on_grid[region] = boxed[
        tuple(slice(r.start - o, r.stop - o) for r, o in zip(region, offset, strict=True))
    ]
    covered = np.zeros(grid, bool)
    covered[region] = True
    back = from_grid(on_grid, scan.array.shape, order=0)
    in_box = from_grid(covered.astype(np.uint8), scan.array.shape, order=0) > 0
    out = path.with_name("back.nii.gz")
    scans.write_labels(scan, back, out)
    written = nib.load(out)
    original = nib.load(path)
    np.testing.assert_allclose(written.affine, original.affine, atol=1e-6)
    stored_in_box = scans.to_original_order(scan, in_box)
    return np.asarray(original.dataobj), np.asarray(written.dataobj), stored_in_box, offset


@pytest.mark.parametrize("flip", [False, True])
@pytest.mark.parametrize(
    ("shape", "box", "cropped"),
    [((40, 36, 60), 24, True), ((20, 18, 12), 32, False)],  # longer than the box; smaller
)
def test_labels_boxed_on_the_spacing_grid_and_mapped_back_round_trip(
    tmp_path, shape, box, cropped, flip
):
    spacing = (0.8, 0.9, 2.0)
    original_labels = _liver_scan(tmp_path / "labels.nii.gz", shape, spacing, 15, flip)
    # At the scan's own spacing the grid is the scan: the round trip is exact in the box.
    original, back, in_box, offset = _round_trip(tmp_path / "labels.nii.gz", spacing, box)
    np.testing.assert_array_equal(original, original_labels)
    np.testing.assert_array_equal(back[in_box], original[in_box])
    assert (back[~in_box] == 0).all()
    assert in_box.all() != cropped  # a longer scan is cropped, a smaller one padded
    assert (np.array(offset) < 0).any() == (not cropped)
    assert (original[~in_box] == 0).all()  # the box keeps the whole liver
    # At a coarser spacing, the labels come back within one grid voxel of their borders
    # (a grid voxel is up to 1.5 of the scan's voxels here: a band of 2).
    coarse = (1.2, 1.2, 2.5)
    original, back, in_box, _ = _round_trip(tmp_path / "labels.nii.gz", coarse, box)
    for value in (1, 2):
        mask = original == value
        band = ndimage.binary_dilation(mask, iterations=2) & ~ndimage.binary_erosion(
            mask, iterations=2
        )
        assert ((back == value) != mask)[~band].sum() == 0, value


@pytest.fixture(scope="module")
def spacing_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("spacing")
    write_dataset(root / "raw", cases=4, size=24, seed=11)
    config = tiny_config(*SPACING_GRID, "mesh.spatial=[2,2,1]", *TRAIN)
    prepare_store(root / "raw", root / "prep", config)
    train_and_evaluate(config, root / "prep", root / "run")
    return root


def test_the_store_holds_whole_grids_and_a_box_around_the_liver(spacing_run):
    store = Store.open(spacing_run / "prep")
    assert store.grid == "spacing" and store.spacing == (24.0, 24.0, 24.0)
    assert store.grid_spec.describe() == "16³ boxes at 24 × 24 × 24 mm"
    for case in store.cases:
        expected = grids.spacing_grid(case.canonical_shape, case.spacing, (24.0,) * 3)
        assert case.grid_shape == expected
        assert np.load(store.path / "cases" / case.id / "image.npy").shape == expected
        # The case's own box holds its whole liver (16 voxels of 24 mm hold any liver).
        label = np.asarray(store.label(case.id))
        boxed = np.asarray(store.box(case.id, "label"))
        assert boxed.shape == (BOX,) * 3
        assert (boxed >= 1).sum() == (label >= 1).sum() == sum(case.label_counts[1:]) > 0
        # The box's affine puts its voxels 24 mm apart, at the grid voxel of its offset.
        affine = case.box_affine()
        np.testing.assert_allclose(np.linalg.norm(affine[:3, :3], axis=0), 24.0, rtol=0.1)
    assert any(any(g > BOX for g in c.grid_shape) for c in store.cases)  # some were cropped


def test_training_boxes_lie_around_the_liver_and_anywhere_the_same_on_every_layout(
    spacing_run,
):
    """A third of the boxes around the liver, the others anywhere on the scan; each box
    holds the grid's voxels at its offset (air beyond), whatever the mesh."""
    store = Store.open(spacing_run / "prep")
    config = tiny_config(*SPACING_GRID, *TRAIN)
    case = max(store.split("train"), key=lambda c: max(c.grid_shape))
    offsets = sorted({pipeline.draw_box_offset(config, case, BOX, step, 0) for step in range(60)})
    assert len(offsets) > 10  # spread over the scan, not one box
    around = [
        o
        for o in offsets
        if all(abs(a - b) <= BOX // 4 for a, b in zip(o, case.box_offset, strict=True))
    ]
    assert 0 < len(around) < len(offsets)
    for offset in list(offsets)[:5]:
        box = np.asarray(store.box(case.id, "image", offset))
        inside = tuple(
            slice(max(-o, 0), min(g - o, BOX)) for o, g in zip(offset, case.grid_shape, strict=True)
        )
        grid_part = tuple(
            slice(max(o, 0), min(o + BOX, g)) for o, g in zip(offset, case.grid_shape, strict=True)
        )
        np.testing.assert_array_equal(box[inside], np.asarray(store.image(case.id))[grid_part])
        outside = np.ones(box.shape, bool)
        outside[inside] = False
        assert (box[outside] == grids.AIR_HU).all()
    batches = [
        jax.device_get(pipeline.training_batch(store, config, make_mesh(spatial), step=7))
        for spatial in ((1, 1, 1), (2, 2, 1))
    ]
    for got, want in zip(batches[1], batches[0], strict=True):
        np.testing.assert_array_equal(got, want)


def test_training_on_the_spacing_grid_is_the_same_on_every_layout(spacing_run, tmp_path):
    config = tiny_config(*SPACING_GRID, "mesh.spatial=[1,1,1]", *TRAIN)
    train_and_evaluate(config, spacing_run / "prep", tmp_path / "run")
    got = load_model(tmp_path / "run", "latest")
    want = load_model(spacing_run / "run", "latest")
    for a, b in zip(
        jax.tree.leaves((got.params, got.stats)),
        jax.tree.leaves((want.params, want.stats)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_prediction_covers_the_whole_scan_tiled_as_whole(spacing_run, tmp_path):
    run, scan_path = spacing_run / "run", spacing_run / "raw" / "volume-1.nii.gz"
    scan = scans.read_scan(scan_path)
    grid = grids.spacing_grid(scan.array.shape, scan.spacing, (24.0,) * 3)
    predictions = []
    for tile in (0, 4):
        predictor = from_run(run, InferenceOptions("latest", tile=tile))
        assert "the scan at 24 × 24 × 24 mm, boxes of its extent" in predictor.summary
        prediction = predictor.predict(scan)
        box = predictor.engine.shape
        assert all(b >= g and b % 16 == 0 for b, g in zip(box, grid, strict=True))
        assert prediction.labels.shape == scan.array.shape
        assert prediction.grid_labels.shape == grid
        predictions.append(prediction)
    assert predictions[1].labels is not predictions[0].labels
    np.testing.assert_array_equal(predictions[0].labels, predictions[1].labels)
    result = runner.invoke(app, ["predict", str(run), str(scan_path), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    written = nib.load(tmp_path / "volume-1_seg.nii.gz")
    np.testing.assert_allclose(written.affine, nib.load(scan_path).affine, atol=1e-6)


def test_evaluation_scores_the_whole_scan_and_the_box_on_the_grid(spacing_run, tmp_path):
    args = ["evaluate", str(spacing_run / "run"), "--data", str(spacing_run / "prep")]
    result = runner.invoke(app, [*args, "--split", "train", "--out", str(tmp_path / "e")])
    assert result.exit_code == 0, result.output
    assert "grid Dice liver" in " ".join(result.output.split())


def test_a_store_of_another_grid_is_refused_by_train_and_evaluate(spacing_run, tmp_path):
    cube = tiny_config("data.resolution=16", "model.depth=2", *TRAIN)
    with pytest.raises(
        CtsegError, match="store of 16³ boxes at 24 × 24 × 24 mm but the run's config"
    ):
        train_and_evaluate(cube, spacing_run / "prep", tmp_path / "run")
    write_dataset(tmp_path / "raw", cases=2, size=16, seed=0)
    prepare_store(tmp_path / "raw", tmp_path / "cube", cube)
    args = ["evaluate", str(spacing_run / "run"), "--data", str(tmp_path / "cube")]
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "e")])
    assert "holds a store of 16³ cube but the run's config asks for 16³ boxes" in str(
        result.exception
    )
