"""The levels of level-wise tiles on JAX devices, shared by the stage programs
(`ctseg.inference.network.jax.plans`) and fixed windows
(`ctseg.inference.network.jax.windows`): each
stage's input and output level's shape and bytes, a window cut out of them and the voxels
its core owns, and the bytes a plan needs beside its programs."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ctseg.config import Config
from ctseg.data.grids import Shape
from ctseg.inference.network.tiling import Stage
from ctseg.labels import NUM_CLASSES
from ctseg.model import aot, unet
from ctseg.model.unet import DOWN, UP


def output_level(config: Config, stage: Stage) -> tuple[tuple[int, ...], Any]:
    """Shape [1, x, y, z, C] and dtype of a stage's output level."""
    if stage.kind != DOWN and stage.level == 0:
        return (1, *stage.out_size, NUM_CLASSES), jnp.float32
    width = unet.level_widths(config.model)[stage.level]
    return (1, *stage.out_size, width), jnp.dtype(config.model.dtype)


def input_level(config: Config, stage: Stage) -> tuple[tuple[int, ...], Any]:
    """Shape [1, x, y, z, C] and dtype of a stage's input level (the image at level 0)."""
    if stage.level == 0:
        return (1, *stage.size, 1), jnp.float32
    width = unet.level_widths(config.model)[stage.level - 1]
    return (1, *stage.size, width), jnp.dtype(config.model.dtype)


def below_level(config: Config, stage: Stage) -> tuple[tuple[int, ...], Any]:
    """Shape and dtype of an up stage's second input, d_{level+1}, from the stage below."""
    width = unet.level_widths(config.model)[stage.level + 1]
    below = tuple(n // 2 for n in stage.size)
    return (1, *below, width), jnp.dtype(config.model.dtype)


def owned(row: jax.Array, block: Shape) -> jax.Array:
    """The voxels of a window's output block (at the row's `kept` start) that its core owns,
    between the row's `first` and `stop`: [x, y, z] bool."""
    kept, first, stop = row[1], row[2], row[3]
    owned = [
        (kept[a] + jnp.arange(side) >= first[a]) & (kept[a] + jnp.arange(side) < stop[a])
        for a, side in enumerate(block)
    ]
    return owned[0][:, None, None] & owned[1][None, :, None] & owned[2][None, None, :]


def level_bytes(shape: tuple[int, ...], dtype: Any) -> int:
    return int(np.prod(shape)) * jnp.dtype(dtype).itemsize


def post_bytes(shape: Shape) -> int:
    """Device bytes after the network: the probabilities and a TTA sum of them (float32)."""
    return 2 * math.prod(shape) * NUM_CLASSES * 4


def stage_needs(config: Config, stages: list[Stage], programs: list, spill: bool) -> list[int]:
    """Peak bytes per device during each stage: its program (its input and output levels
    included) plus the other levels alive then (none on the device when `spill`)."""
    waiting: list[int] = []  # bytes of the levels kept for the up stages, a_0 … a_l
    post = post_bytes(stages[0].size)  # the first stage runs on the whole grid
    needs = []
    for stage, program in zip(stages, programs, strict=True):
        if stage.kind == UP:
            waiting.pop()  # the level this stage reads is its argument now
        others = 0 if spill else sum(waiting)
        needs.append(aot.memory_of(program).total + others + post)
        if stage.kind == DOWN:  # its input level waits for the up stage of its level
            waiting.append(level_bytes(*input_level(config, stage)))
    return needs


def cut(levels: list[jax.Array], row: jax.Array, extent: Shape) -> list[jax.Array]:
    """A window of `extent` voxels of the input level at the row's start, and for an up
    stage the window of d_{l+1} under it, halved."""
    start = row[0]
    windows = [jax.lax.dynamic_slice(levels[0], (0, *start, 0), (1, *extent, levels[0].shape[-1]))]
    if len(levels) == 2:
        half = (1, *(n // 2 for n in extent), levels[1].shape[-1])
        windows.append(jax.lax.dynamic_slice(levels[1], (0, *(start // 2), 0), half))
    return windows


@jax.jit
def as_batch(image: jax.Array) -> jax.Array:
    return jnp.asarray(image, jnp.float32)[None, ..., None]


@jax.jit
def only_item(batch: jax.Array) -> jax.Array:
    # Jitted: an eager index of a sharded array would send the index from the host.
    return batch[0]
