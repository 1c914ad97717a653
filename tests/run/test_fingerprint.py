"""The training data's fingerprint and the checks that hold scans against it."""

import json
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from helpers import prepare_store, tiny_config
from rich.console import Console
from typer.testing import CliRunner

import ctseg.cli.main  # noqa: F401  (registers the commands)
from ctseg.cli.app import app
from ctseg.cli.predict import _stats_table
from ctseg.data.grids import grid_affine
from ctseg.data.store import Store, array_path
from ctseg.errors import CtsegError
from ctseg.inference.inputs import ScanOutcome
from ctseg.inference.quality import scan_checks
from ctseg.inference.quality.scores import UNLIKE
from ctseg.inference.scan import postprocess
from ctseg.io.scans import read_scan
from ctseg.run import fingerprint, rundir
from ctseg.synth.dataset import write_dataset
from ctseg.training.loop import train_and_evaluate

runner = CliRunner()
WIDE = {"COLUMNS": "400"}  # no line of the output folded


@pytest.fixture(scope="module")
def training(tmp_path_factory) -> Path:
    """A 16³ store of 8 synthetic cases (the training split: those the fingerprint reads)."""
    root = tmp_path_factory.mktemp("training")
    write_dataset(root / "raw", cases=8, size=24, seed=0)
    prepare_store(root / "raw", root / "store", tiny_config())
    return root / "store"


def _reference(store_dir: Path) -> dict:
    """The fingerprint's numbers, straight from the arrays (every voxel) with NumPy."""
    store = Store.open(store_dir)
    train = store.split("train")
    spacing = np.array([case.spacing for case in train])
    extent = spacing * np.array([case.canonical_shape for case in train])
    volumes, extents, hu, voxel, shares = [], [], [], [], []
    for case in train:
        label = np.load(array_path(store_dir, case.id, "label"))
        image = np.load(array_path(store_dir, case.id, "image"))
        liver = label >= 1
        affine = grid_affine(np.array(case.canonical_affine), case.canonical_shape, 16)
        volumes.append(liver.sum() * abs(np.linalg.det(affine[:3, :3])) / 1000)
        where = np.argwhere(liver)
        voxels = where.max(axis=0) - where.min(axis=0) + 1
        voxel.append(np.sqrt((affine[:3, :3] ** 2).sum(axis=0)))
        extents.append(voxels * voxel[-1])
        hu.append(image[liver])
        slices = np.flatnonzero(liver.any(axis=(0, 1)))
        body = image[:, :, slices[0] : slices[-1] + 1] > -500
        shares.append(liver.sum() / body.sum())
    return {
        "spacing": spacing,
        "extent": extent,
        "volume": np.array(volumes),
        "liver_extent": np.array(extents),
        "hu": np.concatenate(hu).astype(float),
        "share": np.array(shares),  # the liver's share of the body over its slices
        "voxel": np.array(voxel),  # the grid's voxel size per case and axis, mm
        "cases": len(train),
    }


_QUANTILES = {"min": 0, "p5": 5, "median": 50, "p95": 95, "max": 100}


def _same_distribution(found: dict, values: np.ndarray) -> None:
    for key, q in _QUANTILES.items():
        np.testing.assert_allclose(found[key], np.percentile(values, q, axis=0), rtol=1e-9)
    np.testing.assert_allclose(found["min"], values.min(axis=0))
    np.testing.assert_allclose(found["median"], np.median(values, axis=0))


