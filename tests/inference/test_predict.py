"""`ctseg predict` and `ctseg evaluate RUN_DIR` end to end on one tiny trained run."""

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import nibabel as nib
import numpy as np
import pytest
import SimpleITK as sitk
from dicom_series import write_dicom_series
from helpers import from_run, itk_image
from typer.testing import CliRunner

import ctseg.cli.main  # noqa: F401  (registers the commands)
from ctseg import config as cfg
from ctseg.cli.app import app
from ctseg.config import InferenceOptions
from ctseg.errors import CtsegError
from ctseg.inference.inputs import expand_inputs
from ctseg.inference.network.jax.backend import JaxBackend
from ctseg.inference.predictor import PHASES, Predictor
from ctseg.inference.quality.scan_checks import hu_warnings
from ctseg.model.step import TrainState
from ctseg.run.checkpoints import Checkpoints
from ctseg.run.trained import load_model

runner = CliRunner()


def _ct(rng: np.random.Generator, shape=(20, 18, 12)) -> np.ndarray:
    return rng.normal(0, 300, shape).clip(-1000, 1500).astype(np.int16)


def _inputs(folder: Path) -> dict[str, Path]:
    """NIfTI scans stored RAS, LPS and oblique, and a DICOM series; name -> path."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    c, s = np.cos(0.3), np.sin(0.3)
    affines = {
        "ras": np.diag([0.8, 0.9, 2.5, 1.0]),
        "lps": np.diag([-0.8, -0.9, 2.5, 1.0]),
        "oblique": np.array(
            [[0.8 * c, -0.9 * s, 0, 5], [0.8 * s, 0.9 * c, 0, -3], [0, 0, 2.5, 7], [0, 0, 0, 1]]
        ),
    }
    paths = {}
    for name, affine in affines.items():
        paths[name] = folder / f"{name}.nii.gz"
        nib.save(nib.Nifti1Image(_ct(rng), affine), paths[name])
    image = itk_image(_ct(rng, (14, 12, 9)))
    write_dicom_series(folder / "dicom", image)
    paths["dicom"] = folder / "dicom"
    return paths


def test_predict_keeps_geometry_and_reports_bad_scans(trained, tmp_path):
    run_dir, _, _ = trained
    inputs = _inputs(tmp_path / "in")
    (tmp_path / "in" / "broken.nii.gz").write_bytes(b"not a nifti")
    out = tmp_path / "out"
    result = runner.invoke(app, ["predict", str(run_dir), str(tmp_path / "in"), "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert "broken" in result.output and "failed" in result.output

    for name, source in inputs.items():
        seg = nib.load(out / f"{name}_seg.nii.gz")
        if source.is_dir():
            reference = sitk.ReadImage(sitk.ImageSeriesReader.GetGDCMSeriesFileNames(str(source)))
            shape = reference.GetSize()
            point = np.array(reference.TransformIndexToPhysicalPoint((1, 2, 3))) * [-1, -1, 1]
            np.testing.assert_allclose((seg.affine @ [1, 2, 3, 1])[:3], point, atol=1e-3)
        else:
            original = nib.load(source)
            shape = original.shape
            np.testing.assert_allclose(seg.affine, original.affine, atol=1e-5)
        assert seg.shape == tuple(shape)
        assert set(np.unique(np.asarray(seg.dataobj))) <= {0, 1, 2}
        stats = json.loads((out / f"{name}_stats.json").read_text())
        assert stats["liver_volume_ml"] >= stats["tumour_volume_ml"] >= 0
        assert (out / f"{name}_preview.png").stat().st_size > 0
    assert not list(out.glob("broken*"))


def test_existing_outputs_are_done_earlier_or_redone_with_force(trained, tmp_path):
    run_dir, _, raw = trained
    scan, out = raw / "volume-1.nii.gz", tmp_path / "out"
    args = ["predict", str(run_dir), str(scan), "--out", str(out), "--tile", "0"]
    assert runner.invoke(app, args).exit_code == 0
    written = (out / "volume-1_seg.nii.gz").stat().st_mtime_ns
    again = runner.invoke(app, args)
    assert again.exit_code == 0 and "earlier" in again.output.split()
    assert (out / "volume-1_seg.nii.gz").stat().st_mtime_ns == written
    forced = runner.invoke(app, [*args, "--force"])
    assert forced.exit_code == 0, forced.output
    assert (out / "volume-1_seg.nii.gz").stat().st_mtime_ns != written


def test_tiled_pipeline_equals_whole(trained, tmp_path):
    run_dir, _, raw = trained
    from ctseg.io.scans import read_scan

    scan = read_scan(raw / "volume-0.nii.gz")
    whole = from_run(run_dir, InferenceOptions("latest", tile=0)).predict(scan)
    tiled = from_run(run_dir, InferenceOptions("latest", tile=8)).predict(scan)
    np.testing.assert_array_equal(whole.grid_labels, tiled.grid_labels)
    np.testing.assert_array_equal(whole.labels, tiled.labels)


def test_tta_tiled_equals_tta_whole_and_needs_a_model_trained_with_flips(trained):
    run_dir, _, raw = trained
    from ctseg.io.scans import read_scan

    whole = from_run(run_dir, InferenceOptions("latest", tile=0, tta=True))
    tiled = from_run(run_dir, InferenceOptions("latest", tile=8, tta=True))
    assert whole.summary.endswith("mirrored 8× (TTA)")
    seconds: dict[str, float] = {}
    on_grids = whole.to_grid(read_scan(raw / "volume-0.nii.gz"), seconds)
    np.testing.assert_allclose(
        tiled.infer(on_grids, seconds)[0], whole.infer(on_grids, seconds)[0], atol=1e-5
    )

    model = whole.model
    unflipped = dataclasses.replace(
        model, config=dataclasses.replace(model.config, train=cfg.TrainConfig(flip=False))
    )
    with pytest.raises(CtsegError, match=r"trained without flips \(train.flip = false\)"):
        Predictor(unflipped, JaxBackend(), InferenceOptions(tile=0, tta=True))


def test_run_without_checkpoints(trained, tmp_path):
    run_dir, _, raw = trained
    empty = tmp_path / "empty_run"
    empty.mkdir()
    (empty / "config.toml").write_text((run_dir / "config.toml").read_text())
    with pytest.raises(CtsegError, match="no checkpoints"):
        from_run(empty)
    result = runner.invoke(app, ["predict", str(empty), str(raw), "--out", str(tmp_path / "o")])
    assert result.exit_code != 0 and "no checkpoints" in str(result.exception)
    result = runner.invoke(app, ["predict", str(tmp_path), str(raw), "--out", str(tmp_path / "o")])
    assert "not a ctseg run directory" in str(result.exception)


def test_evaluate_run_dir(trained, tmp_path):
    run_dir, store, _ = trained
    out = tmp_path / "eval"
    result = runner.invoke(
        app,
        ["evaluate", str(run_dir), "--data", str(store), "--split", "train", "--out", str(out)]
        + ["--tta"],
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "summary.json").read_text())
    assert report["run"]["tta"] is True and "mirrored 8×" in report["run"]["device"]
    assert set(report) >= {"run", "cases", "summary", "errors"}
    assert report["errors"] == [] and len(report["cases"]) == report["summary"]["n_cases"] >= 1
    case = report["cases"][0]
    assert {"liver", "tumour", "detection", "burden", "grid_dice"} <= set(case)
    assert 0 <= report["summary"]["grid_dice"]["liver"] <= 1
    assert (out / "metrics.csv").read_text().startswith("case,")
    assert (out / "predictions" / f"{case['case']}_seg.nii.gz").is_file()
    assert "Summary" in result.output


def test_hu_warnings():
    rng = np.random.default_rng(0)
    assert hu_warnings(_ct(rng)) == []
    assert "Hounsfield" in hu_warnings(_ct(rng).astype(np.int32) + 1024)[0]
    assert "outside" in hu_warnings(rng.normal(0, 5000, (20, 20, 20)))[0]


def test_scans_of_one_name_are_not_written_over_each_other(tmp_path):
    rng = np.random.default_rng(0)
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        nib.save(nib.Nifti1Image(_ct(rng), np.eye(4)), tmp_path / folder / "volume-0.nii.gz")
    first, second = tmp_path / "a" / "volume-0.nii.gz", tmp_path / "b" / "volume-0.nii.gz"
    scans, failed, _ = expand_inputs([tmp_path / "a", tmp_path / "b", first])
    assert scans == [first]
    assert [(o.source, o.name) for o in failed] == [(second, "volume-0")]
    assert failed[0].error.startswith(f"{second} would write over the outputs of {first}")
    assert "--out" in failed[0].error


def test_restoring_for_inference_reads_no_optimiser_state(trained, tmp_path):
    """A checkpoint whose optimiser state no longer matches the model (another optimiser,
    say) still loads for inference: only parameters and statistics are read."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained[0], run_dir)
    model = load_model(run_dir, "latest")
    params, stats = model.params, model.stats
    foreign = TrainState(jnp.asarray(99), params, stats, {"not": np.zeros(3, np.float32)})
    checkpoints = Checkpoints(run_dir, keep=5)
    checkpoints.save(foreign)
    checkpoints.close()
    got = load_model(run_dir, "99")
    assert got.step == 99
    got_params, got_stats = got.params, got.stats
    for got, want in zip(
        jax.tree.leaves((got_params, got_stats)), jax.tree.leaves((params, stats)), strict=True
    ):
        assert isinstance(got, np.ndarray)  # host arrays: each engine places them itself
        np.testing.assert_array_equal(got, want)


