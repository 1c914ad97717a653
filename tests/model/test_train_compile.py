"""Training compiles its step once, from the start of the run: the program the memory check
reads is the one the loop runs."""

import threading

import pytest
from helpers import prepare_store, tiny_config

from ctseg.model import aot
from ctseg.parallel import devices as dev
from ctseg.parallel.compile_cache import compile_clock
from ctseg.synth.dataset import write_dataset
from ctseg.training import loop
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


def test_the_step_compiles_once_with_the_memory_check_while_the_state_initialises(
    store_dir, tmp_path, monkeypatch
):
    # The memory check runs on accelerators only: take these CPU devices for GPUs (with
    # the host's RAM as their free memory). Conftest keeps the compilation cache off, so
    # a second compile of the step would be a real one, as on a GPU without the cache.
    monkeypatch.setattr(dev, "is_accelerator", lambda devices: True)
    compiling = threading.Event()
    compile_step, init_state = aot.compile_train_step, loop.init_state

    def recorded(*args, **kwargs):
        compiling.set()
        return compile_step(*args, **kwargs)

    def initialise(config):
        # The step needs only the state's shapes: it compiles while the model initialises
        # (on a GPU, seconds of small eager programs) instead of after.
        assert compiling.wait(timeout=30), "the step did not start compiling before init"
        return init_state(config)

    monkeypatch.setattr(aot, "compile_train_step", recorded)
    monkeypatch.setattr(loop, "init_state", initialise)
    clock = compile_clock()
    before = clock.by_name["jit(train_step)"]
    train_and_evaluate(tiny_config(*TRAIN), store_dir, tmp_path / "run")
    # Measured before the loop ran the checked program: 2 (the check's, then the loop's).
    assert clock.by_name["jit(train_step)"] - before == 1


def test_the_held_step_compiles_after_the_training_step_and_nothing_else_mid_run(
    store_dir, tmp_path, monkeypatch
):
    """The training step and the on-device augmentation compile before the first batch;
    the held-statistics step after the training step (so that a GPU's convolution tuning
    is the training step's, found in the process's cache), in the background. A run that
    reaches the held phase compiles no other step and no augmentation afterwards
    (validation's own programs aside)."""
    events: list[tuple[str, bool]] = []
    compile_step = aot.compile_train_step

    def recorded(*args, held_norm=False, **kwargs):
        events.append(("start", held_norm))
        compiled = compile_step(*args, held_norm=held_norm, **kwargs)
        events.append(("end", held_norm))
        return compiled

    monkeypatch.setattr(aot, "compile_train_step", recorded)
    clock = compile_clock()
    before = clock.by_name["jit(program)"]
    at_first_step: list[int] = []

    def progress(step) -> None:
        if not at_first_step:
            at_first_step.append(clock.by_name["jit(program)"])

    held = [*TRAIN, "train.steps=4", "train.held_norm_share=0.5"]
    config = tiny_config(*held, "augment.rotation_p=1", "augment.noise_p=1")
    train_and_evaluate(config, store_dir, tmp_path / "run", progress)
    assert events == [("start", False), ("end", False), ("start", True), ("end", True)]
    assert at_first_step[0] > before  # the augmentation
    assert clock.by_name["jit(program)"] == at_first_step[0]
