"""Hostile and careless `ctseg synth` options, round four: seeds numpy and JAX cannot take
and sizes this machine cannot hold are one `error:` line before anything is written or
allocated (no folder, no lock, no synth.json)."""

import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import ctseg.cli.main  # noqa: F401  (registers the commands)
from ctseg.cli.app import app
from ctseg.errors import CtsegError
from ctseg.synth import dataset
from ctseg.synth.dataset import check_size, write_dataset

runner = CliRunner()


@pytest.mark.parametrize(
    "options, pattern",
    [
        (["--seed", "-1"], r"^--seed must not be negative, got -1$"),
        (["--seed", str(2**31)], r"^--seed must be a seed from 0 to 2147483647 .*2147483648$"),
        (["--seed", str(2**70)], r"^--seed must be a seed from 0 to 2147483647"),
        (["--size", "3000"], r"^--size 3000: a case of up to 3000×3000×7500 voxels needs about"),
        (["--size", "100000"], r"^--size 100000: .* available here; use --size \d+ or less$"),
    ],
)
def test_refused_before_anything_is_written(tmp_path, options, pattern):
    out = tmp_path / "synth"
    result = runner.invoke(app, ["synth", str(out), "--cases", "1", *options])
    assert isinstance(result.exception, CtsegError), result.output
    assert re.search(pattern, str(result.exception)), str(result.exception)
    assert not out.exists()


def test_the_library_refuses_too(tmp_path):
    with pytest.raises(CtsegError, match="`seed` must not be negative"):
        write_dataset(tmp_path / "a", 1, 16, -3)
    with pytest.raises(CtsegError, match="`size` 5000"):
        write_dataset(tmp_path / "b", 1, 5000, 0)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_size_is_judged_by_the_memory_available(monkeypatch):
    # 96 pixels: a case of up to 96×96×240 voxels, about 50 MiB while drawn.
    check_size(96, available=2**30)
    with pytest.raises(CtsegError, match=r"more than the 10.0 MiB available here; use `size`"):
        check_size(96, available=10 * 2**20)
    # The size it suggests fits.
    message = ""
    try:
        check_size(512, available=100 * 2**20)
    except CtsegError as exc:
        message = str(exc)
    suggested = int(re.search(r"use `size` (\d+) or less", message).group(1))
    check_size(suggested, available=100 * 2**20)
    with pytest.raises(CtsegError):
        check_size(suggested + 1, available=100 * 2**20)
    # By default, this machine's memory (ctseg.memory.host_memory).
    monkeypatch.setattr(dataset, "host_memory", lambda: 10 * 2**20)
    with pytest.raises(CtsegError, match="10.0 MiB available"):
        check_size(96)


def test_the_command_says_it_in_one_line_with_status_2(tmp_path):
    command = [sys.executable, "-m", "ctseg.cli.main", "synth", str(tmp_path / "s")]
    done = subprocess.run([*command, "--size", "100000"], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: --size 100000: ") and done.stderr.count("\n") == 1
    assert not (tmp_path / "s").exists()
