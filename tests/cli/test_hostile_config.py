"""Hostile and careless config values, round four: every one refused in one line naming its
key, before `ctseg train` or `ctseg preprocess` writes or allocates anything (a seed JAX
cannot take, a grid no volume can hold, augmentation that makes the loss NaN, a legacy
key that would be ignored, a config path that is a device or a FIFO)."""

import os
import re
import subprocess
import sys

import pytest
from helpers import REPO, TINY, labels, save
from rich.text import Text
from typer.testing import CliRunner

import ctseg.cli.main  # noqa: F401  (registers the commands)
from ctseg import config as cfg
from ctseg.cli.app import app
from ctseg.data.grids import GridSpec
from ctseg.data_prep import build
from ctseg.errors import CtsegError

runner = CliRunner()


def _refused(args, *patterns):
    """The command's CtsegError (printed by `ctseg` as one `error:` line, exit 2)."""
    result = runner.invoke(app, args)
    assert isinstance(result.exception, CtsegError), result.output
    message = str(result.exception)
    assert "\n" not in message
    assert Text.from_markup(message).plain == message  # rich prints it as it is
    for pattern in patterns:
        assert re.search(pattern, message), message
    return message


@pytest.mark.parametrize(
    "override, pattern",
    [
        # Seeds: within what numpy and JAX take, one definition for every seed.
        ("train.seed=1180591620717411303424", r"train.seed = 1180591620717411303424 is beyond"),
        ("train.seed=4294967296", r"train.seed = 4294967296 is beyond the integers JAX"),
        ("train.seed=-1", r"`train.seed` must not be negative, got -1"),
        ("data.split_seed=2147483648", r"data.split_seed = 2147483648 is beyond"),
        # Every integer within JAX's: a step count optax keeps in int32.
        ("train.steps=3000000000", r"train.steps = 3000000000 is beyond the integers JAX"),
        # Sizes: no volume or array beyond what JAX indexes.
        ("data.resolution=4000000", r"data.resolution = 4000000 is too large.*at most 1290"),
        ("data.resolution=1296", r"data.resolution = 1296 is too large"),
        ("model.base_filters=100000", r"model.base_filters = 100000 is too large"),
        ("model.depth=40", r"model.depth must be at most 16"),
        ("model.kernel_size=101", r"model.kernel_size must be at most 15"),
        # Spacings no CT has, whose grid no machine holds.
        ("data.spacing=[0.001, 0.001, 0.001]", r"data.spacing = \[0.001, 0.001, 0.001\] must be"),
        ("data.spacing=[1.0, 1.0, 1000.0]", r"data.spacing .* from 0.1 to 50 mm"),
        ("data.hu_window=[-1e30, 1e30]", r"data.hu_window .* must lie within"),
        # Augmentation that would make the loss NaN: every range bounded.
        ("augment.noise_std=[1e30, 1e30]", r"augment.noise_std must lie within 0 … 1"),
        ("augment.noise_std=[0, 5]", r"augment.noise_std must lie within"),
        ("augment.brightness=[0.75, 1e30]", r"augment.brightness must lie within"),
        ("augment.contrast=[0.75, 1e20]", r"augment.contrast must lie within"),
        ("augment.gamma=[0.7, 1e30]", r"augment.gamma must lie within"),
        ("augment.scaling=[0.7, 1e9]", r"augment.scaling must lie within"),
        ("augment.phase_liver_hu=[50, 1e30]", r"augment.phase_liver_hu must lie within"),
        ("augment.phase_tumour_share=[0.3, 1e30]", r"augment.phase_tumour_share must lie"),
        ("augment.noise_std=[0, inf]", r"augment.noise_std\[1\] must be a finite number"),
        ("train.intensity_shift=1e30", r"train.intensity_shift must be at most 2"),
        ("train.class_weights=[1, 8, 1e30]", r"train.class_weights must be at most 1000"),
        ("train.dice_weight=1e30", r"train.dice_weight must be at most 1000"),
        ("model.bn_epsilon=1e30", r"model.bn_epsilon must be in \(0, 1\]"),
        # A legacy key, which would be silently overridden: said what replaced it.
        ("train.held_norm_steps=5", r"--set train.held_norm_steps: an earlier version's key.*"),
        # The library's `overrides`, said as the flag the user typed.
        ("resolution=64", r"^--set expects section.key=value, got 'resolution=64'"),
    ],
)
def test_train_refuses_bad_values_before_writing_anything(tmp_path, override, pattern):
    workdir = tmp_path / "run"
    args = ["train", "--data", str(tmp_path / "store"), "--workdir", str(workdir)]
    _refused([*args, "--set", override], pattern)
    assert not workdir.exists()  # no run directory holding only config.toml


