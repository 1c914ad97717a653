"""Ensembles of runs, the Python API, and DICOM SEG output, as users of nnU-Net and
TotalSegmentator use them."""

import dataclasses
import json
import logging
import os
import shutil

import nibabel as nib
import numpy as np
import pydicom
import pytest
import SimpleITK as sitk
from dicom_series import write_dicom_series
from helpers import liver_with_tumour, random_model, rotation_z
from typer.testing import CliRunner

import ctseg.cli.main  # noqa: F401  (registers the commands)
from ctseg import Segmenter, segment
from ctseg.cli.app import app
from ctseg.config import DataConfig, InferenceOptions
from ctseg.errors import CtsegError
from ctseg.inference.network.jax.backend import JaxBackend
from ctseg.inference.predictor import Predictor
from ctseg.inference.scan import postprocess
from ctseg.io import scans

runner = CliRunner(env={"COLUMNS": "400"})  # no line of the output folded


@pytest.fixture(scope="module")
def scan():
    """A CT-like scan of 40×36×30 voxels, oblique, with a bright blob to segment."""
    rng = np.random.default_rng(5)
    hu = rng.normal(40, 30, (40, 36, 30)).astype(np.float32)
    hu[8:30, 10:28, 6:24] += 80
    affine = np.eye(4)
    affine[:3, :3] = rotation_z(10) @ np.diag([1.5, 1.6, 2.5])
    return scans.scan_from_image(hu, affine, "blob")


def _members():
    """Two different models: a depth-2 cube and a depth-3 model on a 6 mm spacing grid."""
    cube = random_model(2)
    spaced = random_model(3)
    data = DataConfig(resolution=32, grid="spacing", spacing=(6.0, 6.0, 6.0))
    spaced = dataclasses.replace(spaced, config=dataclasses.replace(spaced.config, data=data))
    return cube, spaced


@pytest.mark.parametrize("tile", [0, 8])
def test_an_ensemble_is_the_mean_of_its_members_probabilities(scan, tile):
    members = _members()
    options = InferenceOptions(tile=tile)
    alone = [
        Predictor(m, JaxBackend(), options).predict(scan, with_probabilities=True) for m in members
    ]
    ensemble = Predictor(list(members), JaxBackend(), options).predict(
        scan, with_probabilities=True
    )
    mean = (alone[0].probabilities + alone[1].probabilities) / 2
    np.testing.assert_allclose(ensemble.probabilities, mean, rtol=0, atol=1e-6)
    expected = postprocess.clean_labels(mean.argmax(-1).astype(np.uint8), True, True)
    np.testing.assert_array_equal(ensemble.labels, expected)
    assert ensemble.grid_probabilities is None  # the members' grids differ
    # An ensemble of one run is that run.
    one = Predictor([members[0]], JaxBackend(), options).predict(scan, with_probabilities=True)
    np.testing.assert_array_equal(one.probabilities, alone[0].probabilities)
    np.testing.assert_array_equal(one.labels, alone[0].labels)


def test_ensemble_members_are_named_and_need_flips_for_tta(scan):
    members = _members()
    predictor = Predictor(list(members), JaxBackend(), InferenceOptions(tile=0))
    assert "ensemble of 2: a model (step 0): whole volume 32³; a model (step 0): " in (
        predictor.summary
    )
    unflipped = dataclasses.replace(
        members[1],
        config=dataclasses.replace(
            members[1].config, train=dataclasses.replace(members[1].config.train, flip=False)
        ),
    )
    with pytest.raises(CtsegError, match="trained without flips"):
        Predictor([members[0], unflipped], JaxBackend(), InferenceOptions(tta=True))


