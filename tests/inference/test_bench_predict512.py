"""scripts/bench_predict512.py end to end on the CPU, as small as it goes."""

import importlib.util
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
from helpers import REPO, tiny_config

from ctseg import config as cfg
from ctseg.data.grids import hu_to_unit
from ctseg.labels import BACKGROUND, LIVER
from ctseg.model import unet
from ctseg.model.step import init_state
from ctseg.parallel.partition import LOCAL

SCRIPT = REPO / "scripts" / "bench_predict512.py"
# The fewest base filters the run's liver-following network needs (`follow_the_liver`).
WIDE_ENOUGH = "model.base_filters=4"


def bench_module():
    spec = importlib.util.spec_from_file_location("bench_predict512", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_run_predicts_liver_where_the_hu_lies_in_the_liver_s_band():
    bench = bench_module()
    config = tiny_config(WIDE_ENOUGH, "model.dtype=float32")
    graphdef, state = init_state(config)
    state = bench.follow_the_liver(config, state)
    # Slabs of 0, 40, 70, 100 and 300 HU along x; the HU window scales them to [-1, 1].
    hu = np.repeat(np.array([0.0, 40.0, 70.0, 100.0, 300.0]), 8)[:, None, None]
    unit = hu_to_unit(np.broadcast_to(hu, (40, 16, 16)), config.data.hu_window)
    image = jnp.asarray(unit)[None, ..., None]
    logits, _ = unet.apply(graphdef, state.weights, state.stats, image, LOCAL, train=False)
    labels = np.asarray(jnp.argmax(logits[0], axis=-1))
    middles = labels[4::8, 8, 8]  # each slab's middle: its kernel sees only its own HU
    assert middles.tolist() == [BACKGROUND, BACKGROUND, LIVER, BACKGROUND, BACKGROUND]


def test_cold_only_runs_end_to_end_on_the_cpu(tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(cfg.to_toml(tiny_config("mesh.spatial=[1,1,1]", WIDE_ENOUGH)))
    workdir = tmp_path / "bench"
    command = [sys.executable, str(SCRIPT), str(workdir)]
    command += ["--cold-only", "--size", "32", "--config", str(config), "--scans", "2"]
    # This checkout as `--checkout`: run as an older commit's would be.
    command += ["--device", "cpu", "--backend", "jax", "--checkout", str(REPO)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((workdir / "result.json").read_text())
    # No warm run, no anchor.
    assert set(result) == {"scans", "tile", "size", "config", "checkout", "cold"}
    assert result["config"] == str(config)
    cold = result["cold"]
    assert cold["device"] and len(cold["infer_seconds"]) == 2
    assert cold["wall_seconds"] > 0 and cold["peak_gib"] > 0
    assert cold["compiled"]["programs"] > 0 and cold["compiled"]["from_cache"] == 0
    assert cold["infer_seconds_after_first"] == cold["infer_seconds"][1]
    assert 0 <= cold["liver_dice"] <= 1
    # The last version, printed after the runs' own output.
    assert done.stdout.rstrip().endswith(json.dumps(result, indent=2))


def test_roi_runs_beside_the_whole_scan(tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(cfg.to_toml(tiny_config("mesh.spatial=[1,1,1]", "data.grid=spacing")))
    workdir = tmp_path / "bench"
    command = [sys.executable, str(SCRIPT), str(workdir)]
    command += ["--cold-only", "--size", "32", "--config", str(config), "--roi"]
    command += ["--device", "cpu", "--backend", "onnx", "--roi-tile", "8"]
    command += ["--host-figures-only"]  # its width, 4, made wide enough for the liver
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((workdir / "result.json").read_text())
    assert result["network"] == "width shrunk: host figures only"
    (roi,) = result["roi"]
    assert roi["wall_seconds"] > 0 and roi["tile"] == 8
    assert 0 <= roi["liver_dice"] <= 1  # a region's labels cover the whole scan too
    assert set(result["roi_vs_whole"][0]) == {"tile", "wall", "peak"}
    stats = json.loads((workdir / "pred-roi" / "volume-0_stats.json").read_text())
    assert stats["located"]["source"].startswith("mask ")
    assert "tiles ≤ 8³" in stats["device"]
    run_config = cfg.load(workdir / "run" / "config.toml")
    assert run_config.model.base_filters == 4


def test_the_child_that_makes_the_run_starts_jax_quietly(tmp_path):
    """The script's CPU-only child starts JAX as ctseg's commands do: what JAX's plugins
    print on starting (here the `targets` extra's CUDA plugin: "Could not find cuda
    drivers") is held, and its stderr stays empty."""
    config = tmp_path / "tiny.toml"
    config.write_text(cfg.to_toml(tiny_config("mesh.spatial=[1,1,1]", WIDE_ENOUGH)))
    command = [sys.executable, str(SCRIPT), "--make-run", str(tmp_path / "run"), str(config)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "run" / "config.toml").exists()
    assert done.stderr == ""


def test_checkout_measures_that_checkout_even_from_inside_this_one(tmp_path):
    """`--checkout DIR` runs DIR's ctseg, also where the script runs from a checkout, whose
    ctseg a `python -c` would otherwise import first (its working directory)."""
    other = tmp_path / "other" / "ctseg"
    (other / "cli").mkdir(parents=True)
    (other / "__init__.py").write_text("")
    (other / "cli" / "__init__.py").write_text("")
    ran = tmp_path / "other-ran"
    main = f"def main():\n    open({str(ran)!r}, 'w')\n    return 3\n"  # exit status 3
    (other / "cli" / "main.py").write_text(main)
    config = tmp_path / "tiny.toml"
    config.write_text(cfg.to_toml(tiny_config("mesh.spatial=[1,1,1]", WIDE_ENOUGH)))
    command = [sys.executable, str(SCRIPT), str(tmp_path / "bench"), "--cold-only"]
    command += ["--size", "32", "--config", str(config), "--scans", "1", "--device", "cpu"]
    command += ["--backend", "jax", "--checkout", str(other.parent)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    assert "ctseg predict failed (exit status 3)" in done.stderr, done.stderr[-2000:]
    assert ran.exists()
