"""The GPU check's plumbing, on the CPU: its commands run in its work folder (started in a
checkout, `python -m ctseg` would import the checkout's ctseg/, which lacks the command
line), every command's output is kept, and `--only` refuses a check it does not know."""

import gzip
import importlib.util
import json
import subprocess
import sys
import tarfile

import pytest
from helpers import REPO

SCRIPT = REPO / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_a_command_runs_in_the_work_folder_and_its_output_is_kept(gpu_check, tmp_path):
    settings = gpu_check.Settings("cpu", True, tmp_path)
    code = "import os, sys; print(os.getcwd()); print('x', file=sys.stderr)"
    where = [sys.executable, "-c", code]
    _, out = gpu_check.run(settings, "where", where, 60)
    assert out.strip() == str(tmp_path)
    log = (tmp_path / "logs" / "where.log").read_text()
    assert str(tmp_path) in log and "x" in log
    failing = [sys.executable, "-c", "raise SystemExit('the last line')"]
    with pytest.raises(RuntimeError, match="the last line"):
        gpu_check.run(settings, "failing", failing, 60)
    assert "the last line" in (tmp_path / "logs" / "failing.log").read_text()


def test_only_refuses_an_unknown_check(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "--only", "train,nonsense"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert "no check named nonsense" in done.stderr


def test_mirror_copies_the_results_and_the_packed_logs(gpu_check, tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "logs").mkdir(parents=True)
    (work / "gpu_check.json").write_text('{"train": {"first_step_seconds": 1.5}}')
    (work / "logs" / "train.log").write_text("$ ctseg train …\n")
    gpu_check.mirror(work, out)
    gpu_check.mirror(work, out)  # again, as after the next check: replaced whole
    assert json.loads((out / "gpu_check.json").read_text())["train"]["first_step_seconds"] == 1.5
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert tar.extractfile("logs/train.log").read() == "$ ctseg train …\n".encode()
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "logs.tar.gz"]


def test_the_profile_sums_each_device_timeline_per_step(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "profile_step", REPO / "scripts" / "profile_step.py"
    )
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #1"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
    ]
    kernels = [("conv", 600), ("fusion.1", 300), ("conv", 900), ("fusion.2", 200)]
    events = [{"ph": "X", "pid": 1, "tid": 7, "name": n, "dur": us} for n, us in kernels]
    events.append({"ph": "X", "pid": 2, "tid": 3, "name": "python", "dur": 10**6})
    trace = tmp_path / "t.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    figures = profile.per_step(profile.timelines(trace), steps=2, device="gpu")
    assert list(figures) == ["/device:GPU:0 / Stream #1"]  # the host's time left out
    timeline = figures["/device:GPU:0 / Stream #1"]
    assert timeline["ms_per_step"] == 1.0 and timeline["names"] == 3
    assert timeline["top"] == [["conv", 0.75], ["fusion.1", 0.15], ["fusion.2", 0.1]]


def test_the_first_convolution_check_times_both_of_its_ways(gpu_check, tmp_path):
    """`conv1`, quick on the CPU: cuDNN's way (here XLA:CPU's) and ctseg's matrix products,
    each pass; PyTorch's only on a GPU, so the ratio row shows a dash."""
    settings = gpu_check.Settings("cpu", True, tmp_path)
    result = gpu_check.first_conv(settings)
    assert set(result) == {"jax padding", "jax matrix"}
    assert all(result[v]["wgrad_ms"] > 0 and result[v]["cin"] == 1 for v in result)
    row = next(
        line for line in gpu_check.table({"conv1": result}).splitlines() if "first conv" in line
    )
    assert row.split()[-2:] == ["–", "–"]


def test_the_plans_check_times_the_whole_volume_and_fixed_windows(gpu_check, tmp_path):
    """`plans`, quick on the CPU: both ways of running the network over one box, each
    compiled and run, and both shown in the table."""
    settings = gpu_check.Settings("cpu", True, tmp_path)
    result = gpu_check.plans(settings)
    assert set(result) == {"whole", "windows"}
    assert result["whole"]["plan"].startswith("whole volume")
    assert result["windows"]["plan"].startswith("fixed windows")
    assert all(result[m]["compile_seconds"] > 0 and result[m]["run_seconds"] > 0 for m in result)
    lines = gpu_check.table({"plans": result}).splitlines()
    network = [line for line in lines if line.startswith(("network", "  run"))]
    # Measured, without a target: the line ends in its seconds and the dash for "met".
    assert len(network) == 4 and all(line.split()[-2].endswith("s") for line in network)
