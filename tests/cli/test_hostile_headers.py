"""Headers that lie: what a file's header claims (its voxels, their size, a manifest's grid)
is checked before it sizes anything, so that one lying file fails alone and never decides
for the rest of a batch: the canvases are sized from the headers a read would accept, a
scan too large for them is held alone, and `Segmenter.map` yields what it made."""

import gzip
import json
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from helpers import fixed_windows_everywhere, itk_image, tiny_config
from typer.testing import CliRunner

from ctseg.cli.main import app
from ctseg.config import InferenceOptions
from ctseg.data.store import Store
from ctseg.errors import CtsegError
from ctseg.inference.api import Segmenter
from ctseg.inference.network.jax.backend import JaxBackend
from ctseg.inference.predictor import Predictor
from ctseg.inference.scan.canvas import Canvas
from ctseg.io import readers
from ctseg.io.scans import nifti_geometry, read_scan
from ctseg.model import unet
from ctseg.run.trained import TrainedModel

SPACING = (2.0, 2.0, 4.0)


def _good(path: Path, shape=(24, 20, 12), spacing=SPACING) -> Path:
    hu = np.random.default_rng(0).normal(40, 300, shape).clip(-1024, 2000).astype(np.int16)
    nib.save(nib.Nifti1Image(hu, np.diag([*spacing, 1.0])), path)
    return path


def _claiming(path: Path, shape: tuple[int, ...], spacing=SPACING) -> Path:
    """A .nii.gz of a header alone (136 bytes once compressed) that claims `shape` voxels."""
    header = nib.Nifti1Header()
    header.set_data_shape(shape)
    header.set_data_dtype(np.int16)
    header.set_sform(np.diag([*spacing, 1.0]), code=1)
    with gzip.open(path, "wb") as handle:
        handle.write(header.binaryblock + b"\0" * 4)
    return path


def _cut(source: Path, path: Path, keep: float = 0.3) -> Path:
    """`source` cut short, as a copy interrupted leaves it."""
    data = source.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_a_header_claiming_more_than_its_file_holds_sizes_nothing(tmp_path):
    """3000³ voxels in 136 bytes: no compression packs that (deflate: 1032 to 1); nor does an
    uncompressed file cut short hold its voxels. Both are refused from the header, before
    anything is decompressed, and their geometry sizes no canvas."""
    lie = _claiming(tmp_path / "lie.nii.gz", (3000, 3000, 3000))
    assert lie.stat().st_size < 200
    cut = _cut(_good(tmp_path / "whole.nii"), tmp_path / "cut.nii")
    for path in (lie, cut):
        assert nifti_geometry(path) is None
        with pytest.raises(CtsegError) as info:
            read_scan(path)
        assert "cut short or its header lies" in _one_line(info) or "memory" in str(info.value)
    assert nifti_geometry(tmp_path / "whole.nii") is not None


def test_a_field_of_view_no_ct_has_sizes_nothing(tmp_path):
    """100 mm voxels (a header in cm, or edited: 2.4 m across), or 3 m along one axis: no
    CT's; refused by every reader, and left out of the canvases."""
    coarse = _good(tmp_path / "coarse.nii.gz", spacing=(100.0, 100.0, 100.0))
    wide = _good(tmp_path / "wide.nii.gz", shape=(3000, 3, 3), spacing=(1.0, 1.0, 1.0))
    cut = _cut(coarse, tmp_path / "cut.nii.gz", keep=0.5)
    for path in (coarse, wide, cut):
        assert nifti_geometry(path) is None, path
    for path in (coarse, wide):
        with pytest.raises(CtsegError, match="no CT's") as info:
            read_scan(path)
        _one_line(info)
    import SimpleITK as sitk

    image = itk_image(np.zeros((24, 20, 12), np.int16))
    image.SetSpacing((100.0, 100.0, 100.0))
    sitk.WriteImage(image, str(tmp_path / "coarse.mha"))
    with pytest.raises(CtsegError, match="no CT's"):
        read_scan(tmp_path / "coarse.mha")


