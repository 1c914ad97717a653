"""What a layout costs before anything runs (`ctseg plan`): compiled ahead, and accounted.

`plan` compiles — never runs — the jitted training step and the
inference pass for the config's mesh and for the unpartitioned mesh with the
same partitioner. Inputs are `jax.ShapeDtypeStruct`s carrying their
shardings and the state comes from `jax.eval_shape`, so a 512³ plan
allocates nothing 512³-sized. Per-device memory and FLOPs come from XLA's
analysis of the compiled program; halo traffic is counted from the model's
structure (`halo_bytes`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from ctseg.config import Config, with_mesh
from ctseg.model import aot
from ctseg.model.unet import level_widths
from ctseg.parallel.partition import (
    local_block_shape,
    make_mesh,
)
from ctseg.progress import Status

MODES = ("train", "predict")


@dataclass(frozen=True)
class LayoutPlan:
    partitions: int
    partitioner: str
    mode: str  # "train" or "predict"
    spatial: tuple[int, int, int]
    local_shape: tuple[int, ...]
    memory: aot.Memory
    halo_bytes: int
    flops: float | None  # whole step, summed over all devices; None: not counted
    compile_seconds: float  # lowering and compiling, on this machine's CPU

    def to_json(self) -> dict[str, Any]:
        return {
            "partitions": self.partitions,
            "partitioner": self.partitioner,
            "mode": self.mode,
            "spatial": list(self.spatial),
            "local_shape": list(self.local_shape),
            "per_device_bytes": self.memory.total,
            "argument_bytes": self.memory.arguments,
            "output_bytes": self.memory.outputs,
            "temp_bytes": self.memory.temporaries,
            "halo_bytes": self.halo_bytes,
            "flops": self.flops,
            "compile_seconds": round(self.compile_seconds, 2),
        }


# --------------------------------------------------------------------------- layouts


# --------------------------------------------------------------------------- accounting


def _conv_input_channels(config: Config) -> list[tuple[int, int]]:
    """(level, input channels) of every k×k×k convolution of the U-Net, in order."""
    widths = level_widths(config.model)
    convs = []
    for level, width in enumerate(widths):
        convs += [(level, 1 if level == 0 else widths[level - 1]), (level, width)]
    for level in range(config.model.depth - 1):
        convs += [(level, 2 * widths[level]), (level, widths[level])]  # after the skip concat
    return convs


def _exchange_bytes(
    block: tuple[int, int, int], spatial: tuple[int, int, int], width: int, voxel_bytes: int
) -> int:
    """Bytes one interior partition sends to pad `block` by `width` (as `Comm.pad` does).

    Axes are padded in order x, y, z, each on the block already extended
    along the previous ones (that is how corners arrive without diagonal
    messages), so later faces are larger. Only partitioned axes send.
    """
    extent = list(block)
    sent = 0
    for axis, parts in enumerate(spatial):
        face = math.prod(extent[:axis] + extent[axis + 1 :])
        if parts > 1:
            sent += 2 * width * face * voxel_bytes  # two faces, `width` slices each
        extent[axis] += 2 * width
    return sent


def halo_bytes(config: Config, mode: str) -> int:
    """Halo bytes one interior partition sends per step (edge partitions send less).

    For every convolution at level l, on the local block (global side /
    partitions / 2^l per axis, local batch b): for each partitioned axis,
    2 faces × k//2 slices × face area × b × input channels × bytes of the
    compute dtype. Training exchanges again in the backward pass (the
    transpose of each exchange has the same size) and once more in the
    recomputed forward pass under `model.remat`; inference is forward only.
    Under `gspmd` this is what the model needs, not a measurement of what XLA
    sends.
    """
    spatial = config.mesh.spatial
    if math.prod(spatial) == 1:
        return 0
    local = local_block_shape(aot.global_image_shape(config), _mesh_shape(config))
    batch, base_block = local[0], local[1:4]
    width = config.model.kernel_size // 2
    dtype_bytes = jnp.dtype(config.model.dtype).itemsize
    forward = 0
    for level, channels in _conv_input_channels(config):
        block = tuple(side // 2**level for side in base_block)
        forward += _exchange_bytes(block, spatial, width, batch * channels * dtype_bytes)
    if mode == "predict":
        return forward
    return forward * (3 if config.model.remat else 2)


def _mesh_shape(config: Config) -> dict[str, int]:
    x, y, z = config.mesh.spatial
    return {"data": config.mesh.data, "x": x, "y": y, "z": z}


# --------------------------------------------------------------------------- the plan


def plan_layout(
    config: Config,
    progress: Status | None = None,
    devices: Sequence[Any] | None = None,
) -> list[LayoutPlan]:
    """Compile the training step and the inference pass for `config`'s layout on `devices`
    (default: JAX's default devices); account both."""
    mesh = make_mesh(config.mesh.spatial, config.mesh.data, devices)
    graphdef, state = aot.replicated_abstract_state(config, mesh)
    image, label = aot.abstract_batch(config, mesh)
    lowerers = {
        "train": lambda: aot.lower_train_step(graphdef, config, mesh, state, image, label),
        "predict": lambda: aot.lower_predict(graphdef, config, mesh, state, image),
    }
    plans = []
    for mode in MODES:
        if progress is not None:
            progress(f"compiling {mode}, {config.num_partitions} partition(s)")
        began = time.perf_counter()
        lowered = lowerers[mode]()
        compiled = lowered.compile()
        seconds = time.perf_counter() - began
        plans.append(
            LayoutPlan(
                partitions=config.num_partitions,
                partitioner=config.mesh.partitioner,
                mode=mode,
                spatial=config.mesh.spatial,
                local_shape=local_block_shape(aot.global_image_shape(config), mesh.shape),
                memory=aot.memory_of(compiled),
                halo_bytes=halo_bytes(config, mode),
                flops=aot.flops_of(lowered, compiled, mesh),
                compile_seconds=seconds,
            )
        )
    return plans


def plan(
    config: Config,
    progress: Status | None = None,
    devices: Sequence[Any] | None = None,
) -> list[LayoutPlan]:
    """The config's layout, then the unpartitioned one with the same partitioner."""
    plans = plan_layout(config, progress, devices)
    if config.num_partitions > 1:
        whole = with_mesh(config, (1, 1, 1))
        plans += plan_layout(whole, progress, devices)
    return plans
