"""The persistent compilation cache: a cache that cannot be used costs time, never the run,
and never fills the terminal with library warnings."""

import os
import subprocess
import sys
from pathlib import Path

import jax
from helpers import REPO

from ctseg.parallel import compile_cache
from ctseg.parallel.compile_cache import (
    COMPILE_CACHE_ENV,
    CompileClock,
    compile_cache_dir,
    use_compile_cache,
)

# One process that uses the cache as a command does (`cli.options.start_jax`) and compiles
# two small programs; it prints the line the command would print, if any.
COMPILE_TWO = """
import sys
from pathlib import Path
from ctseg.cli.library_output import held
from ctseg.parallel.compile_cache import compile_clock, use_compile_cache
with held(show=False):  # as a command's start holds the lines of JAX's plugins
    import jax, jax.numpy as jnp
    clock = compile_clock()
    problem = use_compile_cache(Path(sys.argv[1]))
    jax.devices()
print("warning:", problem)
x = jnp.arange(4.0)
jax.jit(lambda x: x * 2 + 1)(x).block_until_ready()
jax.jit(lambda x: jnp.sin(x).sum())(x).block_until_ready()
print(clock.programs, clock.cache_hits)
"""


def programs_and_hits(done: subprocess.CompletedProcess) -> tuple[int, int]:
    programs, hits = done.stdout.splitlines()[-1].split()
    return int(programs), int(hits)


def compile_two(cache: Path, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-c", COMPILE_TWO, str(cache)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, **kwargs)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_an_empty_variable_is_the_default_folder_not_the_current_one(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(COMPILE_CACHE_ENV, "")
    assert compile_cache_dir(None) == tmp_path / "ctseg" / "xla"
    monkeypatch.setenv(COMPILE_CACHE_ENV, "  ")
    assert compile_cache_dir(None) == tmp_path / "ctseg" / "xla"


def test_a_cache_path_that_is_a_file_is_one_line_and_no_cache(tmp_path):
    before = jax.config.jax_compilation_cache_dir
    (tmp_path / "a-file").write_text("")
    assert use_compile_cache(tmp_path / "a-file") == (
        f"compilation cache {tmp_path / 'a-file'} is a file, not a folder; compiling without it"
    )
    problem = use_compile_cache(tmp_path / "a-file" / "cache")
    assert problem.startswith(f"compilation cache {tmp_path / 'a-file' / 'cache'} cannot be ")
    assert problem.endswith("; compiling without it")
    assert jax.config.jax_compilation_cache_dir == before  # JAX was not pointed at it


def test_a_corrupt_entry_is_one_warning_naming_the_cache_and_compiled_again(tmp_path):
    cache = tmp_path / "cache"
    first = compile_two(cache)
    programs, hits = programs_and_hits(first)
    assert programs >= 2 and hits == 0
    entries = [p for p in cache.iterdir() if p.is_file()]
    assert entries
    for entry in entries:
        entry.write_bytes(b"not a compiled program")
    again = compile_two(cache)
    assert programs_and_hits(again) == (programs, 0)  # every entry missed, and compiled
    # One line naming the cache, not a library warning per entry with its site-packages path.
    assert again.stderr.startswith(f"compilation cache {cache}: entry "), again.stderr
    assert len(again.stderr.splitlines()) == 1 and "site-packages" not in again.stderr
    assert programs_and_hits(compile_two(cache))[1] >= 2  # compiled again into the cache


def test_a_read_only_cache_is_one_line_and_compiling_goes_on(tmp_path):
    # Permission bits do not stop root; sysfs takes no new files from anyone.
    if os.geteuid() == 0:
        cache = Path("/sys/kernel")
    else:
        cache = tmp_path / "cache"
        cache.mkdir(mode=0o555)
    before = sorted(cache.iterdir())
    done = compile_two(cache)
    assert done.stdout.splitlines()[0] == (
        f"warning: compilation cache {cache} is not writable; compiling without it"
    )
    assert programs_and_hits(done)[0] >= 2
    assert done.stderr == "", done.stderr  # not a warning per program, as JAX would say
    assert sorted(cache.iterdir()) == before


def test_the_compile_clock_counts_compiles_in_threads_once(monkeypatch):
    """Programs compiled side by side in threads: the clock's seconds are the wall time
    some program was compiling, not the sum (a cold prediction's phases subtract them)."""
    clock = CompileClock()
    ends = iter([20.0, 30.0, 50.0])  # when JAX reports each compile, with its duration
    monkeypatch.setattr(compile_cache.time, "perf_counter", lambda: next(ends))
    for duration in (20.0, 30.0, 5.0):  # [0, 20] and [0, 30] together, then [45, 50]
        clock._duration(compile_cache._BACKEND_COMPILE, duration)
    assert clock.seconds == 35.0
    assert clock.seconds_since(10.0) == 25.0  # [10, 30] and [45, 50]
    assert clock.programs == 3
