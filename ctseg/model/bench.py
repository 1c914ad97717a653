"""Timing the training step on one global grid over several layouts and partitioners.

Every layout sees the same global grid, batch and model; only the spatial
split and the partitioner change. Each result is the median of several
steps after a warm-up step, with compilation excluded, and is also given as
throughput: voxels per second and achieved FLOP/s (XLA's count of the compiled
step over its time), which `measure_peak` puts against what the chip reaches on
a large dense matrix product.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ctseg.config import Config, with_mesh
from ctseg.errors import CtsegError, OptionError
from ctseg.model import aot, step
from ctseg.parallel.partition import (
    ACTIVATION_SPEC,
    REPLICATED,
    make_global_array,
    make_mesh,
)
from ctseg.progress import Progress


@dataclass(frozen=True)
class BenchResult:
    partitions: int
    partitioner: str
    spatial: tuple[int, int, int]
    devices: int
    step_seconds: float
    per_device_bytes: int
    voxels_per_step: int  # global grid voxels × batch
    flops_per_step: float | None  # the whole step, all devices; None: not counted

    @property
    def voxels_per_second(self) -> float:
        return self.voxels_per_step / self.step_seconds

    @property
    def flops_per_second(self) -> float | None:
        return None if self.flops_per_step is None else self.flops_per_step / self.step_seconds

    def to_json(self) -> dict[str, Any]:
        return {
            "partitions": self.partitions,
            "partitioner": self.partitioner,
            "spatial": list(self.spatial),
            "step_seconds": self.step_seconds,
            "per_device_bytes": self.per_device_bytes,
            "voxels_per_second": self.voxels_per_second,
            "flops_per_step": self.flops_per_step,
            "tflops_per_second": _tera(self.flops_per_second),
        }


def _tera(flops: float | None) -> float | None:
    return None if flops is None else flops / 1e12


@dataclass(frozen=True)
class Peak:
    """Measured dense matrix-product throughput of one device, the yardstick for a step's FLOP/s."""

    platform: str
    dtype: str
    size: int
    flops_per_second: float
    processes: int

    def utilisation(self, result: BenchResult) -> float | None:
        """The step's FLOP/s as a share of the peak of the hardware it ran on.

        Simulated CPU devices share their host's cores, so a CPU layout has one
        host's peak per process however many devices it uses; accelerators
        each bring their own.
        """
        units = self.processes if self.platform == "cpu" else result.devices
        if result.flops_per_second is None:
            return None
        return result.flops_per_second / (self.flops_per_second * units)

    def to_json(self) -> dict[str, Any]:
        return {
            "platform": self.platform,
            "dtype": self.dtype,
            "size": self.size,
            "tflops_per_second": self.flops_per_second / 1e12,
        }


def layout_config(config: Config, spatial: tuple[int, int, int], partitioner: str) -> Config:
    """`config` split as `spatial`; CtsegError if the split does not divide every level."""
    try:
        return with_mesh(config, spatial, partitioner=partitioner)
    except CtsegError as exc:
        raise CtsegError(f"{math.prod(spatial)} partitions split {list(spatial)}: {exc}") from None