def test_fingerprint_equals_numpy_on_the_store(training):
    found = fingerprint.compute(Store.open(training))
    reference = _reference(training)
    assert found["cases"] == found["liver_cases"] == reference["cases"] > 3
    _same_distribution(found["spacing_mm"], reference["spacing"])
    _same_distribution(found["extent_mm"], reference["extent"])
    _same_distribution(found["liver_volume_ml"], reference["volume"])
    _same_distribution(found["liver_extent_mm"], reference["liver_extent"])
    _same_distribution(found["liver_body_share"], reference["share"])
    hu = reference["hu"]
    assert found["liver_hu"]["voxels"] == len(hu)  # a 16³ grid: every liver voxel
    assert found["liver_hu"]["mean"] == pytest.approx(hu.mean())
    assert found["liver_hu"]["std"] == pytest.approx(hu.std())
    assert found["liver_hu"]["min"] == hu.min() and found["liver_hu"]["max"] == hu.max()
    assert found["liver_hu"]["median"] == pytest.approx(np.median(hu))
    assert found["liver_hu"]["percentile_00_5"] == pytest.approx(np.percentile(hu, 0.5))
    assert found["liver_hu"]["percentile_99_5"] == pytest.approx(np.percentile(hu, 99.5))
    assert json.loads(json.dumps(found)) == found  # plain JSON
    assert fingerprint.Fingerprint.from_json(found).liver_volume == (
        pytest.approx(reference["volume"].min()),
        pytest.approx(reference["volume"].max()),
    )


def test_large_grids_are_read_strided(training, monkeypatch):
    """At large grids every n-th voxel is read: volumes stay exact, boxes good to a stride."""
    monkeypatch.setattr(fingerprint, "_SAMPLED_GRID", 8)  # 16³ read as 8³: every 2nd voxel
    found = fingerprint.compute(Store.open(training))
    reference = _reference(training)
    _same_distribution(found["liver_volume_ml"], reference["volume"])  # manifest counts
    # Each box is off by at most a grid voxel (a stride of 2 loses or gains one).
    largest_voxel = reference["voxel"].max(axis=0)
    for key in ("min", "median", "max"):
        found_mm = np.array(found["liver_extent_mm"][key])
        reference_mm = np.percentile(reference["liver_extent"], _QUANTILES[key], axis=0)
        assert np.all(np.abs(found_mm - reference_mm) <= largest_voxel + 1e-9), key
    assert found["liver_hu"]["voxels"] < len(reference["hu"]) / 4
    assert abs(found["liver_hu"]["median"] - np.median(reference["hu"])) < 15


def test_train_writes_the_fingerprint_once_and_a_resumed_run_keeps_it(trained, training, tmp_path):
    run_dir, store_dir, _ = trained
    path = run_dir / rundir.FINGERPRINT
    assert json.loads(path.read_text()) == fingerprint.compute(Store.open(store_dir))

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    before = (run / rundir.FINGERPRINT).read_bytes()
    # Resumed on another store (same grid): the run keeps the data it started on.
    assert (
        fingerprint.compute(Store.open(training))["spacing_mm"] != json.loads(before)["spacing_mm"]
    )
    train_and_evaluate(rundir.load_config(run), training, run)
    assert (run / rundir.FINGERPRINT).read_bytes() == before


def test_ten_times_the_training_spacing_is_checked_and_held_out_scans_are_not(training, tmp_path):
    known = fingerprint.Fingerprint.from_json(fingerprint.compute(Store.open(training)))
    held_out = tmp_path / "held-out"
    write_dataset(held_out, cases=4, size=24, seed=1)  # drawn as the training scans were
    for index in range(4):
        scan = read_scan(held_out / f"volume-{index}.nii.gz")
        reference = read_scan(held_out / f"segmentation-{index}.nii.gz").array.astype(np.uint8)
        # The scan and its true liver are what the model trained on: nothing to say.
        assert scan_checks.checks(known, scan, reference) == [], index

    # Ten times the spacing: metres of field of view, which the reader refuses as no CT's
    # header (tests/cli/test_hostile_headers.py); the checks still say why on their own.
    scan = read_scan(held_out / "volume-0.nii.gz")
    far = tuple(10 * s for s in scan.spacing)
    found = scan_checks.geometry_checks(known, far, scan.array.shape)
    assert len(found) == 2
    assert found[0].startswith("voxel spacing ") and "3× outside the training scans'" in found[0]
    assert found[1].startswith("field of view ")
    assert scan_checks.checks(None, scan, np.zeros(scan.array.shape, np.uint8)) == []


