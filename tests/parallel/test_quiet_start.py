"""Quiet imports for the Python API as for the commands: on a machine without accelerators,
`from ctseg import Segmenter` and the device choice print nothing of JAX's plugins (the
`targets` extra's CUDA plugin and libtpu: "Could not find cuda drivers", a "Jax plugin
configuration error" traceback, TPU_WORKER_HOSTNAMES errors), and JAX_PLATFORMS is not
needed for it."""

import logging
import os
import subprocess
import sys

import pytest
from helpers import REPO

from ctseg.parallel import held_output
from ctseg.targets import process


def _stderr_of(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "PYTHONWARNINGS")}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "ok" in done.stdout
    return done.stderr


def test_the_api_starts_jax_without_a_word():
    # What `Segmenter(run)` does first: import the API, then see the devices.
    code = (
        "from ctseg import Segmenter\n"
        "from ctseg.parallel import jax_start\n"
        "found = jax_start.visible()\n"
        "assert found.get('cpu'), found\n"
        "print('ok')\n"
    )
    assert _stderr_of(code) == ""


def test_the_command_line_imports_no_jax_before_a_command_runs():
    # `ctseg --help` and every option's error answer without JAX's second of imports.
    code = "import sys\nimport ctseg.cli.main\nassert 'jax' not in sys.modules\nprint('ok')\n"
    assert _stderr_of(code) == ""


@pytest.mark.skipif(
    not process.plugin_installed("cuda"), reason="the targets extra is not installed"
)
def test_a_command_starts_jax_without_a_word_of_its_plugins():
    """The first import of JAX is a command's own (`start_jax`): what the CUDA plugin says
    on a machine without a GPU stays held."""
    command = "import sys; from ctseg.cli.main import main; sys.argv[0] = 'ctseg'; main()"
    args = ["bench", "--steps", "1", "--partitions", "1", "--partitioner", "halo"]
    args += ["--set", "data.resolution=16", "--set", "model.depth=2"]
    args += ["--set", "model.base_filters=2"]
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "PYTHONWARNINGS")}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run(
        [sys.executable, "-c", command, *args], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "halo" in done.stdout and done.stderr.strip() == ""  # a progress bar's newline


def test_start_quietly_starts_only_the_cpu_where_no_accelerator_is_attached():
    code = (
        "from ctseg.parallel import jax_start\n"
        "found = jax_start.start_quietly('auto')\n"
        "import jax\n"
        "if jax_start.no_accelerator():\n"
        "    assert jax.config.jax_platforms == 'cpu' and not found.faults, found.faults\n"
        "print('ok')\n"
    )
    assert _stderr_of(code) == ""


def test_a_users_choice_of_platforms_stays():
    code = (
        "import jax\n"
        "jax.config.update('jax_platforms', 'cpu,tpu')\n"
        "from ctseg.parallel import jax_start\n"
        "jax_start.start_quietly('auto')\n"
        "assert jax.config.jax_platforms == 'cpu,tpu'\n"
        "print('ok')\n"
    )
    _stderr_of(code)


def test_held_output_is_logged_at_debug_level(caplog, monkeypatch):
    monkeypatch.setattr(held_output, "_hold_start_output", True)  # as in a process of no command
    with caplog.at_level(logging.DEBUG, logger="ctseg.parallel.held_output"):
        with held_output.held_start_output():
            os.write(2, b"I0000 cudart_stub.cc:31] Could not find cuda drivers\n")
            logging.getLogger("jax._src.xla_bridge").error("Jax plugin configuration error")
    assert "Could not find cuda drivers" in caplog.text
    assert "Jax plugin configuration error" in caplog.text


def test_holds_from_several_threads_leave_stderr_as_it_was(monkeypatch):
    import threading
    import time

    monkeypatch.setattr(held_output, "_hold_start_output", True)
    before = os.fstat(2)

    def hold():
        for _ in range(20):
            with held_output.held_start_output():
                os.write(2, b"plugin line\n")
                time.sleep(0.001)  # the threads' holds overlap

    threads = [threading.Thread(target=hold) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    after = os.fstat(2)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