def test_a_second_predict_in_a_new_process_compiles_nothing(trained, tmp_path):
    run_dir, _, raw = trained
    cache = tmp_path / "cache"
    compiled = []
    for attempt in ("first", "second"):
        out = tmp_path / attempt
        command = [sys.executable, "-m", "ctseg.cli.main", "predict", str(run_dir)]
        command += [str(raw / "volume-1.nii.gz"), "--out", str(out), "--backend", "jax"]
        command += ["--compile-cache", str(cache), "--verbose"]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        # --verbose: where the time went before the first scan and in it, and the plan.
        one_off = r"once for all scans: imports [0-9.]+ s, devices [0-9.]+ s, load [0-9.]+ s"
        assert re.search(one_off, done.stdout) and "compile " in done.stdout
        plan = r"plan: whole volume 16³: [0-9.]+ [KM]iB per device of [0-9.]+ GiB free"
        assert re.search(plan, done.stdout)
        stats = json.loads((out / "volume-1_stats.json").read_text())
        assert set(stats["seconds"]) == set(PHASES)
        compiled.append(stats["compiled"])
    assert compiled[0]["programs"] > 0 and compiled[0]["from_cache"] == 0
    assert compiled[1] == {
        "programs": compiled[0]["programs"],
        "from_cache": compiled[0]["programs"],
    }


