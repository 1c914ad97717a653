"""The U-Net's first convolution, of the one-channel image, on GPUs as matrix products.

The gradient of its weights is where cuDNN does worst: the kernel XLA's tuning picks from
cuDNN was measured several times slower than PyTorch's, most of the gap between the two
training steps (`scripts/bench_conv.py`; docs/experiments/design-figures.md#image-convolution).
With one input channel, the convolution is a product of small
matrices: the image's 27 shifted copies (its patches, voxels × 27) times the kernel
(27 × filters); and the weights' gradient, the patches' transpose times the output's
gradient, a sum over every voxel. Cut into up to `CHUNKS` row blocks against copies of the
kernel, each block's product is its own matrix product, so the gradient is as many
independent small products (run side by side) and one float32 sum of their results,
not one product whose inner dimension is every voxel of the volume.

On GPUs (`jax.lax.platform_dependent`, chosen when XLA compiles) both passes are those
matrix products; the patches are recomputed for the backward pass rather than kept (a
volume of 27 channels). Elsewhere the convolution is XLA's: its CPU kernels are twice as
fast as the patches there. Both are the same function of the halo-padded block, so a
partitioned step still equals the unpartitioned one (the gradient's sum over partitions
is autodiff's, as for every other weight).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp

# The row blocks of the patches: up to a thousand small products, to fill a GPU, each
# summing over thousands of voxels (fewer blocks for fewer voxels: a block's copy of the
# kernel and its gradient cost the same memory however few its rows).
CHUNKS, MIN_ROWS = 1024, 4096
_DIMENSIONS = ("NXYZC", "XYZIO", "NXYZC")  # channels last, as flax's Conv


def convolution(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """The VALID convolution of the padded block `x` [n, x, y, z, 1] by `kernel`
    [kx, ky, kz, 1, filters], as flax's Conv computes it."""
    return jax.lax.conv_general_dilated(
        x, kernel, (1, 1, 1), "VALID", dimension_numbers=_DIMENSIONS
    )


@jax.checkpoint  # the patches are recomputed for the backward pass, not kept
def as_matrix_products(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """`convolution`, as the patches' products with the kernel, in row blocks."""
    size = kernel.shape[:3]
    out = [n - k + 1 for n, k in zip(x.shape[1:4], size, strict=True)]
    taps = [
        x[:, i : i + out[0], j : j + out[1], k : k + out[2], 0]
        for i, j, k in itertools.product(*map(range, size))
    ]
    patches = jnp.stack(taps, axis=-1).reshape(-1, len(taps))  # voxels × taps, taps in kernel order
    chunks = _chunks(patches.shape[0])
    # A copy of the kernel per block, broadcast in float32: the blocks' gradients (each a
    # matrix product, accumulated in float32 and rounded to the compute dtype once) are
    # summed in float32.
    weights = kernel.astype(jnp.float32).reshape(1, len(taps), -1)
    weights = jnp.broadcast_to(weights, (chunks, *weights.shape[1:])).astype(x.dtype)
    blocks = jnp.einsum("cvt,cto->cvo", patches.reshape(chunks, -1, len(taps)), weights)
    return blocks.reshape(x.shape[0], *out, -1)


def _chunks(rows: int) -> int:
    """The most row blocks, a power of two up to `CHUNKS` dividing `rows`, of at least
    `MIN_ROWS` rows each (one for fewer rows)."""
    chunks = 1
    while chunks < CHUNKS and rows % (2 * chunks) == 0 and rows // (2 * chunks) >= MIN_ROWS:
        chunks *= 2
    return chunks


# Where the matrix products run (a platform's name → the function); tests name the CPU.
MATRIX_PRODUCTS_ON = {"cuda": as_matrix_products}


def image_conv(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """The first convolution: matrix products on GPUs, XLA's convolution elsewhere."""
    return jax.lax.platform_dependent(x, kernel, default=convolution, **MATRIX_PRODUCTS_ON)