# Training livers of 1–2 L, 120–200 mm wide, 10–110 HU (0.5th–99.5th percentile).
HAND_BUILT = {
    "format": "ctseg-fingerprint",
    "version": 1,
    "spacing_mm": {"min": [0.7, 0.7, 1.0], "max": [0.9, 0.9, 5.0]},
    "extent_mm": {"min": [300.0, 300.0, 150.0], "max": [420.0, 420.0, 500.0]},
    "liver_volume_ml": {"min": 1000.0, "max": 2000.0},
    "liver_extent_mm": {"min": [120.0, 130.0, 110.0], "max": [200.0, 220.0, 200.0]},
    "liver_hu": {"percentile_00_5": 10.0, "percentile_99_5": 110.0},
}
AFFINE = np.diag([2.0, 2.0, 5.0, 1.0])  # a 100 × 100 × 40 scan: 200 × 200 × 200 mm


def _liver(box: tuple[slice, ...], hu: float) -> tuple[np.ndarray, np.ndarray]:
    labels = np.zeros((100, 100, 40), np.uint8)
    labels[box] = 1
    image = np.full(labels.shape, -1000.0, np.float32)
    image[box] = hu
    return labels, image


def test_an_implausible_liver_is_named():
    known = fingerprint.Fingerprint.from_json(HAND_BUILT)
    plausible = (slice(10, 70), slice(10, 75), slice(5, 27))  # 120 × 130 × 110 mm, 1.7 L
    assert scan_checks.liver_checks(known, *_liver(plausible, 60.0), AFFINE) == []
    assert scan_checks.liver_checks(known, *_liver(plausible, 155.0), AFFINE) == []  # in margin

    tiny = scan_checks.liver_checks(known, *_liver(np.s_[10:15, 10:15, 5:7], 60.0), AFFINE)
    assert [c.split(",")[0] for c in tiny] == [
        "the predicted liver's volume",
        "the predicted liver's extent",
    ]
    assert "1 mL" in tiny[0] and "(1,000–2,000 mL)" in tiny[0]

    flat = np.s_[10:20, 0:100, 0:40]  # 20 × 200 × 200 mm: 800 mL, but 20 mm wide
    found = scan_checks.liver_checks(known, *_liver(flat, 60.0), AFFINE)
    assert len(found) == 1 and found[0].startswith("the predicted liver's extent, 20 × 200 × 200")

    for hu in (700.0, -100.0):  # bone, fat
        found = scan_checks.liver_checks(known, *_liver(plausible, hu), AFFINE)
        assert len(found) == 1 and f"{hu:.0f} HU, is unlike the training livers'" in found[0]

    nothing = np.zeros((100, 100, 40), np.uint8)
    assert scan_checks.liver_checks(known, nothing, nothing.astype(float), AFFINE) == []
    no_livers = {**HAND_BUILT, "liver_volume_ml": None, "liver_extent_mm": None, "liver_hu": None}
    bone = _liver(plausible, 700.0)
    assert (
        scan_checks.liver_checks(fingerprint.Fingerprint.from_json(no_livers), *bone, AFFINE) == []
    )


def test_a_fingerprint_that_is_not_one_is_one_line(tmp_path):
    assert fingerprint.load(tmp_path) is None  # a run trained before fingerprints
    path = tmp_path / rundir.FINGERPRINT
    for text in ("{", "[]", json.dumps({**HAND_BUILT, "spacing_mm": {"min": [1], "max": [2]}})):
        path.write_text(text)
        with pytest.raises(CtsegError, match="delete it|not the fingerprint") as caught:
            fingerprint.load(tmp_path)
        assert "\n" not in str(caught.value)


