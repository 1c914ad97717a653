"""Compiling ctseg's programs for devices that are not here, and reading what XLA says.

Runs in the child process `ctseg.targets.process` starts (its own JAX_PLATFORMS, so that the
compile-only plugins never touch the command's own process), or in a test's. Given a
`Target`, it asks XLA for compile-only devices (`jax.experimental.topologies`), fits the
config's layout to them as `ctseg train` fits it to real ones, compiles the training step
and the whole-volume inference pass (`ctseg.model.plan`), and lets the inference engine
choose its plan there (`ctseg.inference.network.jax.plans.plan_inference`: whole volume or
level-wise tiles, from the same compiled candidates and memory share as on a real device).
Where the training step does not fit, it finds the fewest partitions that fit, and the
largest grid that fits the devices given.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

import jax

from ctseg.config import Config, with_mesh
from ctseg.data.grids import GridSpec, inference_box
from ctseg.errors import CtsegError
from ctseg.inference.network.boxes import BOX_MULTIPLE
from ctseg.inference.network.jax.plans import COMPILED_SHARE, plan_inference
from ctseg.model import aot, plan, unet
from ctseg.parallel.layouts import auto_spatial, fit_training
from ctseg.parallel.partition import make_mesh
from ctseg.run.trained import TrainedModel
from ctseg.targets.catalogue import Target
from ctseg.training.augment import Augmenter

# A typical LiTS scan, for the spacing grid's inference box: 512 × 512 pixels of 0.78 mm,
# 150 slices of 2.5 mm (the challenge's median slice count and a common thickness).
LITS_SCAN = ((512, 512, 150), (0.78, 0.78, 2.5))
# The largest scan a LiTS-like training set holds, for the augmentation's blocks on the
# spacing grid (mm along x, y, z): a 500 mm field of view, 800 mm from chest to pelvis.
LARGEST_SCAN_MM = (500.0, 500.0, 800.0)
# Partition counts tried when the training step does not fit, and grid steps at most.
_MOST_PARTITIONS = 256
_GRID_SEARCH_STEPS = 6


def devices_of(target: Target) -> list[Any]:
    """The compile-only devices of `target`; CtsegError when XLA cannot make them."""
    from jax.experimental import topologies

    if target.platform == "tpu":
        # libtpu takes a machine-wide lock for the TPU it drives; compiling for a TPU that
        # is not here drives none, so another process compiling at once may too.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", target.accelerator_type or "")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    try:
        if target.platform == "cuda":
            topology = topologies.get_topology_desc(
                platform="cuda", target_config=target.gpu_spec, topology=target.topology
            )
        else:
            topology = topologies.get_topology_desc(platform="tpu", topology_name=target.topology)
    except Exception as exc:  # XLA's own errors: a spec it cannot parse, a plugin missing
        words = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise CtsegError(
            f"XLA cannot make compile-only devices for {target.name}: {words}"
        ) from None
    return list(topology.devices)


def per_device_memory(target: Target, devices: list[Any]) -> int:
    """A device's memory: a GPU's, or a TPU chip's shared by the cores JAX shows for it."""
    return target.memory * target.count // len(devices)