@pytest.fixture(scope="module")
def model() -> TrainedModel:
    """An untrained tiny model on an 8 mm grid (canvases do not depend on the weights)."""
    config = tiny_config("data.grid=spacing", "data.spacing=[8.0,8.0,8.0]", "model.depth=3")
    graphdef, params, stats = unet.create(config.model, seed=1)
    return TrainedModel(config, graphdef, params, stats, step=0)


def test_a_lying_header_leaves_the_batch_s_canvases_alone(tmp_path, monkeypatch, model):
    """The canvases that `ctseg predict` and `Segmenter.map` size from a batch's headers
    (`Predictor.expect` over `nifti_geometry`) hold the good scans only: a 136-byte file
    claiming 3000³ voxels and a cut file claiming 100 mm voxels size nothing."""
    fixed_windows_everywhere(monkeypatch)
    good = [_good(tmp_path / "a.nii.gz"), _good(tmp_path / "b.nii.gz", shape=(30, 16, 10))]
    lies = [
        _claiming(tmp_path / "huge.nii.gz", (3000, 3000, 3000)),
        _cut(_good(tmp_path / "cm.nii.gz", spacing=(100.0,) * 3), tmp_path / "cut.nii.gz"),
    ]
    options = InferenceOptions(backend="jax", tile=8, tta=False)
    honest, batch = Predictor(model, JaxBackend(), options), Predictor(model, JaxBackend(), options)
    honest.expect(map(nifti_geometry, good))
    batch.expect(g for g in map(nifti_geometry, [lies[0], *good, lies[1]]) if g is not None)
    assert batch.backend.boxes.scan_canvas.shape == honest.backend.boxes.scan_canvas.shape
    assert batch.members[0].boxes.canvas.shape == honest.members[0].boxes.canvas.shape
    # A geometry no CT has, from wherever it comes (a store's manifest), is left out too.
    batch.expect([((40, 40, 40), (100.0, 100.0, 100.0))])
    assert batch.members[0].boxes.canvas.shape == honest.members[0].boxes.canvas.shape


def test_a_canvas_never_grows_past_the_largest_scan_read(monkeypatch):
    """A scan that would grow the canvas past the largest scan ctseg reads is held in a
    shape of its own, the canvas kept for the others; one that fails on its way to the
    grid leaves the canvas as it found it (`Canvas.restore`)."""
    monkeypatch.setenv(readers.MAX_SCAN_BYTES_ENV, str(2 * 1000))  # 1,000 int16 voxels
    canvas = Canvas()
    assert canvas.most_voxels == 1000
    assert canvas.holding((10, 10, 10)) == (10, 10, 10)
    assert canvas.holding((20, 5, 5)) == (20, 5, 5)  # 20 × 10 × 10 would not fit
    assert canvas.shape == (10, 10, 10)
    assert canvas.holding((4, 10, 4)) == (10, 10, 10)
    canvas.restore((8, 8, 8))
    assert canvas.shape == (8, 8, 8)


def test_segmenter_map_yields_what_it_made_before_a_lying_scan(tmp_path, monkeypatch, trained):
    """`Segmenter.map` over [good, 3000³ claimed in 136 bytes, good]: the first scan's
    result, then the lying scan's one-line error (the documented behaviour: its error when
    its turn comes); the canvas never held 3000³."""
    fixed_windows_everywhere(monkeypatch)
    segmenter = Segmenter(trained[0], backend="jax", device="cpu", tta=False)
    paths = [
        _good(tmp_path / "a.nii.gz"),
        _claiming(tmp_path / "huge.nii.gz", (3000, 3000, 3000)),
        _good(tmp_path / "b.nii.gz"),
    ]
    results = segmenter.map(paths)
    first = next(results)
    assert first.labels.shape == (24, 20, 12)
    with pytest.raises(CtsegError) as info:
        next(results)
    assert "huge.nii.gz" in _one_line(info)
    canvas = segmenter.predictor.backend.boxes.scan_canvas
    assert canvas.shape is not None and max(canvas.shape) < 100


