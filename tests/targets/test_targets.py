"""Plans for hardware that is not here: compile-only GPU and TPU devices (`ctseg plan --target`).

What the compiler can prove without the device: the partitioned training step compiles
for a GPU and a TPU target and needs less memory per device than the unpartitioned one,
its halo exchanges are collective-permutes, the tiled inference loop runs on the devices
without host transfers, and a plan that does not fit is reported as such.
"""

import dataclasses
import json
import re
import subprocess
import sys

import pytest
from helpers import REPO, tiny_config

from ctseg.errors import CtsegError
from ctseg.inference.network import tiling
from ctseg.inference.network.jax.plans import plan_inference
from ctseg.model import aot, unet
from ctseg.parallel.partition import make_mesh
from ctseg.parallel.xla_options import OPTIONS
from ctseg.run.trained import TrainedModel
from ctseg.targets import compile as target_compile
from ctseg.targets import process, table
from ctseg.targets.catalogue import names, resolve

# 32³ boxes of a base-2, depth-2 U-Net: split [2, 2, 1], each device holds a quarter.
SMALL = ("data.resolution=32",)
gpu_plugin = pytest.mark.skipif(
    not process.plugin_installed("cuda"), reason="the targets extra is not installed"
)
tpu_plugin = pytest.mark.skipif(
    not process.plugin_installed("tpu"), reason="the targets extra is not installed"
)


def test_targets_are_named_and_bad_ones_are_one_line(tmp_path):
    known = names()
    assert {"h100", "a100-80", "a100-40", "l4", "l40s", "rtx4090"} <= set(known)
    assert {f"tpu-{g}:TOPOLOGY" for g in ("v4", "v5e", "v5p", "v6e")} <= set(known)
    h100 = resolve("h100", 16)
    assert (h100.count, h100.topology, h100.memory) == (16, "1x2x8", 80 * 2**30)
    v5e = resolve("tpu-v5e:4x4")
    assert (v5e.count, v5e.topology, v5e.accelerator_type) == (16, "v5e:4x4", "v5litepod-16")
    assert resolve("tpu-v5p:2x2x4").accelerator_type == "v5p-32"
    with pytest.raises(CtsegError, match="no target 'h1000'; known: a100-40"):
        resolve("h1000")
    with pytest.raises(CtsegError, match="a v5e topology has 2 sides, e.g. tpu-v5e:2x2"):
        resolve("tpu-v5e:4x4x4")
    with pytest.raises(CtsegError, match="tpu-v9:2x2 is no TPU slice"):
        resolve("tpu-v9:2x2")
    with pytest.raises(CtsegError, match="`devices` does not apply to tpu-v5e:2x2"):
        resolve("tpu-v5e:2x2", devices=4)
    with pytest.raises(CtsegError, match="give a multiple of 8"):
        resolve("h100", devices=12)
    (tmp_path / "mine.txtpb").write_text("device_memory_size: 5\n")
    with pytest.raises(CtsegError, match="mine.txtpb is not a GPU target description"):
        resolve("", target_file=tmp_path / "mine.txtpb")


def test_without_the_extra_the_target_says_what_to_install(monkeypatch):
    monkeypatch.setattr(process, "plugin_installed", lambda platform: False)
    with pytest.raises(CtsegError, match=r"needs libtpu, which is not installed: pip install"):
        process.plan_on_target(tiny_config(*SMALL), resolve("tpu-v5e:2x2"))


def test_the_compile_child_has_the_options_of_a_command_on_the_device(monkeypatch):
    seen = {}

    def child(command, stdin, env):
        seen.update(env)
        return subprocess.CompletedProcess(command, 0, "{}", "")

    monkeypatch.setattr(process, "plugin_installed", lambda platform: True)
    monkeypatch.setattr(process, "run_child", child)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    process.plan_on_target(tiny_config(*SMALL), resolve("h100"))
    assert seen["XLA_FLAGS"].split() == list(OPTIONS)


@pytest.fixture(scope="module")
def h100s():
    target = resolve("h100", 4)
    return target, target_compile.devices_of(target)


def _train_step(config, devices):
    mesh = make_mesh(config.mesh.spatial, 1, devices)
    graphdef, state = aot.replicated_abstract_state(config, mesh)
    image, label = aot.abstract_batch(config, mesh)
    return aot.compile_train_step(graphdef, config, mesh, state, image, label)


# Where a GPU's memory is compared: cuBLAS's 4 MiB of workspace per matrix product is the
# same on every device, and at 32³ as large as a tiny model's activations.
MEMORY = ("data.resolution=64",)


@gpu_plugin
def test_partitioned_training_on_gpus_halves_memory_with_halo_exchanges(h100s):
    _, devices = h100s
    split = _train_step(tiny_config(*MEMORY, "mesh.spatial=[2,2,1]"), devices)
    whole = _train_step(tiny_config(*MEMORY), devices[:1])
    assert aot.memory_of(split).total < 0.5 * aot.memory_of(whole).total
    assert "collective-permute" in split.as_text()  # the halo exchange, as XLA compiled it
    assert "collective-permute" not in whole.as_text()
    # The image's convolution runs as matrix products (`image_conv`): cuDNN computes the
    # weights' gradient of every other convolution, of none with one input channel.
    for step in (split, whole):
        filters = [line for line in step.as_text().splitlines() if "convBackwardFilter" in line]
        one_channel = r"= \(\w+\[\d+,(1,3,3,3|3,3,3,1)\]"  # channels first or last
        assert filters and not any(re.search(one_channel, f) for f in filters)


