"""The 3D U-Net, written once and partition-aware through a `Comm`.

Architecture of Google's Mesh-TensorFlow and TPU unet3d reference models:
`depth` levels, `base_filters` doubling per level, two (conv → batch norm →
ReLU) per level, 2×2×2 max-pool down, 2×2×2 stride-2 transposed convolution
up, skip concatenation, a 1×1×1 head to 3 classes.

Every convolution pads through `comm.pad` (a halo exchange where the volume is
split, zeros elsewhere) and then runs VALID, so the same module computes the
same function on one device, under explicit halo exchange, and under GSPMD.
Pooling and the up-convolution are local because every local block has even
size at every level (the config checks the alignment).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ctseg.config import ModelConfig
from ctseg.labels import NUM_CLASSES
from ctseg.model.image_conv import image_conv
from ctseg.parallel.partition import Comm
from ctseg.parallel.xla_options import compile_unoptimised

# The stages of level-wise tiled inference (`ctseg.inference`): an encoder level with its
# pooling, the bottom level, a decoder level.
DOWN, BOTTOM, UP = "down", "bottom", "up"


class BatchNorm(nnx.Module):
    """Batch normalisation whose statistics cover the whole batch and volume.

    In training the mean and variance are summed over every partition and
    data replica (`comm.sum`), never averaged per partition, so a partitioned
    step equals the unpartitioned one. At inference the running averages make
    the layer a per-voxel affine map, so the network is local and tiles stitch
    exactly. Statistics are float32 whatever the compute dtype.
    """

    def __init__(self, features: int, momentum: float, epsilon: float):
        self.scale = nnx.Param(jnp.ones((features,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((features,), jnp.float32))
        self.mean = nnx.BatchStat(jnp.zeros((features,), jnp.float32))
        self.var = nnx.BatchStat(jnp.ones((features,), jnp.float32))
        self.momentum = momentum
        self.epsilon = epsilon

    def __call__(self, x: jax.Array, comm: Comm, train: bool) -> jax.Array:
        xf = x.astype(jnp.float32)
        if train:
            axes = (0, 1, 2, 3)
            n = comm.count(x.shape[0] * x.shape[1] * x.shape[2] * x.shape[3])
            mean = comm.sum(xf, axes) / n
            # Two passes (not E[x²] − E[x]²): no cancellation at large volumes.
            var = comm.sum(jnp.square(xf - mean), axes) / n
            m = self.momentum
            # Rebound, never written in place: a caller's host (numpy) statistics would
            # change under it in an eager call.
            self.mean.set_value(m * self.mean[...] + (1 - m) * jax.lax.stop_gradient(mean))
            self.var.set_value(m * self.var[...] + (1 - m) * jax.lax.stop_gradient(var))
        else:
            mean, var = self.mean[...], self.var[...]
        inv = jax.lax.rsqrt(var + self.epsilon) * self.scale[...]
        return ((xf - mean) * inv + self.bias[...]).astype(x.dtype)


class ConvBlock(nnx.Module):
    """conv (halo-padded, VALID) → batch norm → ReLU."""

    def __init__(self, cin: int, cout: int, cfg: ModelConfig, rngs: nnx.Rngs):
        k = cfg.kernel_size
        self.conv = nnx.Conv(
            cin,
            cout,
            (k, k, k),
            padding="VALID",
            use_bias=False,  # batch norm's shift makes a bias redundant
            dtype=jnp.dtype(cfg.dtype),
            param_dtype=jnp.float32,
            rngs=rngs,
        )
        self.norm = BatchNorm(cout, cfg.bn_momentum, cfg.bn_epsilon)
        self.halo = k // 2

    def __call__(self, x: jax.Array, comm: Comm, train: bool) -> jax.Array:
        y = self._convolve(comm.pad(x, self.halo))
        return comm.constrain(jax.nn.relu(self.norm(y, comm, train)))

    def _convolve(self, x: jax.Array) -> jax.Array:
        if self.conv.in_features > 1:
            return self.conv(x)
        # The image's one channel: matrix products on GPUs, where cuDNN's gradient of
        # these weights is slow (`image_conv`); the same function, in the same dtype.
        dtype = self.conv.dtype
        return image_conv(x.astype(dtype), self.conv.kernel[...].astype(dtype))


class Level(nnx.Module):
    """The two conv blocks of one U-Net level."""

    def __init__(self, cin: int, cout: int, cfg: ModelConfig, rngs: nnx.Rngs):
        self.first = ConvBlock(cin, cout, cfg, rngs)
        self.second = ConvBlock(cout, cout, cfg, rngs)

    def __call__(self, x: jax.Array, comm: Comm, train: bool) -> jax.Array:
        return self.second(self.first(x, comm, train), comm, train)


class UpConv(nnx.Module):
    """2×2×2 stride-2 transposed convolution: each voxel becomes a 2×2×2 block.

    Written as one matrix product and a reshape: there is no overlap between
    output blocks, so it needs no halo.
    """

    def __init__(self, cin: int, cout: int, dtype: Any, rngs: nnx.Rngs):
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
        self.kernel = nnx.Param(init(rngs.params(), (cin, 2, 2, 2, cout), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((cout,), jnp.float32))
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        b, nx, ny, nz, _ = x.shape
        k = self.kernel[...].astype(self.dtype)
        y = jnp.einsum("bxyzc,cijkd->bxiyjzkd", x.astype(self.dtype), k)
        y = y.reshape(b, 2 * nx, 2 * ny, 2 * nz, k.shape[-1])
        return y + self.bias[...].astype(self.dtype)


def level_widths(cfg: ModelConfig) -> list[int]:
    """Channels of each level, `base_filters` doubling per level."""
    return [cfg.base_filters * 2**level for level in range(cfg.depth)]


def max_pool(x: jax.Array) -> jax.Array:
    b, nx, ny, nz, c = x.shape
    return x.reshape(b, nx // 2, 2, ny // 2, 2, nz // 2, 2, c).max(axis=(2, 4, 6))


class UNet(nnx.Module):
    """``model(x, comm, train) -> logits``; x is [batch, x, y, z, 1] float32 in [-1, 1]."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype = jnp.dtype(cfg.dtype)
        widths = level_widths(cfg)
        self.down = nnx.List(
            [Level(1 if i == 0 else widths[i - 1], w, cfg, rngs) for i, w in enumerate(widths)]
        )
        self.up_convs = nnx.List(
            [UpConv(widths[i + 1], widths[i], dtype, rngs) for i in range(cfg.depth - 1)]
        )
        self.up = nnx.List(
            [Level(2 * widths[i], widths[i], cfg, rngs) for i in range(cfg.depth - 1)]
        )
        self.head = nnx.Linear(
            widths[0], NUM_CLASSES, dtype=dtype, param_dtype=jnp.float32, rngs=rngs
        )

    def _level(self, level: Level, x: jax.Array, comm: Comm, train: bool) -> jax.Array:
        # Inference has no backward pass to recompute for; and the checkpointed form updates
        # the level's state, which a tiled stage's window loop (another trace) must not.
        if not self.cfg.remat or not train:
            return level(x, comm, train)
        # Recompute the level's activations in the backward pass instead of storing
        # them. Done on the pure (graphdef, state) form so that the batch-norm
        # statistics the level updates flow out of the checkpointed function.
        graphdef, state = nnx.split(level)

        @jax.checkpoint
        def run(state: nnx.State, h: jax.Array) -> tuple[jax.Array, nnx.State]:
            inner = nnx.merge(graphdef, state)
            return inner(h, comm, train), nnx.state(inner)

        y, state = run(state, x)
        nnx.update(level, state)
        return y

    # The pieces `__call__` composes; level-wise tiled inference runs them one stage at a
    # time (`stage`).

    def as_input(self, x: jax.Array, comm: Comm) -> jax.Array:
        """The image [b, x, y, z, 1] in the compute dtype, as the first level takes it."""
        return comm.constrain(x.astype(jnp.dtype(self.cfg.dtype)))

    def encode(self, level: int, x: jax.Array, comm: Comm, train: bool) -> jax.Array:
        """Encoder level `level` on `x` at that level's resolution (already pooled)."""
        return self._level(self.down[level], x, comm, train)

    def decode(
        self, level: int, skip: jax.Array, below: jax.Array, comm: Comm, train: bool
    ) -> jax.Array:
        """Decoder level `level`: up-convolve `below`, concatenate after `skip`, two conv blocks."""
        up = comm.constrain(self.up_convs[level](below))
        return self._level(self.up[level], jnp.concatenate([skip, up], axis=-1), comm, train)

    def classify(self, x: jax.Array) -> jax.Array:
        """The 1×1×1 head: float32 logits [b, x, y, z, 3]."""
        return self.head(x).astype(jnp.float32)

    def stage(self, kind: str, level: int, inputs: Sequence[jax.Array], comm: Comm) -> jax.Array:
        """Stage (`kind`, `level`) of the inference-mode network on windows [b, x, y, z, C].

        `inputs`: the level's activations a_level (the image at level 0) and, for an up
        stage, d_{level+1}. An encoder level with its pooling (DOWN), the bottom, or a
        decoder level with its skip's encoder recomputed (UP); the stage that returns
        level 0's decoder output ends with the head.
        """
        x = self.as_input(inputs[0], comm) if level == 0 else inputs[0]
        h = self.encode(level, x, comm, train=False)
        if kind == DOWN:
            return max_pool(h)
        if kind == UP:
            h = self.decode(level, h, inputs[1], comm, train=False)
        return self.classify(h) if level == 0 else h

    def __call__(self, x: jax.Array, comm: Comm, train: bool) -> jax.Array:
        h = self.as_input(x, comm)
        skips = []
        for level in range(self.cfg.depth):
            if level > 0:
                h = max_pool(h)
            h = self.encode(level, h, comm, train)
            skips.append(h)
        for level in reversed(range(self.cfg.depth - 1)):
            h = self.decode(level, skips[level], h, comm, train)
        return self.classify(h)


