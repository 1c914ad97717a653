"""Hostile and careless pairing in `ctseg evaluate --pred/--ref`, round five: a prediction
is paired with a label map, never with the CT scan beside it; an extension in any case is
one; a reference stored in another voxel order (its affine to match) is the same voxels;
a prediction that is its reference (a link, a hard link) is refused, never a Dice of 1."""

import json
import os

import nibabel as nib
import numpy as np
import pytest
from helpers import SPACING, labels, save
from typer.testing import CliRunner

from ctseg.cli.main import app  # every command registered

runner = CliRunner(env={"COLUMNS": "400"})


def _evaluate(pred, ref) -> tuple[int, str, dict]:
    report = pred.parent / "report.json"
    args = ["evaluate", "--pred", str(pred), "--ref", str(ref), "--json", str(report)]
    result = runner.invoke(app, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert report.exists(), result.output
    return result.exit_code, " ".join(result.output.split()), json.loads(report.read_text())


@pytest.fixture
def folders(tmp_path):
    pred, ref = tmp_path / "pred", tmp_path / "ref"
    pred.mkdir()
    ref.mkdir()
    return pred, ref


def _ct(seed: int = 0) -> np.ndarray:
    """A CT scan's voxels: HU, many values, below zero too."""
    return np.random.default_rng(seed).integers(-1000, 1500, labels().shape).astype(np.int16)


def test_a_prediction_named_as_its_lits_scan_is_paired_with_the_segmentation(folders):
    pred, ref = folders
    for case in range(2):
        save(ref / f"volume-{case}.nii", _ct(case))
        save(ref / f"segmentation-{case}.nii", labels())
        save(pred / f"volume-{case}.nii.gz", labels())  # named as the scan it was made from
    code, output, report = _evaluate(pred, ref)
    assert code == 0 and report["errors"] == [], output
    assert [case["case"] for case in report["cases"]] == ["segmentation-0", "segmentation-1"]
    assert all(case["liver"]["dice"] == 1.0 for case in report["cases"])


def test_an_extension_in_capitals_is_an_extension(folders):
    pred, ref = folders
    save(ref / "segmentation-0.NII.GZ", labels())
    save(pred / "segmentation-0.NII.GZ", labels())
    save(ref / "segmentation-1.Nii", labels())
    save(pred / "volume-1_seg.nii.gz", labels())
    code, output, report = _evaluate(pred, ref)
    assert code == 0 and report["errors"] == [], output
    assert report["summary"]["n_cases"] == 2


@pytest.mark.parametrize("order", ["mirrored", "transposed"])
def test_a_reference_stored_in_another_voxel_order_is_the_same_voxels(folders, order):
    pred, ref = folders
    truth = labels()
    save(pred / "segmentation-0.nii.gz", truth)
    affine = np.diag([*SPACING, 1.0])
    if order == "mirrored":  # x stored from the far side: the same voxels in the world
        stored = truth[::-1]
        affine[0, 0] = -SPACING[0]
        affine[0, 3] = SPACING[0] * (truth.shape[0] - 1)
    else:  # x and y swapped, their columns too
        stored = truth.transpose(1, 0, 2)
        affine[:, [0, 1]] = affine[:, [1, 0]]
    nib.save(nib.Nifti1Image(np.ascontiguousarray(stored), affine), ref / "segmentation-0.nii.gz")
    code, output, report = _evaluate(pred, ref)
    assert code == 0 and report["errors"] == [], output
    assert report["cases"][0]["liver"]["dice"] == 1.0


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_prediction_that_is_its_reference_is_refused(folders, link):
    pred, ref = folders
    save(ref / "segmentation-0.nii.gz", labels())
    save(ref / "segmentation-1.nii.gz", labels())
    save(pred / "segmentation-1.nii.gz", labels(shift=1))  # a real prediction
    if link == "symbolic":
        (pred / "segmentation-0.nii.gz").symlink_to(ref / "segmentation-0.nii.gz")
    else:
        os.link(ref / "segmentation-0.nii.gz", pred / "segmentation-0.nii.gz")
    code, output, report = _evaluate(pred, ref)
    assert code == 1, output
    failed = {error["case"]: error["message"] for error in report["errors"]}
    assert "is the reference" in failed["segmentation-0"], failed
    assert report["summary"]["n_cases"] == 1
    assert [case["case"] for case in report["cases"]] == ["segmentation-1"]
