"""The ONNX Runtime backend computes the JAX inference-mode forward pass."""

import importlib.util
import os
import sys

import jax
import nibabel as nib
import numpy as np
import pytest
from flax import nnx
from helpers import RESOLUTION, random_model
from typer.testing import CliRunner

from ctseg.cli.main import app  # every command registered
from ctseg.errors import CtsegError
from ctseg.inference.network import tiling
from ctseg.inference.network.choice import backend_named
from ctseg.inference.network.engine import Engine
from ctseg.inference.network.jax.backend import JaxBackend
from ctseg.labels import NUM_CLASSES
from ctseg.model import unet
from ctseg.parallel.partition import LOCAL
from ctseg.run.trained import TrainedModel

runner = CliRunner()

needs_onnx = pytest.mark.skipif(
    importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnx") is None,
    reason="the onnx extra is not installed",
)


def with_head_bias(model: TrainedModel) -> TrainedModel:
    """The model with a small non-zero head bias, so the exported head's bias is exercised."""
    rng = np.random.default_rng(2)

    def perturb(path, leaf):
        if "head" in jax.tree_util.keystr(path) and "bias" in jax.tree_util.keystr(path):
            return np.asarray(rng.normal(0, 0.1, leaf.shape), np.float32)
        return leaf

    params = jax.tree_util.tree_map_with_path(perturb, model.params)
    return TrainedModel(model.config, model.graphdef, params, model.stats, model.step)


@needs_onnx
@pytest.mark.parametrize("depth", [2, 3])
def test_onnx_logits_equal_jax_inference_mode(depth):
    import onnx
    import onnxruntime as ort

    from ctseg.inference.network.onnx import export as onnx_export

    model = with_head_bias(random_model(depth))
    proto = onnx_export.export(model.graphdef, model.params, model.stats)
    onnx.checker.check_model(proto, full_check=True)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    # Non-cubic, batch 2: the graph's batch and spatial sizes are dynamic.
    x = np.random.default_rng(4).uniform(-1, 1, (2, 16, 24, 8, 1)).astype(np.float32)
    forward = jax.jit(lambda p, s, v: unet.apply(model.graphdef, p, s, v, LOCAL, train=False)[0])
    expected = forward(model.params, model.stats, x)
    (logits,) = session.run(None, {onnx_export.INPUT: x})
    assert logits.shape == (2, 16, 24, 8, NUM_CLASSES)
    # Measured: about 3e-7 (batch norm folded in float64, rounded once to float32).
    np.testing.assert_allclose(logits, np.asarray(expected), rtol=0, atol=1e-4)


@needs_onnx
def test_onnx_stage_graphs_equal_jax_stages():
    """Each stage graph computes `UNet.stage` on channels-last inputs."""
    import onnx
    import onnxruntime as ort

    from ctseg.inference.network.onnx import export as onnx_export

    model = with_head_bias(random_model(3))
    net = nnx.merge(model.graphdef, model.params, model.stats)
    rng = np.random.default_rng(5)
    shape = (2, 8, 12, 4)  # batch 2, non-cubic: batch and spatial sizes are dynamic
    channels = {"image": 1, 1: 2, 2: 4}  # a_l: 1, then base·2^(l−1); d_l: base·2^l
    for kind, level in tiling.stage_order(3):
        proto = onnx_export.export_stage(model.graphdef, model.params, model.stats, kind, level)
        onnx.checker.check_model(proto, full_check=True)
        a = rng.uniform(-1, 1, (*shape, channels["image" if level == 0 else level]))
        inputs = {onnx_export.STAGE_INPUT: a.astype(np.float32)}
        if kind == unet.UP:
            below = rng.uniform(0, 1, (2, 4, 6, 2, 2 * 2 ** (level + 1)))
            inputs[onnx_export.STAGE_BELOW] = below.astype(np.float32)
        expected = np.asarray(net.stage(kind, level, list(inputs.values()), LOCAL))
        session = ort.InferenceSession(
            proto.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        (out,) = session.run([onnx_export.STAGE_OUTPUT], inputs)
        assert out.shape == expected.shape, (kind, level)
        np.testing.assert_allclose(out, expected, rtol=0, atol=1e-4, err_msg=f"{kind} {level}")
    with pytest.raises(ValueError, match="bottom stage"):
        onnx_export.export_stage(model.graphdef, model.params, model.stats, unet.UP, 2)


@needs_onnx
def test_onnx_level_wise_tiles_equal_jax_whole_volume():
    model = random_model(3)
    image = np.random.default_rng(1).uniform(-1, 1, (RESOLUTION,) * 3).astype(np.float32)
    reference = Engine(model, JaxBackend(), tile=0).logits(image)
    tiled = Engine(model, backend_named("onnx"), tile=12)
    assert tiled.tile == 12 and len(tiled.stages) == 5
    logits = tiled.logits(image)
    np.testing.assert_allclose(logits, reference, rtol=0, atol=1e-4)
    np.testing.assert_array_equal(logits.argmax(-1), reference.argmax(-1))
    logits -= 1  # callers compute probabilities in place: the logits must be writable
    whole = Engine(model, backend_named("onnx"), tile=0).logits(image)
    np.testing.assert_allclose(whole, reference, rtol=0, atol=1e-4)
    whole -= 1


def test_missing_onnxruntime_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # makes `import onnxruntime` fail
    with pytest.raises(CtsegError, match=r"pip install 'ctseg\[onnx\]'"):
        Engine(random_model(2), backend_named("onnx"), tile=0)


def test_unknown_backend():
    with pytest.raises(CtsegError, match="unknown `backend`"):
        Engine(random_model(2), backend_named("tensorrt"), tile=0)


@needs_onnx
def test_predict_cli_onnx_backend_writes_the_jax_labels(request, tmp_path):
    run_dir, _, raw = request.getfixturevalue("trained")  # a tiny trained run
    scan = str(raw / "volume-0.nii.gz")
    labels = {}
    # On a CPU-only machine the device policy picks ONNX Runtime when it is installed.
    for backend, runtime in (("jax", "XLA"), ("onnx", "ONNX Runtime"), (None, "ONNX Runtime")):
        out = tmp_path / str(backend)
        args = ["predict", str(run_dir), scan, "--out", str(out), "--checkpoint", "latest"]
        result = runner.invoke(app, args + (["--backend", backend] if backend else []))
        assert result.exit_code == 0, result.output
        assert result.output.startswith(f"CPU ({os.cpu_count()} cores), {runtime}, float32, ")
        labels[backend] = np.asarray(nib.load(out / "volume-0_seg.nii.gz").dataobj)
    np.testing.assert_array_equal(labels["onnx"], labels["jax"])
    np.testing.assert_array_equal(labels[None], labels["jax"])
