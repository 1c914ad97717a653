"""Training compiles its step once, from the start of the run: the program the memory check
reads is the one the loop runs."""

import threading

import jax
import numpy as np
import pytest
from helpers import prepare_store, tiny_config
from jax.sharding import NamedSharding

from ctseg.model import aot
from ctseg.model.step import init_state
from ctseg.parallel import devices as dev
from ctseg.parallel.compile_cache import compile_clock
from ctseg.parallel.partition import REPLICATED, make_mesh
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
    compile_step, loop_init = aot.compile_train_step, loop.init_state

    def recorded(*args, **kwargs):
        compiling.set()
        return compile_step(*args, **kwargs)

    def initialise(config, sharding):
        # The step needs only the state's shapes: it compiles while the model initialises
        # instead of after.
        assert compiling.wait(timeout=30), "the step did not start compiling before init"
        return loop_init(config, sharding)

    monkeypatch.setattr(aot, "compile_train_step", recorded)
    monkeypatch.setattr(loop, "init_state", initialise)
    clock = compile_clock()
    before = clock.by_name["jit(train_step)"]
    train_and_evaluate(tiny_config(*TRAIN), store_dir, tmp_path / "run")
    # Measured before the loop ran the checked program: 2 (the check's, then the loop's).
    assert clock.by_name["jit(train_step)"] - before == 1


def test_the_frozen_step_compiles_after_the_training_step_and_nothing_else_mid_run(
    store_dir, tmp_path, monkeypatch
):
    """The training step and the on-device augmentation compile before the first batch;
    the frozen-statistics step after the training step (so that a GPU's convolution tuning
    is the training step's, found in the process's cache), in the background. A run that
    reaches the frozen phase compiles no other step and no augmentation afterwards
    (validation's own programs aside)."""
    events: list[tuple[str, bool]] = []
    compile_step = aot.compile_train_step

    def recorded(*args, frozen_norm=False, **kwargs):
        events.append(("start", frozen_norm))
        compiled = compile_step(*args, frozen_norm=frozen_norm, **kwargs)
        events.append(("end", frozen_norm))
        return compiled

    monkeypatch.setattr(aot, "compile_train_step", recorded)
    clock = compile_clock()
    before = clock.by_name["jit(program)"]
    at_first_step: list[int] = []

    def progress(step) -> None:
        if not at_first_step:
            at_first_step.append(clock.by_name["jit(program)"])

    frozen = [*TRAIN, "train.steps=4", "train.frozen_norm_share=0.5"]
    config = tiny_config(*frozen, "augment.rotation_p=1", "augment.noise_p=1")
    train_and_evaluate(config, store_dir, tmp_path / "run", progress)
    assert events == [("start", False), ("end", False), ("start", True), ("end", True)]
    assert at_first_step[0] > before  # the augmentation
    assert clock.by_name["jit(program)"] == at_first_step[0]


def test_a_fresh_state_is_one_program_the_same_wherever_it_is_placed():
    """Op by op, the tiny model's state compiled 33 programs (4.5 s on 2 cores; lits256's
    59, and 60 on a GPU). The state placed over 16 devices equals the default device's, bit for
    bit, and the moving average starts as the weights in buffers of its own (the step
    donates both)."""
    config = tiny_config("train.seed=7919", "train.ema_decay=0.9")  # a seed no test shares
    clock = compile_clock()
    before = clock.programs
    _, alone = init_state(config)
    assert clock.programs - before == 1
    mesh = make_mesh((4, 2, 2))
    _, placed = init_state(config, NamedSharding(mesh, REPLICATED))
    for one, other in zip(jax.tree.leaves(alone), jax.tree.leaves(placed), strict=True):
        assert other.sharding.is_fully_replicated and len(other.sharding.device_set) == 16
        np.testing.assert_array_equal(np.asarray(one), np.asarray(other))
    for weight, average in zip(
        jax.tree.leaves(placed.params), jax.tree.leaves(placed.average), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(weight), np.asarray(average))
        pointers = [a.addressable_shards[0].data.unsafe_buffer_pointer() for a in (weight, average)]
        assert pointers[0] != pointers[1]
