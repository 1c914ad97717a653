"""scripts/bench_predict512.py end to end on the CPU, as small as it goes."""

import json
import os
import subprocess
import sys

from helpers import REPO, tiny_config

from ctseg import config as cfg


def test_cold_only_runs_end_to_end_on_the_cpu(tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(cfg.to_toml(tiny_config("mesh.spatial=[1,1,1]")))
    workdir = tmp_path / "bench"
    command = [sys.executable, str(REPO / "scripts" / "bench_predict512.py"), str(workdir)]
    command += ["--cold-only", "--size", "32", "--config", str(config), "--scans", "2"]
    command += ["--device", "cpu", "--backend", "jax"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((workdir / "result.json").read_text())
    assert set(result) == {"scans", "tile", "size", "cold"}  # no warm run, no anchor
    cold = result["cold"]
    assert cold["device"] and len(cold["infer_seconds"]) == 2
    assert cold["wall_seconds"] > 0 and cold["peak_gib"] > 0
    assert cold["compiled"]["programs"] > 0 and cold["compiled"]["from_cache"] == 0
    assert cold["infer_seconds_after_first"] == cold["infer_seconds"][1]
    # The last version, printed after the runs' own output.
    assert done.stdout.rstrip().endswith(json.dumps(result, indent=2))


def test_roi_runs_beside_the_whole_scan(tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(cfg.to_toml(tiny_config("mesh.spatial=[1,1,1]", "data.grid=spacing")))
    workdir = tmp_path / "bench"
    command = [sys.executable, str(REPO / "scripts" / "bench_predict512.py"), str(workdir)]
    command += ["--cold-only", "--size", "32", "--config", str(config), "--roi"]
    command += ["--device", "cpu", "--backend", "onnx", "--roi-tile", "8"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((workdir / "result.json").read_text())
    (roi,) = result["roi"]
    assert roi["wall_seconds"] > 0 and roi["tile"] == 8
    assert set(result["roi_vs_whole"][0]) == {"tile", "wall", "peak"}
    stats = json.loads((workdir / "pred-roi" / "volume-0_stats.json").read_text())
    assert stats["located"]["source"].startswith("mask ")
    assert "tiles ≤ 8³" in stats["device"]
