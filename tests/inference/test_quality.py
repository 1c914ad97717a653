"""Per-scan quality (`ctseg.inference.quality.scores`): each component on hand-built probabilities,
scans and livers; the verdict the same whole, tiled and partitioned; wired into `ctseg
predict`'s stats and table, the API's `result.quality` and the DICOM SEG's description."""

import dataclasses
import json
import math
import shutil

import jax
import jax.numpy as jnp
import nibabel as nib
import numpy as np
import pytest
from helpers import liver_with_tumour
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from typer.testing import CliRunner

import ctseg.cli.main  # noqa: F401  (registers the commands)
from ctseg.cli.app import app
from ctseg.config import InferenceOptions
from ctseg.inference.network.jax.backend import JaxBackend
from ctseg.inference.quality import scores, thresholds, uncertainty
from ctseg.inference.quality.scan_checks import liver_checks
from ctseg.inference.scan import way_back
from ctseg.io import dicom_seg
from ctseg.io.scans import read_scan
from ctseg.labels import mask_dice
from ctseg.run.fingerprint import Fingerprint
from ctseg.run.fingerprint import liver_body_share as fingerprint_share
from ctseg.run.trained import load_model

runner = CliRunner()
SHAPE = (32, 16, 8)
AFFINE = np.diag([2.0, 2.0, 5.0, 1.0])  # 20 µL voxels
REFERENCE = scores.Reference(liver_hu_median=60.0, liver_hu_sd=30.0, liver_volume_ml=(5.0, 20.0))


def _labels(tumour: bool = True) -> np.ndarray:
    labels = np.zeros(SHAPE, np.uint8)
    labels[4:28, 3:13, 2:6] = 1  # 960 voxels: 19.2 mL
    if tumour:
        labels[10:16, 6:10, 3:5] = 2
    return labels


def _hu(liver_hu: float = 60.0) -> np.ndarray:
    hu = np.full(SHAPE, -80.0, np.float32)
    hu[_labels() >= 1] = liver_hu
    return hu


def _probabilities(labels: np.ndarray, sure: float) -> np.ndarray:
    """`sure` on each voxel's label, the rest shared by the other two classes."""
    p = np.full((*labels.shape, 3), (1.0 - sure) / 2, np.float32)
    np.put_along_axis(p, labels[..., None].astype(np.int64), sure, axis=-1)
    return p


def _measured(probabilities: np.ndarray) -> uncertainty.Uncertainty:
    """The uncertainty of probabilities on the scan's voxels, as the way back measures it."""
    return way_back.ON_DEVICES.scan_labels(
        jnp.asarray(probabilities), probabilities.shape[:3]
    ).uncertainty


def _concern(judged: scores.Quality, name: str) -> scores.Concern:
    return next(c for c in judged.concerns if c.name == name)


def test_a_confident_prediction_is_ok_and_an_uncertain_one_is_reviewed():
    labels = _labels()
    sure = scores.assess(
        labels, AFFINE, _hu(), _measured(_probabilities(labels, 0.98)), (), REFERENCE
    )
    assert sure.verdict == scores.OK and sure.reason is None and sure.score < scores.REVIEW_AT
    assert _concern(sure, "liver_uncertainty").value < 0.02
    assert json.loads(json.dumps(sure.to_json(), allow_nan=False))["verdict"] == "ok"

    # The liver at 0.55 against background 0.45, and a rim of background at 0.45 liver.
    unsure = np.zeros((*SHAPE, 3), np.float32)
    unsure[..., 0] = 1.0
    rim = np.zeros(SHAPE, bool)
    rim[3:29, 2:14, 1:7] = True
    unsure[rim] = (0.55, 0.45, 0.0)
    unsure[labels >= 1] = (0.45, 0.55, 0.0)
    judged = scores.assess(labels, AFFINE, _hu(), _measured(unsure), (), REFERENCE)
    liver = _concern(judged, "liver_uncertainty")
    inside, count = 0.55 * 960, 960  # Σ_pred p, |pred|; the rim's 0.45 counts in Σ p
    mass = inside + 0.45 * (rim.sum() - 960)
    expected = (2 * inside + uncertainty.SMOOTH_VOXELS) / (count + mass + uncertainty.SMOOTH_VOXELS)
    assert liver.value == pytest.approx(1 - expected, rel=1e-5)
    assert judged.verdict == scores.REVIEW and "unsure of the liver" in judged.reason
    assert judged.liver >= scores.REVIEW_AT and judged.tumour >= judged.liver


