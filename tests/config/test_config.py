"""Configs: shipped files, `--set` overrides, clear errors, TOML round trip, the docs' reference."""

import re

import pytest
from helpers import REPO
from rich.markup import render

from ctseg import config as cfg
from ctseg.errors import CtsegError

SHIPPED = ("demo.toml", "lits128.toml", "lits256_16way.toml", "lits512_16way.toml")
REFERENCE_START = "<!-- config-reference:start -->"
REFERENCE_END = "<!-- config-reference:end -->"


def test_the_four_configs_are_shipped():
    present = {p.name for p in (REPO / "configs").glob("*.toml")}
    assert set(SHIPPED) <= present, f"missing in configs/: {set(SHIPPED) - present}"


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    config = cfg.load(path)
    assert config.data.resolution % (max(config.mesh.spatial) * config.alignment) == 0
    assert cfg.load(path) == config  # loading is deterministic


def test_defaults():
    assert cfg.load() == cfg.Config()
    assert cfg.Config().num_devices == 1 and cfg.Config().alignment == 8


def test_overrides_of_every_type():
    config = cfg.load(
        None,
        [
            "data.resolution=64",
            "train.learning_rate=3e-4",
            "train.class_weights=[1, 4, 8.5]",
            "mesh.spatial=[2, 2, 1]",
            "model.remat=true",
            "mesh.partitioner=gspmd",  # a bare word is a string
            'model.dtype="bfloat16"',
        ],
    )
    assert config.data.resolution == 64
    assert config.train.learning_rate == 3e-4
    assert config.train.class_weights == (1.0, 4.0, 8.5)
    assert all(type(w) is float for w in config.train.class_weights)
    assert config.mesh.spatial == (2, 2, 1) and config.num_devices == 4
    assert config.model.remat is True
    assert config.mesh.partitioner == "gspmd" and config.model.dtype == "bfloat16"


def test_overrides_apply_on_top_of_a_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[data]\nresolution = 64\nval_fraction = 0.3\n")
    config = cfg.load(path, ["data.resolution=32"])
    assert config.data.resolution == 32 and config.data.val_fraction == 0.3


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.resolutoin=64", r"unknown config key 'data.resolutoin'.*did you mean 'resolution'"),
        ("model.kernel=5", r"unknown config key 'model.kernel'.*did you mean 'kernel_size'"),
        ("dta.resolution=64", r"unknown config section 'dta'.*did you mean 'data'"),
        ("optimizer.lr=1", r"unknown config section 'optimizer'; allowed: data, model"),
        ("data.resolution=big", r"data.resolution must be an integer, got 'big'"),
        ('data.resolution="64"', r"data.resolution must be an integer, got '64'"),
        ("data.resolution=64.0", r"data.resolution must be an integer, got 64.0"),
        ("data.resolution=true", r"data.resolution must be an integer, got True"),
        ("mesh.spatial=[2.0, 1, 1]", r"mesh.spatial\[0\] must be an integer, got 2.0"),
        ("mesh.spatial=[2, 1]", r"mesh.spatial must be a list of 3 values, got \[2, 1\]"),
        ("train.class_weights=[1, 2, x]", r"train.class_weights must be a list of 3 values"),
        ("model.remat=1", r"model.remat must be true or false, got 1"),
        ("train.learning_rate=fast", r"train.learning_rate must be a number, got 'fast'"),
        ("mesh.partitioner=spmd", r"mesh.partitioner = 'spmd' is not allowed; .*'halo', 'gspmd'"),
        # The library names the API's argument; the CLI says --set (tests/cli).
        ("resolution=64", r"^`overrides` expects section.key=value"),
        ("data.resolution", r"^`overrides` expects section.key=value"),
    ],
)
def test_bad_overrides(override, message):
    with pytest.raises(CtsegError, match=message):
        cfg.load(None, [override])


