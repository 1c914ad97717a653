"""Full resolution only where the liver is: inside the region, the labels of a prediction
that runs the network on the region's box of the grid equal the whole scan's, exactly."""

import dataclasses

import jax
import numpy as np
import pytest
from helpers import fixed_windows_everywhere, random_model

from ctseg import config as cfg
from ctseg.config import InferenceOptions
from ctseg.inference.network.choice import backend_named
from ctseg.inference.network.jax.backend import JaxBackend
from ctseg.inference.predictor import Predictor
from ctseg.inference.scan import postprocess
from ctseg.inference.scan.region import Region, region_of, window_of
from ctseg.io.scans import scan_from_image
from ctseg.model import unet

# A scan long in x, so that a region's box has interior borders on the 1 mm → 2 mm grid.
SHAPE = (300, 100, 60)


@pytest.fixture(scope="module")
def scan():
    rng = np.random.default_rng(5)
    hu = rng.normal(40, 120, SHAPE).astype(np.float32)
    hu[180:260, 30:80, 15:45] += 200  # something for the network to see
    return scan_from_image(hu, np.diag([1.0, 1.0, 1.0, 1.0]), "long")


@pytest.fixture(scope="module")
def model():
    spacing = cfg.load(None, ["data.grid=spacing", "data.spacing=[2.0, 2.0, 2.0]"])
    base = random_model(depth=2)
    config = dataclasses.replace(base.config, data=spacing.data)
    return dataclasses.replace(base, config=config)


def _raw(monkeypatch):
    monkeypatch.setattr(postprocess, "clean_labels", lambda labels, *options: labels)


@pytest.mark.parametrize(
    "backend, tile, devices",
    [
        ("jax", 0, 1),
        ("jax", 0, 4),
        ("jax", 8, 1),
        ("jax", 8, 4),
        ("jax windows", 8, 1),  # fixed windows, as on accelerators: the whole scan in canvases
        ("onnx", 0, 1),
        ("onnx", 8, 1),
    ],
)
def test_inside_the_region_the_labels_are_the_whole_scan_s(
    scan, model, backend, tile, devices, monkeypatch, tmp_path
):
    _raw(monkeypatch)
    windows = backend == "jax windows"
    if windows:
        fixed_windows_everywhere(monkeypatch)
        backend = "jax"
    if backend == "onnx":
        pytest.importorskip("onnxruntime")
    options = InferenceOptions(tile=tile, backend=backend)
    predictor = Predictor(model, backend_named(backend, jax.devices()[:devices]), options)
    assert predictor.backend.name == backend
    whole = predictor.predict(scan).labels
    assert (predictor.members[0].boxes.canvas is not None) == windows  # the whole scan's in one
    mask = np.zeros(SHAPE, np.uint8)
    mask[200:240, 40:70, 20:40] = 1
    path = tmp_path / "roi.nii.gz"
    import nibabel as nib

    nib.save(nib.Nifti1Image(mask, np.eye(4)), path)
    predictor.predict_region(roi=path, margin_mm=4.0)
    located = predictor.predict(scan)
    record = located.located
    lo, hi = record["region"]["lo"], record["region"]["hi"]
    assert lo == [196, 36, 16] and hi == [244, 74, 44]
    inside = tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))
    np.testing.assert_array_equal(located.labels[inside], whole[inside])
    outside = np.ones(SHAPE, bool)
    outside[inside] = False
    assert not located.labels[outside].any() and whole[outside].any()
    # The network ran on a box of the grid, not the whole of it.
    box = predictor.members[0].engine.shape
    assert box[0] < 150 and predictor.members[0].engine is not None


def test_a_mask_of_the_whole_scan_gives_the_whole_scan_s_prediction(scan, model, monkeypatch):
    _raw(monkeypatch)
    predictor = Predictor(
        model, JaxBackend(jax.devices()[:1]), InferenceOptions(tile=0, backend="jax")
    )
    whole = predictor.predict(scan).labels
    region = Region((0, 0, 0), SHAPE)
    on_grid = predictor.members[0].to_grid(scan, region)
    assert on_grid.window.lo == (0, 0, 0) and on_grid.window.hi == SHAPE
    probabilities = predictor.infer([on_grid], {})
    labels = predictor.to_scan(scan, probabilities, [on_grid], {}).labels
    np.testing.assert_array_equal(labels, whole)