def test_an_accelerator_asked_for_on_a_cpu_machine_is_one_line(trained, tmp_path):
    run_dir, _, raw = trained
    result = runner.invoke(
        app,
        [
            "predict",
            str(run_dir),
            str(raw / "volume-1.nii.gz"),
            "--out",
            str(tmp_path),
            "--device",
            "gpu",
        ],
    )
    assert isinstance(result.exception, CtsegError)  # `ctseg` prints it as one line, exit 2
    assert str(result.exception).startswith("--device gpu: JAX sees no GPU here")


def test_force_never_overwrites_an_input_and_outputs_are_not_inputs(trained, tmp_path):
    run_dir, _, raw = trained
    folder = tmp_path / "scans"
    folder.mkdir()
    shutil.copy(raw / "volume-0.nii.gz", folder / "a.nii.gz")
    shutil.copy(raw / "volume-1.nii.gz", folder / "a_seg.nii.gz")  # a scan, by its name an output
    kept = (folder / "a_seg.nii.gz").read_bytes()
    args = ["predict", str(run_dir), str(folder), "--out", str(folder), "--tile", "0", "--force"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert "failed" in result.output
    assert (folder / "a_seg.nii.gz").read_bytes() == kept
    assert (folder / "a_seg_seg.nii.gz").is_file()  # a_seg itself is a scan of this call
    # Predicting the folder again: a_seg_seg.nii.gz, an output of the first call, is no input.
    scans, failed, _ = expand_inputs([folder], folder)
    assert sorted(s.name for s in scans) == ["a_seg.nii.gz"]
    assert [o.name for o in failed] == ["a"]
    assert "a_seg.nii.gz would overwrite an input of this call" in failed[0].error


def test_scans_outside_what_a_ct_can_be_are_warned_about(tmp_path):
    from ctseg.inference.quality.scan_checks import geometry_warnings, volume_warnings
    from ctseg.io.scans import read_scan

    rng = np.random.default_rng(0)
    cases = {
        "ok": ((64, 64, 40), [0.8, 0.8, 2.5], 0),
        "tiny": ((64, 64, 40), [0.001, 0.001, 0.001], 2),  # spacing and extent
        "coarse": ((64, 64, 40), [15.0, 15.0, 15.0], 1),  # spacing only: 960 mm across
        "slices": ((64, 64, 4), [0.8, 0.8, 2.5], 1),  # fewer than 3 slices are refused
        "huge": ((64, 64, 40), [100.0, 100.0, 100.0], None),  # 6.4 m: the reader refuses it
    }
    for name, (shape, spacing, count) in cases.items():
        nib.save(
            nib.Nifti1Image(_ct(rng, shape), np.diag([*spacing, 1.0])), tmp_path / f"{name}.nii"
        )
        if count is None:
            with pytest.raises(CtsegError, match="no CT's"):
                read_scan(tmp_path / f"{name}.nii")
            continue
        warnings = geometry_warnings(read_scan(tmp_path / f"{name}.nii"))
        assert len(warnings) == count, (name, warnings)
    assert volume_warnings({"liver_volume_ml": 1500.0}) == []
    assert volume_warnings({"liver_volume_ml": 0.0}) == ["no liver was found"]
    assert "larger than any human liver" in volume_warnings({"liver_volume_ml": 14_625_000.0})[0]


def test_evaluate_refuses_a_source_that_is_not_the_scan_prepared(trained, tmp_path):
    run_dir, store, raw = trained
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    elsewhere = tmp_path / "other.nii.gz"
    nib.save(nib.Nifti1Image(_ct(np.random.default_rng(1)), np.eye(4)), elsewhere)
    for case in manifest["cases"]:
        case["image_source"] = str(elsewhere)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "eval"
    args = ["evaluate", str(run_dir), "--data", str(copy), "--split", "train", "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    errors = json.loads((out / "summary.json").read_text())["errors"]
    assert errors and all("is not the scan case" in e["message"] for e in errors)
    assert not list(out.glob("predictions/*"))  # nothing of the other scan was written


def test_evaluate_and_predict_out_of_files_are_one_error_line(trained, tmp_path):
    run_dir, store, raw = trained
    (tmp_path / "file").write_text("")
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("")
    for args, message in [
        (
            ["evaluate", str(run_dir), "--data", str(store), "--out", str(tmp_path / "file")],
            "is a file",
        ),
        (
            ["evaluate", str(run_dir), "--data", str(store), "--out", str(tmp_path / "theirs")],
            "did not write",
        ),
        (["predict", str(run_dir), str(raw), "--out", str(tmp_path / "file")], "is a file"),
    ]:
        result = runner.invoke(app, args)
        assert isinstance(result.exception, CtsegError) and message in str(result.exception), args


# What running out of memory raises: XLA's allocation failure (an accelerator's, or the host
# CPU's where the probabilities run under either backend), the host's for numpy.
OUT_OF_MEMORY = {
    "xla": jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1 B"),
    "host": MemoryError("Unable to allocate 86.0 GiB for an array"),
}


@pytest.mark.parametrize(("raised", "failures"), [("xla", 1), ("xla", 2), ("host", 1)])
def test_an_out_of_memory_scan_is_retried_with_smaller_tiles_or_fails_alone(
    trained, tmp_path, monkeypatch, raised, failures
):
    """The second of three scans runs out of memory: once, it is retried with smaller
    tiles and says so; twice, its row fails and the other two are written."""
    from ctseg.inference import member as pipeline
    from ctseg.inference.files import predict_files

    run_dir, _, raw = trained
    scans = [raw / f"volume-{i}.nii.gz" for i in range(3)]
    predictor = from_run(run_dir, InferenceOptions("latest", tile=0))
    calls = []
    real = pipeline.class_probabilities

    def probabilities(*args, **kwargs):
        calls.append(predictor.engine.description)
        if 2 <= len(calls) <= 1 + failures:
            raise OUT_OF_MEMORY[raised]
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "class_probabilities", probabilities)
    outcomes = list(predict_files(predictor, scans, tmp_path / "out"))
    assert [o.error is None for o in outcomes] == [True, failures == 1, True]
    assert calls[0] == "whole volume 16³" and "tiles" in calls[2]  # the retry's smaller plan
    retried = outcomes[1]
    if failures == 1:
        expected = "out of memory with whole volume 16³; retried with level-wise tiles"
        assert any(expected in warning for warning in retried.warnings)
        assert (tmp_path / "out" / "volume-1_stats.json").is_file()
    else:
        assert "out of memory" in retried.error and "smaller tile" in retried.error
        assert not (tmp_path / "out" / "volume-1_seg.nii.gz").exists()
    for index in (0, 2):
        assert (tmp_path / "out" / f"volume-{index}_seg.nii.gz").is_file()
