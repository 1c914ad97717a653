"""Fixed windows: level-wise tiles whose compiled window programs serve boxes of every shape.

Each stage's convolutions run on windows of one extent that does not depend on the box
(`tiling.fixed_stages`), compiled once per model, stage and device and kept by the backend;
the driver's small programs (cut a window, add its core) follow the level shapes. Stitched,
the windows equal the whole-volume pass of the same box; dealt out over several devices,
they equal one device's windows exactly.
"""

from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import REPO, no_host_transfers, random_model, tiny_config

from ctseg import config as cfg
from ctseg.config import TileRequest
from ctseg.inference.member import Member
from ctseg.inference.network import tiling
from ctseg.inference.network.engine import Engine, class_probabilities
from ctseg.inference.network.jax import window_programs
from ctseg.inference.network.jax import windows as jax_windows
from ctseg.inference.network.jax.backend import JaxBackend
from ctseg.inference.network.jax.boxes import Windowed
from ctseg.io.scans import Scan
from ctseg.model import unet
from ctseg.parallel import devices as dev
from ctseg.parallel.compile_cache import compile_clock
from ctseg.run.trained import TrainedModel

SHIPPED_SHARE = window_programs.BATCHED_SHARE  # before `batched_windows` changes it

# The driver's programs: they depend on a box's level shapes, not on the network.
DRIVER = {"jit(_begin)", "jit(_add_then_cut)", "jit(_add)", "jit(as_batch)", "jit(only_item)"}


class _Calls(list):
    """A progress callback that records its calls."""

    def __call__(self, done: int, count: int) -> None:
        self.append((done, count))


@pytest.fixture(autouse=True)
def batched_windows(monkeypatch):
    """Every stage whose windows are smaller than the largest runs them several to a
    dispatch: at these tests' small extents (a GPU batches only the deep stages'
    windows, `BATCHED_SHARE`), so that the exact results hold for batches too."""
    monkeypatch.setattr(window_programs, "BATCHED_SHARE", 1.0)


def _windowed(model: TrainedModel, backend: JaxBackend, core: int, box: tuple) -> Engine:
    """An engine running boxes of `box` in the backend's fixed windows of `core` voxels."""
    return Engine(model, backend, tile=core, shape=box, windows=backend.boxes.windows(core))


def _windows_backend(devices: int = 1) -> JaxBackend:
    return JaxBackend(jax.devices()[:devices], fixed_windows=True)


@pytest.fixture(scope="module")
def one_device() -> JaxBackend:
    """One device's fixed windows, the reference of the dealt ones (its window programs
    compiled once for the module)."""
    return _windows_backend()


@pytest.fixture(scope="module")
def four_devices() -> JaxBackend:
    return _windows_backend(4)


@pytest.mark.parametrize(("depth", "core"), [(2, 6), (2, 12), (3, 8)])
def test_fixed_windows_equal_the_whole_pass_on_boxes_of_several_shapes(depth, core):
    """On boxes of three shapes (one no longer than a window along an axis), the stitched
    windows give the whole pass's logits and labels, on the device throughout."""
    model = random_model(depth)
    backend = _windows_backend()
    floor = tiling.window_floor(model.config, core)
    for index, box in enumerate([(32, 32, 32), (floor, 40, 56), (48, 28, 36)]):
        image = np.random.default_rng(index).uniform(-1, 1, box).astype(np.float32)
        reference = np.asarray(Engine(model, backend, tile=0, shape=box).logits(image))
        assert np.ptp(reference.argmax(-1)) > 0
        engine = _windowed(model, backend, core, box)
        assert engine.description.startswith(f"fixed windows ≤ {core}³")
        assert sum(len(s.windows()) for s in engine.stages) > 2 * depth - 1
        assert max(engine._plan.batches) > 1  # deep stages' windows several to a dispatch
        placed = engine.place(image)
        calls = _Calls()
        with no_host_transfers():  # no window and no level through the host
            logits = jax.block_until_ready(engine.logits(placed, calls))
        assert calls[-1][0] == calls[-1][1] == sum(len(s.windows()) for s in engine.stages)
        np.testing.assert_allclose(logits, reference, rtol=0, atol=1e-5, err_msg=str(box))
        np.testing.assert_array_equal(np.asarray(logits).argmax(-1), reference.argmax(-1))


