"""Training compiles its step once: the program the memory check reads is the one the loop runs."""

import pytest
from helpers import prepare_store, tiny_config

from ctseg.parallel import devices as dev
from ctseg.parallel.compile_cache import compile_clock
from ctseg.synth.dataset import write_dataset
from ctseg.training.loop import train_and_evaluate

TRAIN = [
    "mesh.spatial=[2,1,1]",
    "train.steps=2",
    "train.eval_every=2",
    "train.checkpoint_every=2",
    "train.log_every=1",
    "train.warmup_steps=1",
]


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    write_dataset(root / "raw", cases=3, size=24, seed=5)
    prepare_store(root / "raw", root / "prep", tiny_config(*TRAIN))
    return root / "prep"


def test_the_step_compiles_once_with_the_memory_check(store_dir, tmp_path, monkeypatch):
    # The memory check runs on accelerators only: take these CPU devices for GPUs (with
    # the host's RAM as their free memory). Conftest keeps the compilation cache off, so
    # a second compile of the step would be a real one, as on a GPU without the cache.
    monkeypatch.setattr(dev, "is_accelerator", lambda devices: True)
    clock = compile_clock()
    before = clock.by_name["jit(train_step)"]
    train_and_evaluate(tiny_config(*TRAIN), store_dir, tmp_path / "run")
    # Measured before the loop ran the checked program: 2 (the check's, then the loop's).
    assert clock.by_name["jit(train_step)"] - before == 1
