"""Multi-host: two processes × 8 CPU devices through `jax.distributed` equal one process × 16.

Each worker (`tests/multihost_worker.py`) joins the mesh over localhost with
gloo collectives, builds only its own blocks of the batch and writes its copy
of the replicated loss and gradients; the reference runs in this process on
the 16 devices `conftest.py` configures.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
from multihost_worker import DATA, SPATIAL, loss_and_grads

WORKER = Path(__file__).with_name("multihost_worker.py")
PROCESSES = 2
TIMEOUT_S = 240  # a hung collective must fail the test, not stall CI


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start_workers(tmp_path: Path, partitioner: str) -> list[tuple[subprocess.Popen, Path]]:
    coordinator = f"localhost:{_free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    workers = []
    for i in range(PROCESSES):
        out = tmp_path / f"process-{i}.npz"
        args = [
            f"--coordinator={coordinator}",
            f"--num-processes={PROCESSES}",
            f"--process-id={i}",
            f"--partitioner={partitioner}",
            f"--out={out}",
        ]
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        workers.append((proc, out))
    return workers


def _collect(workers: list[tuple[subprocess.Popen, Path]]) -> list[dict[str, np.ndarray]]:
    try:
        logs = [proc.communicate(timeout=TIMEOUT_S)[0] for proc, _ in workers]
    finally:
        for proc, _ in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for (proc, _), log in zip(workers, logs):
        assert proc.returncode == 0, log[-3000:]
    return [dict(np.load(out, allow_pickle=False)) for _, out in workers]


def test_two_processes_equal_one_process(tmp_path):
    # gspmd takes the same path through jax.distributed; halo (the default) is tested
    # alone to keep the test fast on a 2-core machine.
    workers = _start_workers(tmp_path, "halo")
    try:
        assert DATA * np.prod(SPATIAL) == 16
        reference = loss_and_grads("halo")  # computed while the workers run
    finally:
        results = _collect(workers)
    for got in results:
        assert set(got) == set(reference)
        for name, want in reference.items():
            np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-7, err_msg=name)
