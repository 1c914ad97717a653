"""The inference-mode U-Net as an ONNX graph, for ONNX Runtime on CPUs.

XLA:CPU runs 3-D convolutions 4–10× slower than oneDNN-class kernels (README,
Troubleshooting: CPU speed); ONNX Runtime's CPU kernels close most of that gap.
The graph is small enough to write with `onnx.helper`: per level two (conv with
batch norm folded in → ReLU), 2×2×2 max-pool down, the 2×2×2 stride-2
up-convolution as a ConvTranspose, skip concatenation, the 1×1×1 head as a
convolution. Inference-mode batch norm is an affine map per channel, so folding
it into the preceding bias-free convolution is exact up to float32 rounding.

The graph takes and returns the JAX layout, image [batch, x, y, z, 1] and
logits [batch, x, y, z, 3]; inside it runs NCDHW, the layout ONNX convolutions
use. Batch and spatial sizes are dynamic, so one model serves whole volumes and
every tile window (sizes must respect the alignment, as in JAX). Weights are
float32 whatever `model.dtype` says: a bfloat16 model runs in float32 here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from flax import nnx
from onnx import TensorProto, helper, numpy_helper

from ctseg import unet

INPUT, OUTPUT = "image", "logits"
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


def _head(g: _GraphBuilder, head: nnx.Linear, x: str) -> str:
    kernel = np.asarray(head.kernel[...])  # [cin, classes]
    weight = kernel.T[:, :, None, None, None]  # [classes, cin, 1, 1, 1]
    return g.node("Conv", [x, g.weight(weight), g.weight(np.asarray(head.bias[...]))])


def export(graphdef: nnx.GraphDef, params: nnx.State, stats: nnx.State) -> onnx.ModelProto:
    """The inference-mode network (`unet.apply(..., train=False)`) as an ONNX model."""
    model = nnx.merge(graphdef, params, stats)
    g = _GraphBuilder()
    # [b, x, y, z, 1] → [b, 1, x, y, z]
    h = g.node("Transpose", [INPUT], perm=[0, 4, 1, 2, 3])
    skips = []
    for i, level in enumerate(model.down):
        if i > 0:
            h = g.node("MaxPool", [h], kernel_shape=[2, 2, 2], strides=[2, 2, 2])
        h = _level(g, level, h)
        skips.append(h)
    for i in reversed(range(model.cfg.depth - 1)):
        up = _up_conv(g, model.up_convs[i], h)
        h = _level(g, model.up[i], g.node("Concat", [skips[i], up], axis=1))  # skip first
    logits = _head(g, model.head, h)
    g.nodes.append(helper.make_node("Transpose", [logits], [OUTPUT], perm=[0, 2, 3, 4, 1]))

    spatial = ["batch", "x", "y", "z"]
    graph = helper.make_graph(
        g.nodes,
        "ctseg_unet",
        [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, [*spatial, 1])],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, [*spatial, unet.NUM_CLASSES])],
        initializer=g.weights,
    )
    onnx_model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", _OPSET)], producer_name="ctseg"
    )
    onnx_model.ir_version = _IR_VERSION
    return onnx_model