def test_lits512_runs_its_deep_stages_windows_eight_to_a_dispatch(monkeypatch):
    """Cores of 128 on a 640×640×320 box: levels 2 and 3 (windows of 34³ and 16³) batched,
    the others one window to a dispatch."""
    monkeypatch.setattr(window_programs, "BATCHED_SHARE", SHIPPED_SHARE)
    config = cfg.load(REPO / "configs" / "lits512_16way.toml", [])
    stages = tiling.fixed_stages(config, 128, (640, 640, 320))
    assert [window_programs.window_batch(s, stages) for s in stages] == [1, 1, 8, 8, 8, 1, 1]
    assert {window_programs.window_batch(s, stages, most=1) for s in stages} == {1}


def test_a_batch_of_windows_is_filled_with_windows_that_own_nothing():
    rows = np.arange(5 * 4 * 3, dtype=np.int32).reshape(5, 4, 3)
    batches = jax_windows._batched(rows, 4)
    assert batches.shape == (2, 4, 4, 3)
    np.testing.assert_array_equal(batches.reshape(-1, 4, 3)[:5], rows)
    idle = batches[1, 1:]
    np.testing.assert_array_equal(idle[:, :3], np.repeat(rows[:1, :3], 3, axis=0))
    np.testing.assert_array_equal(idle[:, 3], idle[:, 2])  # stop = first: owns nothing


def test_fixed_windows_with_tta_and_a_region_equal_the_whole_pass():
    """Mirrored TTA is exact too, and a region's voxels (`need`) compute only their cone."""
    model = random_model(3)
    backend = _windows_backend()
    box = (32, 24, 96)
    image = np.random.default_rng(3).uniform(-1, 1, box).astype(np.float32)
    whole = Engine(model, backend, tile=0, shape=box)
    windows = _windowed(model, backend, 8, box)
    mirrored = [np.asarray(class_probabilities(e, image, True)) for e in (whole, windows)]
    np.testing.assert_allclose(mirrored[1], mirrored[0], rtol=0, atol=1e-5)
    need = ((6, 20), (0, 24), (40, 58))
    region = tuple(slice(lo, hi) for lo, hi in need)
    calls: list[tuple[int, int]] = []
    logits = np.asarray(windows.logits(image, lambda *c: calls.append(c), need))
    np.testing.assert_allclose(logits[region], np.asarray(whole.logits(image))[region], atol=1e-5)
    assert calls[-1][0] < sum(len(s.windows()) for s in windows.stages)
    assert not logits[:, :, :8].any() and not logits[:, :, 90:].any()


def test_fixed_windows_dealt_over_four_devices_equal_one_device(one_device, four_devices):
    """Windows dealt round-robin over the devices, each device's partial level summed onto
    the first: on boxes of two shapes the logits are exactly one device's windows' (the
    blocks own disjoint voxels) and the whole pass's, moved device to device only."""
    model = random_model(3)
    core = 8
    for index, box in enumerate([(32, 32, 32), (24, 40, 24)]):
        image = np.random.default_rng(index).uniform(-1, 1, box).astype(np.float32)
        whole = np.asarray(Engine(model, one_device, tile=0, shape=box).logits(image))
        alone = _windowed(model, one_device, core, box)
        dealt = _windowed(model, four_devices, core, box)
        assert dealt.description == alone.description.replace(")", ", 4 at a time)")
        windows = [len(s.windows()) for s in dealt.stages]
        assert min(windows) > 4  # every device has windows in every stage
        placed = dealt.place(image)
        calls = _Calls()
        with no_host_transfers():  # device to device, never through the host
            logits = jax.block_until_ready(dealt.logits(placed, calls))
        assert calls[-1] == (sum(windows), sum(windows))
        assert logits.devices() == {jax.devices()[0]}
        np.testing.assert_array_equal(logits, alone.logits(image), err_msg=str(box))
        np.testing.assert_allclose(logits, whole, rtol=0, atol=1e-5, err_msg=str(box))


