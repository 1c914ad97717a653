"""Device meshes, halo exchange and cross-partition reductions.

A volume ``[batch, x, y, z, channel]`` is split over a mesh with axes
``data`` (batch), ``x``, ``y`` and ``z``. Layers never talk to devices
directly: they receive a `Comm`, which says how to pad before a convolution
and how to sum statistics. Three kinds exist:

- `LOCAL`: one device (or a tile); padding is plain zero padding.
- `halo_comm(mesh)`: inside `jax.shard_map`; padding exchanges the boundary
  slices with the neighbouring partitions (``ppermute``), sums are ``psum``.
- `gspmd_comm(mesh)`: a plain `jax.jit` on spatially sharded arrays; XLA's
  SPMD partitioner inserts the exchanges itself. Activations are pinned to the
  spatial sharding so that XLA keeps them partitioned.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ctseg.errors import CtsegError, OptionError

MESH_AXES = ("data", "x", "y", "z")
SPATIAL_AXES = ("x", "y", "z")
# An activation [batch, x, y, z, channel]: batch over `data`, space over x, y, z.
ACTIVATION_SPEC = P("data", "x", "y", "z", None)
REPLICATED = P()


# --------------------------------------------------------------------------- devices


def configure_cpu_devices(count: int) -> None:
    """Ask for at least `count` CPU devices; simulated ones where real ones are missing.

    Must run before JAX initialises its backends (the first `jax.devices()` or
    array operation). It only affects the CPU platform, so it is harmless on a
    GPU or TPU machine.
    """
    try:
        current = jax.config.jax_num_cpu_devices
        if current is None or current < count:
            jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        # Backends already started (e.g. tests set this in conftest.py); make_mesh
        # reports a clear error if there are too few devices.
        pass


def initialize_distributed(
    coordinator: str | None, num_processes: int | None, process_id: int | None
) -> None:
    """Join a multi-process mesh through JAX's own runtime (`jax.distributed`).

    The arguments win; without them the environment (e.g. a TPU pod or SLURM) may still
    describe the job, which `jax.distributed.initialize()` detects itself.
    """
    given = [v is not None for v in (coordinator, num_processes, process_id)]
    if any(given) and not all(given):
        raise OptionError("`coordinator`, `num_processes` and `process_id` go together")
    if not all(given) and "JAX_COORDINATOR_ADDRESS" not in os.environ:
        return
    if num_processes is not None and not 0 <= process_id < num_processes:
        raise OptionError(f"`process_id` must be in 0 … {num_processes - 1}, got {process_id}")
    # Collectives between CPU processes need a transport; gloo ships with jaxlib.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
    )


def make_mesh(spatial: Sequence[int], data: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A mesh with axes (data, x, y, z) over the first `data·x·y·z` of `devices`.

    `devices`: by default all of JAX's default backend's devices (the
    accelerators, else the CPU's); `ctseg.parallel.devices` chooses them for commands.
    Too few is an error, never a quiet move to other devices.
    """
    shape = (data, *spatial)
    count = math.prod(shape)
    devices = jax.devices() if devices is None else list(devices)
    if len(devices) < count:
        raise CtsegError(
            f"the mesh data={data} × spatial={list(spatial)} needs {count} devices but only "
            f"{len(devices)} {devices[0].platform.upper()} device(s) are here; on a CPU "
            "machine run through the ctseg CLI (it simulates devices) or set "
            "jax_num_cpu_devices before JAX starts"
        )
    grid = np.asarray(devices[:count], dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def activation_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, ACTIVATION_SPEC)


# --------------------------------------------------------------------------- halo exchange


def replicated_shapes(tree: Any, mesh: Mesh) -> Any:
    """The shapes and dtypes of `tree`'s arrays (concrete or abstract), replicated over
    `mesh`: what a program is compiled for, or a checkpoint restored into, with no transfer."""
    sharding = NamedSharding(mesh, REPLICATED)
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=sharding), tree
    )


def exchange_halo(x: jax.Array, halo: Sequence[tuple[str, int] | None], width: int) -> jax.Array:
    """`x` zero-padded by `width` on the spatial dims, with neighbours' slices where split.

    Runs inside `shard_map`. `halo[d]` is the (mesh axis, partitions) that
    split spatial dim d, or None where it is whole. The block is padded once
    (one copy, which the convolution keeps for its backward pass) and each
    received face is written into that buffer in place. Split dims are
    exchanged in order, each sending faces of the buffer already extended
    along the earlier dims, so edges and corners arrive without diagonal
    messages. The exchange is not cyclic: ``ppermute`` leaves zeros on the
    outer faces of the first and last partitions, which is SAME zero padding.
    """
    if width == 0:
        return x
    padded = jnp.pad(x, [(0, 0), *[(width, width)] * 3, (0, 0)])
    for dim, split in zip((1, 2, 3), halo, strict=True):
        if split is None:
            continue
        axis, size = split
        if x.shape[dim] < width:
            raise ValueError(
                f"local block of {x.shape[dim]} slices cannot supply a halo of {width}"
            )
        n = padded.shape[dim]
        first = jax.lax.slice_in_dim(padded, width, 2 * width, axis=dim)
        last = jax.lax.slice_in_dim(padded, n - 2 * width, n - width, axis=dim)
        from_left = jax.lax.ppermute(last, axis, [(i, i + 1) for i in range(size - 1)])
        from_right = jax.lax.ppermute(first, axis, [(i + 1, i) for i in range(size - 1)])
        padded = jax.lax.dynamic_update_slice_in_dim(padded, from_left, 0, axis=dim)
        padded = jax.lax.dynamic_update_slice_in_dim(padded, from_right, n - width, axis=dim)
    return padded


