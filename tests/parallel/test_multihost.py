"""Multi-host: two processes × 8 CPU devices through `jax.distributed` equal one process × 16.

Each worker (`tests/support/multihost_worker.py`) joins the mesh over localhost with
gloo collectives, builds only its own blocks of the batch and writes its copy
of the replicated loss and gradients; the reference runs in this process on
the 16 devices `conftest.py` configures.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO
from multihost_worker import DATA, SPATIAL, loss_and_grads

WORKER = REPO / "tests" / "support" / "multihost_worker.py"
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
    for (proc, _), log in zip(workers, logs, strict=True):
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


def test_two_process_train_command_equals_one_process(tmp_path):
    """`ctseg train` with --coordinator/--num-processes/--process-id on two local
    processes logs the same losses as the same training in one process."""
    from helpers import prepare_store

    from ctseg import config as cfg
    from ctseg.synth.dataset import write_dataset
    from ctseg.training.loop import train_and_evaluate

    overrides = [
        "data.resolution=16",
        "model.base_filters=2",
        "model.depth=2",
        "mesh.spatial=[2,2,2]",
        "mesh.data=2",
        "train.batch_size=2",
        "train.steps=2",
        "train.eval_every=2",
        "train.checkpoint_every=2",
        "train.log_every=1",
    ]
    config = cfg.load(overrides=overrides)
    write_dataset(tmp_path / "raw", cases=3, size=24, seed=5)
    prepare_store(tmp_path / "raw", tmp_path / "prep", config)

    coordinator = f"localhost:{_free_port()}"
    command = [
        sys.executable,
        "-m",
        "ctseg.cli.main",
        "train",
        "--data",
        str(tmp_path / "prep"),
        "--workdir",
        str(tmp_path / "multi"),
        f"--coordinator={coordinator}",
        f"--num-processes={PROCESSES}",
    ]
    for item in overrides:
        command += ["--set", item]
    procs = [
        subprocess.Popen(
            [*command, f"--process-id={i}"],
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(PROCESSES)
    ]
    try:
        logs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)

    train_and_evaluate(config, tmp_path / "prep", tmp_path / "single")
    multi = (tmp_path / "multi" / "metrics.jsonl").read_text().splitlines()
    single = (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()
    assert len(multi) == len(single) == 2  # process 0 alone writes the log
    for m, s in zip(multi, single, strict=True):
        m, s = json.loads(m), json.loads(s)
        np.testing.assert_allclose(m["loss"], s["loss"], rtol=1e-5)
        assert m.get("val_dice_liver") == pytest.approx(s.get("val_dice_liver"), abs=1e-6)
    assert (tmp_path / "multi" / "checkpoints" / "2").is_dir()