def test_fixed_windows_over_four_devices_with_tta_and_a_region(one_device, four_devices):
    """Mirrored TTA over four devices is one device's exactly (and so the whole pass's,
    `test_fixed_windows_with_tta_and_a_region_equal_the_whole_pass`); a region's voxels
    (`need`) compute only their cone, its last stage's one window on the first device, the
    other three left out."""
    model = random_model(3)
    box = (24, 40, 24)
    image = np.random.default_rng(5).uniform(-1, 1, box).astype(np.float32)
    alone = _windowed(model, one_device, 8, box)
    dealt = _windowed(model, four_devices, 8, box)
    mirrored = [np.asarray(class_probabilities(e, image, True)) for e in (alone, dealt)]
    np.testing.assert_array_equal(mirrored[1], mirrored[0])
    need = ((6, 12), (10, 16), (8, 14))
    spans = tiling.stage_spans(dealt.stages, need)
    assert len(dealt.stages[-1].windows(spans[-1])) == 1
    region = tuple(slice(lo, hi) for lo, hi in need)
    calls = _Calls()
    logits = np.asarray(dealt.logits(image, calls, need))
    expected = np.asarray(alone.logits(image, None, need))
    np.testing.assert_array_equal(logits[region], expected[region])
    assert calls[-1][0] < sum(len(s.windows()) for s in dealt.stages)


