"""Hostile and careless use, round five: Ctrl-C (SIGINT) and SIGTERM from a command's first
instant — among its imports, while JAX starts, while it works — end it with one line and
the shell's status for the signal (130, 143): never a traceback, never a signal swallowed
(the command running on to exit 0), never SIGABRT or SIGSEGV; nothing half-written is left
looking done, and the same command run again finishes.

Each case runs the real command line in its own process and sends the signal at a moment
found from outside (`/proc`: a library's code mapped into the process, a file written), so
that the phase it lands in does not depend on how loaded the machine is.
"""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

CTSEG = [str(Path(sys.executable).parent / "ctseg")]  # the console script
PYTHON_M = [sys.executable, "-m", "ctseg"]
# Run as from a terminal: with Ctrl-C's default action, also where these tests run in a
# background job (`nohup make test &`), whose children inherit SIGINT ignored.
TERMINAL = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)
IMPORTS = "numpy/_core/_multiarray_umath"  # mapped among the command line's imports
JAX = "jaxlib/_jax"  # mapped when the command starts JAX (`cli/options.start_jax`)
STOPS = [signal.SIGINT, signal.SIGTERM]


def _start(command: list[str], cwd: Path) -> subprocess.Popen:
    """`command` started as from a terminal, once its own program runs (not the launcher)."""
    if not Path(command[0]).is_absolute():
        raise ValueError(command[0])
    proc = subprocess.Popen(
        [sys.executable, "-c", TERMINAL, *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
    )
    _wait_for(proc, lambda: b"SIG_DFL" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes())
    return proc


def _wait_for(proc: subprocess.Popen, condition: Callable[[], bool], seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            if condition():
                return
        except OSError:  # the process is gone: it ended before the moment came
            pass
        if proc.poll() is not None:
            pytest.fail(f"the command ended (status {proc.returncode}) before the moment came")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no such moment in {seconds:.0f} s")
        time.sleep(0.001)


def _mapped(proc: subprocess.Popen, library: str) -> Callable[[], bool]:
    return lambda: library in Path(f"/proc/{proc.pid}/maps").read_text()


def _interrupted(proc: subprocess.Popen, stop: signal.Signals, after: float = 0.0) -> str:
    """Send `stop` `after` seconds from now; check the command ends as interrupted: the
    shell's status for the signal (a death by it, or 128 + its number), and one line."""
    time.sleep(after)
    proc.send_signal(stop)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{stop.name}: no end in 60 s\n{err[-3000:]}")
    status = 128 - proc.returncode if proc.returncode < 0 else proc.returncode
    assert status == 128 + stop, f"{stop.name}: status {proc.returncode}\n{err[-3000:]}"
    # Blank lines aside: a progress bar ends its line on stderr, as on any ending.
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"interrupted ({stop.name})"], err[-3000:]
    return out


def _predict(trained, out: Path, command: list[str] = CTSEG) -> subprocess.Popen:
    run_dir, _, raw = trained
    scan = raw / "volume-0.nii.gz"
    return _start([*command, "predict", str(run_dir), str(scan), "--out", str(out)], out.parent)


def _nothing_looks_done(out: Path) -> None:
    """A scan whose record (`_stats.json`, written last) is there has every output."""
    for record in out.glob("*_stats.json") if out.is_dir() else ():
        name = record.name.removesuffix("_stats.json")
        assert (out / f"{name}_seg.nii.gz").is_file(), sorted(os.listdir(out))
        assert (out / f"{name}_preview.png").is_file(), sorted(os.listdir(out))


@pytest.mark.parametrize("stop", STOPS, ids=lambda s: s.name)
def test_a_signal_among_the_imports_is_one_line(trained, tmp_path, stop):
    out = tmp_path / "out"
    proc = _predict(trained, out)
    _wait_for(proc, _mapped(proc, IMPORTS))
    _interrupted(proc, stop)
    assert not out.exists()  # nothing made before the work began


@pytest.mark.parametrize("after", [0.0, 0.2])
@pytest.mark.parametrize("stop", STOPS, ids=lambda s: s.name)
def test_a_signal_while_jax_starts_is_one_line_never_swallowed(trained, tmp_path, stop, after):
    """Raised as KeyboardInterrupt here it was swallowed by JAX's gc callback (the command
    ran on and exited 0), or ended in SIGABRT or SIGSEGV."""
    out = tmp_path / "out"
    proc = _predict(trained, out)
    _wait_for(proc, _mapped(proc, JAX))
    _interrupted(proc, stop, after)
    assert not out.exists()


def test_python_m_ctseg_is_handled_as_the_console_script(trained, tmp_path):
    out = tmp_path / "out"
    proc = _predict(trained, out, PYTHON_M)
    _wait_for(proc, _mapped(proc, IMPORTS))
    _interrupted(proc, signal.SIGINT)
    proc = _predict(trained, out, PYTHON_M)
    _wait_for(proc, _mapped(proc, JAX))
    _interrupted(proc, signal.SIGTERM)


def test_at_any_moment_of_the_first_seconds(trained, tmp_path):
    """From the first import on, every 0.5 s into the start and the work, either signal:
    one line, and nothing that looks done."""
    out = tmp_path / "out"
    for i in range(5):
        proc = _predict(trained, out)
        _wait_for(proc, _mapped(proc, IMPORTS))
        time.sleep(0.5 * i)
        if proc.poll() is not None:  # done before the signal: this machine is fast
            assert proc.returncode == 0, proc.stderr.read()[-3000:]
            break
        _interrupted(proc, STOPS[i % 2])
        _nothing_looks_done(out)


def test_a_signal_while_predicting_leaves_nothing_that_looks_done(trained, tmp_path):
    """Either signal once the work began; the same command then finishes in the folder."""
    out = tmp_path / "out"
    for stop in STOPS:
        proc = _predict(trained, out)
        _wait_for(proc, lambda: (out / ".ctseg-lock").exists())  # the work began
        _interrupted(proc, stop, after=0.3)
        _nothing_looks_done(out)
    done = _predict(trained, out)
    _, err = done.communicate(timeout=120)
    assert done.returncode == 0, err[-3000:]
    assert (out / "volume-0_stats.json").is_file()
    _nothing_looks_done(out)


@pytest.mark.parametrize("stop", STOPS, ids=lambda s: s.name)
def test_synth_interrupted_then_run_again_finishes(tmp_path, stop):
    out = tmp_path / "synth"
    command = [*CTSEG, "synth", str(out), "--cases", "3", "--size", "48", "--seed", "1"]
    proc = _start(command, tmp_path)
    _wait_for(proc, _mapped(proc, IMPORTS))
    _interrupted(proc, stop)
    proc = _start(command, tmp_path)
    _wait_for(proc, lambda: (out / ".ctseg-synth").exists())  # its folder claimed: it writes
    _interrupted(proc, stop)
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    cases = [f"{kind}-{i}.nii.gz" for kind in ("segmentation", "volume") for i in range(3)]
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == sorted(
        [*cases, "synth.json"]
    )


# A program whose gc callback swallows the KeyboardInterrupt that a signal raises in it, as
# JAX's `_xla_gc_callback` does: the signal is sent from within the callback.
SWALLOWING = """
import gc, os, signal, sys, time
from ctseg.cli import interrupts

interrupts.handle()
sent = []

def callback(phase, info):
    if phase == "start" and not sent:
        sent.append(True)
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(100_000):  # Python code: the handler runs here, in the callback
            pass

gc.callbacks.append(callback)
with interrupts.honoured():
    gc.collect()
    time.sleep(5)  # the interruption is delivered again meanwhile
    print("ran on")
"""


def test_an_interruption_swallowed_by_a_gc_callback_is_delivered_again(tmp_path):
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", TERMINAL, sys.executable, "-c", SWALLOWING],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode in (-signal.SIGINT, 128 + signal.SIGINT), done.stderr
    assert done.stderr.splitlines() == ["interrupted (SIGINT)"], done.stderr
    assert "ran on" not in done.stdout and time.monotonic() - began < 4
