"""Prediction compiles once per model: boxes on a ladder of sizes, the way to the grid and
back on the devices with programs that depend on the ladder's rungs, not on the scan."""

import json
import subprocess
import sys

import jax
import nibabel as nib
import numpy as np
import pytest
from helpers import from_grid, from_run, rotation_z, tiny_config

from ctseg.config import InferenceOptions
from ctseg.data import grids
from ctseg.inference.member import OnGrid
from ctseg.inference.quality import uncertainty
from ctseg.inference.scan import to_grid, way_back
from ctseg.io.scans import read_scan
from ctseg.model.step import init_state
from ctseg.run import rundir
from ctseg.run.checkpoints import Checkpoints


def test_the_ladder_holds_every_size_in_a_few_rungs():
    for multiple in (2, 16, 32):
        sides = [grids.ladder_rung(n, multiple) for n in range(1, 1300)]
        assert all(side % multiple == 0 and side >= n for n, side in enumerate(sides, 1))
        # From four multiples on, a rung is at most 1.25× the size it holds.
        assert all(side <= 1.25 * n for n, side in enumerate(sides, 1) if n > 4 * multiple)
    # LiTS-like grids (at 0.8 mm: 60–1250 voxels a side) take 18 box sides, not 76.
    assert len({grids.ladder_rung(n, 16) for n in range(60, 1250)}) == 18
    assert len({-(-n // 16) for n in range(60, 1250)}) == 76
    assert grids.inference_box((560, 560, 320), 16) == (640, 640, 320)


def _scan(path, shape, spacing, degrees, seed):
    """Smooth HU (a blurred field from −1000 to 400) with noise, at an affine rotated
    `degrees` about z: oblique scans are resampled in their own canonical voxels."""
    rng = np.random.default_rng(seed)
    axes = np.meshgrid(*(np.linspace(0, 3, n) for n in shape), indexing="ij")
    smooth = 700 * np.sin(axes[0] * 2.1 + axes[1]) * np.cos(axes[2] * 1.7) - 300
    hu = np.clip(smooth + rng.normal(0, 40, shape), -1024, 3000).astype(np.int16)
    affine = np.eye(4)
    affine[:3, :3] = rotation_z(degrees) @ np.diag(spacing)
    nib.save(nib.Nifti1Image(hu, affine), path)
    return path


@pytest.mark.parametrize("degrees", [0, 20])
def test_the_devices_bring_a_scan_to_the_grid_as_training_does(tmp_path, degrees):
    """`to_grid.unit_box` (float32 on the devices) against `grids.to_box` (float64
    scipy on the host): at most one HU apart, on a rare voxel rounding the other way;
    the whole grid padded with air, and a window of it reaching past the grid."""
    scan = read_scan(_scan(tmp_path / "scan.nii.gz", (45, 38, 21), (0.9, 0.7, 2.5), degrees, 0))
    window = (-150.0, 250.0)
    one_hu = 2.0 / (window[1] - window[0])
    grid = grids.spacing_grid(scan.array.shape, scan.spacing, (1.1, 1.1, 1.1))
    boxes = [((0, 0, 0), grids.inference_box(grid, 16)), ((-6, 4, 10), (32, 16, 48))]
    for offset, box in boxes:
        host = grids.hu_to_unit(grids.to_box(scan.array, grid, offset, box, order=1), window)
        device = to_grid.unit_box(scan.array, grid, offset, box, window, jax.devices()[0])
        device = np.asarray(device)
        assert device.shape == box and device.dtype == np.float32
        differ = np.abs(device - host) > 1e-6
        assert np.abs(device - host).max() <= one_hu + 1e-6
        assert differ.mean() < 1e-3
        # Beyond the grid: air, exactly.
        outside = np.ones(box, bool)
        outside[tuple(slice(max(-o, 0), g - o) for o, g in zip(offset, grid, strict=True))] = False
        np.testing.assert_array_equal(device[outside], grids.hu_to_unit(-1024, window))


def test_the_way_back_from_a_padded_box_equals_the_grid_s():
    """The tables crop the box to the grid: the labels and probabilities on the scan are
    those of the grid alone (scipy's, `helpers.from_grid`)."""
    rng = np.random.default_rng(4)
    box = rng.dirichlet(np.ones(3), size=(32, 32, 16)).astype(np.float32)
    grid = (21, 30, 11)
    cropped = box[: grid[0], : grid[1], : grid[2]]
    for shape in [(50, 17, 40), (21, 30, 11), (9, 64, 5)]:
        back = way_back.ON_DEVICES.scan_labels(jax.device_put(box), shape, True, grid)
        labels, on_scan = back.labels, back.probabilities
        expected = from_grid(cropped, shape, order=1)
        assert labels.shape == shape and on_scan.shape == (*shape, 3)
        np.testing.assert_allclose(on_scan, expected, rtol=0, atol=1e-6)
        assert (labels == expected.argmax(-1)).mean() > 0.999  # ties may break either way
        # The uncertainty on the scan's voxels alone, not the devices' padding.
        host_sums = uncertainty.probability_sums(expected, np)
        np.testing.assert_allclose(back.uncertainty.sums, host_sums, rtol=1e-4)
    np.testing.assert_array_equal(
        way_back.ON_DEVICES.grid_labels(jax.device_put(box), grid), cropped.argmax(-1)
    )


def test_a_trained_model_s_labels_are_those_of_the_host_s_preprocessing(trained):
    """The tiny trained run's probabilities from the devices' grid equal those from the
    host's (the same int16 HU here), and so do its labels before post-processing (which
    leaves a 2-step model nothing)."""
    run_dir, _, raw = trained
    predictor = from_run(run_dir, InferenceOptions(backend="jax", device="cpu"))
    member = predictor.members[0]
    window = member.config.data.hu_window
    for source in sorted(raw.glob("volume-*.nii.gz")):
        scan = read_scan(source)
        grid = member.grid.grid_of(scan.array.shape, scan.spacing)
        hu = grids.to_box(scan.array, grid, (0, 0, 0), grid, order=1)
        host = OnGrid(grids.hu_to_unit(hu, window), grid)
        (device,) = predictor.to_grid(scan, {})
        np.testing.assert_allclose(np.asarray(device.unit), host.unit, rtol=0, atol=1e-6)
        labels = []
        for on_grid in (host, device):
            (probabilities,) = predictor.infer([on_grid], {})
            labels.append(way_back.ON_DEVICES.scan_labels(probabilities, scan.array.shape).labels)
        assert np.ptp(labels[0]) > 0  # a labelling to compare
        np.testing.assert_array_equal(labels[1], labels[0])


def _spacing_run(run_dir):
    """An untrained tiny model on a spacing grid of 8 mm (speed and compiles do not depend
    on the weights)."""
    config = tiny_config("data.grid=spacing", "data.spacing=[8.0,8.0,8.0]")
    run_dir.mkdir(parents=True)
    rundir.write_or_check_config(run_dir, config)
    _, state = init_state(config)
    checkpoints = Checkpoints(run_dir, keep=1)
    checkpoints.save(state)
    checkpoints.wait()
    checkpoints.close()
    return run_dir


def _predict(run_dir, scans, out, cache):
    command = [sys.executable, "-m", "ctseg.cli.main", "predict", str(run_dir)]
    command += [*map(str, scans), "--out", str(out), "--backend", "jax", "--device", "cpu"]
    command += ["--compile-cache", str(cache)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    names = [scan.name.removesuffix(".nii.gz") for scan in scans]
    return [json.loads((out / f"{name}_stats.json").read_text()) for name in names]


def test_scans_of_ten_extents_compile_once_and_a_second_process_nothing(tmp_path):
    """Ten scans of ten extents (2 × 2 × 4 mm: grids of 17–25 voxels at 8 mm, boxes of 32
    voxels a side) compile no program after the first scan's; a second process over ten
    other extents finds every program in the persistent cache."""
    run_dir = _spacing_run(tmp_path / "run")
    cache = tmp_path / "cache"
    extents = {
        "first": [(70 + i, 79 - i, 34 + i) for i in range(10)],
        "second": [(70 + i, 70 + i, 48 - i) for i in range(10)],
    }
    recorded = []
    for attempt, shapes in extents.items():
        (tmp_path / attempt).mkdir()
        scans = [
            _scan(tmp_path / attempt / f"scan-{i}.nii.gz", shape, (2.0, 2.0, 4.0), 0, i)
            for i, shape in enumerate(shapes)
        ]
        stats = _predict(run_dir, scans, tmp_path / f"out-{attempt}", cache)
        recorded.append([s["compiled"] for s in stats])
    assert not set(extents["first"]) & set(extents["second"])
    first, second = recorded
    assert first[0]["programs"] > 0 and first[0]["from_cache"] == 0
    assert all(compiled == first[0] for compiled in first), first  # nothing after the first
    programs = first[0]["programs"]
    assert all(c == {"programs": programs, "from_cache": programs} for c in second)