def test_a_voxel_that_is_not_a_number_does_not_poison_the_score():
    p = _probabilities(_labels(), 0.98)
    p[0, 0, 0] = np.nan  # argmax: background, below every floor
    judged = scores.assess(_labels(), AFFINE, _hu(), _measured(p), (), REFERENCE)
    assert judged.verdict == scores.OK
    json.dumps(judged.to_json(), allow_nan=False)
    nan = scores.Concern("x", scores.LIVER, math.nan, scores._ramp(math.nan, 0.1), "…")
    assert nan.concern == 1.0 and nan.to_json()["value"] is None


def test_a_likely_tumour_that_was_not_predicted_is_reviewed():
    labels = _labels(tumour=False)
    p = _probabilities(labels, 0.98)
    p[10:16, 6:10, 3:5] = (0.0, 0.6, 0.4)  # tumour likely, the argmax says liver
    judged = scores.assess(labels, AFFINE, _hu(), _measured(p), (), REFERENCE)
    assert judged.verdict == scores.REVIEW
    assert "tumours" in judged.reason and "none predicted" in judged.reason
    assert judged.liver < scores.REVIEW_AT <= judged.tumour


def test_the_uncertainty_is_the_same_on_1_and_on_16_devices_and_by_hand():
    labels = _labels()
    p = _probabilities(labels, 0.7)
    # The scan's 8 slices are padded to the ladder's 16 on the devices, which must not count.
    host = _measured(p)
    mesh = Mesh(np.array(jax.devices()[:16]), ("x",))
    sharded = jax.device_put(jnp.asarray(p), NamedSharding(mesh, PartitionSpec("x")))
    on_devices = way_back.ON_DEVICES.scan_labels(sharded, SHAPE).uncertainty
    np.testing.assert_allclose(on_devices.sums, host.sums, rtol=1e-5)
    # By hand: the organ is 0.85 likely on its voxels and 0.3 (≥ the floor) on the others.
    liver, tumour = np.count_nonzero(labels >= 1), np.count_nonzero(labels == 2)
    rest = labels.size - liver
    by_hand = [0.85 * liver, liver, 0.85 * liver + 0.3 * rest, 0.7 * tumour, tumour, 0.7 * tumour]
    np.testing.assert_allclose(host.sums, by_hand, rtol=1e-5)


def test_an_ensembles_agreement_is_the_dice_between_its_members():
    labels = _labels()
    other = labels.copy()
    other[10:13, 6:10, 3:5] = 1  # half the tumour missed; the liver the same
    members = [_probabilities(labels, 0.9), _probabilities(other, 0.9)]
    tumour_dice = mask_dice(labels == 2, other == 2)
    smooth = uncertainty.SMOOTH_VOXELS
    pairs, total = (
        2 * np.count_nonzero((labels == 2) & (other == 2)),
        np.count_nonzero(labels == 2) + np.count_nonzero(other == 2),
    )
    arrays = [jnp.asarray(m) for m in members]
    measured = way_back.ON_DEVICES.mean_scan_labels(arrays, SHAPE).uncertainty
    assert measured.members == 2 and measured.agreement("liver") == pytest.approx(1.0)
    assert measured.agreement("tumour") == pytest.approx((pairs + smooth) / (total + smooth))
    assert (pairs + smooth) / (total + smooth) == pytest.approx(tumour_dice, abs=0.05)
    judged = scores.assess(labels, AFFINE, _hu(), measured, (), REFERENCE)
    disagreement = _concern(judged, "tumour_disagreement")
    assert disagreement.value == pytest.approx(1 - measured.agreement("tumour"))
    assert "2 models disagree on the tumours" in disagreement.reason
    alone = _measured(members[0])
    assert alone.agreement("tumour") is None


def test_a_scan_inside_and_far_outside_the_training_intensities():
    labels = _labels()
    fingerprint = Fingerprint(
        spacing=(np.full(3, 0.5), np.full(3, 5.0)),
        extent=(np.full(3, 10.0), np.full(3, 500.0)),
        liver_volume=(5.0, 20.0),
        liver_extent=None,
        liver_hu=(-50.0, 150.0),
    )
    inside = _hu(70.0)
    checks = liver_checks(fingerprint, labels, inside, AFFINE)
    judged = scores.assess(labels, AFFINE, inside, None, checks, REFERENCE)
    assert checks == [] and judged.verdict == scores.OK
    assert _concern(judged, "intensity").value == pytest.approx(10 / 30)

    shifted = _hu(100.0)  # within the training voxels' range, 1.3 SD from their median
    judged = scores.assess(labels, AFFINE, shifted, None, (), REFERENCE)
    assert judged.verdict == scores.REVIEW and "median intensity, 100 HU" in judged.reason

    far = _hu(400.0)  # no liver has it: the fingerprint's check says so
    checks = liver_checks(fingerprint, labels, far, AFFINE)
    judged = scores.assess(labels, AFFINE, far, None, checks, REFERENCE)
    assert judged.verdict == scores.UNLIKE and judged.reason == checks[0]
    assert judged.score == judged.liver == judged.tumour == 1.0
    assert judged.to_json()["verdict"] == "unlike the training data"


