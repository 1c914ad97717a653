"""The inference engine: exact level-wise tiled inference equals the whole-volume pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import RESOLUTION, from_grid, no_host_transfers, random_model

from ctseg.errors import CtsegError
from ctseg.inference.network import probability_ops, tiling
from ctseg.inference.network.choice import backend_named
from ctseg.inference.network.engine import Engine, class_probabilities
from ctseg.inference.network.jax.backend import JaxBackend
from ctseg.inference.network.jax.plans import COMPILED_SHARE
from ctseg.inference.network.onnx.backend import OnnxBackend
from ctseg.inference.scan import way_back
from ctseg.memory import aligned_zeros
from ctseg.model import unet
from ctseg.parallel import devices as dev
from ctseg.parallel.partition import LOCAL


@pytest.fixture(scope="module")
def image():
    rng = np.random.default_rng(1)
    return rng.uniform(-1, 1, (RESOLUTION,) * 3).astype(np.float32)


def _progress(engine: Engine, image: np.ndarray) -> tuple[np.ndarray, list]:
    calls: list[tuple[int, int]] = []
    logits = engine.logits(image, progress=lambda *call: calls.append(call))
    return logits, calls


@pytest.mark.parametrize(
    ("depth", "tiles"),
    [
        # depth 2, levels 32 and 16: cores 6 (level 0: 6·5 + 2; level 1: 6, 6, 4), 12
        # (14 balanced: 12, 12, 8; level 1: 8, 8), 16 (level 1 in one window).
        (2, [6, 14, 16]),
        # depth 3, levels 32, 16, 8: cores 6 (6·5 + 2; 6, 6, 4; 8 whole) and 12 (12, 12, 8;
        # 8, 8 down, the 16 grid whole up).
        (3, [6, 12]),
    ],
)
def test_level_wise_tiles_equal_whole_volume(depth, tiles, image):
    model = random_model(depth)
    whole = Engine(model, JaxBackend(), tile=0)
    assert whole.tile == 0 and whole.stages == []
    reference = whole.logits(image)
    assert reference.shape == (RESOLUTION,) * 3 + (3,)
    assert np.ptp(reference.argmax(-1)) > 0  # a non-trivial labelling to compare
    for tile in tiles:
        # Four windows per step, one per device, as on four accelerators.
        engine = Engine(model, JaxBackend(jax.devices()[:4]), tile=tile)
        assert [(s.kind, s.level) for s in engine.stages] == tiling.stage_order(depth)
        assert f"tiles ≤ {tile}³ ({2 * depth - 1} stages" in engine.description
        logits, calls = _progress(engine, image)
        total = sum(len(s.windows()) for s in engine.stages)
        assert total > 2 * depth - 1  # some stage really is tiled
        assert calls[-1] == (total, total)
        assert logits.dtype == np.float32 and isinstance(logits, jax.Array)  # on the devices
        np.testing.assert_allclose(logits, reference, rtol=0, atol=1e-4, err_msg=f"tile {tile}")
        np.testing.assert_array_equal(logits.argmax(-1), reference.argmax(-1))


def test_a_model_trained_16_way_predicts_on_the_devices_there(image):
    """The training mesh is a training fact: on 1 device or 4, whole or tiled, the logits are
    those of one plain unpartitioned pass of the same weights."""
    model = random_model(2, spatial=(4, 4, 1))
    reference = np.asarray(
        jax.jit(
            lambda x: unet.apply(model.graphdef, model.params, model.stats, x, LOCAL, train=False)[
                0
            ]
        )(image[None, ..., None])[0]
    )
    on_device = jax.device_put(image, jax.devices()[0])
    for count in (1, 4):
        for tile in (0, 14):
            engine = Engine(model, JaxBackend(jax.devices()[:count]), tile=tile)
            if tile == 0:
                assert engine.spatial == ((1, 1, 1) if count == 1 else (2, 2, 1))
            else:
                assert len(engine.stages[0].windows()) > count
            # Once the image is on a device, no window and no level passes through the host.
            with no_host_transfers():
                logits = jax.block_until_ready(engine.logits(on_device))
            np.testing.assert_allclose(
                logits, reference, rtol=0, atol=1e-5, err_msg=f"{count} devices, tile {tile}"
            )


def test_a_box_longer_than_the_training_grid_tiles_exactly_on_one_and_four_devices():
    """The spacing grid predicts over a scan's whole extent: a box of any aligned shape.
    Tiled (with and without TTA) equals whole, and both equal one plain pass, on 1 and 4
    devices; the whole pass is partitioned along the box's long axis where it can be."""
    model = random_model(3)  # trained on 32³; alignment 4
    box = (24, 32, 72)
    image = np.random.default_rng(2).uniform(-1, 1, box).astype(np.float32)
    plain = jax.jit(
        lambda x: unet.apply(model.graphdef, model.params, model.stats, x, LOCAL, train=False)[0]
    )
    reference = np.asarray(plain(image[None, ..., None])[0])
    for count in (1, 4):
        devices = jax.devices()[:count]
        whole = Engine(model, JaxBackend(devices), tile=0, shape=box)
        assert "whole volume 24×32×72" in whole.description
        if count == 4:
            assert whole.spatial != (1, 1, 1)  # partitioned, halo exchange and all
        tiled = Engine(model, JaxBackend(devices), tile=8, shape=box)
        assert len(tiled.stages[0].windows()) > 4
        for engine in (whole, tiled):
            np.testing.assert_allclose(
                engine.logits(image), reference, rtol=0, atol=1e-5, err_msg=engine.description
            )
        mirrored = [np.asarray(class_probabilities(e, image, True)) for e in (whole, tiled)]
        np.testing.assert_allclose(mirrored[1], mirrored[0], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="not the engine's grid"):
        whole.logits(image[:, :, :64])


