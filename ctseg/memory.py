"""The host's memory: what is available, buffers JAX on the CPU takes without a copy, what
running out of memory raises, and byte counts as people read them (one formatter for every
command)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

# XLA:CPU adopts a host buffer that starts on a multiple of these bytes without a copy.
XLA_ALIGNMENT = 64


def host_memory() -> int:
    """Bytes of the host's RAM available to new allocations."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def aligned_zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Zeros on an `XLA_ALIGNMENT` boundary, so that `jax.device_put` to the CPU adopts them
    without a copy (a box's logits are gigabytes, a copy of them a measured wait:
    docs/experiments/design-figures.md#aligned-arrays)."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.zeros(size + XLA_ALIGNMENT, np.uint8)  # calloc: untouched pages take no memory
    start = -raw.ctypes.data % XLA_ALIGNMENT
    return raw[start : start + size].view(dtype).reshape(shape)


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` says memory ran out: the host's (`MemoryError`), or a device's as XLA
    reports it (status RESOURCE_EXHAUSTED; the host CPU's too). Every backend runs XLA
    programs beside its network (to the grid, the class probabilities, the way back), so
    this is one test for all of them."""
    return isinstance(exc, MemoryError) or "RESOURCE_EXHAUSTED" in str(exc)


def human_bytes(count: float) -> str:
    """Binary units, the largest that keeps the number ≥ 1: `512 B`, `3.4 MiB`, `48.0 GiB`."""
    unit = "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if count < 1024:
            break
        count, unit = count / 1024, bigger
    return f"{count:.0f} B" if unit == "B" else f"{count:.1f} {unit}"
