"""One process of the multi-host test: 8 simulated CPU devices joining a 16-device mesh.

Run as ``python tests/support/multihost_worker.py --coordinator localhost:PORT
--num-processes 2 --process-id I --out result-I.npz``. Every process builds
only its own blocks of the batch (`partition.make_global_array`), computes the
loss and the parameter gradients on the global mesh and writes its local copy
of these replicated results to ``--out``. `tests/parallel/test_multihost.py` imports
the same helpers to compute the single-process reference.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ctseg import config as cfg
from ctseg.model import step, unet
from ctseg.parallel import partition as pt

DEVICES_PER_PROCESS = 8
GRID = 16
SPATIAL = (2, 2, 2)
DATA = 2


def make_config(partitioner: str) -> cfg.Config:
    return cfg.load(
        overrides=[
            f"data.resolution={GRID}",
            "model.base_filters=2",
            "model.depth=2",
            f"train.batch_size={DATA}",
            f"mesh.spatial={list(SPATIAL)}",
            f"mesh.data={DATA}",
            f"mesh.partitioner={partitioner}",
        ]
    )


def host_batch() -> tuple[np.ndarray, np.ndarray]:
    """The same deterministic batch in every process."""
    rng = np.random.default_rng(7)
    image = rng.uniform(-1, 1, (DATA, GRID, GRID, GRID, 1)).astype(np.float32)
    label = rng.integers(0, 3, (DATA, GRID, GRID, GRID)).astype(np.int32)
    return image, label


def _global(mesh: Mesh, host: np.ndarray, spec: P) -> jax.Array:
    # Only this process's blocks are read: `host[index]` runs for addressable devices.
    return pt.make_global_array(mesh, host.shape, host.dtype, lambda index: host[index], spec)


def loss_and_grads(partitioner: str) -> dict[str, np.ndarray]:
    """Loss and parameter gradients on the data=2 × [2, 2, 2] mesh, as flat host arrays."""
    config = make_config(partitioner)
    mesh = pt.make_mesh(SPATIAL, DATA)
    graphdef, params, stats = unet.create(config.model, seed=0)
    # Parameters are replicated global arrays, identical in every process.
    params, stats = jax.tree.map(
        lambda a: _global(mesh, np.asarray(a), pt.REPLICATED), (params, stats)
    )
    image, label = host_batch()
    loss_fn = step.make_loss(graphdef, config, mesh)
    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    (loss, _), grads = grad_fn(
        params,
        stats,
        _global(mesh, image, pt.ACTIVATION_SPEC),
        _global(mesh, label, step.LABEL_SPEC),
    )
    # Replicated results: every process holds a full copy on its first local device.
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    result = {jax.tree_util.keystr(path): np.asarray(g.addressable_data(0)) for path, g in leaves}
    result["loss"] = np.asarray(loss.addressable_data(0))
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--partitioner", default="halo")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    # Before anything touches a device: the backend starts with this many CPU devices.
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", DEVICES_PER_PROCESS)
    pt.initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    result = loss_and_grads(args.partitioner)
    np.savez(args.out, **result)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
