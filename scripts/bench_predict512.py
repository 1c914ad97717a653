"""Time `ctseg predict` of 512×512 scans with the lits512 model: cold, warm, many scans.

    .venv/bin/python scripts/bench_predict512.py WORKDIR [--device auto|cpu|gpu|tpu]
        [--backend jax|onnx] [--tile N] [--scans 10] [--anchor .gpu/torch_unet.py]
        [--config configs/lits512_16way.toml] [--size 512]

Speed and memory do not depend on the weights, so the run directory holds an
untrained model (`configs/lits512_16way.toml`, checkpoint at step 0). The scan is
a synthetic 512×512 phantom (`ctseg synth --size 512`), copied under N names.
`ctseg predict` runs as a user runs it, in its own process, twice on the same
scans: **cold** (an empty compilation cache) and **warm** (the cache the cold run
filled; `--cold-only` skips it). Printed and written to WORKDIR/result.json:
each run's wall time and peak resident memory, the network's seconds per scan (`infer` in the scans'
`_stats.json`), the compile seconds, and with several scans the wall seconds per
scan after the first. `--anchor` runs the PyTorch/MONAI sliding-window anchor
(`../shared/gpu/torch_unet.py infer --size 512 --sw 128`) in the same call, so the
network's time is put against it measured on the same machine the same day.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CTSEG = str(Path(sys.executable).with_name("ctseg"))
CONFIG = REPO / "configs" / "lits512_16way.toml"


def make_untrained_run(run_dir: Path, config_path: Path) -> None:
    """A run directory with the config and a step-0 checkpoint of freshly initialised weights."""
    from ctseg import config as cfg
    from ctseg.checkpoints import Checkpoints
    from ctseg.step import init_state

    config = cfg.load(config_path)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(cfg.to_toml(config))
    _, state = init_state(config)
    checkpoints = Checkpoints(run_dir, keep=1)
    checkpoints.save(state)
    checkpoints.wait()
    checkpoints.close()


def make_scans(folder: Path, count: int, size: int) -> list[Path]:
    """`count` copies of one synthetic size×size scan (volume-0 … volume-{count-1})."""
    first = folder / "volume-0.nii.gz"
    if not first.is_file():
        synth = [CTSEG, "synth", str(folder), "--cases", "1", "--size", str(size)]
        subprocess.run(synth, check=True)
        (folder / "segmentation-0.nii.gz").unlink()  # the scans alone are the input
    scans = [folder / f"volume-{i}.nii.gz" for i in range(count)]
    for scan in scans[1:]:
        if not scan.is_file():
            shutil.copyfile(first, scan)
    return scans


def predict(args: argparse.Namespace, run_dir: Path, scans: list[Path], out: Path) -> dict:
    """One `ctseg predict` process over `scans`: wall seconds, peak RSS, the scans' stats."""
    shutil.rmtree(out, ignore_errors=True)
    command = [CTSEG, "predict", str(run_dir), *map(str, scans), "--out", str(out)]
    command += ["--device", args.device, "--tile", str(args.tile), "--verbose"]
    command += ["--compile-cache", str(args.workdir / "xla-cache")]
    if args.backend:
        command += ["--backend", args.backend]
    began = time.perf_counter()
    done = subprocess.run(command, check=False)
    wall = time.perf_counter() - began
    if done.returncode != 0:
        sys.exit(done.returncode)
    stats = [json.loads((out / f"{s.name[:-7]}_stats.json").read_text()) for s in scans]
    return {
        "wall_seconds": wall,
        # The largest child so far: the cold run's, then the larger of both.
        "peak_gib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20,
        "device": stats[0]["device"],
        "infer_seconds": [s["seconds"]["infer"] for s in stats],
        "compile_seconds": stats[-1]["seconds"]["compile"],
        "compiled": stats[-1]["compiled"],
    }


def anchor(script: Path) -> dict:
    command = [sys.executable, str(script), "infer", "--size", "512", "--base", "32"]
    done = subprocess.run([*command, "--sw", "128"], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu", "tpu"])
    parser.add_argument("--backend", choices=["jax", "onnx"], help="default: the device policy")
    parser.add_argument("--tile", type=int, default=-1)
    parser.add_argument("--scans", type=int, default=1)
    parser.add_argument("--config", type=Path, default=CONFIG, help="the untrained run's config")
    parser.add_argument("--size", type=int, default=512, help="in-plane size of the scan")
    parser.add_argument(
        "--anchor", type=Path, help="torch_unet.py: also time MONAI's sliding window"
    )
    args = parser.parse_args()
    run_dir, out = args.workdir / "run", args.workdir / "pred"
    if not (run_dir / "checkpoints").is_dir():
        make_untrained_run(run_dir, args.config)
    scans = make_scans(args.workdir / "scan", args.scans, args.size)
    shutil.rmtree(args.workdir / "xla-cache", ignore_errors=True)
    result = {"scans": args.scans, "tile": args.tile}
    for kind in ("cold",) if args.cold_only else ("cold", "warm"):
        result[kind] = predict(args, run_dir, scans, out)
        if args.scans > 1:
            # What each further scan adds, from the same call with one scan less: the
            # network's seconds of the later scans, and the wall time shared out.
            later = result[kind]["infer_seconds"][1:]
            result[kind]["infer_seconds_after_first"] = sum(later) / len(later)
    if args.scans > 1 and not args.cold_only:
        single = predict(args, run_dir, scans[:1], out)
        per_scan = (result["warm"]["wall_seconds"] - single["wall_seconds"]) / (args.scans - 1)
        result["warm"]["wall_seconds_per_scan_after_first"] = per_scan
    if args.anchor:
        result["anchor"] = anchor(args.anchor)
        result["network_vs_anchor"] = (
            result["warm"]["infer_seconds"][0] / result["anchor"]["seconds"]
        )
    (args.workdir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