def test_plausibility_no_liver_a_small_liver_and_one_in_pieces():
    none = scores.assess(np.zeros(SHAPE, np.uint8), AFFINE, _hu(), None, (), REFERENCE)
    assert (none.verdict, none.reason, none.score) == (scores.REVIEW, "no liver was found", 1.0)

    small = np.zeros(SHAPE, np.uint8)
    small[4:10, 3:8, 2:5] = 1  # 90 voxels: 1.8 mL, 2.8× below the smallest training liver
    judged = scores.assess(small, AFFINE, _hu(), None, (), REFERENCE)
    assert judged.verdict == scores.REVIEW and "1.8 mL" in judged.reason
    assert _concern(judged, "liver_volume").value == pytest.approx(5.0 / 1.8)

    pieces = np.zeros(SHAPE, np.uint8)
    pieces[2:12, 3:13, 2:6] = 1
    pieces[20:30, 3:13, 2:6] = 1  # two livers of one size: half outside the largest
    judged = scores.assess(pieces, AFFINE, _hu(), None, (), REFERENCE)
    assert _concern(judged, "fragments").value == pytest.approx(0.5)
    assert judged.verdict == scores.REVIEW and "2 pieces" in judged.reason

    plain = scores.assess(_labels(), AFFINE, _hu(), None, (), REFERENCE)
    assert plain.verdict == scores.OK and _concern(plain, "fragments").value == 0.0
    assert _concern(plain, "liver_volume").value == 1.0  # inside the training range


def test_the_ramp_the_reference_and_the_batch_line(trained):
    assert scores._ramp(0.0, 0.1) == 0.0 and scores._ramp(0.1, 0.1) == scores.REVIEW_AT
    assert scores._ramp(5.0, 0.1) == 1.0 and scores._ramp(math.nan, 0.1) == 1.0
    run_dir, _, _ = trained
    raw = json.loads((run_dir / "fingerprint.json").read_text())
    reference = scores.Reference.of_run(run_dir)
    assert reference.liver_hu_median == raw["liver_hu"]["median"]
    assert reference.liver_volume_ml == (
        raw["liver_volume_ml"]["min"],
        raw["liver_volume_ml"]["max"],
    )
    assert scores.Reference.of_run(None) == scores.Reference()
    assert scores.Reference.from_json({"liver_hu": "garbage"}) == scores.Reference()
    # Without probabilities or a fingerprint: the plausibility alone.
    alone = scores.assess(_labels(), AFFINE)
    assert alone.verdict == scores.OK and {c.name for c in alone.concerns} == {"fragments"}
    verdicts = ["ok", "review", None, "unlike the training data", "ok"]
    assert scores.batch_line(verdicts) == "2 of 4 to review (1 unlike the training data)"
    assert scores.batch_line(["ok"]) == "0 of 1 to review" and scores.batch_line([None]) is None
    assert dicom_seg.content_description(None) == "ctseg liver/tumour segmentation"
    for verdict in scores.VERDICTS:
        description = dicom_seg.content_description(verdict)
        assert description.endswith(f"QC: {verdict}") and len(description) <= 64


def test_the_verdict_is_the_same_whole_tiled_and_partitioned(trained):
    from ctseg.inference.predictor import Predictor
    from ctseg.run import fingerprint

    run_dir, _, raw = trained
    scan = read_scan(raw / "volume-0.nii.gz")
    reference = scores.Reference.of_run(run_dir)
    model = load_model(run_dir, "latest")
    judged = []
    for tile, devices in ((0, 1), (8, 1), (0, 4)):
        predictor = Predictor(
            model, JaxBackend(jax.devices()[:devices]), InferenceOptions(tile=tile)
        )
        predictor.fingerprint = fingerprint.load(run_dir)
        prediction = predictor.predict(scan)
        assert prediction.grid_probabilities is not None  # the uncertainty is measured
        judged.append(scores.of_prediction(prediction, scan, reference))
    names = {c.name for c in judged[0].concerns}
    assert {"liver_uncertainty", "tumour_uncertainty"} <= names
    for other in judged[1:]:
        assert other.verdict == judged[0].verdict and other.reason == judged[0].reason
        for mine, theirs in zip(judged[0].concerns, other.concerns, strict=True):
            assert mine.name == theirs.name
            assert mine.value == pytest.approx(theirs.value, abs=1e-4)


