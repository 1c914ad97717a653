"""Time `ctseg predict` of one 512×512 scan with the lits512 model, and its peak memory.

    .venv/bin/python scripts/bench_predict512.py WORKDIR [--backend onnx] [--tile N]

Speed and memory do not depend on the weights, so the run directory holds an
untrained model (`configs/lits512_16way.toml`, checkpoint at step 0). The scan is
a synthetic 512×512 phantom (`ctseg synth --size 512`). The prediction runs as a
user runs it, under `/usr/bin/time -v`; the script prints its wall time and
maximum resident memory and writes them to WORKDIR/result.json.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CTSEG = str(Path(sys.executable).with_name("ctseg"))
CONFIG = REPO / "configs" / "lits512_16way.toml"


def make_untrained_run(run_dir: Path) -> None:
    """A run directory with the config and a step-0 checkpoint of freshly initialised weights."""
    from ctseg import config as cfg
    from ctseg.checkpoints import Checkpoints
    from ctseg.step import init_state

    config = cfg.load(CONFIG)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(cfg.to_toml(config))
    _, state = init_state(config)
    checkpoints = Checkpoints(run_dir, keep=1)
    checkpoints.save(state)
    checkpoints.wait()
    checkpoints.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--backend", default="onnx", choices=["jax", "onnx"])
    parser.add_argument("--tile", type=int, default=-1)
    args = parser.parse_args()
    run_dir, scans, out = args.workdir / "run", args.workdir / "scan", args.workdir / "pred"
    if not (run_dir / "checkpoints").is_dir():
        make_untrained_run(run_dir)
    scan = scans / "volume-0.nii.gz"
    if not scan.is_file():
        subprocess.run([CTSEG, "synth", str(scans), "--cases", "1", "--size", "512"], check=True)
    command = [CTSEG, "predict", str(run_dir), str(scan), "--out", str(out), "--force"]
    command += ["--backend", args.backend, "--tile", str(args.tile)]
    timed = subprocess.run(
        ["/usr/bin/time", "-v", *command], stderr=subprocess.PIPE, text=True, check=False
    )
    sys.stderr.write(timed.stderr)
    if timed.returncode != 0:
        sys.exit(timed.returncode)
    wall = re.search(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)", timed.stderr)
    hours, minutes, seconds = (float(g) if g else 0.0 for g in wall.groups())
    peak_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", timed.stderr)[1])
    result = {
        "backend": args.backend,
        "tile": args.tile,
        "wall_seconds": 3600 * hours + 60 * minutes + seconds,
        "peak_gib": peak_kib / 2**20,
    }
    (args.workdir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