# --------------------------------------------------------------------------- functional form


def build(cfg: ModelConfig, seed: int) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """A new model split into (graphdef, params, batch_stats), made op by op: to be traced
    into a program (`create`, `ctseg.model.step.init_state`), as each op run alone
    compiles a program of its own."""
    model = UNet(cfg, nnx.Rngs(params=seed))
    graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    return graphdef, params, stats


def create(cfg: ModelConfig, seed: int) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """A new model split into (graphdef, params, batch_stats), its values made by one
    program."""
    graphdef, _, _ = abstract(cfg)
    params, stats = _initial_weights(cfg, seed)()
    return graphdef, params, stats


@functools.cache
def _initial_weights(cfg: ModelConfig, seed: int) -> Any:
    return compile_unoptimised(jax.jit(lambda: build(cfg, seed)[1:]).lower())


def abstract(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, params, batch_stats) of the model with shapes only: nothing is allocated."""
    captured: dict[str, nnx.GraphDef] = {}

    def shapes() -> tuple[nnx.State, nnx.State]:
        # The graphdef is static structure: safe to keep from inside the trace.
        captured["graphdef"], params, stats = build(cfg, seed=0)
        return params, stats

    params, stats = jax.eval_shape(shapes)
    return captured["graphdef"], params, stats


def apply(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    stats: nnx.State,
    x: jax.Array,
    comm: Comm,
    train: bool,
) -> tuple[jax.Array, nnx.State]:
    """Pure forward pass: logits and the updated batch statistics."""
    # copy=True: the module must not share Variables with the caller's states, or
    # a training-mode call would update the caller's batch statistics in place.
    model = nnx.merge(graphdef, params, stats, copy=True)
    logits = model(x, comm, train)
    return logits, nnx.state(model, nnx.BatchStat)


def batch_statistics(
    graphdef: nnx.GraphDef, params: nnx.State, stats: nnx.State, x: jax.Array, comm: Comm
) -> nnx.State:
    """Every batch norm's own mean and variance on the batch `x` (`stats` gives the shapes).

    A training-mode forward pass, so each layer sees its input normalised by the
    batch, exactly as in training; the statistics are global over partitions
    and replicas (invariant 4). `ctseg.model.step.pool_statistics` averages them over
    batches into the population statistics inference uses.
    """
    model = nnx.merge(graphdef, params, stats, copy=True)
    for _, module in nnx.iter_modules(model):
        if isinstance(module, BatchNorm):
            module.momentum = 0.0  # the running average becomes this batch's statistics
    model(x, comm, train=True)
    return nnx.state(model, nnx.BatchStat)


# --------------------------------------------------------------------------- geometry of the net


def alignment(cfg: ModelConfig) -> int:
    """Partitioned local blocks must start and end on multiples of this: 2^(depth−1)."""
    return 2 ** (cfg.depth - 1)


def receptive_field_radius(cfg: ModelConfig) -> int:
    """Farthest input voxel (per axis) that any output voxel depends on, in inference mode.

    Traced through the network as index intervals along one axis, for every
    output position modulo the alignment (pooling makes the dependency depend
    on the position's phase): a convolution widens an interval by k//2 on each
    side at its level, pooling maps a coarse index i to fine [2i, 2i+1], an
    up-convolution maps a fine index j to coarse j//2, a skip concatenation
    takes the union.
    """
    h = cfg.kernel_size // 2

    def encoder(level: int, lo: int, hi: int) -> tuple[int, int]:
        lo, hi = lo - 2 * h, hi + 2 * h  # the level's two convolutions
        if level == 0:
            return lo, hi
        return encoder(level - 1, 2 * lo, 2 * hi + 1)

    def decoder(level: int, lo: int, hi: int) -> tuple[int, int]:
        if level == cfg.depth - 1:
            return encoder(level, lo, hi)
        lo, hi = lo - 2 * h, hi + 2 * h
        skip = encoder(level, lo, hi)
        below = decoder(level + 1, lo // 2, hi // 2)
        return min(skip[0], below[0]), max(skip[1], below[1])

    period = alignment(cfg)
    # Offset by many periods so floor division never sees negative indices.
    base = period * (4 * cfg.kernel_size * 2**cfg.depth)
    radius = 0
    for phase in range(period):
        j = base + phase
        lo, hi = decoder(0, j, j)
        radius = max(radius, j - lo, hi - j)
    return radius