def test_an_ensembles_prediction_measures_its_uncertainty_and_agreement(trained):
    from ctseg.inference.predictor import Predictor

    run_dir, _, raw = trained
    scan = read_scan(raw / "volume-0.nii.gz")
    reference = scores.Reference.of_run(run_dir)
    model = load_model(run_dir, "latest")
    alone = Predictor(model, JaxBackend()).predict(scan)
    twice = Predictor([model, model], JaxBackend()).predict(
        scan
    )  # two identical members agree exactly
    assert twice.uncertainty.members == 2 and alone.uncertainty.agreement("liver") is None
    np.testing.assert_allclose(twice.uncertainty.sums, alone.uncertainty.sums, rtol=1e-4)
    judged = {c.name: c.value for c in scores.of_prediction(twice, scan, reference).concerns}
    assert judged["liver_disagreement"] == judged["tumour_disagreement"] == pytest.approx(0.0)
    assert "liver_uncertainty" in judged and "tumour_uncertainty" in judged


def test_a_regions_prediction_measures_the_uncertainty_on_its_exact_voxels(trained, tmp_path):
    from ctseg.inference.predictor import Predictor

    run_dir, _, raw = trained
    scan = read_scan(raw / "volume-0.nii.gz")
    reference = scores.Reference.of_run(run_dir)
    predictor = Predictor(load_model(run_dir, "latest"), JaxBackend(), InferenceOptions(tile=0))
    whole = scores.of_prediction(predictor.predict(scan), scan, reference)
    mask = tmp_path / "roi.nii.gz"  # the whole scan as the region: the same voxels count
    nib.save(nib.Nifti1Image(np.ones(scan.original_shape, np.uint8), scan.original_affine), mask)
    predictor.predict_region(roi=mask, margin_mm=0.0)
    prediction = predictor.predict(scan)
    assert prediction.grid_probabilities is None and prediction.uncertainty is not None
    region = scores.of_prediction(prediction, scan, reference)
    uncertain = {c.name: c.value for c in region.concerns if c.name.endswith("uncertainty")}
    assert set(uncertain) == {"liver_uncertainty", "tumour_uncertainty"}
    for concern in whole.concerns:
        if concern.name in uncertain:
            assert uncertain[concern.name] == pytest.approx(concern.value, abs=0.05)