def test_the_table_tells_checks_by_the_verdict_and_shows_every_name_in_a_narrow_terminal():
    """The status column says whether a scan has warnings, the verdict whether it is unlike
    the training data; at 80 columns every letter of the names shows (folded, not cut)."""
    stats = {
        "liver_volume_ml": 1.0,
        "tumour_volume_ml": 0.0,
        "tumour_count": 0,
        "largest_tumour_diameter_mm": 0.0,
        "tumour_burden_percent": 0.0,
    }
    unlike = {**stats, "quality": {"verdict": "unlike the training data"}}
    ok = {**stats, "quality": {"verdict": "ok"}}
    outcomes = [
        ScanOutcome(Path("a"), "volume-1", unlike, checks=["far"]),
        ScanOutcome(Path("b"), "volume-12", unlike, warnings=["odd"], checks=["far"]),
        ScanOutcome(Path("c"), "LIVER_patient_0001_portal_venous", ok, warnings=["odd"]),
        ScanOutcome(Path("d"), "d", ok),
    ]

    def cells(width: int) -> list[list[str]]:
        console = Console(record=True, width=width)
        console.print(_stats_table(outcomes))
        lines = console.export_text().splitlines()
        return [[c.strip() for c in line.split("│")[1:-1]] for line in lines if line[0] == "│"]

    rows = {row[0]: (row[-2], row[-1]) for row in cells(200)}
    assert rows == {
        "volume-1": ("ok", UNLIKE),
        "volume-12": ("warning", UNLIKE),
        "LIVER_patient_0001_portal_venous": ("warning", "ok"),
        "d": ("ok", "ok"),
    }
    narrow = cells(80)
    assert "".join(row[0] for row in narrow) == "".join(o.name for o in outcomes)
    assert " ".join(" ".join(row[-1] for row in narrow).split()) == f"{UNLIKE} {UNLIKE} ok ok"


def _rescaled(raw: Path, folder: Path, factor: float) -> Path:
    """volume-1 of the trained run's raw scans with voxels `factor`× as large."""
    image = nib.load(raw / "volume-1.nii.gz")
    affine = image.affine.copy()
    affine[:3, :3] *= factor
    folder.mkdir()
    nib.save(nib.Nifti1Image(np.asarray(image.dataobj), affine), folder / "volume-1.nii.gz")
    return folder / "volume-1.nii.gz"


def _oracle(monkeypatch, raw: Path) -> None:
    """The 2-step model finds no liver (a warning of its own): the scan's reference labels
    stand in for a trained model's prediction."""
    reference = read_scan(raw / "segmentation-1.nii.gz").array.astype(np.uint8)
    monkeypatch.setattr(postprocess, "clean_labels", lambda labels, *options: reference.copy())


def test_predict_says_a_scan_is_outside_the_training_data(trained, tmp_path, monkeypatch):
    run_dir, _, raw = trained
    _oracle(monkeypatch, raw)
    # Voxels 0.15× as large: still a CT (no warning), but more than 3× smaller, and a field
    # of view more than 3× smaller, than any trained on (their range is under 2.2×).
    scan = _rescaled(raw, tmp_path / "in", 0.15)
    out = tmp_path / "out"
    result = runner.invoke(app, ["predict", str(run_dir), str(scan), "--out", str(out)], env=WIDE)
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if line.startswith("│ volume-1"))
    status, verdict = (cell.strip() for cell in row.split("│")[-3:-1])
    assert (status, verdict) == ("ok", UNLIKE)
    stats = json.loads((out / "volume-1_stats.json").read_text())
    assert stats["warnings"] == []
    starts = [check.split(",")[0] for check in stats["checks"]]
    assert starts[0].startswith("voxel spacing ") and starts[1].startswith("field of view ")
    assert "the predicted liver's volume" in starts  # the oracle's liver, 0.15³ as large
    for check in stats["checks"]:
        assert f"warning: volume-1: {check}" in result.output


def test_a_run_without_fingerprint_predicts_as_before(trained, tmp_path, monkeypatch):
    run_dir, _, raw = trained
    _oracle(monkeypatch, raw)
    old = tmp_path / "old-run"
    shutil.copytree(run_dir, old)
    (old / rundir.FINGERPRINT).unlink()
    scan = _rescaled(raw, tmp_path / "in", 0.15)
    out = tmp_path / "out"
    result = runner.invoke(app, ["predict", str(old), str(scan), "--out", str(out)], env=WIDE)
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if line.startswith("│ volume-1"))
    assert row.split("│")[-3].strip() == "ok"
    stats = json.loads((out / "volume-1_stats.json").read_text())
    assert stats["warnings"] == stats["checks"] == []
    assert "warning" not in result.output