@pytest.mark.parametrize(("backend", "count"), [("jax", 1), ("jax", 4), ("onnx", 1)])
def test_tiles_asked_for_a_region_compute_its_cone_only_and_exactly(backend, count):
    """A region's voxels (`need`): the tiles of its cone give the whole pass's logits and
    probabilities there (TTA too: each mirrored pass needs the mirrored region), run fewer
    windows, and leave what nothing wanted depends on uncomputed (zero)."""
    if backend == "onnx":
        pytest.importorskip("onnxruntime")
    model = random_model(3)  # alignment 4; receptive-field radius 20
    box = (32, 24, 96)
    image = np.random.default_rng(3).uniform(-1, 1, box).astype(np.float32)
    need = ((6, 20), (0, 24), (40, 58))
    devices = jax.devices()[:count]
    reference = Engine(model, backend_named(backend, devices), tile=0, shape=box)
    tiled = Engine(model, backend_named(backend, devices), tile=8, shape=box)
    region = tuple(slice(lo, hi) for lo, hi in need)
    calls: list[tuple[int, int]] = []
    logits = np.asarray(tiled.logits(image, lambda *call: calls.append(call), need))
    np.testing.assert_allclose(
        logits[region], np.asarray(reference.logits(image))[region], atol=1e-5
    )
    assert calls[-1][0] == calls[-1][1] < sum(len(s.windows()) for s in tiled.stages)
    assert not logits[:, :, :8].any() and not logits[:, :, 90:].any()  # far along z
    for mirrored in (False, True):
        ours = np.asarray(class_probabilities(tiled, image, mirrored, need=need))
        whole = np.asarray(class_probabilities(reference, image, mirrored))
        np.testing.assert_allclose(ours[region], whole[region], atol=1e-5, err_msg=str(mirrored))


def test_mirrored_tta_is_the_mean_of_eight_flipped_passes_and_mirror_equivariant(image):
    engine = Engine(random_model(2), JaxBackend(), tile=0)
    calls: list[tuple[int, int]] = []
    on_device = jax.device_put(image, jax.devices()[0])
    with no_host_transfers():  # the flips, softmax and mean stay on the device too
        mirrored = class_probabilities(engine, on_device, True, lambda *call: calls.append(call))
    assert calls[-1] == (8, 8)
    passes = []
    for axes in [(), (0,), (1,), (2,), (0, 1), (0, 2), (1, 2), (0, 1, 2)]:
        logits = engine.logits(np.ascontiguousarray(np.flip(image, axes)))
        passes.append(np.flip(jax.nn.softmax(logits, axis=-1), axes))
    np.testing.assert_allclose(mirrored, np.mean(passes, axis=0), rtol=0, atol=1e-6)
    # Mirroring the scan mirrors the prediction: no axis is preferred any more.
    flipped = class_probabilities(engine, np.flip(image, (0, 2)), True)
    np.testing.assert_allclose(np.flip(flipped, (0, 2)), mirrored, rtol=0, atol=1e-6)
    plain = class_probabilities(engine, image, False)
    assert np.abs(plain - mirrored).max() > 1e-3  # the passes do differ on this model


