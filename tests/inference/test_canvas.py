"""Canvases (`ctseg.inference.scan.canvas`): where the backend holds its scans in a canvas (fixed
windows: JAX on accelerators, here forced on the CPU), a batch of scans of ten extents
compiles nothing after its first scan, and a scan's probabilities on its grid do not
depend on the canvas that held it: they are those of a box of its own."""

from pathlib import Path

import jax
import nibabel as nib
import numpy as np
import pytest
from helpers import fixed_windows_everywhere, tiny_config

from ctseg.config import InferenceOptions
from ctseg.inference import files
from ctseg.inference.api import Segmenter
from ctseg.inference.network import tiling
from ctseg.inference.network.engine import Engine
from ctseg.inference.network.jax.backend import JaxBackend
from ctseg.inference.predictor import Predictor
from ctseg.inference.scan import to_grid
from ctseg.inference.scan.canvas import Canvas
from ctseg.io.scans import nifti_geometry, read_scan
from ctseg.model import unet
from ctseg.parallel.compile_cache import compile_clock
from ctseg.run.trained import TrainedModel

CORE = 8
SPACING = (2.0, 2.0, 4.0)
SLICES = to_grid.SLICES_LAST  # the canvas's order of axes on the way to the grid
# Grids of 8 mm from 6 to 46 voxels a side: scans of several rungs of the ladder, boxes of
# windows of several shapes.
SHAPES = [(40 + 16 * i, 180 - 14 * i, 12 + 3 * i) for i in range(10)]


@pytest.fixture
def windows_on_the_cpu(monkeypatch):
    fixed_windows_everywhere(monkeypatch)


@pytest.fixture(scope="module")
def model() -> TrainedModel:
    """An untrained tiny model on an 8 mm grid (compiles do not depend on the weights)."""
    config = tiny_config("data.grid=spacing", "data.spacing=[8.0,8.0,8.0]", "model.depth=3")
    graphdef, params, stats = unet.create(config.model, seed=1)
    return TrainedModel(config, graphdef, params, stats, step=0)


def _scans(folder: Path) -> list[Path]:
    rng = np.random.default_rng(0)
    folder.mkdir()
    paths = []
    for index, shape in enumerate(SHAPES):
        hu = rng.normal(40, 300, shape).clip(-1024, 2000).astype(np.int16)
        paths.append(folder / f"scan-{index}.nii.gz")
        nib.save(nib.Nifti1Image(hu, np.diag([*SPACING, 1.0])), paths[-1])
    return paths


def test_a_canvas_grows_to_hold_every_shape_asked():
    canvas = Canvas()
    assert canvas.holding((4, 9, 2)) == (4, 9, 2)
    assert canvas.holding((6, 3, 2)) == (6, 9, 2)
    assert canvas.holding((1, 1, 1)) == (6, 9, 2) == canvas.shape


