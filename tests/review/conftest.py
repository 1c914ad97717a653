"""A predicted batch for the review tests: `ctseg predict` of the session's trained run."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from dicom_series import write_dicom_series
from helpers import itk_image
from typer.testing import CliRunner

from ctseg.cli.main import app
from ctseg.inference.scan.postprocess import scan_stats
from ctseg.io.scans import read_scan

# The verdicts given to the batch's scans (the tiny run finds no liver: all would be
# `review`), with their scores: the page's order is review, unlike, ok.
VERDICTS = {
    "volume-0": ("ok", 0.1),
    "volume-1": ("review", 0.7),
    "volume-2": ("unlike the training data", 1.0),
    "series": ("review", 0.9),
}


@pytest.fixture
def verdicts() -> dict[str, tuple[str, float]]:
    return VERDICTS


@pytest.fixture
def page_order() -> list[str]:
    """The batch's scans in the page's order: review (highest score first), unlike, ok."""
    return ["series", "volume-1", "volume-2", "volume-0"]


@pytest.fixture(scope="session")
def predicted(trained, tmp_path_factory) -> Path:
    """`ctseg predict`'s folder over the trained run's three scans and a DICOM series."""
    run_dir, _, raw = trained
    root = tmp_path_factory.mktemp("review")
    rng = np.random.default_rng(3)
    ct = rng.normal(0, 300, (14, 12, 9)).clip(-1000, 1500).astype(np.int16)
    write_dicom_series(root / "series", itk_image(ct))
    scans = [str(raw / f"volume-{i}.nii.gz") for i in range(3)]
    out = root / "out"
    args = ["predict", str(run_dir), *scans, str(root / "series"), "--out", str(out)]
    result = CliRunner().invoke(app, [*args, "--tile", "0"])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture
def batch(predicted, trained, tmp_path) -> Path:
    """A copy of `predicted` whose labels are the synthetic truth (a liver and tumours to
    see), with their statistics as predict measures them, and whose verdicts are
    `VERDICTS`: every other byte as predict wrote it."""
    _, _, raw = trained
    out = tmp_path / "out"
    shutil.copytree(predicted, out)
    for name, (verdict, score) in VERDICTS.items():
        stats_file = out / f"{name}_stats.json"
        stats = json.loads(stats_file.read_text())
        if name.startswith("volume-"):
            seg = out / f"{name}_seg.nii.gz"
            truth = raw / f"{name.replace('volume', 'segmentation')}.nii.gz"
            shutil.copyfile(truth, seg)
            labels = read_scan(seg)
            stats.update(scan_stats(labels.array.astype(np.uint8), labels.affine))
        stats["quality"].update(verdict=verdict, score=score)
        stats_file.write_text(json.dumps(stats))
    return out