@pytest.mark.parametrize("devices", [1, 4])
def test_window_programs_compile_once_for_boxes_of_every_shape(devices):
    """Three box shapes through one backend: each stage's window program is compiled once
    per device, with the first box; a new box shape compiles the driver's small programs
    only, a bounded number of them per device, and a box seen before compiles nothing."""
    model = random_model(3)
    backend = _windows_backend(devices)
    clock = compile_clock()
    core = 8
    keys = {tiling.window_key(s) for s in tiling.fixed_stages(model.config, core, (32,) * 3)}
    compiled = []
    # Shapes no other test runs: the driver's programs are jax.jit's, kept by the process.
    for box in [(32, 32, 40), (24, 40, 56), (48, 24, 32), (24, 40, 56)]:
        before = dict(clock.by_name)
        image = np.random.default_rng(0).uniform(-1, 1, box).astype(np.float32)
        engine = _windowed(model, backend, core, box)
        jax.block_until_ready(engine.logits(image))
        compiled.append({k: v - before.get(k, 0) for k, v in clock.by_name.items()})
        compiled[-1] = {k: v for k, v in compiled[-1].items() if v}
    first, *later = compiled
    assert first.get("jit(window_program)") == len(keys) * devices
    stages = len(tiling.stage_order(model.config.model.depth))
    for programs in later[:2]:
        assert set(programs) <= DRIVER, programs  # no convolution compiled again
        # Per stage and device its first windows' cut and zero level, and the add-then-cut;
        # per stage the sums on every other device; the image's batch and the logits' item.
        assert sum(programs.values()) <= stages * (2 * devices + devices // 2) + 2
    assert later[2] == {}  # the same shape again: nothing


def test_the_automatic_plan_runs_fixed_windows_on_accelerators(monkeypatch):
    """On the CPU the default stays the box's own plan (fastest there, measured); on one
    accelerator or several the spacing grid's boxes run in fixed windows of a core chosen
    from memory; the whole volume asked for, or a backend without them, runs none."""
    config = random_model(2).config
    assert not isinstance(JaxBackend(jax.devices()[:1]).boxes, Windowed)
    assert not isinstance(JaxBackend(jax.devices()[:4]).boxes, Windowed)
    monkeypatch.setattr(dev, "is_accelerator", lambda devices: True)
    assert isinstance(JaxBackend(jax.devices()[:1]).boxes, Windowed)
    assert isinstance(JaxBackend(jax.devices()[:4]).boxes, Windowed)  # dealt out over them

    def core(tile: TileRequest, memory: int) -> int | None:
        return Windowed(jax.devices()[:1], memory, 1).core(config, tile)

    assert core(TileRequest.size(16), 2**30) == 16
    assert core(TileRequest.whole(), 2**30) is None
    assert core(TileRequest.auto(), 2**40) == 128
    assert core(TileRequest.auto(), 2**20) < 128
    off = JaxBackend(jax.devices()[:1], fixed_windows=False)
    assert off.boxes.of_grid(random_model(2), TileRequest.auto()).windows is None


def _spacing_model() -> TrainedModel:
    config = tiny_config("data.grid=spacing", "data.spacing=[8.0,8.0,8.0]", "model.depth=3")
    graphdef, params, stats = unet.create(config.model, seed=1)
    return TrainedModel(config, graphdef, params, stats, step=0)


def test_a_member_holds_spacing_grid_boxes_in_a_canvas_and_predicts_exactly():
    """A member on the spacing grid with fixed windows holds its boxes in a canvas: the
    largest box so far, each reaching the receptive field beyond its grid, at least the
    windows' floor a side and a multiple of their core. Its probabilities on the grid
    are those of the whole pass over the same box, and the window programs compiled
    once, begun when the member was made (before its first scan is read), none with a
    later scan."""
    model = _spacing_model()
    core = 8
    clock = compile_clock()
    made = clock.by_name["jit(window_program)"]
    member = Member(model, TileRequest.size(core), _windows_backend())
    assert member.boxes.windows.core == core and member.boxes.canvas is not None
    radius = unet.receptive_field_radius(model.config.model)
    stages = tiling.fixed_stages(model.config, core, (64, 64, 64))
    assert len(member.backend.boxes.programs._compiled) == len(stages)  # compiling already
    floor = tiling.window_floor(model.config, core)
    rng = np.random.default_rng(0)
    compiled, boxes = [], []
    for shape in [(70, 79, 34), (90, 60, 40), (40, 100, 50)]:
        before = made if not compiled else clock.by_name["jit(window_program)"]
        hu = rng.normal(0, 300, shape).astype(np.int16)
        affine = np.diag([2.0, 2.0, 4.0, 1.0])
        scan = Scan(hu, affine, shape, affine, None, Path("scan.nii.gz"), "scan")
        on_grid = member.to_grid(scan)
        box, grid = tuple(on_grid.unit.shape), on_grid.grid
        assert min(box) >= floor and all(n % core == 0 for n in box)  # `tiling.windows_box`
        assert all(b >= n + radius for b, n in zip(box, grid, strict=True))
        assert on_grid.need == tuple((0, n) for n in grid)
        boxes.append(box)
        probabilities = member.infer(on_grid, False, lambda *c: None, None)
        compiled.append(clock.by_name["jit(window_program)"] - before)
        assert member.engine.windows.core == core and member.engine.shape == box
        whole = Engine(model, member.backend, tile=0, shape=box)
        expected = jax.nn.softmax(whole.logits(on_grid.unit), axis=-1)
        inside = tuple(slice(0, n) for n in grid)  # the rest of the canvas is not computed
        np.testing.assert_allclose(
            np.asarray(probabilities)[inside], np.asarray(expected)[inside], rtol=0, atol=1e-5
        )
    assert all(min(np.subtract(b, a)) >= 0 for a, b in zip(boxes, boxes[1:], strict=False))
    assert boxes[-1] == member.boxes.canvas.shape and len(member._engines) == len(set(boxes))
    assert compiled == [len(stages), 0, 0]  # compiled once


def test_a_cube_member_runs_fixed_windows_for_region_boxes_only():
    """On the cube grid the one box keeps its own plan; a region's box (its shape follows the
    liver) runs in fixed windows when it holds one, else in its own plan."""
    model = random_model(3)  # the 32³ cube
    member = Member(model, TileRequest.size(8), _windows_backend())
    assert member.engine is not None and member.engine.windows is None
    floor = tiling.window_floor(model.config, 8)
    assert member.engine_for((floor, 28, 32)).windows.core == 8
    assert member.engine_for((floor - 4, 28, 32)).windows is None


def test_a_window_program_whose_compile_failed_is_compiled_again_when_asked(monkeypatch):
    """A failed compile (a GPU out of memory while tuning, say) fails that plan only: the
    next box asks again, as when the programs compiled in the plan's own thread."""
    model = random_model(2)
    stages = tiling.fixed_stages(model.config, 8, (32, 32, 32))
    batches = [window_programs.window_batch(s, stages) for s in stages]
    devices = jax.devices()[:1]
    real, calls = window_programs.window_program, []

    def failing_once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("RESOURCE_EXHAUSTED while autotuning")
        return real(*args)

    monkeypatch.setattr(window_programs, "window_program", failing_once)
    programs = window_programs.WindowPrograms()
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        programs.of(model, stages[:1], batches[:1], devices)
    compiled = programs.of(model, stages[:1], batches[:1], devices)
    assert len(calls) == 2 and compiled[0][0] is not None