def test_the_window_reaches_the_receptive_field_beyond_what_the_region_needs(model):
    radius = unet.receptive_field_radius(model.config.model)
    window = window_of(
        Region((200, 40, 20), (240, 70, 40)), SHAPE, (150, 50, 30), (160, 64, 32), radius, 16
    )
    assert window.offset[0] % 16 == 0 and window.offset[0] <= 100 - radius - 1
    assert window.offset[0] + window.box[0] >= 120 + radius
    assert window.lo[0] <= 200 and window.hi[0] >= 240
    # The box voxels the region's labels read: inside the box, the radius from its edges
    # (where the box is not at the whole box's faces).
    (lo, hi), box = window.need[0], window.box[0]
    assert radius <= lo < hi <= box - radius and hi - lo >= (240 - 200) // 2


def test_no_liver_or_a_cut_one_predicts_the_whole_scan():
    empty = np.zeros((20, 20, 20), np.uint8)
    assert region_of(empty, (1, 1, 1), 5.0) == (None, "no liver found")
    cut = empty.copy()
    cut[5:10, 5:10, 0:8] = 1
    region, why = region_of(cut, (1, 1, 1), 5.0)
    assert region is None and "top or bottom" in why
    region, why = region_of(cut, (1, 1, 1), 2.0, located=False)  # a user's mask: as it is
    assert why is None and region == Region((3, 3, 0), (12, 12, 10))


def test_predict_locate_records_the_region_or_says_why_the_whole_scan(trained, tmp_path):
    import json

    from typer.testing import CliRunner

    import ctseg.cli.main  # noqa: F401  (registers the commands)
    from ctseg.cli.app import app

    run_dir, _, raw = trained
    scans = [str(raw / "volume-0.nii.gz"), str(raw / "volume-1.nii.gz")]
    predict = ["predict", str(run_dir), *scans, "--checkpoint", "latest", "--tile", "0"]
    result = CliRunner().invoke(
        app, [*predict, "--out", str(tmp_path / "p"), "--locate", str(run_dir)]
    )
    assert result.exit_code == 0, result.output
    located = json.loads((tmp_path / "p" / "volume-0_stats.json").read_text())["located"]
    assert located["source"].startswith(f"locator {run_dir}") and located["margin_mm"] == 20.0
    if located["fallback"] is not None:  # a 2-step model may find no liver: said, not silent
        assert located["region"] is None and "predicted the whole scan" in result.output
    else:
        assert len(located["region"]["lo"]) == 3
    both = [*predict, "--out", str(tmp_path / "q"), "--roi", scans[0]]
    result = CliRunner().invoke(app, both)
    assert "--roi" in str(result.exception) and "one scan" in str(result.exception)
    # Several scans: a folder of masks named as the scans, each scan's own region.
    masks = tmp_path / "masks"
    masks.mkdir()
    for name in ("volume-0", "volume-1"):
        label = raw / f"{name.replace('volume', 'segmentation')}.nii.gz"
        target = masks / (f"{name}.nii.gz" if name == "volume-0" else f"{name}_seg.nii.gz")
        target.write_bytes(label.read_bytes())
    result = CliRunner().invoke(app, [*predict, "--out", str(tmp_path / "r"), "--roi", str(masks)])
    assert result.exit_code == 0, result.output
    for name, mask in (("volume-0", "volume-0.nii.gz"), ("volume-1", "volume-1_seg.nii.gz")):
        record = json.loads((tmp_path / "r" / f"{name}_stats.json").read_text())["located"]
        assert record["source"] == f"mask {masks / mask}" and record["region"] is not None
    (masks / "volume-1_seg.nii.gz").unlink()  # a scan without its mask: nothing predicted
    result = CliRunner().invoke(app, [*predict, "--out", str(tmp_path / "s"), "--roi", str(masks)])
    message = str(result.exception)
    assert result.exit_code != 0 and "no mask for the scan volume-1" in message
    assert "\n" not in message and not (tmp_path / "s" / "volume-0_seg.nii.gz").exists()
    result = CliRunner().invoke(app, [*predict, "--out", str(tmp_path / "t"), "--roi", "gone"])
    assert "--roi gone: no such mask file or folder" in str(result.exception)
