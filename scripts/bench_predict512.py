"""Time `ctseg predict` of 512×512 scans with the lits512 model: cold, warm, many scans.

    python scripts/bench_predict512.py WORKDIR [--device auto|cpu|gpu|tpu]
        [--backend jax|onnx] [--tile N] [--scans 10] [--cold-only] [--anchor]
        [--config configs/lits512_16way.toml] [--size 512] [--roi] [--roi-tile N]
        [--host-figures-only] [--checkout DIR]

Speed and memory do not depend on the weights, so the run directory holds an
untrained model (`configs/lits512_16way.toml`, checkpoint at step 0), made in a
CPU-only process so that no accelerator memory is taken before the timed runs. The
host's work after the network does depend on what the network predicts: an untrained
network's scattered specks of liver and tumour are no scan's prediction. So a few of
its weights are set (`follow_the_liver`) to predict the phantom's liver as a trained
model would: the first level's encoder averages the HU window over its 3×3×3 kernel
and ramps it at 50, 60, 85 and 95 HU, its second block averages the ramps again, the
first level's decoder passes them on (its half from the levels below weighs nothing),
and the head makes a trapezoid of them: liver where the averaged HU lies between about
55 and 90 HU, background elsewhere, with probabilities near 1. No tumour is predicted:
the phantom's tumours (about 25 HU) are as dark as its muscle, which no local rule
tells apart. Every other weight stays untrained, and every level still runs. On the
512×512×63 phantom the liver's Dice against its truth is 0.95 (`liver_dice` in
each run's result): a prediction whose post-processing and writing cost what a real
one's do. The network needs 4 base filters or more.

`--host-figures-only` shrinks the network's width to 4 base filters in float32, its
depth (and so the box the scan goes on) and the config's data and grid sections kept: a
pass over the lits512 grid takes a minute or two on a CPU (ONNX Runtime) rather than the
full network's many minutes. Its network figures (`infer`, compiling, the anchor) mean
nothing; its host figures (read, resample, postprocess, write, `host_seconds`, the
not-overlapped seconds) are the config's grid's, as `"network"` in the result says.

`--checkout DIR` runs `ctseg predict` of another checkout (DIR on `PYTHONPATH`, its
`ctseg.cli.main`) on the same run directory and scans, made by this checkout: the
same inputs measured at another commit. Give it a WORKDIR of its own holding a copy
of the first one's `run`, `scan` and `liver-mask.nii.gz`.

The scan is a synthetic size×size phantom (`ctseg synth --size`), copied under N names.
`ctseg predict` runs as a user runs it, in its own process, twice on the same scans:
**cold** (an empty compilation cache) and **warm** (the cache the cold run filled;
`--cold-only` skips it). For each run: wall seconds, the process's peak resident
memory, the network's seconds per scan (`infer` in the scans' `_stats.json`: the
grid from host memory to the devices, the network, the probabilities back), the
first scan's compile seconds, each scan's seconds per phase (read, resample: to the
grid and back, infer, postprocess, write) and its host seconds (all but infer), the
liver's Dice of the first scan's labels against the phantom's truth (`liver_dice`), and
with several scans the network's seconds per scan after the first, the wall seconds of
the same call on one scan, warm (`one_scan_wall_seconds`; its phases and host seconds,
`one_scan_seconds` and `one_scan_host_seconds`, all on the critical path as nothing
overlaps them), the wall seconds each
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
fails later keeps what was measured; the last version is also printed. A later run in the
same WORKDIR reuses its run and scans only where they are what it asks for (the same
config, the same `--host-figures-only`, the same `--size`), and otherwise refuses, naming
what differs: give it a new WORKDIR. A mistake in the arguments is one line, `error: …`
(exit status 2), before anything is made; Ctrl-C is one line too (exit status 130).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from ctseg import atomic  # no JAX here: this process leaves the accelerators to the runs
from ctseg.errors import CtsegError
from ctseg.io.scans import scan_name

if TYPE_CHECKING:
    from ctseg import config as cfg

REPO = Path(__file__).resolve().parent.parent
# The command line of this Python's ctseg. -P: a `ctseg` folder or `ctseg.py` in the working
# folder (a checkout, a user's own module) is never the ctseg imported.
CTSEG = [sys.executable, "-P", "-m", "ctseg"]
# `--checkout`'s: its command line where every commit has it (`python -m ctseg` came later).
CHECKOUT_CTSEG = "import sys; from ctseg.cli.main import main; sys.exit(main())"
CONFIG = REPO / "configs" / "lits512_16way.toml"
ANCHOR = REPO / "scripts" / "monai_anchor.py"
MAKE_RUN = "--make-run"  # the child's argument: make the run directory, nothing else
# `--host-figures-only`: the network's width shrunk to 4 base filters (the fewest that
# `follow_the_liver` needs), in float32 (XLA:CPU's bfloat16 convolutions are many times
# slower; ONNX Runtime runs float32 anyway), its depth and the config's data and grid kept,
# so the box the scan goes on is the config's: a pass over the lits512 grid takes a minute
# or two on a CPU, not the full network's many minutes.
SHRUNK = ["model.base_filters=4", "model.dtype=float32"]
# The run's network predicts liver where the grid's HU, averaged over a kernel, lies in
# the phantom's liver band (`follow_the_liver`): ramps at these HU make a trapezoid that
# is half way up at 55 and 90 HU (the phantom's liver, its tumours darker, lies between;
# nothing tells its tumours from its muscle by HU alone, so none are predicted).
RAMPS_HU = (50.0, 60.0, 85.0, 95.0)
LOGIT_GAIN = 10.0  # the liver's logit on the plateau: probabilities near 1, as a trained net's
# A scan's phases as its `_stats.json` records them ("resample": to the grid and back),
# and those the host does: one scan's, or with several each scan's not overlapped with
# the network (`not_overlapped_seconds_per_scan`).
SCAN_PHASES = ("read", "resample", "infer", "postprocess", "write")
HOST_PHASES = ("read", "resample", "postprocess", "write")


def make_run(run_dir: Path, config: cfg.Config) -> None:
    """A run directory with `config` and a step-0 checkpoint of freshly initialised weights,
    a few of them set to follow the phantom's liver (`follow_the_liver`): in the child
    process, `make_run_apart`."""
    import logging

    from ctseg.model.step import init_state
    from ctseg.run import rundir
    from ctseg.run.checkpoints import Checkpoints

    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on saving a step 0
    run_dir.mkdir(parents=True, exist_ok=True)
    rundir.write_or_check_config(run_dir, config)
    _, state = init_state(config)
    checkpoints = Checkpoints(run_dir, keep=1)
    checkpoints.save(follow_the_liver(config, state))
    checkpoints.wait()
    checkpoints.close()


def make_run_apart(run_dir: Path, config_path: Path, shrunk: bool) -> None:
    """`make_run` in a CPU-only process: JAX started here on a GPU would hold most of its
    memory (JAX's preallocation) through every timed run. `shrunk`: `SHRUNK`'s network."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, __file__, MAKE_RUN, str(run_dir), str(config_path)]
    command += SHRUNK if shrunk else []
    run_child(command, "making the run", env)


def run_child(command: list[str], what: str, env: dict[str, str] | None = None) -> None:
    """Run `command`, its output on this terminal; one line, exit status 1, if it fails."""
    status = subprocess.run(command, env=env).returncode
    if status != 0:
        sys.exit(f"{what} failed (exit status {status})")


def follow_the_liver(config: cfg.Config, state: Any) -> Any:
    """`state` whose inference weights predict the phantom's liver: the first
    level's encoder averages the HU window's values over its kernel and ramps them at
    `RAMPS_HU`, its second block averages each ramp again, the first level's decoder passes
    them on (its half from below weighs nothing), and the head combines them into a
    trapezoid on the liver's band. Every other weight stays untrained; the network's work
    is the same whatever its weights."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from ctseg.data.grids import hu_to_unit
    from ctseg.model import unet

    graphdef, _, _ = unet.abstract(config.model)
    model = nnx.merge(graphdef, state.weights, state.stats)
    width = model.head.kernel.shape[0]
    if width < len(RAMPS_HU):
        sys.exit(f"the run's network needs model.base_filters >= {len(RAMPS_HU)}, got {width}")
    ramps = hu_to_unit(np.array(RAMPS_HU), config.data.hu_window)
    # Channels beyond the ramps repeat the last one; the head leaves them out.
    thresholds = np.pad(ramps, (0, width - len(ramps)), "edge")
    _set_block(model.down[0].first, np.ones((1, width)), thresholds)
    _set_block(model.down[0].second, np.eye(width), np.zeros(width))
    if config.model.depth > 1:  # the skip passes; the level below is left out
        _set_block(model.up[0].first, np.eye(2 * width, width), np.zeros(width), centre=True)
        _set_block(model.up[0].second, np.eye(width), np.zeros(width), centre=True)
    # liver − background: (r0 − r1 − r2 + r3) / (r0's plateau) − ½, > 0 inside the band.
    plateau = ramps[1] - ramps[0]
    kernel = np.zeros((width, 3))
    kernel[:4, 1] = np.array([1.0, -1.0, -1.0, 1.0]) * LOGIT_GAIN / plateau
    bias = np.array([LOGIT_GAIN / 2, 0.0, -LOGIT_GAIN])  # tumour: never
    model.head.kernel.set_value(jnp.asarray(kernel, jnp.float32))
    model.head.bias.set_value(jnp.asarray(bias, jnp.float32))
    weights, stats = nnx.state(model, nnx.Param), nnx.state(model, nnx.BatchStat)
    if state.average is None:
        return state._replace(params=weights, stats=stats)
    return state._replace(average=weights, stats=stats)


def _set_block(block: Any, mixing: Any, mean: Any, centre: bool = False) -> None:
    """A conv block as a plain filter: input channel i goes to output channel j with weight
    `mixing[i, j]`, averaged over the kernel (`centre`: the centre voxel alone), then
    `x − mean` (the batch norm, whose variance + epsilon is 1) and the ReLU."""
    import jax.numpy as jnp
    import numpy as np

    size = block.conv.kernel.shape[0]
    taps = np.zeros((size,) * 3)
    if centre:
        taps[(size // 2,) * 3] = 1.0
    else:
        taps[...] = 1.0 / taps.size
    kernel = taps[..., None, None] * np.asarray(mixing)[None, None, None]
    block.conv.kernel.set_value(jnp.asarray(kernel, jnp.float32))
    norm = block.norm
    norm.mean.set_value(jnp.asarray(mean, jnp.float32))
    norm.var.set_value(jnp.full(norm.var.shape, 1.0 - norm.epsilon, jnp.float32))
    norm.scale.set_value(jnp.ones(norm.scale.shape, jnp.float32))
    norm.bias.set_value(jnp.zeros(norm.bias.shape, jnp.float32))


# `ctseg synth --seed 94` draws a liver-only scan of 63 slices of 3.9 mm (512×512×63 at
# --size 512): the scan the prediction targets are stated for.
SCAN_SEED = 94
SMALLEST = 16  # `ctseg synth --size`'s least


def make_scans(folder: Path, count: int, size: int) -> list[Path]:
    """`count` copies of one synthetic size×size scan (volume-0 … volume-{count-1}); its
    label map is kept beside the folder (a region mask for `--roi`)."""
    first = folder / "volume-0.nii.gz"
    if not first.is_file():
        synth = [*CTSEG, "synth", str(folder), "--cases", "1", "--size", str(size)]
        synth += ["--seed", str(SCAN_SEED)]
        run_child(synth, "ctseg synth")
        # The scans alone are the input; the label map is the region mask of `--roi`.
        (folder / "segmentation-0.nii.gz").replace(folder.parent / "liver-mask.nii.gz")
    scans = [folder / f"volume-{i}.nii.gz" for i in range(count)]
    for scan in scans[1:]:  # each time: copies an earlier run left may be of another scan
        shutil.copyfile(first, scan)
    return scans


def check_reused(workdir: Path, config: cfg.Config, size: int) -> None:
    """CtsegError if WORKDIR holds a run or scans that this request did not ask for (another
    config, another size): measured, they would be reported as this request's."""
    from ctseg import config as cfg
    from ctseg.run.rundir import config_changes

    run_config = workdir / "run" / "config.toml"
    if run_config.is_file():
        changes = config_changes(cfg.load(run_config), config)
        if changes:
            raise CtsegError(
                f"{workdir / 'run'} is a run of another config (it differs in "
                f"{', '.join(changes)}): give a new WORKDIR"
            )
    scan = workdir / "scan" / "volume-0.nii.gz"
    if scan.exists():
        shape = _scan_shape(scan)
        if shape[:2] != (size, size):
            raise CtsegError(
                f"{scan} is a scan of {shape[0]}×{shape[1]} pixels, not of --size {size}: "
                "give a new WORKDIR"
            )
        if not (workdir / "liver-mask.nii.gz").is_file():
            raise CtsegError(
                f"{scan} has no liver-mask.nii.gz beside its folder: give a new WORKDIR"
            )


def _scan_shape(scan: Path) -> tuple[int, ...]:
    import nibabel as nib

    try:
        return tuple(nib.load(scan).shape)
    except Exception as exc:  # nibabel's errors for a file that is no NIfTI vary
        raise CtsegError(f"{scan} cannot be read ({exc}): give a new WORKDIR") from None


def measured(command: list[str], env: dict[str, str] | None = None) -> tuple[int, float, float]:
    """Run `command`: its exit status, wall seconds and peak resident GiB (its own, as
    `wait4` reports it for this child and its children; not another run's)."""
    began = time.perf_counter()
    child = subprocess.Popen(command, env=env)
    try:
        _, status, usage = os.wait4(child.pid, 0)
    except KeyboardInterrupt:  # Ctrl-C here only (not from the terminal): the child too
        child.kill()
        child.wait()
        raise
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
    ctseg, env = CTSEG, None
    if args.checkout:
        # -P: without the working directory first on its path: run from inside a checkout,
        # the child would import that checkout's ctseg rather than DIR's.
        ctseg = [sys.executable, "-P", "-c", CHECKOUT_CTSEG]
        env = {**os.environ, "PYTHONPATH": str(args.checkout.resolve())}
    command = [*ctseg, "predict", str(run_dir), *map(str, scans), "--out", str(out)]
    if roi is not None:
        command += ["--roi", str(roi)]
    tile = args.tile if tile is None else tile
    command += ["--device", args.device, "--tile", str(tile), "--verbose"]
    command += ["--compile-cache", str(args.workdir / "xla-cache")]
    if args.backend:
        command += ["--backend", args.backend]
    status, wall, peak = measured(command, env)
    if status != 0:
        sys.exit(f"ctseg predict failed (exit status {status}); measured so far: {args.result}")
    stats = [json.loads((out / f"{scan_name(s)}_stats.json").read_text()) for s in scans]
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
        "liver_dice": liver_dice(out / f"{scan_name(scans[0])}_seg.nii.gz", args.truth),
    }
    if len(scans) > 1:
        later = run["infer_seconds"][1:]
        run["infer_seconds_after_first"] = sum(later) / len(later)
    return run


