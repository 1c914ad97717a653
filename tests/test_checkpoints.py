"""Checkpoint selection: the best by validation Dice, NaN skipped, kept through rotation."""

import jax.numpy as jnp
import pytest

from ctseg.checkpoints import Checkpoints
from ctseg.errors import CtsegError
from ctseg.step import TrainState


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


def test_a_checkpoint_folder_ctseg_did_not_write_is_one_error(tmp_path):
    writer = Checkpoints(tmp_path, keep=2)
    writer.save(_state(1))
    writer.close()
    (tmp_path / "checkpoints" / "5").mkdir()
    (tmp_path / "checkpoints" / "5" / "x").write_text("junk")
    reader = Checkpoints(tmp_path, keep=2, read_only=True)
    with pytest.raises(CtsegError, match="checkpoint 5 in .* cannot be read"):
        reader.restore(reader.latest_step(), _state(0))
    reader.close()
