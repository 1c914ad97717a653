"""The compilation cache as a careless or hostile user leaves it: reached through a link,
copied to another folder, its entries swapped with another program's or replaced by a
FIFO, or placed inside a folder ctseg writes. It serves wherever it lives, never runs an
entry as another program, never hangs, and never lives inside a run or an output folder."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

from ctseg.parallel import compile_cache
from ctseg.parallel.compile_cache import use_compile_cache

# A process that uses the cache as a command does and runs two small programs; it prints
# their results, then the programs compiled and the cache hits.
RUN_TWO = """
import sys
from pathlib import Path
from ctseg.cli.library_output import held
from ctseg.parallel.compile_cache import compile_clock, use_compile_cache
with held(show=False):  # as a command's start holds the lines of JAX's plugins
    import jax, jax.numpy as jnp
clock = compile_clock()
problem = use_compile_cache(Path(sys.argv[1]))  # as `cli.options.start_jax`: not held
with held(show=False):
    jax.devices()
assert problem is None, problem
x = jnp.arange(4.0)
print(jax.jit(lambda x: x * 2 + 1)(x).tolist())
print(round(float(jax.jit(lambda x: jnp.sin(x).sum())(x)), 5))
print(clock.programs, clock.cache_hits)
"""
RESULTS = ["[1.0, 3.0, 5.0, 7.0]", "1.89189"]


def run_two(cache: Path) -> tuple[list[str], int, int, str]:
    """The two results, the programs compiled, the cache hits, and what went to stderr."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", RUN_TWO, str(cache)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,  # a FIFO read would wait for ever
    )
    assert done.returncode == 0, done.stdout + done.stderr
    *results, counts = done.stdout.splitlines()
    programs, hits = counts.split()
    return results, int(programs), int(hits), done.stderr


def test_a_cache_reached_through_a_link_or_copied_elsewhere_still_serves(tmp_path):
    """The keys do not depend on the cache's folder (JAX hashes XLA's autotuning folder, a
    path inside it, into every key): the same cache through a link, or a copy of it in
    another folder (another machine's mount, a container's volume), compiles nothing."""
    cache = tmp_path / "cache"
    results, programs, hits, _ = run_two(cache)
    assert results == RESULTS and programs >= 2 and hits == 0
    (tmp_path / "link").symlink_to(cache)
    shutil.copytree(cache, tmp_path / "elsewhere" / "copy")
    entries = len(list(cache.glob("*-cache")))
    for where in (tmp_path / "link", tmp_path / "elsewhere" / "copy"):
        results, again, hits, stderr = run_two(where)
        assert results == RESULTS and hits == again == programs, (where, again, hits)
        assert stderr == ""
    assert len(list(cache.glob("*-cache"))) == entries  # nothing doubled


def test_entries_swapped_with_another_program_s_are_compiled_again(tmp_path):
    """An entry whose bytes are another program's is never run as this one (JAX would, and
    fail far from the cause: "safe_zip() …", blamed on a scan): one warning naming the
    cache, the program compiled again, the right results."""
    cache = tmp_path / "cache"
    run_two(cache)
    entries = sorted(cache.glob("*-cache"), key=lambda p: p.stat().st_size)[-2:]
    first, second = (entry.read_bytes() for entry in entries)
    entries[0].write_bytes(second)
    entries[1].write_bytes(first)
    results, programs, hits, stderr = run_two(cache)
    assert results == RESULTS
    assert programs >= 2 and hits <= programs - 2
    assert stderr.startswith(f"compilation cache {cache}: entry "), stderr
    assert len(stderr.splitlines()) == 1 and "compiling it again" in stderr
    assert run_two(cache)[2] == programs  # recompiled into the cache: all served now


def test_an_entry_that_is_a_fifo_is_passed_over_without_waiting(tmp_path):
    """A FIFO where an entry was (or in XLA's autotuning folder) would block the read for
    ever: one warning naming the cache at start, the program compiled, no hang."""
    cache = tmp_path / "cache"
    run_two(cache)
    entry = max(cache.glob("*-cache"), key=lambda p: p.stat().st_size)
    entry.unlink()
    os.mkfifo(entry)
    results, programs, hits, stderr = run_two(cache)
    assert results == RESULTS and programs >= 2
    assert stderr.startswith(f"compilation cache {cache}: 1 of its entries are not regular "), (
        stderr
    )
    assert len(stderr.splitlines()) == 1


@pytest.mark.parametrize(
    "owner, made",
    [
        ("run", ["config.toml", "checkpoints/"]),
        ("predicted", [".ctseg-outputs.json"]),
        ("store", ["manifest.json", "cases/"]),
        ("evaluation", ["evaluated.json"]),
    ],
)
def test_a_cache_inside_a_folder_ctseg_writes_is_one_line_and_not_used(tmp_path, owner, made):
    """In a run's checkpoints/ orbax would read the cache's files as checkpoints; in an
    output folder ctseg clears or claims, the cache would go with it: one line, nothing
    created there, compiling goes on without it."""
    folder = tmp_path / owner
    for name in made:
        (folder / name.rstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        if name.endswith("/"):
            (folder / name).mkdir()
        else:
            (folder / name).write_text("{}")
    inside = folder / ("checkpoints" if owner == "run" else "") / "xla"
    problem = use_compile_cache(inside)
    assert problem == (
        f"compilation cache {inside} lies in {folder}, a folder ctseg writes (a run, a "
        "prediction's outputs, a store or an evaluation); give a folder of its own; compiling "
        "without it"
    )
    assert not inside.exists()


def test_the_folders_ctseg_writes_are_named_as_their_modules_name_them():
    from ctseg.data.manifest import MANIFEST
    from ctseg.inference.inputs import OUTPUTS_RECORD
    from ctseg.run.evaluations import EVALUATED
    from ctseg.run.rundir import CHECKPOINTS, CONFIG

    assert compile_cache._OWNED_BY_CTSEG == (
        (CONFIG, CHECKPOINTS),
        (OUTPUTS_RECORD,),
        (MANIFEST, "cases"),
        (EVALUATED,),
    )
