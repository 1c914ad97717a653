"""Checkpoint selection (best by validation Dice, NaN skipped, kept through rotation) and
refusing checkpoints that do not fit the run or cannot be read."""

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_config
from jax.sharding import NamedSharding

from ctseg import config as cfg
from ctseg.errors import CtsegError
from ctseg.model.step import TrainState, init_state
from ctseg.parallel.compile_cache import compile_clock
from ctseg.parallel.partition import REPLICATED, make_mesh
from ctseg.run.checkpoints import Checkpoints
from ctseg.run.trained import load_model


def _state(step: int) -> TrainState:
    leaf = {"w": jnp.full((2,), float(step))}
    return TrainState(jnp.asarray(step), leaf, leaf, leaf)


def test_best_is_the_highest_dice_skips_nan_and_survives_rotation(tmp_path):
    writer = Checkpoints(tmp_path, keep=2)
    scores = [(1, 0.2), (2, 0.9), (3, float("nan")), (4, 0.5), (5, 0.3), (6, None), (7, 0.1)]
    for step, dice in scores:
        writer.save(_state(step), dice)
    writer.close()
    reader = Checkpoints(tmp_path, keep=2, read_only=True)
    assert 2 in reader.manager.all_steps()  # far older than the 2 latest, and kept
    assert reader.best_step() == reader.resolve("best") == 2
    assert reader.resolve("latest") == 7
    restored = reader.restore(2, _state(0))
    assert float(restored.params["w"][0]) == 2.0
    reader.close()


def test_a_state_replicated_over_16_devices_saves_without_compiling(tmp_path):
    """Orbax would write a slice of each array from each of its 16 replicas, compiling a
    program per slice (160 for the demo's state); one replica writes it whole."""
    replicated = NamedSharding(make_mesh((4, 2, 2)), REPLICATED)
    # Channels of 16: orbax slices an axis the replicas divide.
    config = tiny_config("train.seed=4242", "model.base_filters=16")
    _, state = init_state(config, replicated)
    clock = compile_clock()
    before = clock.programs
    writer = Checkpoints(tmp_path, keep=1)
    writer.save(state)
    writer.close()
    assert clock.programs == before
    restored = Checkpoints(tmp_path, keep=1, read_only=True).restore(0, state)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_checkpoint_folder_ctseg_did_not_write_is_one_error(tmp_path):
    writer = Checkpoints(tmp_path, keep=2)
    writer.save(_state(1))
    writer.close()
    (tmp_path / "checkpoints" / "5").mkdir()
    (tmp_path / "checkpoints" / "5" / "x").write_text("junk")
    reader = Checkpoints(tmp_path, keep=2, read_only=True)
    with pytest.raises(CtsegError, match="checkpoint 5 in .* is unreadable"):
        reader.restore(reader.latest_step(), _state(0))
    reader.close()


# --- a run directory whose checkpoints do not fit its config.toml ------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory with checkpoints 4 and 8 of a tiny untrained model (no training)."""
    run = tmp_path_factory.mktemp("run")
    config = tiny_config("data.resolution=8")
    (run / "config.toml").write_text(cfg.to_toml(config))
    _, state = init_state(config)
    writer = Checkpoints(run, keep=3)
    for step in (4, 8):
        writer.save(state._replace(step=jnp.asarray(step)), 0.5)
    writer.close()
    return run


def _copy(run: Path, tmp_path: Path, edit: str | None = None) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    if edit is not None:
        old, new = edit.split("->")
        text = (copy / "config.toml").read_text()
        assert old in text
        (copy / "config.toml").write_text(text.replace(old, new))
    return copy


def test_the_run_s_own_checkpoint_loads(run):
    model = load_model(run, "latest")
    config, params, step = model.config, model.params, model.step
    assert step == 8 and config.model.base_filters == 2
    assert params["down"][0]["first"]["conv"]["kernel"][...].shape == (3, 3, 3, 1, 2)


@pytest.mark.parametrize(
    "edit, message",
    [
        ("base_filters = 2->base_filters = 4", "model.base_filters is 2 in the checkpoint, 4 in"),
        ("depth = 2->depth = 1", "model.depth is 2 in the checkpoint, 1 in config.toml"),
        ("kernel_size = 3->kernel_size = 5", "model.kernel_size is 3 in the checkpoint, 5 in"),
    ],
)
def test_a_checkpoint_that_does_not_fit_config_toml_is_one_line(run, tmp_path, edit, message):
    copy = _copy(run, tmp_path, edit)
    for which in ("best", "latest", "8"):
        with pytest.raises(CtsegError, match=f"checkpoint 8 in .* does not match .*{message}"):
            load_model(copy, which)
    # Resuming training checks the same way.
    config = cfg.load(copy / "config.toml")
    reader = Checkpoints(copy, keep=3, read_only=True)
    with pytest.raises(CtsegError, match="does not match"):
        reader.restore(8, init_state(config)[1])
    reader.close()


def _truncate_arrays(step_folder: Path) -> None:
    for data in (step_folder / "default").rglob("d/*"):
        with data.open("r+b") as handle:
            handle.truncate(10)


@pytest.mark.parametrize("damage", ["truncated", "item deleted", "emptied"])
def test_latest_and_best_skip_an_unreadable_checkpoint_a_step_number_does_not(
    run, tmp_path, caplog, damage
):
    copy = _copy(run, tmp_path)
    step_folder = copy / "checkpoints" / "8"
    if damage == "truncated":
        _truncate_arrays(step_folder)
    elif damage == "item deleted":
        shutil.rmtree(step_folder / "default")
    else:
        shutil.rmtree(step_folder)
        step_folder.mkdir()
    assert load_model(copy, "best").step == 4
    caplog.clear()
    assert load_model(copy, "latest").step == 4
    assert "checkpoint 8 in" in caplog.text and "is unreadable" in caplog.text
    with pytest.raises(CtsegError, match=r"checkpoint 8 in .* is unreadable \(truncated") as info:
        load_model(copy, "8")
    assert "\n" not in str(info.value)


def test_no_readable_checkpoint_at_all(run, tmp_path):
    copy = _copy(run, tmp_path)
    for step in ("4", "8"):
        _truncate_arrays(copy / "checkpoints" / step)
    with pytest.raises(CtsegError, match=r"no checkpoint in .* can be read \(steps \[4, 8\]\)"):
        load_model(copy, "latest")


@pytest.mark.parametrize("which", ["²", "٣", "-4", "4.0", "last", ""])
def test_a_checkpoint_that_is_no_step_number_is_one_line(run, which):
    with pytest.raises(CtsegError, match="use best, latest or one of"):
        load_model(run, which)


def test_a_damaged_metrics_file_is_one_line_naming_its_checkpoint(run, tmp_path):
    copy = _copy(run, tmp_path)
    (copy / "checkpoints" / "8" / "metrics" / "metrics").write_text("{")
    # Orbax reads every checkpoint's metrics when it opens the folder, whichever is asked for.
    for which in ("latest", "4"):
        with pytest.raises(CtsegError, match=r"checkpoint 8 in .* is unreadable .*metrics/metrics"):
            load_model(copy, which)
