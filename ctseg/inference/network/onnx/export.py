"""The inference-mode U-Net as an ONNX graph, for ONNX Runtime on CPUs.

XLA:CPU runs 3-D convolutions 4–10× slower than oneDNN-class kernels (README,
Troubleshooting: CPU speed); ONNX Runtime's CPU kernels close most of that gap.
The graph is small enough to write with `onnx.helper`: per level two (conv with
batch norm folded in → ReLU), 2×2×2 max-pool down, the 2×2×2 stride-2
up-convolution as a ConvTranspose, skip concatenation, the 1×1×1 head as a
convolution. Inference-mode batch norm is an affine map per channel, so folding
it into the preceding bias-free convolution is exact up to float32 rounding.

`export` builds the whole network; `export_stage` one stage of level-wise tiled
inference (`ctseg.inference.network.engine`: a down, bottom or up stage of one level), from the same
weights and the same layer builders. Graphs take and return the JAX layout,
channels last (image [batch, x, y, z, 1] → logits [batch, x, y, z, 3], a stage's
level activations [batch, x, y, z, C]); inside they run NCDHW, the layout ONNX
convolutions use. Batch and spatial sizes are dynamic, so one graph serves whole
volumes and every window of its shape (even sizes where a graph pools). Weights
and activations are float32 whatever `model.dtype` says: a bfloat16 model runs in
float32 here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from flax import nnx
from onnx import TensorProto, helper, numpy_helper

from ctseg.labels import NUM_CLASSES
from ctseg.model import unet
from ctseg.model.unet import BOTTOM, DOWN, UP

INPUT, OUTPUT = "image", "logits"
# A stage's inputs (its level's activations; the level below's output for an up stage)
# and its output; level-0 stages take the image and the last one returns the logits.
STAGE_INPUT, STAGE_BELOW, STAGE_OUTPUT = "input", "below", "output"
# Opset 17 and IR version 8 load in every onnxruntime the `onnx` extra allows (≥ 1.18).
_OPSET, _IR_VERSION = 17, 8


class _GraphBuilder:
    """Nodes and weights of a graph under construction; every value gets a fresh name."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.weights: list[onnx.TensorProto] = []
        self._count = 0

    def _name(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}_{self._count}"

    def weight(self, array: np.ndarray) -> str:
        name = self._name("w")
        self.weights.append(numpy_helper.from_array(np.asarray(array, np.float32), name))
        return name

    def node(self, op: str, inputs: list[str], **attributes: Any) -> str:
        output = self._name(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [output], **attributes))
        return output

    def channels_first(self, name: str) -> str:
        """The graph input `name` [b, x, y, z, c] as [b, c, x, y, z]."""
        return self.node("Transpose", [name], perm=[0, 4, 1, 2, 3])

    def model(
        self, name: str, x: str, inputs: dict[str, int], output: tuple[str, int]
    ) -> onnx.ModelProto:
        """The graph with channels-last `inputs` {name: channels} and `output` from NCDHW `x`."""
        out_name, out_channels = output
        self.nodes.append(helper.make_node("Transpose", [x], [out_name], perm=[0, 2, 3, 4, 1]))
        spatial = ["batch", "x", "y", "z"]
        graph = helper.make_graph(
            self.nodes,
            name,
            [
                helper.make_tensor_value_info(n, TensorProto.FLOAT, [*spatial, c])
                for n, c in inputs.items()
            ],
            [helper.make_tensor_value_info(out_name, TensorProto.FLOAT, [*spatial, out_channels])],
            initializer=self.weights,
        )
        proto = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", _OPSET)], producer_name="ctseg"
        )
        proto.ir_version = _IR_VERSION
        return proto


def _conv_block(g: _GraphBuilder, block: unet.ConvBlock, x: str) -> str:
    """conv → batch norm → ReLU, with the running-statistics batch norm folded into the conv."""
    norm = block.norm
    # Fold in float64: the float32 weights then differ from W·scale by one rounding only.
    scale = np.asarray(norm.scale[...], np.float64) / np.sqrt(
        np.asarray(norm.var[...], np.float64) + norm.epsilon
    )
    shift = np.asarray(norm.bias[...], np.float64) - np.asarray(norm.mean[...], np.float64) * scale
    kernel = np.asarray(block.conv.kernel[...], np.float64)  # [kx, ky, kz, cin, cout]
    weight = (kernel * scale).transpose(4, 3, 0, 1, 2)  # [cout, cin, kx, ky, kz]
    k = kernel.shape[0]
    h = block.halo
    y = g.node("Conv", [x, g.weight(weight), g.weight(shift)], kernel_shape=[k] * 3, pads=[h] * 6)
    return g.node("Relu", [y])