@pytest.mark.parametrize("tile", [0, 8])
def test_both_backends_give_the_same_probabilities_through_one_interface(tile):
    """JAX and ONNX Runtime are two `Backend`s of one interface: the same probabilities of
    the same model, plain and mirrored (one TTA loop), as JAX arrays (ONNX Runtime's on the
    host CPU's device), and the labels on a scan's voxels by the one way back; the name,
    dtype and exactness class are the backend's."""
    pytest.importorskip("onnxruntime")
    model = random_model(3)
    box = (32, 24, 40)
    image = np.random.default_rng(5).uniform(-1, 1, box).astype(np.float32)
    engines = [Engine(model, backend_named(name), tile=tile, shape=box) for name in ("jax", "onnx")]
    assert [e.backend.name for e in engines] == ["jax", "onnx"]
    assert [e.backend.exactness([model.config]) for e in engines] == [
        "jax float32",
        "onnx float32",
    ]
    for mirrored in (False, True):
        on_jax, on_onnx = (class_probabilities(e, image, mirrored) for e in engines)
        assert isinstance(on_jax, jax.Array) and isinstance(on_onnx, jax.Array)
        assert on_onnx.devices() == {engines[1].backend.grid_device}
        np.testing.assert_allclose(on_jax, on_onnx, rtol=0, atol=1e-5, err_msg=str(mirrored))
        np.testing.assert_allclose(on_onnx.sum(-1), 1, atol=1e-5)
        shape = (40, 20, 30)
        pairs = zip(engines, (on_jax, on_onnx), strict=True)
        labels = [engine.backend.boxes.space.scan_labels(p, shape).labels for engine, p in pairs]
        assert labels[0].shape == shape and (labels[0] == labels[1]).mean() > 0.99
    # ONNX Runtime's logits, whole or stitched from tiles, pass to JAX without a copy.
    logits = engines[1].logits(image)
    adopted = engines[1].backend.adopt_logits(logits)
    assert adopted.unsafe_buffer_pointer() == logits.ctypes.data
    bfloat16 = random_model(2, dtype="bfloat16").config
    jax_backend, onnx_backend = (e.backend for e in engines)
    assert jax_backend.dtype(bfloat16).name == "bfloat16"
    assert onnx_backend.dtype(bfloat16).name == "float32"  # ONNX Runtime runs it in float32
    assert jax_backend.exactness([model.config, bfloat16]) == "jax bfloat16/float32"


def test_a_whole_volume_that_does_not_fit_is_one_line(monkeypatch):
    monkeypatch.setattr(dev, "free_memory", lambda devices: 2**20)  # 1 MiB free
    with pytest.raises(
        CtsegError,
        match=r"a whole-volume pass of the 32³ grid needs [0-9.]+ MiB per "
        r"device, more than the 1\.0 MiB free on CPU .*; use tiles",
    ):
        Engine(random_model(2), JaxBackend(), tile=0)


def test_windows_run_one_per_device():
    model = random_model(2)  # trained on a [2, 2, 1] mesh: that does not matter
    assert Engine(model, JaxBackend(), tile=6).description.endswith(" windows)")
    assert Engine(model, JaxBackend(jax.devices()[:4]), tile=6).description.endswith(
        " windows, 4 at a time)"
    )


def test_level_wise_bfloat16_equals_whole_volume_bfloat16(image):
    """Intermediates stay bfloat16, as in the whole pass: the stitched logits match it."""
    model = random_model(3, dtype="bfloat16")
    reference = Engine(model, JaxBackend(), tile=0).logits(image)
    logits = Engine(model, JaxBackend(), tile=12).logits(image)
    # Measured bit-equal (jax 0.10.2, CPU). Allowed: a rare last-bit difference of a
    # float32 sum flipping a bfloat16 rounding, about one bfloat16 step of the logits.
    assert (logits == reference).mean() > 0.99
    np.testing.assert_allclose(logits, reference, rtol=0, atol=1e-2)
    np.testing.assert_array_equal(logits.argmax(-1), reference.argmax(-1))