def _is_resource_exhausted(exc: BaseException) -> bool:
    return "RESOURCE_EXHAUSTED" in str(exc) or "Ran out of memory" in str(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    for line in text.splitlines():
        if "memory" in line.lower() or "RESOURCE_EXHAUSTED" in line:
            return line.strip()
    return text.splitlines()[0] if text else type(exc).__name__


def training(config: Config, devices: list[Any], memory: int) -> dict[str, Any]:
    """The training step (and the whole-volume pass) of `config`'s layout fitted to
    `devices`: per-device bytes, whether the step fits `memory` × the planners' share."""
    layout = fit_training(config, devices)
    fitted = layout.config
    entry: dict[str, Any] = {
        "spatial": list(fitted.mesh.spatial),
        "data": fitted.mesh.data,
        "devices": fitted.num_devices,
        "layout": layout.line,
    }
    try:
        plans = plan.plan_layout(fitted, devices=layout.devices)
    except Exception as exc:
        if not _is_resource_exhausted(exc):
            raise
        entry.update(train_bytes=None, fits=False, compiler=_first_line(exc))
        return entry
    train, whole = plans
    entry.update(
        train_bytes=train.memory.total,
        predict_bytes=whole.memory.total,
        halo_bytes=train.halo_bytes,
        flops=train.flops,
        fits=train.memory.total <= COMPILED_SHARE * memory,
    )
    entry["train_compile_seconds"] = round(train.compile_seconds, 2)
    if fitted.augment.on_device:
        # The batch is augmented by a program of its own before the step: its blocks
        # must fit beside nothing but the model's state.
        mesh = make_mesh(fitted.mesh.spatial, fitted.mesh.data, layout.devices)
        began = time.perf_counter()
        augmenter = Augmenter(fitted, mesh, fitted.data.resolution, largest_grid(fitted))
        needed = aot.memory_of(augmenter.compiled).total
        entry.update(
            augment_bytes=needed,
            augment_block=list(augmenter.block or augmenter.slab),
            augment_compile_seconds=round(time.perf_counter() - began, 2),
        )
        entry["fits"] = entry["fits"] and needed <= COMPILED_SHARE * memory
    return entry


def _fits(config: Config, devices: list[Any], memory: int) -> bool:
    return bool(training(config, devices, memory)["fits"])


def fewest_partitions(config: Config, target: Target, tried: int) -> dict[str, Any] | None:
    """The smallest spatial split of the config's grid, above the `tried` partitions, whose
    training step fits on that many devices of the target's kind (a standard slice for
    TPUs); None if none up to `_MOST_PARTITIONS` does."""
    count = 2 * tried
    while count <= _MOST_PARTITIONS:
        more = target.with_count(count)
        spatial = auto_spatial(count)
        split = _with_mesh_or_none(config, spatial)
        if more is not None and split is not None:
            devices = devices_of(more)
            result = training(split, devices, per_device_memory(more, devices))
            if result["fits"]:
                return {"target": more.name, "devices": more.count, **result}
        count *= 2
    return None


def largest_grid(config: Config) -> tuple[int, int, int]:
    """The largest grid a run of `config` reads: the cube, or on the spacing grid the
    largest LiTS-like scan (`LARGEST_SCAN_MM`) at the config's spacing."""
    if config.data.grid == "cube":
        return (config.data.resolution,) * 3
    return tuple(
        math.ceil(mm / s) for mm, s in zip(LARGEST_SCAN_MM, config.data.spacing, strict=True)
    )


def largest_resolution(config: Config, devices: list[Any], memory: int) -> int | None:
    """The largest data.resolution (a multiple of what the layout needs) whose training step
    fits `devices`, searched below the config's; None if not even the smallest does."""
    layout = fit_training(config, devices).config
    step = layout.alignment * max(layout.mesh.spatial)
    low, high = 1, config.data.resolution // step - 1  # multiples of `step` to try
    best = None
    for _ in range(_GRID_SEARCH_STEPS):
        if low > high:
            break
        middle = (low + high) // 2
        smaller = dataclasses.replace(
            config, data=dataclasses.replace(config.data, resolution=middle * step)
        )
        if _fits(smaller, devices, memory):
            best, low = middle * step, middle + 1
        else:
            high = middle - 1
    return best


def _with_mesh_or_none(config: Config, spatial: tuple[int, int, int]) -> Config | None:
    try:
        return with_mesh(config, spatial)
    except CtsegError:
        return None


def inference_shape(config: Config) -> tuple[int, int, int]:
    """The box `ctseg predict` runs on: the cube's grid, or on the spacing grid the whole
    extent of a typical LiTS scan (`LITS_SCAN`), padded as `ctseg.inference.network.boxes`
    pads it."""
    grid = GridSpec.of(config.data)
    if grid.kind == "cube":
        return (config.data.resolution,) * 3
    shape, spacing = LITS_SCAN
    return inference_box(grid.grid_of(shape, spacing), max(config.alignment, BOX_MULTIPLE))


def inference(config: Config, devices: list[Any], memory: int) -> dict[str, Any]:
    """The plan `ctseg predict` would choose on `devices` (each with `memory` bytes free), for
    the box of `inference_shape`, chosen by the engine's own planner."""
    graphdef, params, stats = unet.abstract(config.model)
    model = TrainedModel(config, graphdef, params, stats, step=0)
    shape = inference_shape(config)
    entry: dict[str, Any] = {"box": list(shape)}
    try:
        chosen = plan_inference(model, shape, None, devices, memory)
    except Exception as exc:
        if not (_is_resource_exhausted(exc) or isinstance(exc, CtsegError)):
            raise
        entry.update(plan=None, bytes=None, fits=False, compiler=_first_line(exc))
        return entry
    if chosen.stages:
        largest = max(stage.largest_core for stage in chosen.stages)
        words = f"level-wise tiles ≤ {largest}³ ({len(chosen.stages)} stages)"
    else:
        words = f"whole volume, split {list(chosen.spatial)}"
    entry.update(
        plan=words,
        bytes=chosen.needed,
        fits=chosen.needed <= COMPILED_SHARE * memory,
        levels_on_host=chosen.spill,
    )
    return entry


def plan_target(config: Config, target: Target, search: bool = True) -> dict[str, Any]:
    """Everything `ctseg plan --target` reports for `config` on `target`."""
    devices = devices_of(target)
    memory = per_device_memory(target, devices)
    result: dict[str, Any] = {
        "target": target.name,
        "device": target.device,
        "count": target.count,
        "devices": len(devices),
        "memory_per_device": memory,
        "share": COMPILED_SHARE,
        "jax": jax.__version__,
        "train": training(config, devices, memory),
        "predict": inference(config, devices, memory),
    }
    if search and not result["train"]["fits"]:
        tried = result["train"]["devices"]
        result["fewest_partitions"] = fewest_partitions(config, target, tried)
        result["largest_resolution"] = largest_resolution(config, devices, memory)
    return result
