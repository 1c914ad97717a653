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


def test_every_step_and_augmentation_program_compiles_before_the_first_step(store_dir, tmp_path):
    """The held-statistics step and the on-device augmentation compile beside the training
    step, before the first batch: a run that reaches the held phase compiles no step and
    no augmentation afterwards (validation's own programs aside)."""
    clock = compile_clock()
    names = ("jit(train_step)", "jit(program)")
    before = {name: clock.by_name[name] for name in names}
    at_first_step: dict[str, int] = {}

    def progress(step) -> None:
        if not at_first_step:
            at_first_step.update({name: clock.by_name[name] for name in names})

    held = [*TRAIN, "train.steps=4", "train.held_norm_share=0.5"]
    config = tiny_config(*held, "augment.rotation_p=1", "augment.noise_p=1")
    train_and_evaluate(config, store_dir, tmp_path / "run", progress)
    assert at_first_step["jit(train_step)"] - before["jit(train_step)"] == 2  # plain, held
    assert at_first_step["jit(program)"] > before["jit(program)"]  # the augmentation
    assert {name: clock.by_name[name] for name in names} == at_first_step
