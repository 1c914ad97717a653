"""Halo exchange and meshes against plain numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import shard_global

from ctseg.errors import CtsegError
from ctseg.parallel import partition as pt


@pytest.mark.parametrize("kernel", [3, 5])
@pytest.mark.parametrize("spatial", [(2, 1, 1), (1, 2, 2), (2, 2, 2), (4, 2, 2)])
def test_halo_exchange_equals_slices_of_the_zero_padded_array(kernel, spatial):
    mesh = pt.make_mesh(spatial)
    width = kernel // 2
    shape = (1, 8, 8, 8, 2)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)

    padded_blocks = jax.jit(
        jax.shard_map(
            lambda block: pt.halo_comm(mesh).pad(block, width),
            mesh=mesh,
            in_specs=pt.ACTIVATION_SPEC,
            out_specs=pt.ACTIVATION_SPEC,
        )
    )(shard_global(mesh, x))
    got = np.asarray(padded_blocks)

    reference = np.pad(x, [(0, 0)] + [(width, width)] * 3 + [(0, 0)])
    local = [n // p for n, p in zip(shape[1:4], spatial, strict=True)]
    for index in np.ndindex(*spatial):
        got_block = got[
            :,
            index[0] * (local[0] + 2 * width) : (index[0] + 1) * (local[0] + 2 * width),
            index[1] * (local[1] + 2 * width) : (index[1] + 1) * (local[1] + 2 * width),
            index[2] * (local[2] + 2 * width) : (index[2] + 1) * (local[2] + 2 * width),
        ]
        want_block = reference[
            :,
            index[0] * local[0] : index[0] * local[0] + local[0] + 2 * width,
            index[1] * local[1] : index[1] * local[1] + local[1] + 2 * width,
            index[2] * local[2] : index[2] * local[2] + local[2] + 2 * width,
        ]
        np.testing.assert_array_equal(got_block, want_block, err_msg=f"block {index}")


def test_global_sum_covers_every_partition():
    mesh = pt.make_mesh((2, 2, 1), data=2)
    x = np.arange(2 * 4 * 4 * 2 * 1, dtype=np.float32).reshape(2, 4, 4, 2, 1)
    total = jax.jit(
        jax.shard_map(
            lambda block: pt.halo_comm(mesh).sum(block),
            mesh=mesh,
            in_specs=pt.ACTIVATION_SPEC,
            out_specs=pt.REPLICATED,
        )
    )(shard_global(mesh, x))
    assert float(total) == x.sum()


def test_make_global_array_reads_only_each_devices_block():
    mesh = pt.make_mesh((2, 2, 2))
    source = np.arange(1 * 4 * 4 * 4 * 1, dtype=np.float32).reshape(1, 4, 4, 4, 1)
    requested = []

    def read(index):
        requested.append(index)
        return source[index]

    array = pt.make_global_array(mesh, source.shape, np.float32, read)
    np.testing.assert_array_equal(np.asarray(array), source)
    assert len(requested) == 8
    assert all(source[i].shape == (1, 2, 2, 2, 1) for i in requested)


def test_mesh_needing_more_devices_than_exist_is_a_clear_error():
    with pytest.raises(CtsegError, match="needs 64 devices"):
        pt.make_mesh((4, 4, 4))


def test_unknown_partitioner_is_refused():
    with pytest.raises(CtsegError, match="halo"):
        pt.partitioned(lambda comm: None, pt.make_mesh((1, 1, 1)), "magic", (), None)


def test_local_comm_pads_with_zeros():
    x = jnp.ones((1, 2, 2, 2, 1))
    padded = pt.LOCAL.pad(x, 1)
    assert padded.shape == (1, 4, 4, 4, 1)
    assert float(padded.sum()) == 8.0