@dataclass(frozen=True)
class Comm:
    """What a layer needs to know about how its input is partitioned.

    `halo`: for the spatial dims x, y, z, the (mesh axis, partitions) that split
    it, or None where the dim is whole on every device. `reduce_axes`: mesh axes
    over which statistics are summed; `reduce_size` their total size.
    `sharding`: under gspmd, the sharding activations are pinned to.
    """

    halo: tuple[tuple[str, int] | None, ...] = (None, None, None)
    reduce_axes: tuple[str, ...] = ()
    reduce_size: int = 1
    sharding: NamedSharding | None = None

    def pad(self, x: jax.Array, width: int) -> jax.Array:
        """SAME padding of `width` on the spatial dims: halos where split, zeros elsewhere."""
        return exchange_halo(x, self.halo, width)

    def sum(self, x: jax.Array, axis: int | tuple[int, ...] | None = None) -> jax.Array:
        """Sum over `axis` of the whole (global) array, not just the local block."""
        local = jnp.sum(x, axis=axis)
        return jax.lax.psum(local, self.reduce_axes) if self.reduce_axes else local

    def count(self, local_count: int) -> int:
        """Global number of elements, given the local block's count."""
        return local_count * self.reduce_size

    def constrain(self, x: jax.Array) -> jax.Array:
        if self.sharding is None:
            return x
        return jax.lax.with_sharding_constraint(x, self.sharding)


LOCAL = Comm()


def halo_comm(mesh: Mesh) -> Comm:
    halo = tuple((a, mesh.shape[a]) if mesh.shape[a] > 1 else None for a in SPATIAL_AXES)
    return Comm(halo=halo, reduce_axes=MESH_AXES, reduce_size=mesh.size)


def gspmd_comm(mesh: Mesh) -> Comm:
    return Comm(sharding=activation_sharding(mesh))


# --------------------------------------------------------------------------- running a function


def partitioned(
    fn: Callable[..., Any],
    mesh: Mesh,
    partitioner: str,
    in_specs: tuple[Any, ...],
    out_specs: Any,
) -> Callable[..., Any]:
    """Turn ``fn(comm, *args)`` into ``g(*args)`` running over `mesh` with `partitioner`.

    `in_specs`/`out_specs` are partition specs (pytree prefixes) of the
    arguments and results. Under `halo` the function body runs once per device
    on its local block (`jax.shard_map`); under `gspmd` it runs on global
    arrays whose sharding XLA propagates. Either way the caller wraps the
    result in `jax.jit` (and may differentiate through it).
    """
    if partitioner == "halo":
        return jax.shard_map(
            partial(fn, halo_comm(mesh)),
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            check_vma=True,
        )
    if partitioner == "gspmd":
        comm = gspmd_comm(mesh)

        def run(*args: Any) -> Any:
            # Pin every argument to its sharding (specs may be pytree prefixes),
            # then let XLA's SPMD partitioner propagate it through the body.
            def pin(spec: P, subtree: Any) -> Any:
                sharding = NamedSharding(mesh, spec)
                return jax.tree.map(
                    lambda a: jax.lax.with_sharding_constraint(a, sharding), subtree
                )

            args = jax.tree.map(pin, tuple(in_specs), args, is_leaf=lambda s: isinstance(s, P))
            return fn(comm, *args)

        return run
    raise CtsegError(f"mesh.partitioner must be 'halo' or 'gspmd', got {partitioner!r}")


def make_global_array(
    mesh: Mesh,
    shape: tuple[int, ...],
    dtype: Any,
    read_block: Callable[[tuple[slice, ...]], np.ndarray],
    spec: P = ACTIVATION_SPEC,
) -> jax.Array:
    """Assemble a sharded global array from per-device blocks read on demand.

    `read_block(index)` receives the global index (a tuple of slices) of one
    device's block and returns it; it is called only for the devices this
    process addresses, so each host reads only its own slabs.
    """
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(
        shape, sharding, lambda index: np.asarray(read_block(index), dtype=dtype)
    )


def local_block_shape(global_shape: Sequence[int], mesh_shape: dict[str, int]) -> tuple[int, ...]:
    """Shape of one device's block of an activation of `global_shape`."""
    b, x, y, z, c = global_shape
    return (
        b // mesh_shape["data"],
        x // mesh_shape["x"],
        y // mesh_shape["y"],
        z // mesh_shape["z"],
        c,
    )