def test_a_batch_of_ten_extents_compiles_nothing_after_its_first_scan(
    tmp_path, windows_on_the_cpu, model
):
    """The canvases sized from the batch's headers (`Predictor.expect`): the first scan
    compiles its programs, the nine others none, though their rungs and boxes differ;
    and a scan's probabilities on its grid are those of the whole pass over a box of
    its own that reaches the receptive field beyond the grid, brought to the grid in the
    canvas's order of axes (to 1e-6: windows sum in another order)."""
    paths = _scans(tmp_path / "scans")
    predictor = Predictor(
        model, JaxBackend(), InferenceOptions(backend="jax", tile=CORE, tta=False)
    )
    member = predictor.members[0]
    assert member.boxes.canvas is not None and predictor.backend.boxes.scan_canvas is not None
    grids = [member.grid.grid_of(s.array.shape, s.spacing) for s in map(read_scan, paths)]
    # Without canvases: six rungs of scans, five boxes of windows, each compiling anew.
    assert len({to_grid.padded(shape) for shape in SHAPES}) >= 6
    assert len({tiling.windows_box(model.config, CORE, g) for g in grids}) >= 5
    predictor.expect(nifti_geometry(path) for path in paths)
    clock = compile_clock()
    compiled, on_grids = [], []
    for path, grid in zip(paths, grids, strict=True):
        before = clock.programs
        prediction = predictor.predict(read_scan(path))
        compiled.append(clock.programs - before)
        inside = tuple(slice(0, n) for n in grid)
        on_grids.append(np.asarray(prediction.grid_probabilities)[inside])
    assert compiled[0] > 0 and compiled[1:] == [0] * 9, compiled
    # The first, a middle and the last scan against boxes of their own.
    radius, align = unet.receptive_field_radius(model.config.model), model.config.alignment
    window, device = model.config.data.hu_window, jax.devices()[0]
    for index in (0, 4, 9):
        scan, grid = read_scan(paths[index]), grids[index]
        own = tuple(-(-(n + radius) // align) * align for n in grid)
        unit = to_grid.unit_box(scan.array, grid, (0, 0, 0), own, window, device, None, SLICES)
        whole = jax.nn.softmax(Engine(model, JaxBackend(), tile=0, shape=own).logits(unit), axis=-1)
        expected = np.asarray(whole)[tuple(slice(0, n) for n in grid)]
        np.testing.assert_allclose(on_grids[index], expected, rtol=0, atol=1e-6)


class Told(Exception):
    """Raised once the predictor was told what scans come: nothing was read before."""


@pytest.fixture
def told(monkeypatch) -> list:
    """What `Predictor.expect` is told, before `Told` stops the batch."""
    heard = []

    def expect(self, geometries):
        heard.extend(geometries)
        raise Told

    monkeypatch.setattr(Predictor, "expect", expect)
    return heard


def _as_read(paths) -> list:
    """Each scan's canonical shape and spacing, as `read_scan` reads them."""
    return [(s.array.shape, pytest.approx(s.spacing)) for s in map(read_scan, paths)]


def test_a_batch_sizes_the_canvases_from_its_headers_before_its_first_scan(
    tmp_path, windows_on_the_cpu, told, trained, model
):
    """`ctseg predict`'s batches (`files.predict_files`) and the API's (`Segmenter.map`)
    tell the predictor every NIfTI scan's canonical shape and spacing before the first
    scan is read; a file that is no NIfTI is left to its turn."""
    paths = _scans(tmp_path / "scans")
    (tmp_path / "scans" / "notes.nii").write_text("not a scan")
    predictor = Predictor(
        model, JaxBackend(), InferenceOptions(backend="jax", tile=CORE, tta=False)
    )
    sources = [*paths, tmp_path / "scans" / "notes.nii"]
    with pytest.raises(Told):
        list(files.predict_files(predictor, sources, tmp_path / "out"))
    assert told == _as_read(paths)
    told.clear()
    with pytest.raises(Told):
        list(Segmenter(trained[0], backend="jax", device="cpu").map(sources))
    assert told == _as_read(paths)


def test_evaluate_sizes_the_canvases_from_the_store_s_manifest(
    tmp_path, windows_on_the_cpu, told, trained
):
    """`ctseg evaluate RUN --data STORE` tells the predictor its cases' extents from the
    manifest (no file read) before the first case."""
    from ctseg.data.store import Store
    from ctseg.evaluation.runs import evaluate_run

    run_dir, store_dir, _ = trained
    with pytest.raises(Told):
        evaluate_run(run_dir, store_dir, split="train", out_dir=tmp_path / "eval")
    cases = [case for case in Store.open(store_dir).split("train") if case.labelled]
    assert told == _as_read([case.image_source for case in cases]) and told


def test_a_locator_s_canvases_are_sized_with_its_predictor_s(windows_on_the_cpu, model):
    """`--locate`'s coarse run predicts the same scans: `expect` sizes its canvases too,
    each the largest of the batch's on every axis."""
    options = InferenceOptions(backend="jax", tile=CORE, tta=False)
    backend = JaxBackend()  # the locator runs on its predictor's backend
    predictor = Predictor(model, backend, options)
    predictor.locator = Predictor(model, backend, options)
    batch = [((40, 180, 12), SPACING), ((184, 54, 39), SPACING)]
    predictor.expect(iter(batch))
    for each in (predictor, predictor.locator):
        member = each.members[0]
        scans = [to_grid.padded(shape) for shape, _ in batch]
        boxes = [member.boxes.canvas_box(member.grid.grid_of(*geometry)) for geometry in batch]
        assert each.backend.boxes.scan_canvas.shape == tuple(np.max(scans, axis=0))
        assert member.boxes.canvas.shape == tuple(np.max(boxes, axis=0))


def test_without_canvases_no_header_is_read(model):
    """On the CPU's own plans (no fixed windows) the batch's headers are not even read."""

    def headers():
        raise AssertionError("a header read for nothing")
        yield

    predictor = Predictor(
        model, JaxBackend(), InferenceOptions(backend="jax", tile=CORE, tta=False)
    )
    assert predictor.backend.boxes.scan_canvas is None
    predictor.expect(headers())