def test_predict_and_evaluate_take_several_runs(trained, tmp_path):
    run_dir, store, raw = trained
    twin = tmp_path / "twin"  # another run directory with the same model
    shutil.copytree(run_dir, twin)
    args = [str(raw / "volume-1.nii.gz"), "--checkpoint", "latest", "--out", str(tmp_path / "p")]
    # A run named twice would weigh twice in the mean: refused, however it is spelled.
    result = runner.invoke(
        app,
        [
            "predict",
            str(run_dir),
            "--run",
            str(twin),
            "--run",
            os.path.join(run_dir, "..", run_dir.name),
            *args,
        ],
    )
    assert "is named twice (also as" in str(result.exception), result.output
    assert not (tmp_path / "p").exists()
    result = runner.invoke(app, ["predict", str(run_dir), "--run", str(twin), *args])
    assert result.exit_code == 0, result.output
    assert "ensemble of 2:" in result.output and "checkpoint steps 2, 2" in result.output
    stats = json.loads((tmp_path / "p" / "volume-1_stats.json").read_text())
    assert [m["run_step"] for m in stats["ensemble"]] == [2, 2]
    assert len(stats["member_seconds"]) == 2
    # A folder of runs is an ensemble too, and evaluate scores it; it needs --out.
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "a").symlink_to(run_dir)
    (runs / "b").symlink_to(run_dir)
    evaluate = ["evaluate", str(runs), "--data", str(store), "--split", "train"]
    result = runner.invoke(app, [*evaluate, "--out", str(tmp_path / "e")])
    assert "is named twice" in str(result.exception), result.output
    (runs / "b").unlink()
    (runs / "b").symlink_to(twin)
    result = runner.invoke(app, evaluate)
    assert "reports into --out: give one" in str(result.exception), result.output
    result = runner.invoke(app, [*evaluate, "--out", str(tmp_path / "e")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "e" / "summary.json").read_text())
    assert len(summary["run"]["ensemble"]) == 2 and summary["summary"]["n_cases"] >= 1
    assert summary["summary"]["grid_dice"]["liver"] is None


def test_the_python_api_gives_the_cli_s_labels_from_memory(trained, tmp_path):
    run_dir, _, raw = trained
    path = raw / "volume-2.nii.gz"
    out = tmp_path / "cli"
    args = ["predict", str(run_dir), str(path), "--checkpoint", "latest", "--tile", "0"]
    result = runner.invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    written = nib.load(out / "volume-2_seg.nii.gz")
    stats = json.loads((out / "volume-2_stats.json").read_text())

    segmenter = Segmenter(run_dir, checkpoint="latest", tile=0)
    image = nib.load(path)
    from_nibabel = segmenter(image)
    np.testing.assert_array_equal(from_nibabel.labels, np.asarray(written.dataobj))
    np.testing.assert_allclose(from_nibabel.affine, written.affine, atol=1e-6)
    for key in ("liver_volume_ml", "tumour_volume_ml", "tumour_count"):
        assert from_nibabel.stats[key] == stats[key]
    # The same scan as a SimpleITK image, an array with its affine, and a path.
    itk = sitk.ReadImage(str(path))
    for result in (
        segmenter(itk),
        segmenter(np.asarray(image.get_fdata(), np.float32), image.affine),
        segment(path, run_dir, checkpoint="latest", tile=0, out=tmp_path / "api.nii.gz"),
    ):
        np.testing.assert_array_equal(result.labels, from_nibabel.labels)
    saved = nib.load(tmp_path / "api.nii.gz")
    np.testing.assert_array_equal(np.asarray(saved.dataobj), np.asarray(written.dataobj))
    np.testing.assert_allclose(saved.affine, written.affine, atol=1e-6)
    with pytest.raises(CtsegError, match="needs its 4×4 voxel-to-RAS affine"):
        segmenter(np.zeros((8, 8, 8), np.float32))