@gpu_plugin
def test_tiled_inference_on_gpus_loops_on_the_devices(h100s):
    """Each stage is one program looping over its windows (a while loop) with nothing sent
    to or from the host inside it."""
    _, devices = h100s
    config = tiny_config(*SMALL)
    graphdef, params, stats = unet.abstract(config.model)
    model = TrainedModel(config, graphdef, params, stats, step=0)
    stages = tiling.plan_stages(config, 8, (32, 32, 32))
    chosen = plan_inference(model, (32, 32, 32), stages, devices, 80 * 2**30)
    assert len(chosen.programs) == len(stages) == 3
    for program in chosen.programs:
        text = program.as_text()
        assert "while" in text
        for host_transfer in ("is_host_transfer=true", "outfeed", "infeed", "callback"):
            assert host_transfer not in text


@gpu_plugin
def test_tiles_of_a_model_trained_with_remat_compile_for_gpus(h100s):
    """Compiling lits512_16way (model.remat) for a GPU target revealed that a tiled stage
    could not be traced: the checkpointed level updated its state inside the stage's
    window loop. Inference runs levels plainly now."""
    config = tiny_config(*SMALL, "model.remat=true")
    graphdef, params, stats = unet.abstract(config.model)
    model = TrainedModel(config, graphdef, params, stats, step=0)
    stages = tiling.plan_stages(config, 8, (32, 32, 32))
    chosen = plan_inference(model, (32, 32, 32), stages, h100s[1][:1], 80 * 2**30)
    assert len(chosen.programs) == len(stages)


@gpu_plugin
def test_a_plan_that_does_not_fit_says_so_and_what_would(h100s, tmp_path):
    """A GPU of 70 % of what one device's training step needs: training does not fit one;
    the fewest partitions that fit, and the largest grid for the one, are found by
    compiling."""
    config = tiny_config(*MEMORY)
    needed = aot.memory_of(_train_step(config, h100s[1][:1])).total
    memory = int(0.7 * needed)
    # Far smaller than any GPU, so that it compiles in seconds: a target file of it would be
    # refused (below 1 GiB), so the target is made here.
    h100 = resolve("h100")
    spec = h100.gpu_spec.replace(str(80 * 2**30), str(memory))
    target = dataclasses.replace(h100, name="small-gpu", memory=memory, gpu_spec=spec)
    result = target_compile.plan_target(config, target)
    # XLA rematerialises to the device's memory (less than `needed`), but not enough.
    assert result["train"]["fits"] is False
    assert 0.85 * memory < result["train"]["train_bytes"] <= needed
    fewest = result["fewest_partitions"]
    assert fewest["fits"] and fewest["devices"] == 2 and fewest["spatial"] == [2, 1, 1]
    assert fewest["train_bytes"] <= 0.85 * memory
    assert 0 < result["largest_resolution"] < 64


@tpu_plugin
def test_partitioned_training_compiles_for_a_tpu_slice():
    target = resolve("tpu-v5e:2x2")
    devices = target_compile.devices_of(target)
    assert len(devices) == 4 and target_compile.per_device_memory(target, devices) == 16 * 2**30
    split = _train_step(tiny_config("mesh.spatial=[2,2,1]"), devices)
    assert "collective-permute" in split.as_text()
    assert aot.memory_of(split).total < 16 * 2**30


@gpu_plugin
def test_ctseg_plan_target_compiles_in_a_child_and_writes_json(tmp_path):
    out = tmp_path / "plan.json"
    command = [sys.executable, "-m", "ctseg.cli.main", "plan", "--target", "h100"]
    command += ["--devices", "4", "--set", "data.resolution=16", "--set", "model.depth=2"]
    command += ["--set", "model.base_filters=2", "--set", "mesh.spatial=[2,2,1]"]
    command += ["--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "planning for 4 × NVIDIA H100 80GB HBM3 (80 GiB each)" in done.stdout
    assert "training [2, 2, 1] over 4 device(s)" in done.stdout and ": fits" in done.stdout
    result = json.loads(out.read_text())["target"]
    assert result["train"]["fits"] and result["predict"]["plan"].startswith("whole volume")


def test_the_targets_table_is_rendered_from_its_compiled_cells():
    """docs/reference/targets.md shows exactly what `make targets-table` compiled."""
    page = (REPO / "docs" / "reference" / "targets.md").read_text()
    found = page[page.index(table.START) + len(table.START) : page.index(table.END)].strip()
    expected = table.render(REPO / "docs" / "reference" / "targets")
    assert found == expected, f"run `make targets-table`, or paste:\n{expected}"


@gpu_plugin
def test_augmentation_compiles_for_gpus_partition_by_partition(h100s):
    """The devices' augmentation program, at its largest blocks, for 4 GPUs: the blur's
    halos are collective-permutes, a box's statistics all-gathers, nothing goes by the
    host; `ctseg plan --target` reports its memory beside the step's."""
    from ctseg.training.augment import Augmenter

    config = tiny_config(
        *SMALL,
        "mesh.spatial=[2,2,1]",
        "augment.rotation_p=0.5",
        "augment.blur_p=0.5",
        "augment.gamma_p=0.5",
    )
    target, devices = h100s
    augmenter = Augmenter(config, make_mesh((2, 2, 1), 1, devices), 32, (32, 32, 32))
    text = augmenter.compiled.as_text()
    assert "collective-permute" in text and "all-gather" in text
    for host_transfer in ("is_host_transfer=true", "outfeed", "infeed", "callback"):
        assert host_transfer not in text
    entry = target_compile.training(config, devices, target.memory)
    assert entry["augment_block"] == list(augmenter.block) == [34, 34, 34]
    assert entry["augment_compile_seconds"] > 0 and entry["train_compile_seconds"] > 0
    assert 0 < entry["augment_bytes"] < entry["train_bytes"]