def test_a_legacy_key_says_what_replaced_it():
    message = _refused(["plan", "--set", "train.held_norm_steps=5"])
    assert "replaced by train.frozen_norm_share, a share of train.steps" in message
    message = _refused(["plan", "--set", "train.held_norm_share=0.5"])
    assert "replaced by train.frozen_norm_share, the same share renamed" in message


@pytest.mark.parametrize("legacy", ["held_norm_steps=50", "held_norm_share=0.5"])
def test_a_legacy_key_is_refused_even_where_it_would_have_counted(tmp_path, legacy):
    # configs/demo.toml sets train.frozen_norm_share: a --set of an older spelling would
    # have been ignored.
    key = legacy.split("=")[0]
    _refused(
        ["plan", "--config", str(REPO / "configs" / "demo.toml"), "--set", f"train.{legacy}"],
        rf"^--set train.{key}: an earlier version's key",
    )
    # An earlier version's config.toml, with the legacy key alone, still reads (compat).
    path = tmp_path / "config.toml"
    path.write_text(f"[train]\nsteps = 100\n{legacy}\n")
    assert cfg.load(path).train.frozen_norm_steps == 50


def test_bounds_keep_the_values_people_use():
    cfg.load(REPO / "configs" / "demo.toml")
    cfg.load(None, ["data.resolution=1024", "train.seed=2147483647", "data.spacing=[0.5, 0.5, 5]"])
    cfg.load(None, ["augment.noise_std=[0, 0.2]", "augment.gamma=[0.7, 1.5]"])


def test_a_config_path_that_is_no_regular_file_says_what_it_is(tmp_path):
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    # Never opened: reading a FIFO without a writer would wait for ever.
    _refused(["plan", "--config", str(fifo)], r"config.fifo is a FIFO \(named pipe\), not a")
    _refused(["plan", "--config", "/dev/null"], r"/dev/null is a character device, not a")
    _refused(["plan", "--config", str(tmp_path / "none.toml")], r"config file not found: ")


def test_the_command_prints_one_error_line_and_exits_2(tmp_path):
    command = [sys.executable, "-m", "ctseg.cli.main", "train", "--data", str(tmp_path)]
    command += ["--workdir", str(tmp_path / "run"), "--set", "train.seed=2147483648"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: train.seed = 2147483648 is beyond"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


# ---------------------------------------------------------------- preprocess: grids


def test_a_cube_beyond_this_machines_memory_is_refused_before_the_store(tmp_path, monkeypatch):
    raw, out = tmp_path / "raw", tmp_path / "store"
    raw.mkdir()
    save(raw / "volume-0.nii.gz", labels().astype("int16"))
    save(raw / "segmentation-0.nii.gz", labels())
    monkeypatch.setattr(build, "host_memory", lambda: 2**20)  # a machine with 1 MiB free
    _refused(
        ["preprocess", str(raw), str(out), *[f"--set={o}" for o in TINY[1:]]]
        + ["--set", "data.resolution=512"],
        r"every case's grid at data.resolution = 512 would be 512×512×512 voxels",
        r"than the 1.0 MiB of memory available here; use a smaller data.resolution",
    )
    assert not out.exists()


def test_a_spacing_grid_too_large_names_the_key():
    grid = GridSpec("spacing", 64, (0.1, 0.1, 0.1))
    with pytest.raises(CtsegError, match=r"at data.spacing = \[0.1, 0.1, 0.1\] mm would be "):
        build.check_grid_size(grid, (4000, 4000, 3000), "the grid of volume-0.nii.gz")
    with pytest.raises(CtsegError, match="beyond the 2\\^31 − 1 a volume can hold.*coarser"):
        build.check_grid_size(grid, (4000, 4000, 3000), "the grid of volume-0.nii.gz")
    build.check_grid_size(grid, (100, 100, 100), "the grid of volume-0.nii.gz")
