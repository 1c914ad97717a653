"""Time `ctseg predict` of 512×512 scans with the lits512 model: cold, warm, many scans.

    python scripts/bench_predict512.py WORKDIR [--device auto|cpu|gpu|tpu]
        [--backend jax|onnx] [--tile N] [--scans 10] [--cold-only] [--anchor]
        [--config configs/lits512_16way.toml] [--size 512] [--roi] [--roi-tile N]

Speed and memory do not depend on the weights, so the run directory holds an
untrained model (`configs/lits512_16way.toml`, checkpoint at step 0), made in a
CPU-only process so that no accelerator memory is taken before the timed runs. The
scan is a synthetic size×size phantom (`ctseg synth --size`), copied under N names.
`ctseg predict` runs as a user runs it, in its own process, twice on the same scans:
**cold** (an empty compilation cache) and **warm** (the cache the cold run filled;
`--cold-only` skips it). For each run: wall seconds, the process's peak resident
memory, the network's seconds per scan (`infer` in the scans' `_stats.json`: the
grid from host memory to the devices, the network, the probabilities back), the
first scan's compile seconds, each scan's seconds per phase (read, resample: to the
grid and back, infer, postprocess, write) and its host seconds (all but infer), and
with several scans the network's seconds per scan after the first, the wall seconds of
the same call on one scan, warm (`one_scan_wall_seconds`), the wall seconds each
further scan adds, and of those the seconds not overlapped with the network
(`not_overlapped_seconds_per_scan`: the host's work on the critical path).

`--roi` also runs `ctseg predict --roi` on the same scans, the region taken from the
phantom's own liver mask, and gives `roi_vs_whole`: its wall seconds and peak memory
against the whole-scan run's, measured in the same run; `--roi-tile N` runs it with
tiles of N (default: `--tile`'s), once per `--roi-tile` given.

`--anchor` (needs the `bench` extra) also runs MONAI's sliding window (128³ windows,
overlap 0.25, Gaussian weights) on the same U-Net in PyTorch (`scripts/monai_anchor.py
infer --sw 128 --overlap 0.25`). On a CUDA GPU it infers a 512³ cube and gives
`network_vs_anchor`: ctseg's network seconds per scan after the first against the
anchor's median after a warm-up, both from host memory to host memory on the same
machine the same day (so it needs --scans 2 or more). With `--device cpu` it infers
the scan's own grid (the model's spacing grid of the phantom) once, in float32 as
ctseg does there, and gives `vs_anchor`: the `infer` seconds (grid to probabilities)
of the whole-scan run and of each `--roi` run against the anchor's.

WORKDIR/result.json is rewritten (atomically) after every measurement, so a run that
fails later keeps what was measured; the last version is also printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ctseg import atomic  # no JAX here: this process leaves the accelerators to the runs

REPO = Path(__file__).resolve().parent.parent
CTSEG = [sys.executable, "-m", "ctseg"]  # the command line of this Python's ctseg
CONFIG = REPO / "configs" / "lits512_16way.toml"
ANCHOR = REPO / "scripts" / "monai_anchor.py"
UNTRAINED = "--untrained-run"  # the child's argument: make the run directory, nothing else
# A scan's phases as its `_stats.json` records them ("resample": to the grid and back),
# and those the host does: one scan's, or with several each scan's not overlapped with
# the network (`not_overlapped_seconds_per_scan`).
SCAN_PHASES = ("read", "resample", "infer", "postprocess", "write")
HOST_PHASES = ("read", "resample", "postprocess", "write")


def make_untrained_run(run_dir: Path, config_path: Path) -> None:
    """A run directory with the config and a step-0 checkpoint of freshly initialised weights
    (in the child process, `untrained_run`)."""
    import logging

    from ctseg import config as cfg
    from ctseg.model.step import init_state
    from ctseg.run import rundir
    from ctseg.run.checkpoints import Checkpoints

    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on saving a step 0
    config = cfg.load(config_path)
    run_dir.mkdir(parents=True, exist_ok=True)
    rundir.write_or_check_config(run_dir, config)
    _, state = init_state(config)
    checkpoints = Checkpoints(run_dir, keep=1)
    checkpoints.save(state)
    checkpoints.wait()
    checkpoints.close()


def untrained_run(run_dir: Path, config_path: Path) -> None:
    """`make_untrained_run` in a CPU-only process: JAX started here on a GPU would hold
    most of its memory (JAX's preallocation) through every timed run."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, __file__, UNTRAINED, str(run_dir), str(config_path)]
    subprocess.run(command, env=env, check=True)


# `ctseg synth --seed 94` draws a liver-only scan of 63 slices of 3.9 mm (512×512×63 at
# --size 512): the scan the prediction targets are stated for.
SCAN_SEED = 94


def make_scans(folder: Path, count: int, size: int) -> list[Path]:
    """`count` copies of one synthetic size×size scan (volume-0 … volume-{count-1}); its
    label map is kept beside the folder (a region mask for `--roi`)."""
    first = folder / "volume-0.nii.gz"
    if not first.is_file():
        synth = [*CTSEG, "synth", str(folder), "--cases", "1", "--size", str(size)]
        synth += ["--seed", str(SCAN_SEED)]
        subprocess.run(synth, check=True)
        # The scans alone are the input; the label map is the region mask of `--roi`.
        (folder / "segmentation-0.nii.gz").replace(folder.parent / "liver-mask.nii.gz")
    scans = [folder / f"volume-{i}.nii.gz" for i in range(count)]
    for scan in scans[1:]:
        if not scan.is_file():
            shutil.copyfile(first, scan)
    return scans


def measured(command: list[str]) -> tuple[int, float, float]:
    """Run `command`: its exit status, wall seconds and peak resident GiB (its own, as
    `wait4` reports it for this child and its children; not another run's)."""
    began = time.perf_counter()
    child = subprocess.Popen(command)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - began
    return os.waitstatus_to_exitcode(status), wall, usage.ru_maxrss / 2**20


def predict(
    args: argparse.Namespace,
    run_dir: Path,
    scans: list[Path],
    out: Path,
    roi: Path | None = None,
    tile: int | None = None,
) -> dict:
    """One `ctseg predict` process over `scans` (tiles of `tile`, default `--tile`'s): wall
    seconds, peak RSS, the scans' stats."""
    shutil.rmtree(out, ignore_errors=True)
    command = [*CTSEG, "predict", str(run_dir), *map(str, scans), "--out", str(out)]
    if roi is not None:
        command += ["--roi", str(roi)]
    tile = args.tile if tile is None else tile
    command += ["--device", args.device, "--tile", str(tile), "--verbose"]
    command += ["--compile-cache", str(args.workdir / "xla-cache")]
    if args.backend:
        command += ["--backend", args.backend]
    status, wall, peak = measured(command)
    if status != 0:
        sys.exit(f"ctseg predict failed (exit status {status}); measured so far: {args.result}")
    stats = [json.loads((out / f"{s.name[:-7]}_stats.json").read_text()) for s in scans]
    seconds = {phase: [s["seconds"][phase] for s in stats] for phase in SCAN_PHASES}
    run = {
        "wall_seconds": wall,
        "peak_gib": peak,
        "device": stats[0]["device"],
        "infer_seconds": seconds["infer"],
        # The first scan's: it compiles the programs (a later scan's record holds only
        # what it compiled itself, none when the programs serve every extent).
        "compile_seconds": stats[0]["seconds"]["compile"],
        "compiled": stats[-1]["compiled"],
        "seconds": seconds,
        "host_seconds": [sum(seconds[p][i] for p in HOST_PHASES) for i in range(len(stats))],
    }
    if len(scans) > 1:
        later = run["infer_seconds"][1:]
        run["infer_seconds_after_first"] = sum(later) / len(later)
    return run


def grid_shape(config_path: Path, scan: Path) -> list[int]:
    """The box ctseg's model of `config_path` sees of `scan`: its grid (no JAX here)."""
    from ctseg import config as cfg
    from ctseg.data.grids import GridSpec
    from ctseg.io.scans import read_scan

    read = read_scan(scan)
    return list(GridSpec.of(cfg.load(config_path).data).grid_of(read.array.shape, read.spacing))


def anchor(args: argparse.Namespace, scan: Path) -> dict:
    command = [sys.executable, str(ANCHOR), "infer", "--base", "32", "--sw", "128"]
    command += ["--overlap", "0.25"]
    if args.device == "cpu":
        command += ["--device", "cpu", "--shape", *map(str, grid_shape(args.config, scan))]
    else:
        command += ["--size", "512"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu", "tpu"])
    parser.add_argument("--backend", choices=["jax", "onnx"], help="default: the device policy")
    parser.add_argument("--tile", type=int, default=-1)
    parser.add_argument("--scans", type=int, default=1)
    parser.add_argument("--cold-only", action="store_true", help="skip the warm run")
    parser.add_argument("--config", type=Path, default=CONFIG, help="the untrained run's config")
    parser.add_argument("--size", type=int, default=512, help="in-plane size of the scan")
    parser.add_argument(
        "--anchor", action="store_true", help="also time MONAI's sliding window (PyTorch)"
    )
    parser.add_argument(
        "--roi", action="store_true", help="also predict only the phantom's liver box (--roi)"
    )
    parser.add_argument(
        "--roi-tile",
        type=int,
        action="append",
        help="tiles of a --roi run (default --tile's); repeat for one run per tile",
    )
    args = parser.parse_args()
    if args.anchor and args.device != "cpu" and args.scans < 2:
        parser.error("--anchor compares the scans after the first: give --scans 2 or more")
    if args.roi and args.scans != 1:
        parser.error("--roi takes the one scan's mask: give --scans 1")
    return args


def main() -> None:
    args = _arguments()
    args.result = args.workdir / "result.json"
    run_dir, out = args.workdir / "run", args.workdir / "pred"
    if not (run_dir / "checkpoints").is_dir():
        untrained_run(run_dir, args.config)
    scans = make_scans(args.workdir / "scan", args.scans, args.size)
    shutil.rmtree(args.workdir / "xla-cache", ignore_errors=True)
    result: dict = {"scans": args.scans, "tile": args.tile, "size": args.size}
    kinds = ("cold",) if args.cold_only else ("cold", "warm")
    for kind in kinds:
        result[kind] = predict(args, run_dir, scans, out)
        atomic.write_json(args.result, result)
    if args.scans > 1 and not args.cold_only:
        # What each further scan adds to the wall time: against the same call on one scan.
        single = predict(args, run_dir, scans[:1], out)
        per_scan = (result["warm"]["wall_seconds"] - single["wall_seconds"]) / (args.scans - 1)
        result["warm"]["wall_seconds_per_scan_after_first"] = per_scan
        result["warm"]["one_scan_wall_seconds"] = single["wall_seconds"]
        # What each further scan adds beyond its network: the host's work on the critical path.
        network = result["warm"]["infer_seconds_after_first"]
        result["warm"]["not_overlapped_seconds_per_scan"] = per_scan - network
        atomic.write_json(args.result, result)
    if args.roi:
        mask = args.workdir / "liver-mask.nii.gz"
        whole = result[kinds[-1]]
        result["roi"], result["roi_vs_whole"] = [], []
        for tile in args.roi_tile or [args.tile]:
            run = predict(args, run_dir, scans, args.workdir / "pred-roi", mask, tile)
            result["roi"].append({"tile": tile, **run})
            result["roi_vs_whole"].append(
                {
                    "tile": tile,
                    "wall": run["wall_seconds"] / whole["wall_seconds"],
                    "peak": run["peak_gib"] / whole["peak_gib"],
                }
            )
            atomic.write_json(args.result, result)
    if args.anchor:
        result["anchor"] = anchor(args, scans[0])
        theirs = result["anchor"].get("seconds")
        if theirs and args.device == "cpu":
            runs = {"whole": result[kinds[-1]]}
            runs.update({f"roi tile {run['tile']}": run for run in result.get("roi", [])})
            result["vs_anchor"] = {
                name: run["infer_seconds"][0] / theirs for name, run in runs.items()
            }
        elif theirs:
            ours = result[kinds[-1]]["infer_seconds_after_first"]
            result["network_vs_anchor"] = ours / theirs
        atomic.write_json(args.result, result)
    print(json.dumps(result, indent=2))
    if "error" in result.get("anchor", {}):
        sys.exit("the anchor failed: " + " ".join(result["anchor"]["error"]))


if __name__ == "__main__":
    if sys.argv[1:2] == [UNTRAINED]:
        make_untrained_run(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        main()