def test_tile_must_be_even():
    model = random_model(3)
    with pytest.raises(CtsegError, match="must be even"):
        Engine(model, JaxBackend(), tile=7)
    with pytest.raises(CtsegError, match=r"tile must be -1 \(auto\), 0 .* got -2"):
        Engine(model, JaxBackend(), tile=-2)  # not a quiet whole volume
    assert Engine(model, JaxBackend(), tile=6).tile == 6  # no longer a multiple of 2^(depth-1)
    assert Engine(model, JaxBackend(), tile=32).tile == 0  # a core as large as the grid is whole
    assert Engine(model, JaxBackend(), tile=64).stages == []


def test_onnx_runtime_s_logits_go_to_jax_without_a_copy():
    """The stitched logits' buffer is aligned as XLA:CPU wants, so JAX adopts it as it is
    (a copy of a 560×560×320 box's logits takes 0.5 s); the softmax is the formula's."""
    logits = aligned_zeros((40, 3, 2, 3), np.dtype(np.float32))
    logits[...] = np.random.default_rng(0).normal(size=logits.shape)
    adopted = OnnxBackend().adopt_logits(logits)
    assert adopted.unsafe_buffer_pointer() == logits.ctypes.data
    expected = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    np.testing.assert_allclose(probability_ops.softmax(adopted), expected, rtol=1e-6)


def test_the_plan_is_chosen_from_the_compiled_programs_memory(monkeypatch, image):
    """Enough free memory gives the whole volume; too little for it gives tiles whose
    compiled programs, with the levels alive beside them, fit the budget."""
    model = random_model(3)
    whole = Engine(model, JaxBackend(), tile=-1, memory=2**40)
    assert whole.stages == [] and whole.needed > 0
    # A tiny model's image and logits dominate: tiles save little, so the budget lies
    # between what tiles of 8 and the whole pass need.
    small = Engine(model, JaxBackend(), tile=8).needed
    assert small < whole.needed
    memory = int((small + whole.needed) / 2 / COMPILED_SHARE)
    tiled = Engine(model, JaxBackend(), tile=-1, memory=memory)
    assert tiled.stages and tiled.needed <= COMPILED_SHARE * memory
    reference = whole.logits(image)
    np.testing.assert_allclose(tiled.logits(image), reference, rtol=0, atol=1e-5)
    # When even small cores do not fit, the levels waiting for their up stage wait on the
    # host, whole: the same logits.
    tiled._plan._plan.spill = True
    np.testing.assert_allclose(tiled.logits(image), reference, rtol=0, atol=1e-5)
    # The default is the devices' free memory, as the device policy reports it.
    monkeypatch.setattr(dev, "free_memory", lambda devices: memory)
    assert Engine(model, JaxBackend(), tile=-1).stages == tiled.stages


def test_labels_on_the_scan_are_resampled_on_the_device_as_on_the_host():
    """The device's linear resampling back to the scan's voxels equals
    scipy's (`helpers.from_grid`, order 1), shrinking, stretching and keeping axes."""
    rng = np.random.default_rng(2)
    probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(16, 16, 16, 3)), jnp.float32), axis=-1)
    host = np.asarray(probs)
    for shape in [(16, 40, 5), (7, 16, 33)]:
        back = way_back.ON_DEVICES.scan_labels(probs, shape, with_probabilities=True)
        labels, on_scan = back.labels, back.probabilities
        expected = from_grid(host, shape, order=1)
        np.testing.assert_allclose(on_scan, expected, rtol=0, atol=1e-6)
        assert labels.dtype == np.uint8 and labels.shape == shape
        assert (labels == expected.argmax(-1)).mean() > 0.999  # ties may break either way
    np.testing.assert_array_equal(way_back.ON_DEVICES.grid_labels(probs), host.argmax(-1))


def test_a_model_trained_with_remat_tiles_exactly(image):
    """model.remat recomputes activations in training's backward pass; inference has none,
    and runs the levels plainly, tiled or whole."""
    import dataclasses

    model = random_model(2)
    config = dataclasses.replace(
        model.config, model=dataclasses.replace(model.config.model, remat=True)
    )
    model = dataclasses.replace(model, config=config)
    whole = Engine(model, JaxBackend(), tile=0).logits(image)
    tiled = Engine(model, JaxBackend(), tile=8).logits(image)
    np.testing.assert_allclose(tiled, whole, rtol=0, atol=1e-5)
