"""Hostile and careless use of the measuring scripts, round five: `scripts/gpu_check.py` and
`scripts/bench_predict512.py` held to the command line's standard. A mistake in the
arguments is one line (`error: …`, exit status 2) before anything is made, a check that
failed is exit status 1, their children run this Python's ctseg whatever lies in the
working folder, and a work folder of another request is refused, not measured as this one.
"""

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from helpers import REPO, tiny_config

from ctseg import config as cfg

GPU_CHECK = REPO / "scripts" / "gpu_check.py"
BENCH = REPO / "scripts" / "bench_predict512.py"
# A module of the user's, named as the package, where they stand.
USERS_CTSEG = "import sys; print('the user module'); sys.exit(3)\n"


def _module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu_check():
    yield _module(GPU_CHECK)
    del sys.modules["gpu_check"]


@pytest.fixture(scope="module")
def bench():
    yield _module(BENCH)
    del sys.modules["bench_predict512"]


def _script(script: Path, *args, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    command = [sys.executable, str(script), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=timeout)


def _one_line(done: subprocess.CompletedProcess, *words: str) -> None:
    """Exit status 2 and one `error:` line, naming `words`."""
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("error: ") and all(w in lines[0] for w in words), lines[0]


def _read_only_folder(tmp_path: Path) -> Path:
    """A folder no file can be written in: permission bits do not stop root, sysfs does."""
    if os.geteuid() == 0:
        return Path("/sys/kernel")
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o555)
    return folder