def random_batch(config: Config, mesh: Mesh, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """A random image in [-1, 1] and random labels; each process makes only its own blocks."""
    image_shape = aot.global_image_shape(config)

    def block_rng(index: tuple[slice, ...]) -> np.random.Generator:
        # Seeded by the block's position, so the batch does not depend on the layout.
        return np.random.default_rng([seed, *(s.start or 0 for s in index)])

    def image_block(index: tuple[slice, ...]) -> np.ndarray:
        shape = [len(range(*s.indices(n))) for s, n in zip(index, image_shape, strict=True)]
        return block_rng(index).uniform(-1, 1, shape)

    def label_block(index: tuple[slice, ...]) -> np.ndarray:
        # A label block's index has no channel axis: the image shape's last entry goes unused.
        shape = [len(range(*s.indices(n))) for s, n in zip(index, image_shape, strict=False)]
        return block_rng(index).integers(0, 3, shape)

    image = make_global_array(mesh, image_shape, np.float32, image_block, ACTIVATION_SPEC)
    label = make_global_array(mesh, image_shape[:-1], aot.LABEL_DTYPE, label_block, step.LABEL_SPEC)
    return image, label


def time_layout(config: Config, steps: int, devices: Sequence[Any] | None = None) -> BenchResult:
    """Median seconds of `steps` training steps after compilation and one warm-up step, on
    the first of `devices` (default: JAX's default devices) the layout needs."""
    mesh = make_mesh(config.mesh.spatial, config.mesh.data, devices)
    graphdef, state = step.init_state(config)
    state = jax.device_put(state, NamedSharding(mesh, REPLICATED))
    image, label = random_batch(config, mesh, config.train.seed)
    lowered = aot.lower_train_step(graphdef, config, mesh, state, image, label)
    compiled = lowered.compile()
    state, metrics = compiled(state, image, label)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = compiled(state, image, label)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    return BenchResult(
        partitions=config.num_partitions,
        partitioner=config.mesh.partitioner,
        spatial=config.mesh.spatial,
        devices=mesh.size,
        step_seconds=statistics.median(times),
        per_device_bytes=aot.memory_of(compiled).total,
        voxels_per_step=math.prod(image.shape),
        flops_per_step=aot.flops_of(lowered, compiled, mesh),
    )


# Matrix side that keeps a device busy: GPUs and TPUs need large products to reach
# their peak; a CPU gets there sooner and would take minutes on an 8192² product.
_PEAK_SIZE = {"cpu": 2048}
_DEFAULT_PEAK_SIZE = 8192


def measure_peak(
    dtype: str, size: int | None = None, repeats: int = 5, devices: Sequence[Any] | None = None
) -> Peak:
    """Best FLOP/s of a `size`² × `size`² product in `dtype` on this process's first device
    of `devices` (default: of JAX's default devices)."""
    # Every process of a multi-host bench measures its own.
    here = jax.process_index()
    local = jax.local_devices() if devices is None else devices
    device = next(d for d in local if d.process_index == here)
    n = size or _PEAK_SIZE.get(device.platform, _DEFAULT_PEAK_SIZE)
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    product = jax.jit(jnp.matmul)
    jax.block_until_ready(product(a, a))  # compile and warm up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(product(a, a))
        best = min(best, time.perf_counter() - start)
    return Peak(device.platform, str(jnp.dtype(dtype)), n, 2 * n**3 / best, jax.process_count())


def bench(
    config: Config,
    splits: Sequence[tuple[int, int, int]],
    partitioners: Sequence[str],
    steps: int,
    progress: Progress | None = None,
    devices: Sequence[Any] | None = None,
) -> list[BenchResult]:
    """Time every (partitioner, spatial split) pair on `config`'s grid, on `devices` (the
    command's, `ctseg.parallel.devices.ChosenDevices`; default: JAX's default devices).

    `splits` come from `ctseg.parallel.layouts.auto_spatial` for plain partition counts.
    """
    if steps < 1:
        raise OptionError(f"`steps` must be at least 1, got {steps}")
    # Check every layout before spending minutes on the first.
    layouts = [layout_config(config, s, p) for p in partitioners for s in splits]
    results = []
    for done, layout in enumerate(layouts):
        if progress is not None:
            label = f"{layout.mesh.partitioner}, {layout.num_partitions} partition(s)"
            progress(done, len(layouts), label)
        results.append(time_layout(layout, steps, devices))
    if progress is not None:
        progress(len(layouts), len(layouts), "done")
    return results


def ratio_to_one_partition(results: Sequence[BenchResult], result: BenchResult) -> float | None:
    """Step time relative to the 1-partition run of the same partitioner, if there is one."""
    for base in results:
        if base.partitioner == result.partitioner and base.partitions == 1:
            return result.step_seconds / base.step_seconds
    return None
