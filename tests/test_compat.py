"""Files written by earlier versions of ctseg read as today's (`ctseg.compat`): a store, a run
directory and an evaluation report rewritten in their earlier formats still load."""

import json
import shutil

import pytest
from helpers import REPO

from ctseg import compat
from ctseg import config as cfg
from ctseg.data.store import Store
from ctseg.run import rundir


def test_a_held_step_count_becomes_the_frozen_share_of_the_steps():
    raw = {"train": {"steps": 600, "held_norm_steps": 200}}
    config = cfg.from_dict(raw)
    assert config.train.frozen_norm_share == 0.3333 and config.train.frozen_norm_steps == 200
    # The demo's config says the same: a run trained with the count resumes under it.
    assert (
        config.train.frozen_norm_steps
        == cfg.load(REPO / "configs" / "demo.toml").train.frozen_norm_steps
    )
    # An explicit share is not overridden; without steps the default count of steps applies.
    both = {"train": {"held_norm_steps": 200, "held_norm_share": 0.25}}
    assert cfg.from_dict(both).train.frozen_norm_share == 0.25
    assert cfg.from_dict({"train": {"held_norm_steps": 600}}).train.frozen_norm_steps == 600


def test_a_held_share_is_the_frozen_share_renamed(tmp_path):
    """`train.held_norm_share` (run directories trained before the rename say it) reads as
    `train.frozen_norm_share`; the newest spelling present wins."""
    config = cfg.from_dict({"train": {"steps": 600, "held_norm_share": 0.3333}})
    assert config.train.frozen_norm_share == 0.3333 and config.train.frozen_norm_steps == 200
    newest = {"held_norm_steps": 100, "held_norm_share": 0.25, "frozen_norm_share": 0.5}
    assert cfg.from_dict({"train": newest}).train.frozen_norm_share == 0.5
    raw = {"train": {"held_norm_share": 0.25}}
    assert compat.config(raw) == {"train": {"frozen_norm_share": 0.25}}
    assert raw == {"train": {"held_norm_share": 0.25}}  # the caller's dict as it was
    # A run's config.toml written before the rename still reads.
    old_run = (REPO / "configs" / "demo.toml").read_text().replace("frozen_norm", "held_norm")
    (tmp_path / rundir.CONFIG).write_text(old_run)
    assert rundir.load_config(tmp_path).train.frozen_norm_steps == 200


def test_a_held_step_count_that_is_no_number_is_the_share_s_one_line():
    with pytest.raises(Exception, match="train.frozen_norm_share must be a number"):
        cfg.from_dict({"train": {"held_norm_steps": "many"}})


def test_a_run_and_its_store_in_their_earlier_formats_still_load(trained, tmp_path):
    run_dir, store_dir, _ = trained
    old_run, old_store = tmp_path / "run", tmp_path / "store"
    shutil.copytree(run_dir, old_run)
    shutil.copytree(store_dir, old_store)

    # The store before the spacing grid and folds: no grid, no folds, cases without their
    # grid shape and box offset (in the manifest and in each case.json).
    manifest_path = old_store / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for key in ("grid", "folds", "fold_seed"):
        manifest.pop(key, None)
    for case in manifest["cases"]:
        case.pop("grid_shape"), case.pop("box_offset"), case.pop("fold", None)
        case_json = old_store / "cases" / case["id"] / "case.json"
        written = json.loads(case_json.read_text())
        written.pop("grid_shape"), written.pop("box_offset")
        case_json.write_text(json.dumps(written))
    manifest_path.write_text(json.dumps(manifest))
    store, today = Store.open(old_store), Store.open(store_dir)
    assert store.grid_spec == today.grid_spec and store.folds == 0
    assert [c.grid_shape for c in store.cases] == [c.grid_shape for c in today.cases]
    assert {c.box_offset for c in store.cases} == {(0, 0, 0)}

    # The run: its config with a held step count, its metrics spelling the tumour "tumor".
    config_path = old_run / rundir.CONFIG
    text = config_path.read_text().replace("frozen_norm_share = 0.0", "held_norm_steps = 0")
    config_path.write_text(text)
    metrics = old_run / rundir.METRICS
    metrics.write_text(metrics.read_text().replace("val_dice_tumour", "val_dice_tumor"))
    assert rundir.load_config(old_run) == rundir.load_config(run_dir)
    rundir.write_or_check_config(old_run, rundir.load_config(run_dir))  # resumable
    validations = rundir.MetricsLog.read(old_run)
    assert validations == rundir.MetricsLog.read(run_dir)


def test_an_evaluation_folder_without_its_record_is_known_by_its_summary():
    summary = {"run": {"run_dir": "r", "checkpoint_step": 4, "data": "p", "split": "val"}}
    assert compat.evaluation_of_summary(summary) == ("r", 4, "p", "val")
    with pytest.raises(KeyError):
        compat.evaluation_of_summary({"cases": []})