def _lying_store(trained, tmp_path: Path, edit) -> Path:
    """A copy of the trained run's store whose manifest's first case was edited by `edit`."""
    store = tmp_path / "store"
    shutil.copytree(trained[1], store)
    manifest = json.loads((store / "manifest.json").read_text())
    edit(manifest["cases"][0])
    (store / "manifest.json").write_text(json.dumps(manifest))
    return store


def _scaled_affine(case, factor=100.0):
    case["original_affine"] = [
        [v * factor if col < 3 and row < 3 else v for col, v in enumerate(line)]
        for row, line in enumerate(case["original_affine"])
    ]


def _more_voxels(case):
    case["original_shape"] = [n * 40 for n in case["original_shape"]]
    case["canonical_shape"] = [n * 40 for n in case["canonical_shape"]]


@pytest.mark.parametrize("edit", [_scaled_affine, _more_voxels])
def test_a_manifest_that_lies_about_a_grid_is_one_line_before_anything_is_sized(
    tmp_path, trained, edit
):
    """`ctseg evaluate` sizes its canvases from the store's manifest before any case is
    read: a case's geometry that is not its arrays' (the .npy headers on disk), or no
    CT's, is refused when the store opens, naming the case; exit 2, nothing written."""
    store = _lying_store(trained, tmp_path, edit)
    with pytest.raises(CtsegError, match=r"manifest.json: cases\[0\]") as info:
        Store.open(store)
    _one_line(info)
    out = tmp_path / "eval"
    done = CliRunner().invoke(
        app, ["evaluate", str(trained[0]), "--data", str(store), "--out", str(out)]
    )
    # The command line's error (exit 2, `error: ` and the line; `cli.main`).
    assert isinstance(done.exception, CtsegError), done.output
    assert "cases[0]" in str(done.exception) and "\n" not in str(done.exception)
    assert not (out / "summary.json").exists()


def test_ctseg_predict_fails_only_the_rows_of_lying_or_too_large_scans(
    tmp_path, monkeypatch, trained
):
    """`ctseg predict` over good scans among a 136-byte file claiming 3000³ voxels, a cut
    file claiming 100 mm voxels and a scan larger than the memory allowed: each of those
    three fails its own row in one line (exit 1), the good scans are written."""
    fixed_windows_everywhere(monkeypatch)
    monkeypatch.setenv(readers.MAX_SCAN_BYTES_ENV, str(100_000))  # 50,000 int16 voxels
    scans, out = tmp_path / "scans", tmp_path / "out"
    scans.mkdir()
    _good(scans / "a.nii.gz")
    _claiming(scans / "huge.nii.gz", (3000, 3000, 3000))
    _cut(_good(tmp_path / "cm.nii.gz", spacing=(100.0,) * 3), scans / "cut.nii.gz")
    _good(scans / "large.nii.gz", shape=(60, 60, 40))
    _good(scans / "b.nii.gz", shape=(30, 16, 10))
    args = [str(trained[0]), str(scans), "--out", str(out), "--device", "cpu", "--no-tta"]
    done = CliRunner(env={"COLUMNS": "400"}).invoke(app, ["predict", *args, "--backend", "jax"])
    assert done.exit_code == 1, done.output
    for name in ("a", "b"):
        assert (out / f"{name}_seg.nii.gz").is_file() and (out / f"{name}_stats.json").is_file()
    for name, words in [
        ("huge", "3000 × 3000 × 3000 voxels, 50.3 GiB in memory"),
        ("cut", "no CT's"),
        ("large", "more than the 97.7 KiB that CTSEG_MAX_SCAN_BYTES allows"),
    ]:
        assert not (out / f"{name}_stats.json").exists()
        assert any(name in line and words in line for line in done.output.splitlines()), (
            name,
            done.output,
        )
    assert "Traceback" not in done.output