def _level(g: _GraphBuilder, level: unet.Level, x: str) -> str:
    return _conv_block(g, level.second, _conv_block(g, level.first, x))


def _up_conv(g: _GraphBuilder, up: unet.UpConv, x: str) -> str:
    # UpConv: y[2x+i, 2y+j, 2z+k, d] = Σ_c x[c]·K[c, i, j, k, d] + b[d], which is a
    # stride-2 ConvTranspose with weight [cin, cout, i, j, k] and no overlap.
    kernel = np.asarray(up.kernel[...]).transpose(0, 4, 1, 2, 3)
    weights = [g.weight(kernel), g.weight(np.asarray(up.bias[...]))]
    return g.node("ConvTranspose", [x, *weights], kernel_shape=[2, 2, 2], strides=[2, 2, 2])


def _pool(g: _GraphBuilder, x: str) -> str:
    return g.node("MaxPool", [x], kernel_shape=[2, 2, 2], strides=[2, 2, 2])


def _decode(g: _GraphBuilder, model: unet.UNet, level: int, skip: str, below: str) -> str:
    """`UNet.decode`: up-convolution of `below`, concatenated after `skip`, the level's convs."""
    up = _up_conv(g, model.up_convs[level], below)
    return _level(g, model.up[level], g.node("Concat", [skip, up], axis=1))


def _head(g: _GraphBuilder, head: nnx.Linear, x: str) -> str:
    kernel = np.asarray(head.kernel[...])  # [cin, classes]
    weight = kernel.T[:, :, None, None, None]  # [classes, cin, 1, 1, 1]
    return g.node("Conv", [x, g.weight(weight), g.weight(np.asarray(head.bias[...]))])


def export(graphdef: nnx.GraphDef, params: nnx.State, stats: nnx.State) -> onnx.ModelProto:
    """The inference-mode network (`unet.apply(..., train=False)`) as an ONNX model."""
    model = nnx.merge(graphdef, params, stats)
    g = _GraphBuilder()
    h = g.channels_first(INPUT)
    skips = []
    for level in range(model.cfg.depth):
        if level > 0:
            h = _pool(g, h)
        h = _level(g, model.down[level], h)
        skips.append(h)
    for level in reversed(range(model.cfg.depth - 1)):
        h = _decode(g, model, level, skips[level], h)
    return g.model("ctseg_unet", _head(g, model.head, h), {INPUT: 1}, (OUTPUT, NUM_CLASSES))


def export_stage(
    graphdef: nnx.GraphDef, params: nnx.State, stats: nnx.State, kind: str, level: int
) -> onnx.ModelProto:
    """One stage of level-wise tiled inference as an ONNX model (`unet.UNet.stage`).

    `kind` DOWN: max_pool(encoder `level` of STAGE_INPUT); BOTTOM: encoder `level`;
    UP: decoder `level` of (encoder `level` of STAGE_INPUT, STAGE_BELOW). The stage
    that returns level 0's decoder output (UP 0, or BOTTOM 0 of a depth-1 net) ends
    with the head: logits.
    """
    model = nnx.merge(graphdef, params, stats)
    depth = model.cfg.depth
    if kind not in (DOWN, BOTTOM, UP) or not 0 <= level < depth:
        raise ValueError(f"no stage {kind!r} at level {level} in a depth-{depth} U-Net")
    if (kind == BOTTOM) != (level == depth - 1):
        raise ValueError(f"the bottom stage is level {depth - 1}, not a {kind} stage at {level}")
    widths = unet.level_widths(model.cfg)
    g = _GraphBuilder()
    inputs = {STAGE_INPUT: 1 if level == 0 else widths[level - 1]}
    h = _level(g, model.down[level], g.channels_first(STAGE_INPUT))
    channels = widths[level]
    if kind == DOWN:
        h = _pool(g, h)
    elif kind == UP:
        inputs[STAGE_BELOW] = widths[level + 1]
        h = _decode(g, model, level, h, g.channels_first(STAGE_BELOW))
    if kind != DOWN and level == 0:
        h, channels = _head(g, model.head, h), NUM_CLASSES
    return g.model(f"ctseg_unet_{kind}{level}", h, inputs, (STAGE_OUTPUT, channels))
