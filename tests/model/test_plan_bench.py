"""`ctseg plan` and `ctseg bench`: abstract compilation, memory and halo accounting, timing."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import TINY, tiny_config
from typer.testing import CliRunner

import ctseg.cli.main  # noqa: F401  (registers the commands)
from ctseg.cli.app import app
from ctseg.errors import CtsegError
from ctseg.model import aot, bench, plan, unet
from ctseg.parallel.layouts import auto_spatial

DEPTH_3 = ["model.depth=3", "mesh.spatial=[2,2,1]"]


@pytest.fixture(scope="module")
def tiny_plan():
    return plan.plan(tiny_config(*DEPTH_3))


def test_plan_covers_the_layout_and_the_unpartitioned_one(tiny_plan):
    rows = [(p.partitions, p.mode, p.partitioner) for p in tiny_plan]
    assert rows == [(4, "train", "halo"), (4, "predict", "halo")] + [
        (1, "train", "halo"),
        (1, "predict", "halo"),
    ]
    by_key = {(p.partitions, p.mode): p for p in tiny_plan}
    assert by_key[4, "train"].local_shape == (1, 8, 8, 16, 1)
    for mode in plan.MODES:
        assert by_key[4, mode].memory.total < by_key[1, mode].memory.total
        assert by_key[1, mode].halo_bytes == 0
        assert by_key[4, mode].halo_bytes > 0
        assert by_key[4, mode].flops > 0
    # Training exchanges in the backward pass as well.
    assert by_key[4, "train"].halo_bytes == 2 * by_key[4, "predict"].halo_bytes


def test_halo_bytes_match_a_hand_count():
    # depth 2, base 2, float32, batch 1, 16³ split [2, 2, 1]: local block 8×8×16, 4×4×8 below.
    config = tiny_config("mesh.spatial=[2,2,1]")

    def conv(cin, bx, by, bz):
        # x faces: by·bz; y faces on the x-extended block: (bx+2)·bz; z is not split.
        return 2 * 1 * (by * bz + (bx + 2) * bz) * cin * 4

    forward = (
        conv(1, 8, 8, 16)  # level 0, first conv
        + conv(2, 8, 8, 16)  # level 0, second conv
        + conv(2, 4, 4, 8)  # level 1, first conv
        + conv(4, 4, 4, 8)  # level 1, second conv
        + conv(4, 8, 8, 16)  # decoder level 0, after the skip concatenation
        + conv(2, 8, 8, 16)
    )
    assert plan.halo_bytes(config, "predict") == forward
    assert plan.halo_bytes(config, "train") == 2 * forward


@pytest.mark.parametrize(
    "partitions,split",
    [(1, (1, 1, 1)), (2, (2, 1, 1)), (4, (2, 2, 1)), (8, (2, 2, 2)), (16, (4, 4, 1))],
)
def test_auto_spatial(partitions, split):
    assert auto_spatial(partitions) == split


def test_bench_refuses_a_split_that_does_not_divide_the_grid():
    config = tiny_config(DEPTH_3[0])  # depth 3: blocks must be multiples of 4
    # 16 / 3 partitions along x is not a multiple of the alignment 2^(depth-1) = 4.
    with pytest.raises(CtsegError, match=r"3 partitions split \[3, 1, 1\]"):
        bench.bench(config, [(1, 1, 1), auto_spatial(3)], ["halo"], steps=1)


def test_bench_returns_one_result_per_layout():
    # One level (two convolutions and the head): the schema, not the model, is under test.
    config = tiny_config("data.resolution=8", "model.depth=1")
    seen = []
    results = bench.bench(
        config,
        [auto_spatial(1), auto_spatial(2)],
        ["halo"],
        steps=2,
        progress=lambda done, total, _: seen.append((done, total)),
    )
    assert [r.to_json()["spatial"] for r in results] == [[1, 1, 1], [2, 1, 1]]
    for r in results:
        assert set(r.to_json()) == {
            "partitions",
            "partitioner",
            "spatial",
            "step_seconds",
            "per_device_bytes",
            "voxels_per_second",
            "flops_per_step",
            "tflops_per_second",
        }
        assert r.step_seconds > 0 and r.per_device_bytes > 0 and r.flops_per_step > 0
        assert r.voxels_per_second == pytest.approx(8**3 / r.step_seconds)
    assert seen[-1] == (2, 2)


def test_peak_is_a_timed_matrix_product_and_shared_by_simulated_devices():
    peak = bench.measure_peak("float32", size=64, repeats=2)
    assert (peak.platform, peak.dtype, peak.size, peak.processes) == ("cpu", "float32", 64, 1)
    assert peak.flops_per_second > 0
    # Simulated CPU devices share one host's cores: a 16-device layout is held to one
    # host's peak, not sixteen.
    result = bench.BenchResult(16, "halo", (4, 4, 1), 16, 2.0, 1, 8**3, 4 * peak.flops_per_second)
    assert peak.utilisation(result) == pytest.approx(2.0)


def test_plan_cli_writes_the_json_schema(tmp_path):
    out = tmp_path / "plan.json"
    small = [*TINY, "mesh.spatial=[2,1,1]"]
    args = ["plan", "--json", str(out)] + [f"--set={item}" for item in small]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "receptive field radius" in result.output
    layouts = json.loads(out.read_text())["layouts"]
    assert {(d["partitions"], d["mode"]) for d in layouts} == {
        (2, "train"),
        (2, "predict"),
        (1, "train"),
        (1, "predict"),
    }
    for d in layouts:
        assert isinstance(d["per_device_bytes"], int) and isinstance(d["halo_bytes"], int)
        assert isinstance(d["flops"], float) and len(d["local_shape"]) == 5
    # What `ctseg train` would do here: on this CPU machine, the config's own mesh.
    here = json.loads(out.read_text())["this_machine"]
    assert here["spatial"] == [2, 1, 1] and here["fits"] is None
    words = " ".join(result.output.split())  # as rich wraps them
    assert "this machine: 16 simulated CPU devices" in words
    assert "training [2, 1, 1] (2 partitions)" in words


def test_bench_cli_reports_throughput_against_the_measured_peak(tmp_path):
    out = tmp_path / "bench.json"
    tiny = [*TINY, "data.resolution=8", "model.depth=1"]
    args = ["bench", "--partitions", "1", "--partitioner", "halo", "--steps", "1", "--peak"]
    args += ["--json", str(out)] + [f"--set={item}" for item in tiny]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "peak:" in result.output and "float32 matrix product" in result.output
    report = json.loads(out.read_text())
    assert report["peak"]["dtype"] == "float32" and report["peak"]["tflops_per_second"] > 0
    (entry,) = report["results"]
    share = entry["tflops_per_second"] / report["peak"]["tflops_per_second"]
    assert entry["share_of_peak"] == pytest.approx(share)


@pytest.mark.parametrize(
    ("option", "value"), [("--partitions", ",,"), ("--partitioner", ","), ("--partitions", "x")]
)
def test_bench_lists_that_name_nothing_are_one_line(option, value):
    """`--partitions ,,` raised, and `--partitioner ,` printed an empty table with exit 0."""
    result = CliRunner().invoke(app, ["bench", option, value, "--steps", "1"])
    assert isinstance(result.exception, CtsegError), result.output
    assert option in str(result.exception)


def test_flops_are_counted_before_xla_hands_a_gpus_convolutions_to_cudnn():
    """On a GPU the optimised program's count leaves cuDNN's convolutions out: only the
    lowered program's count is used there; elsewhere the compiled one stands in."""

    def stage(flops):
        return SimpleNamespace(cost_analysis=lambda: None if flops is None else {"flops": flops})

    def mesh(platform):
        return SimpleNamespace(devices=np.array([SimpleNamespace(platform=platform)] * 4), size=4)

    assert aot.flops_of(stage(7.0), stage(5.0), mesh("gpu")) == 28.0
    assert aot.flops_of(stage(None), stage(5.0), mesh("gpu")) is None
    assert aot.flops_of(stage(None), stage(5.0), mesh("tpu")) == 20.0


def test_the_step_s_flops_are_its_convolutions_and_little_more():
    # The plain count: 2 × k³ × c_in × c_out per output voxel for every convolution, and
    # the backward pass's two more (input and weights' gradients).
    config = tiny_config()
    r, k = config.data.resolution, config.model.kernel_size
    widths = unet.level_widths(config.model)
    forward = 0
    for level, width in enumerate(widths):
        voxels = (r // 2**level) ** 3
        first_in = 1 if level == 0 else widths[level - 1]
        forward += 2 * k**3 * voxels * (first_in * width + width * width)
        if level < len(widths) - 1:  # its decoder level: [skip, up] in, then width
            forward += 2 * k**3 * voxels * (2 * width * width + width * width)
    result = bench.time_layout(bench.layout_config(config, (1, 1, 1), "halo"), steps=1)
    assert 3 * forward <= result.flops_per_step <= 1.5 * 3 * forward