def test_bad_files(tmp_path):
    with pytest.raises(CtsegError, match="config file not found"):
        cfg.load(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[data\nresolution = 64\n")
    with pytest.raises(CtsegError, match="broken.toml is not valid TOML"):
        cfg.load(broken)
    flat = tmp_path / "flat.toml"
    flat.write_text("data = 64\n")
    with pytest.raises(CtsegError, match="config section 'data' must be a table"):
        cfg.load(flat)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["data.resolution=100", "mesh.spatial=[4, 1, 1]"],
            r"mesh.spatial = \[4, 1, 1\] does not fit data.resolution = 100: along x, "
            r".*multiple of 32",
        ),
        (
            ["data.resolution=64", "mesh.spatial=[1, 1, 3]"],
            r"mesh.spatial = \[1, 1, 3\] does not fit data.resolution = 64: along z",
        ),
        (
            ["data.resolution=16", "mesh.spatial=[2, 1, 1]", "model.kernel_size=5"],
            r"mesh.spatial = \[2, 1, 1\] is too fine for data.resolution = 16 and "
            r"model.depth = 4: at the deepest level a block is 1 voxel\(s\) thick along x, "
            r"less than the 2 halo voxels of a 5³ kernel",
        ),
        (
            ["train.batch_size=3", "mesh.data=2"],
            r"train.batch_size = 3 must be divisible by mesh.data = 2",
        ),
        (["model.kernel_size=4"], r"model.kernel_size must be odd and positive, got 4"),
        (["train.batch_size=0"], r"train.batch_size must be at least 1, got 0"),
        (
            ["data.hu_window=[250, -200]"],
            r"data.hu_window = \[250.0, -200.0\] must be a low and a high HU with low < high",
        ),
        (["data.val_fraction=1.0"], r"data.val_fraction must be in \[0, 1\)"),
        (["mesh.spatial=[0, 1, 1]"], r"mesh.spatial and mesh.data must be positive"),
        (["train.learning_rate=0"], r"train.learning_rate must be positive"),
        (["train.grad_clip=-1"], r"train.grad_clip must be positive, got -1.0"),
        (["train.grad_clip=0"], r"train.grad_clip must be positive"),
        (["train.seed=-3"], r"`train.seed` must not be negative"),
        (["data.split_seed=-1"], r"`data.split_seed` must not be negative"),
        (["train.learning_rate=nan"], r"train.learning_rate must be a finite number, got nan"),
        (["data.hu_window=[-inf, 250]"], r"data.hu_window\[0\] must be a finite number"),
        (["train.class_weights=[0, 0, 0]"], r"train.class_weights must be non-negative"),
        (["model.bn_momentum=1.5"], r"model.bn_momentum must be in \[0, 1\)"),
        (["train.ema_decay=1"], r"train.ema_decay must be in \[0, 1\), got 1"),
        (
            ["augment.phase_liver_hu=[135, 50]"],
            r"augment.phase_liver_hu must be a range \(low, high\)",
        ),
        (
            ["train.frozen_norm_share=1.0"],
            r"train.frozen_norm_share = 1.0 must be in \[0, 1\) and leave at least one",
        ),
        (
            ["train.steps=1", "train.frozen_norm_share=0.6"],
            r"leave at least one of train.steps = 1 to train on each box's own statistics",
        ),
        (["predict.tile=13"], r"predict.tile = 13 must be even"),
        (["predict.tile=-2"], r"predict.tile must be -1 \(auto\), 0 \(whole volume\) or a size"),
    ],
)
def test_invalid_combinations(overrides, message):
    with pytest.raises(CtsegError, match=message) as info:
        cfg.load(None, overrides)
    # The CLI prints errors through rich: no word of the message may read as a markup tag.
    assert render(str(info.value)).plain == str(info.value)


def test_deepest_blocks_thick_enough_for_the_halo_pass():
    # 16 / 2 partitions / 2^(4-1) = 1 voxel per block: enough for a 3³ kernel's 1-voxel halo.
    cfg.load(None, ["data.resolution=16", "mesh.spatial=[2, 1, 1]", "model.kernel_size=3"])
    cfg.load(None, ["data.resolution=32", "mesh.spatial=[2, 1, 1]", "model.kernel_size=5"])
    # An unpartitioned axis pads locally and needs no neighbour.
    cfg.load(None, ["data.resolution=8", "model.kernel_size=7"])


def test_error_messages_are_one_line():
    for overrides in (["data.resolution=100", "mesh.spatial=[4, 1, 1]"], ["data.resolutoin=1"]):
        with pytest.raises(CtsegError) as info:
            cfg.load(None, overrides)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        [
            "data.hu_window=[-150.5, 300]",
            "train.learning_rate=1e-5",
            "mesh.partitioner=gspmd",
            "model.remat=true",
            "mesh.spatial=[4, 2, 1]",
        ],
    ],
)
def test_to_toml_round_trip(tmp_path, overrides):
    config = cfg.load(None, overrides)
    path = tmp_path / "resolved.toml"
    path.write_text(cfg.to_toml(config))
    assert cfg.load(path) == config
    assert cfg.from_dict(cfg.to_dict(config)) == config


def test_reference_lists_every_key():
    reference = cfg.reference_markdown()
    for section, values in cfg.to_dict(cfg.Config()).items():
        for key in values:
            assert f"| `{section}.{key}` |" in reference


def test_the_docs_hold_the_generated_config_reference():
    readme = REPO / "docs" / "reference" / "configuration.md"
    expected = cfg.reference_markdown()
    paste = f"{REFERENCE_START}\n{expected}\n{REFERENCE_END}"
    assert readme.is_file(), f"{readme} is missing; its configuration table needs:\n{paste}"
    match = re.search(
        re.escape(REFERENCE_START) + r"\n(.*?)\n?" + re.escape(REFERENCE_END),
        readme.read_text(),
        re.DOTALL,
    )
    assert match, f"{readme} lacks the config reference markers; paste:\n{paste}"
    assert match.group(1).strip() == expected, (
        f"{readme}'s config reference differs from config.reference_markdown(); "
        f"replace the text between the markers with:\n{expected}"
    )


def _scalar_number_keys():
    for section, values in cfg.to_dict(cfg.Config()).items():
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                yield f"{section}.{key}"


@pytest.mark.parametrize("key", list(_scalar_number_keys()))
def test_every_number_has_a_range(key):
    """A key added without a range check fails here: -10⁹ is nonsense for every one of them."""
    with pytest.raises(CtsegError, match=re.escape(key)):
        cfg.load(None, [f"{key}=-1000000000"])


def test_config_path_that_is_a_folder_says_so(tmp_path):
    with pytest.raises(CtsegError, match="is a folder, not a config file"):
        cfg.load(tmp_path)


def test_a_config_that_is_not_text_is_one_line(tmp_path):
    (tmp_path / "binary.toml").write_bytes(b"\xff\xfe[data]\n")
    with pytest.raises(CtsegError, match="binary.toml is not a TOML file: byte 0 is not UTF-8"):
        cfg.load(tmp_path / "binary.toml")


def test_shortening_a_run_needs_no_second_setting():
    """The frozen phase is a share of the steps: `--set train.steps=100` alone shortens the
    demo, freezing its last third as the full run does."""
    config = cfg.load(REPO / "configs" / "demo.toml", ["train.steps=100"])
    assert config.train.frozen_norm_steps == 33
    assert cfg.load(REPO / "configs" / "demo.toml").train.frozen_norm_steps == 200