def liver_dice(labels: Path, truth: Path) -> float:
    """The Dice of the liver (tumour included) of a label map against the phantom's truth:
    how near the run's prediction is to a real one."""
    import numpy as np

    from ctseg.io.scans import read_scan

    predicted, true = read_scan(labels).array > 0, read_scan(truth).array > 0
    both = np.count_nonzero(predicted & true)
    return 2 * both / (np.count_nonzero(predicted) + np.count_nonzero(true))


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


class _Parser(argparse.ArgumentParser):
    """argparse, a mistake in the arguments one line as ctseg's commands say it."""

    def error(self, message: str) -> NoReturn:
        _refuse(message)


def _refuse(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _arguments() -> argparse.Namespace:
    parser = _Parser(description=__doc__.split("\n")[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu", "tpu"])
    parser.add_argument("--backend", choices=["jax", "onnx"], help="default: the device policy")
    parser.add_argument("--tile", type=int, default=-1)
    parser.add_argument("--scans", type=int, default=1)
    parser.add_argument("--cold-only", action="store_true", help="skip the warm run")
    parser.add_argument("--config", type=Path, default=CONFIG, help="the run's config")
    parser.add_argument(
        "--host-figures-only",
        action="store_true",
        help="shrink the network's width (its depth, data and grid kept): host figures only",
    )
    parser.add_argument(
        "--checkout",
        type=Path,
        help="run `ctseg predict` of this checkout (on PYTHONPATH): same inputs, another commit",
    )
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
    if args.scans < 1:
        parser.error(f"--scans {args.scans}: give 1 or more")
    if args.size < SMALLEST:
        parser.error(f"--size {args.size}: ctseg synth draws scans of {SMALLEST} pixels or more")
    # Without ctseg there, the child would import the installed ctseg and measure it.
    if args.checkout is not None and not (args.checkout / "ctseg" / "__init__.py").is_file():
        parser.error(
            f"--checkout {args.checkout}: no ctseg package there (ctseg/__init__.py); give the "
            "folder of a ctseg checkout"
        )
    return args


def checked_request(args: argparse.Namespace) -> None:
    """Everything the run will need checked before anything is made (CtsegError): the
    config readable and wide enough, the scan's size within memory, WORKDIR a folder this
    process can write in, and what an earlier run left there of this request."""
    from ctseg import config as cfg
    from ctseg.synth.dataset import check_size

    config = cfg.load(args.config, SHRUNK if args.host_figures_only else ())
    if config.model.base_filters < len(RAMPS_HU):
        raise CtsegError(
            f"{args.config}: model.base_filters is {config.model.base_filters}; the run's "
            f"liver-following network needs {len(RAMPS_HU)} or more"
        )
    check_size(args.size)
    atomic.check_writable(args.workdir)
    args.workdir = atomic.output_folder(args.workdir).resolve()
    check_reused(args.workdir, config, args.size)


def _header(args: argparse.Namespace) -> dict:
    """What the result's figures are of: scans, tiles, size, the run's config, and where
    they are not this checkout's network (`--host-figures-only`, `--checkout`)."""
    header: dict = {"scans": args.scans, "tile": args.tile, "size": args.size}
    header["config"] = str(args.config)  # the run's: `check_reused` holds the run to it
    if args.host_figures_only:
        header["network"] = "width shrunk: host figures only"
    if args.checkout:
        header["checkout"] = str(args.checkout)
    return header


def _roi_runs(
    args: argparse.Namespace, run_dir: Path, scans: list[Path], result: dict, whole: dict
) -> None:
    """The liver's region alone (`--roi`) at each asked tile, and against the whole scan;
    `result` written after each."""
    mask = args.workdir / "liver-mask.nii.gz"
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


def main() -> None:
    args = _arguments()
    try:
        checked_request(args)
    except CtsegError as exc:
        _refuse(str(exc))
    args.result = args.workdir / "result.json"
    args.truth = args.workdir / "liver-mask.nii.gz"  # the phantom's label map (`make_scans`)
    run_dir, out = args.workdir / "run", args.workdir / "pred"
    if not (run_dir / "checkpoints").is_dir():
        make_run_apart(run_dir, args.config, args.host_figures_only)
    scans = make_scans(args.workdir / "scan", args.scans, args.size)
    shutil.rmtree(args.workdir / "xla-cache", ignore_errors=True)
    result = _header(args)
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
        # Alone, nothing overlaps its host's work: all of it is on the critical path.
        result["warm"]["one_scan_host_seconds"] = single["host_seconds"][0]
        result["warm"]["one_scan_seconds"] = {p: s[0] for p, s in single["seconds"].items()}
        # What each further scan adds beyond its network: the host's work on the critical path.
        network = result["warm"]["infer_seconds_after_first"]
        result["warm"]["not_overlapped_seconds_per_scan"] = per_scan - network
        atomic.write_json(args.result, result)
    if args.roi:
        _roi_runs(args, run_dir, scans, result, whole=result[kinds[-1]])
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
    if sys.argv[1:2] == [MAKE_RUN]:
        from ctseg.parallel import jax_start

        # CPU-only, as the parent asked; what JAX's plugins print on starting is held.
        jax_start.start_quietly("cpu")
        from ctseg import config as cfg

        run_dir, config_path, *overrides = sys.argv[2:]
        try:
            make_run(Path(run_dir), cfg.load(config_path, overrides))
        except CtsegError as exc:
            _refuse(str(exc))
    else:
        try:
            main()
        except KeyboardInterrupt:
            # What was measured before is in result.json.
            print("interrupted (SIGINT)", file=sys.stderr)
            sys.exit(128 + signal.SIGINT)