def test_predict_writes_every_readable_scans_quality_and_the_api_returns_it(
    trained, tmp_path, monkeypatch
):
    from ctseg.inference.scan import postprocess

    monkeypatch.setattr(postprocess, "clean_labels", liver_with_tumour)  # a liver to judge
    run_dir, _, raw = trained
    inputs = tmp_path / "in"
    inputs.mkdir()
    for name in ("volume-0.nii.gz", "volume-1.nii.gz"):
        (inputs / name).write_bytes((raw / name).read_bytes())
    (inputs / "broken.nii.gz").write_bytes(b"not a nifti")
    out = tmp_path / "out"
    args = ["predict", str(run_dir), str(inputs), "--out", str(out), "--checkpoint", "latest"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output  # the broken scan failed; the others not
    verdicts = []
    for name in ("volume-0", "volume-1"):
        stats = json.loads((out / f"{name}_stats.json").read_text())
        assert stats["quality"]["verdict"] in scores.VERDICTS
        assert stats["quality"]["thresholds"] == thresholds.DEFAULT_THRESHOLDS.calibrated_on
        assert 0.0 <= stats["quality"]["score"] <= 1.0
        assert {"liver_uncertainty", "intensity", "liver_volume"} <= set(
            stats["quality"]["concerns"]
        )
        verdicts.append(stats["quality"]["verdict"])
    assert "verdi" in result.output  # the column's heading (cut short in 80 columns)
    assert f"quality: {scores.batch_line(verdicts)}" in " ".join(result.output.split())

    again = runner.invoke(app, args)  # done earlier: the verdicts come from the stats files
    assert f"quality: {scores.batch_line(verdicts)}" in " ".join(again.output.split())

    from ctseg import Segmenter

    api = Segmenter(run_dir, checkpoint="latest")(raw / "volume-0.nii.gz")
    assert isinstance(api.quality, scores.Quality)
    written = json.loads((out / "volume-0_stats.json").read_text())["quality"]
    assert api.quality.verdict == written["verdict"]
    assert api.quality.to_json()["score"] == pytest.approx(written["score"], abs=1e-3)

    # A run's own thresholds (`ctseg evaluate --calibrate`'s): predict and the API judge by them.
    own = tmp_path / "own"
    shutil.copytree(run_dir, own)
    strict = thresholds.Thresholds(1e-6, 1e-6, 1e-6, 1.000001, 1e-6, calibrated_on="strict")
    strict.write(thresholds.thresholds_path(own))
    args = ["predict", str(own), str(inputs / "volume-0.nii.gz"), "--out", str(tmp_path / "o2")]
    assert runner.invoke(app, [*args, "--checkpoint", "latest"]).exit_code == 0
    judged = json.loads((tmp_path / "o2" / "volume-0_stats.json").read_text())["quality"]
    assert judged["thresholds"] == "strict" and judged["verdict"] != scores.OK
    api = Segmenter(own, checkpoint="latest")(raw / "volume-0.nii.gz")
    assert api.quality.thresholds == "strict" and api.quality.verdict == judged["verdict"]


def test_the_dicom_seg_names_the_verdict_in_its_description(tmp_path):
    hd = pytest.importorskip("highdicom")
    import SimpleITK as sitk
    from dicom_series import write_dicom_series

    hu = np.random.default_rng(0).integers(-200, 200, (6, 10, 12)).astype(np.int16)  # z, y, x
    write_dicom_series(tmp_path / "series", sitk.GetImageFromArray(hu), one_study=True)
    scan = read_scan(tmp_path / "series")
    labels = np.zeros(scan.array.shape, np.uint8)
    labels[2:6, 2:6, 1:4] = 1
    dicom_seg.write_dicom_seg(scan, labels, tmp_path / "seg.dcm", verdict=scores.UNLIKE)
    written = hd.seg.segread(tmp_path / "seg.dcm")
    assert written.ContentDescription == "ctseg liver/tumour segmentation, QC: " + scores.UNLIKE


def _patient(scale: int = 1, liver_scale: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Labels and HU of a body (fat, air around it) holding the liver of `_labels`, the
    whole patient `scale` times larger along each axis, the liver alone `liver_scale`."""
    labels = np.zeros(SHAPE, np.uint8)
    labels[8:24, 4:12, 2:6] = 1
    if liver_scale > 1:
        labels[4:28, 2:14, 1:7] = 1
    hu = np.full(SHAPE, -1000.0, np.float32)
    hu[2:30, 1:15, :] = -80.0
    hu[labels >= 1] = 60.0
    grow = [np.repeat(np.repeat(np.repeat(a, scale, 0), scale, 1), scale, 2) for a in (labels, hu)]
    return grow[0], grow[1]


def test_a_larger_patient_s_larger_liver_is_not_unlike_the_training_livers():
    labels, hu = _patient()
    share = fingerprint_share(labels >= 1, hu)
    voxel_ml = 0.02
    volume = np.count_nonzero(labels) * voxel_ml
    reference = scores.Reference(
        liver_volume_ml=(volume / 1.1, volume * 1.1), liver_body_share=(share / 1.1, share * 1.1)
    )
    larger_labels, larger_hu = _patient(scale=2)  # 8× the liver's volume
    size = scores.liver_concerns(larger_labels, larger_hu, voxel_ml, reference)
    assert _named(size, "liver_volume").value == 1.0  # its share of the body is the same
    big_labels, big_hu = _patient(liver_scale=2)  # the same body, a liver too large for it
    big = _named(scores.liver_concerns(big_labels, big_hu, voxel_ml, reference), "liver_volume")
    assert big.value > 1.5 and "of the body over its slices" in big.reason
    # A fingerprint made before the share compares the volume, as before.
    by_volume = dataclasses.replace(reference, liver_body_share=None)
    old = _named(
        scores.liver_concerns(larger_labels, larger_hu, voxel_ml, by_volume), "liver_volume"
    )
    assert old.value == pytest.approx(8 / 1.1) and "mL" in old.reason


def _named(concerns: list[scores.Concern], name: str) -> scores.Concern:
    return next(c for c in concerns if c.name == name)
