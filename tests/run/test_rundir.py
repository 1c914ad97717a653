"""The run directory's plain functions: which config keys two runs differ in."""

import pytest

from ctseg import config as cfg
from ctseg.errors import CtsegError
from ctseg.run import rundir


def test_config_changes_name_the_keys_that_differ_and_leave_out_what_is_ignored():
    base = cfg.load(None, ["data.resolution=32"])
    other = cfg.load(None, ["data.resolution=32", "mesh.spatial=[2,1,1]", "train.fold=1"])
    assert rundir.config_changes(base, base) == []
    # The mesh is no part of a run's identity; the fold is, unless it is ignored too.
    assert rundir.config_changes(base, other) == ["train.fold"]
    assert rundir.config_changes(base, other, ("mesh", "train.fold")) == []
    assert rundir.config_changes(base, other, ()) == ["mesh.spatial", "train.fold"]
    changed = cfg.load(None, ["data.resolution=32", "train.steps=7", "model.base_filters=4"])
    assert rundir.config_changes(base, changed) == ["model.base_filters", "train.steps"]


def test_a_resumed_run_of_another_config_is_refused_naming_the_keys(tmp_path):
    config = cfg.load(None, ["data.resolution=32"])
    rundir.write_or_check_config(tmp_path, config)
    rundir.write_or_check_config(
        tmp_path, cfg.load(None, ["data.resolution=32", "mesh.spatial=[2,1,1]"])
    )
    with pytest.raises(CtsegError, match=r"different config \(train.steps\); use a new"):
        rundir.write_or_check_config(
            tmp_path, cfg.load(None, ["data.resolution=32", "train.steps=9"])
        )
