"""Hostile and careless `ctseg plan --target` options, round four: impossible memories and
topologies, device counts beyond any plan, a name beside a target file, a report over an
input, each one line before the compile child starts; and the child dies with the
command, whether it is stopped by SIGTERM or killed outright."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, TINY
from typer.testing import CliRunner

import ctseg.cli.main  # noqa: F401  (registers the commands)
from ctseg.cli.app import app
from ctseg.errors import CtsegError
from ctseg.targets import process
from ctseg.targets.catalogue import MOST_DEVICES, resolve

runner = CliRunner()
H100 = (REPO / "ctseg" / "targets" / "specs" / "h100.txtpb").read_text()
gpu_plugin = pytest.mark.skipif(
    not process.plugin_installed("cuda"), reason="the targets extra is not installed"
)


def _spec(tmp_path: Path, name: str, old: str, new: str) -> Path:
    assert old in H100
    path = tmp_path / f"{name}.txtpb"
    path.write_text(H100.replace(old, new))
    return path


@pytest.mark.parametrize(
    "name, devices, pattern",
    [
        ("h100", 1_000_000, r"`devices` must be from 1 to 1024 GPUs \(128 hosts of 8\)"),
        ("h100", 0, r"`devices` must be from 1 to 1024"),
        ("h100", MOST_DEVICES + 8, r"`devices` must be from 1 to 1024"),
        ("tpu-v5e:0x4", None, r"every side of a topology must be at least 1 chip"),
        ("tpu-v5p:2x0x2", None, r"every side of a topology must be at least 1 chip"),
        ("tpu-v5e:64x64", None, r"is 4096 chips, more than a v5e pod's 256"),
        ("tpu-v4:16x16x16", None, r"ctseg plans for at most 1024 devices"),
        ("tpu-v6e:1000000x1000000", None, r"more than a v6e pod's 256"),
    ],
)
def test_counts_and_topologies_beyond_reach_are_one_line(name, devices, pattern):
    with pytest.raises(CtsegError, match=pattern):
        resolve(name, devices)


def test_the_largest_counts_within_reach_still_resolve():
    assert resolve("h100", MOST_DEVICES).topology == "1x128x8"
    assert resolve("tpu-v5e:16x16").count == 256
    assert resolve("tpu-v4:8x8x16").count == 1024


@pytest.mark.parametrize(
    "old, new, pattern",
    [
        ("85899345920", "1000", r"device_memory_size: 1000 is no GPU's memory"),
        ("85899345920", "0", r"device_memory_size: 0 is no GPU's memory"),
        ("85899345920", str(2**60), r"is no GPU's memory; give its bytes, from 1073741824"),
        ("core_count: 132", "core_count: 0", r"core_count: 0 must be a positive number"),
        ("clock_rate_ghz: 1.98", "clock_rate_ghz: -1", r"clock_rate_ghz: -1 must be a positive"),
        ("threads_per_warp: 32", "threads_per_warp: 0", r"threads_per_warp: 0 must be"),
    ],
)
def test_target_files_with_impossible_values_are_one_line(tmp_path, old, new, pattern):
    path = _spec(tmp_path, "mine", old, new)
    with pytest.raises(CtsegError, match=pattern):
        resolve("", target_file=path)
    # Through the command: refused before the compile child starts.
    result = runner.invoke(app, ["plan", "--target-file", str(path), *_tiny()])
    assert isinstance(result.exception, CtsegError) and re.search(pattern, str(result.exception)), (
        result.output
    )


def _tiny():
    return [item for override in TINY for item in ("--set", override)]


def test_a_name_beside_a_target_file_is_refused(tmp_path):
    path = _spec(tmp_path, "mine", "core_count: 132", "core_count: 132")
    result = runner.invoke(app, ["plan", "--target", "nonsense", "--target-file", str(path)])
    assert isinstance(result.exception, CtsegError), result.output
    assert str(result.exception).startswith(
        "--target nonsense and --target-file " + str(path) + " both name the target"
    )


def test_the_report_never_replaces_the_target_file_even_with_force(tmp_path):
    path = _spec(tmp_path, "mine", "core_count: 132", "core_count: 132")
    for extra in ([], ["--force"]):
        args = ["plan", "--target-file", str(path), "--json", str(path), *extra]
        result = runner.invoke(app, args)
        assert isinstance(result.exception, CtsegError), result.output
        assert "is an input of this command" in str(result.exception)
    assert path.read_text() == H100


def test_a_child_killed_by_a_signal_is_named_and_library_lines_are_not_the_cause():
    stub = (
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
        "I0000 00:00:1795675661.403220    4932 cudart_stub.cc:31] Could not find cuda drivers "
        "on your machine, GPU will not be used.\n"
    )
    done = subprocess.CompletedProcess([], -signal.SIGFPE, "", stub)
    cause = process._cause(done)
    assert cause.startswith("the compiler crashed with SIGFPE") and "cudart" not in cause
    traceback = stub + "Traceback (most recent call last):\nValueError: no such thing\n"
    assert process._cause(subprocess.CompletedProcess([], 1, "", traceback)) == (
        "ValueError: no such thing"
    )


# ---------------------------------------------------------------- the child ends with us


def _children(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"ctseg.targets.child" in cmdline:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie has ended; only its parent's wait is left


def _wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


@gpu_plugin
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_the_compile_child_dies_with_the_command(tmp_path, how):
    command = [sys.executable, "-m", "ctseg.cli.main", "plan", "--target", "h100", *_tiny()]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=tmp_path
    )
    children: list[int] = []
    try:
        assert _wait_for(lambda: bool(children.extend(_children(parent.pid)) or children), 60)
        child = children[0]
        parent.send_signal(how)
        parent.wait(timeout=30)
        assert _wait_for(lambda: not _alive(child), 10), f"{how.name}: the child lives on"
        if how == signal.SIGTERM:  # the command still dies of the signal, as before
            assert parent.returncode == -signal.SIGTERM
    finally:
        parent.kill()
        parent.wait()
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