@pytest.fixture
def tiny_toml(tmp_path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(cfg.to_toml(tiny_config("mesh.spatial=[1,1,1]", "model.base_filters=4")))
    return path


# ------------------------------------------------------------------ gpu_check.py


@pytest.mark.parametrize("only", ["", ",", "train,,predict"])
def test_gpu_check_refuses_an_only_that_names_no_check(tmp_path, only):
    done = _script(GPU_CHECK, tmp_path / "w", "--only", only, "--device", "cpu", cwd=tmp_path)
    _one_line(done, "--only")
    assert not (tmp_path / "w").exists()


def test_gpu_check_says_an_unknown_check_in_one_line(tmp_path):
    done = _script(GPU_CHECK, tmp_path / "w", "--only", "train,nonsense", cwd=tmp_path)
    _one_line(done, "no check named nonsense")


def test_gpu_check_refuses_a_work_or_mirror_folder_it_cannot_write_in(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    read_only = _read_only_folder(tmp_path)
    only = ["--only", "extents", "--device", "cpu", "--quick"]
    _one_line(_script(GPU_CHECK, a_file, *only, cwd=tmp_path), str(a_file), "not a folder")
    _one_line(_script(GPU_CHECK, read_only, *only, cwd=tmp_path), "cannot write", str(read_only))
    work = tmp_path / "w"
    for mirror in (a_file, read_only):
        done = _script(GPU_CHECK, work, *only, "--mirror", mirror, cwd=tmp_path)
        _one_line(done, str(mirror))
        assert not work.exists()  # refused before anything was made
    assert a_file.read_text() == "mine"


def test_gpu_check_exits_1_when_a_check_failed(tmp_path):
    """`extents` without the predict check's run and scan fails: its row says so, and the
    status too (it was 0, the only check run having failed)."""
    done = _script(GPU_CHECK, tmp_path / "w", "--only", "extents", "--device", "cpu", "--quick",
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "extents failed" in done.stdout


def test_gpu_check_runs_this_python_s_ctseg_beside_a_user_s_ctseg_py(gpu_check, tmp_path):
    (tmp_path / "ctseg.py").write_text(USERS_CTSEG)  # in the work folder, where it runs
    settings = gpu_check.Settings("cpu", True, tmp_path)
    _, out = gpu_check.run(settings, "version", [*gpu_check.CTSEG, "--version"], 60)
    assert out.startswith("ctseg ")


def test_gpu_check_extents_takes_the_predict_check_s_scan_not_a_stray_file(gpu_check, tmp_path):
    """A file named `.nii.gz` beside the scan (sorted first) is not taken for it."""
    settings = gpu_check.Settings("gpu", False, tmp_path)
    work = tmp_path / "predict512"  # the predict check's, at full size
    (work / "run").mkdir(parents=True)
    (work / "scan").mkdir()
    nib.save(nib.Nifti1Image(np.zeros((20, 20, 20), np.int16), np.eye(4)),
             work / "scan" / "volume-0.nii.gz")  # fmt: skip
    (work / "scan" / ".nii.gz").write_bytes(b"not a scan")
    ran = []

    def predicted(s, name, command, timeout):
        ran.append(command)
        raise RuntimeError("stop here")

    gpu_check.run, run = predicted, gpu_check.run
    try:
        with pytest.raises(RuntimeError, match="stop here"):
            gpu_check.extents(settings)
    finally:
        gpu_check.run = run
    cut = sorted((tmp_path / "extents").iterdir())
    assert len(cut) == gpu_check.EXTENTS and nib.load(cut[0]).shape[:2] == (20, 20)


# ------------------------------------------------------------------ bench_predict512.py


def test_bench_refuses_a_size_synth_cannot_draw(tmp_path, tiny_toml):
    done = _script(BENCH, tmp_path / "w", "--size", "8", "--config", tiny_toml, "--device",
                   "cpu", "--cold-only", cwd=tmp_path)  # fmt: skip
    _one_line(done, "--size 8")
    assert not (tmp_path / "w").exists()


def test_bench_refuses_a_missing_config(tmp_path):
    done = _script(BENCH, tmp_path / "w", "--config", tmp_path / "nowhere.toml", "--device",
                   "cpu", "--cold-only", "--size", "16", cwd=tmp_path)  # fmt: skip
    _one_line(done, "nowhere.toml")
    assert not (tmp_path / "w").exists()


def test_bench_refuses_a_work_folder_that_is_a_file(tmp_path, tiny_toml):
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    done = _script(BENCH, a_file, "--config", tiny_toml, "--device", "cpu", "--size", "16",
                   cwd=tmp_path)  # fmt: skip
    _one_line(done, str(a_file))
    assert a_file.read_text() == "mine"


def test_bench_checkout_must_hold_a_ctseg(tmp_path, tiny_toml):
    """Else its child imports the installed ctseg, measured as that checkout's."""
    for checkout in (tmp_path / "nowhere", tmp_path):
        done = _script(BENCH, tmp_path / "w", "--config", tiny_toml, "--device", "cpu",
                       "--size", "16", "--cold-only", "--checkout", checkout,
                       cwd=tmp_path, timeout=120)  # fmt: skip
        _one_line(done, "--checkout", str(checkout))
    assert not (tmp_path / "w").exists()


def test_bench_refuses_a_run_of_another_config(tmp_path, tiny_toml):
    work = tmp_path / "w"
    (work / "run" / "checkpoints").mkdir(parents=True)
    other = tiny_config("mesh.spatial=[1,1,1]", "model.base_filters=8")
    (work / "run" / "config.toml").write_text(cfg.to_toml(other))
    done = _script(BENCH, work, "--config", tiny_toml, "--device", "cpu", "--size", "16",
                   "--cold-only", cwd=tmp_path, timeout=120)  # fmt: skip
    _one_line(done, str(work / "run"), "model.base_filters")
    assert not (work / "result.json").exists()


def test_bench_refuses_scans_of_another_size(tmp_path, tiny_toml):
    work = tmp_path / "w"
    (work / "scan").mkdir(parents=True)
    image = nib.Nifti1Image(np.zeros((16, 16, 8), np.int16), np.eye(4))
    nib.save(image, work / "scan" / "volume-0.nii.gz")
    nib.save(image, work / "liver-mask.nii.gz")
    done = _script(BENCH, work, "--config", tiny_toml, "--device", "cpu", "--size", "32",
                   "--cold-only", cwd=tmp_path, timeout=120)  # fmt: skip
    _one_line(done, "16×16", "--size 32")
    assert not (work / "run").exists() and not (work / "result.json").exists()


def test_bench_makes_its_scan_with_this_python_s_ctseg(bench, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ctseg.py").write_text(USERS_CTSEG)  # where the script is run from
    scans = bench.make_scans(tmp_path / "w" / "scan", 2, 16)
    assert [nib.load(scan).shape[:2] for scan in scans] == [(16, 16), (16, 16)]
    assert (tmp_path / "w" / "liver-mask.nii.gz").is_file()


# ------------------------------------------------------------------ Ctrl-C


def _interrupted_once(command: list, ready, cwd: Path) -> subprocess.CompletedProcess:
    """`command` sent SIGINT (it alone, not a terminal's group) once `ready()`."""
    launcher = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    launcher += "os.execv(sys.argv[1], sys.argv[1:])"  # Ctrl-C's default, as in a terminal
    proc = subprocess.Popen(
        [sys.executable, "-c", launcher, sys.executable, *map(str, command)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
    )
    deadline = time.monotonic() + 60
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def test_the_scripts_stop_on_ctrl_c_in_one_line(tmp_path, tiny_toml):
    work = tmp_path / "gc"
    done = _interrupted_once(
        [GPU_CHECK, work, "--only", "train", "--device", "cpu", "--quick"],
        lambda: (work / "train-raw").exists(),  # its first command runs
        tmp_path,
    )
    assert done.returncode == 130 and done.stderr.splitlines() == ["interrupted (SIGINT)"], (
        done.stderr[-3000:]
    )
    work = tmp_path / "bench"
    done = _interrupted_once(
        [BENCH, work, "--config", tiny_toml, "--device", "cpu", "--size", "16", "--cold-only"],
        lambda: (work / "run").exists(),  # its child makes the run
        tmp_path,
    )
    assert done.returncode == 130 and done.stderr.splitlines() == ["interrupted (SIGINT)"], (
        done.stderr[-3000:]
    )