def test_predict_writes_a_dicom_seg_for_a_dicom_series(trained, tmp_path, monkeypatch):
    hd = pytest.importorskip("highdicom")
    monkeypatch.setattr(postprocess, "clean_labels", liver_with_tumour)
    run_dir, _, raw = trained
    source = scans.read_scan(raw / "volume-0.nii.gz")
    itk = sitk.GetImageFromArray(
        np.asarray(scans.to_original_order(source, source.array), np.int16).transpose(2, 1, 0)
    )
    itk.SetSpacing(tuple(float(v) for v in source.spacing))
    series = tmp_path / "series"
    write_dicom_series(series, itk, one_study=True)
    base = ["predict", str(run_dir), str(series), "--checkpoint", "latest", "--out"]
    nifti = runner.invoke(app, [*base, str(tmp_path / "nifti")])
    seg = runner.invoke(app, [*base, str(tmp_path / "seg"), "--output-type", "dicom-seg"])
    assert nifti.exit_code == 0 and seg.exit_code == 0, nifti.output + seg.output
    labels = scans.read_scan(tmp_path / "nifti" / "series_seg.nii.gz").array
    written = hd.seg.segread(tmp_path / "seg" / "series_seg.dcm")
    assert [s.SegmentLabel for s in written.SegmentSequence] == ["Liver", "Liver tumour"]
    uids = [pydicom.dcmread(f, stop_before_pixels=True).SOPInstanceUID for f in series.iterdir()]
    masks = written.get_pixels_by_source_instance(
        uids, segment_numbers=[1, 2], assert_missing_frames_are_empty=True
    )
    # The same prediction as the NIfTI's: the liver (tumour included) and the tumour.
    assert (labels == 2).any()
    assert int(masks[..., 0].sum()) == int((labels >= 1).sum())
    assert int(masks[..., 1].sum()) == int((labels == 2).sum())
    assert (tmp_path / "seg" / "series_stats.json").is_file()
    # A NIfTI input cannot become a DICOM SEG: one line, before anything is predicted.
    refused = runner.invoke(
        app,
        [*base, str(tmp_path / "x"), "--output-type", "dicom-seg"][:2]
        + [
            str(raw / "volume-0.nii.gz"),
            "--out",
            str(tmp_path / "x"),
            "--output-type",
            "dicom-seg",
        ],
    )
    assert isinstance(refused.exception, CtsegError)
    assert "needs DICOM series as inputs" in str(refused.exception)
    assert not (tmp_path / "x").exists()


def test_the_python_api_names_each_run_once_and_loads_quietly(trained, caplog):
    """A run named twice would weigh twice in the ensemble's mean: refused, as the CLI
    refuses it. Loading a model logs none of orbax's notes on reading checkpoints."""
    run_dir = trained[0]
    with pytest.raises(CtsegError, match="is named twice"):
        Segmenter([run_dir, run_dir])
    with caplog.at_level(logging.INFO):
        segmenter = Segmenter(run_dir, checkpoint="latest", tile=0)
    assert "ensemble" not in segmenter.summary
    assert [r.getMessage() for r in caplog.records if r.name == "absl"] == []


def test_segmenter_map_pipelines_files_into_the_results_of_single_calls(trained, tmp_path):
    run_dir, _, raw = trained
    segmenter = Segmenter(run_dir, checkpoint="latest", tile=0)
    paths = [raw / f"volume-{i}.nii.gz" for i in (2, 0, 1)]
    mapped = list(segmenter.map(paths))
    assert [result.scan.name for result in mapped] == [segmenter(p).scan.name for p in paths]
    for path, result in zip(paths, mapped, strict=True):
        alone = segmenter(path)
        np.testing.assert_array_equal(result.labels, alone.labels)
        assert result.stats == alone.stats and result.quality == alone.quality
    # A file that cannot be read raises in its turn, after the results before it.
    broken = tmp_path / "volume-9.nii.gz"
    broken.write_bytes(b"not a scan")
    results = segmenter.map([paths[0], broken, paths[1]])
    np.testing.assert_array_equal(next(results).labels, mapped[0].labels)
    with pytest.raises(CtsegError, match="volume-9"):
        next(results)
