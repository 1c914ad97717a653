"""The GPU check: everything ctseg promises on one accelerator, in one command of ~8 minutes.

    python scripts/gpu_check.py WORKDIR [--device gpu] [--quick]      # or: make gpu-check

On a machine with one GPU and the `cuda12`/`cuda13` and `bench` extras, it runs, each
in its own process as a user runs it:

1. `ctseg train` with `configs/lits256_16way.toml` on four synthetic 256³-box scans,
   100 steps with the LiTS augmentations: seconds from the command's start to the first
   step, and the share of the loop spent waiting for input;
2. prediction of 512×512 scans with the lits512 model (`scripts/bench_predict512.py
   --anchor`): cold and warm, each further scan, the network against MONAI's sliding
   window; ten scans of ten different extents in one `ctseg predict`, which must
   compile nothing after the first scan's programs; and lits512's network over that
   scan's grid as one whole-volume program and as fixed windows, each one's compile and
   run seconds (`scripts/bench_windows.py`);
3. the training step at 256³ and 128³ (`ctseg bench`, `configs/lits256_16way.toml`
   fitted to one device and `configs/lits128.toml`), and the same U-Net's step in
   PyTorch, eager and `torch.compile`d (`scripts/monai_anchor.py train`); where the
   256³ step's device time goes, kernel by kernel (`scripts/profile_step.py`); and the
   image's convolution alone, its weights' gradient against PyTorch's
   (`scripts/bench_conv.py`).

A check that fails is a row saying so; the others go on. It prints a table of
measurements against the targets last and writes WORKDIR/gpu_check.json (rewritten after
every check, so an interrupted run keeps what it measured) and each command's output to
WORKDIR/logs/ (with JAX_LOG_COMPILES=1 set: `ctseg train`'s log lists every program
compiled and its seconds).
`--quick` runs the same checks on small grids (minutes on a CPU: `--device cpu --quick`
tests the script itself; its numbers mean nothing); `--only train,predict` runs those
checks alone, in that order (PyTorch's anchors run last by default, so a short lease
keeps ctseg's own figures); `--mirror DIR` copies the JSON and the logs (packed) there
after every check.
A mistake in the arguments (an unknown check, a work or mirror folder that cannot be
written) is one line, `error: …` (exit status 2), before any check runs; the script exits
with status 1 when a check it ran failed, and on Ctrl-C with one line and status 130.
Record each run in docs/experiments/gpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from ctseg import atomic  # no JAX here: this process leaves the accelerator to the checks
from ctseg.errors import CtsegError

REPO = Path(__file__).resolve().parent.parent
# The command line of this Python's ctseg. -P: a `ctseg` folder or `ctseg.py` in the working
# folder (a checkout, a user's own module) is never the ctseg imported.
CTSEG = [sys.executable, "-P", "-m", "ctseg"]
SCRIPTS = REPO / "scripts"
LITS128, LITS256 = REPO / "configs" / "lits128.toml", REPO / "configs" / "lits256_16way.toml"
LITS512 = REPO / "configs" / "lits512_16way.toml"
EXTENTS = 10  # scans of different extents predicted in one command


@dataclass
class Settings:
    """What the checks run on: the full sizes on a GPU, small ones with --quick."""

    device: str
    quick: bool
    work: Path
    results: dict = field(default_factory=dict)

    def sets(self) -> list[str]:
        """Overrides that shrink a config's grid and network under --quick."""
        small = ["data.resolution=32", "model.base_filters=8", "model.depth=3"]
        return [f"--set={s}" for s in small] if self.quick else []


def run(s: Settings, name: str, command: list[str], timeout: float) -> tuple[float, str]:
    """Run a command; its wall seconds and standard output, both streams kept in
    WORKDIR/logs/NAME.log. RuntimeError with its last error line when it fails or
    overruns."""
    began = time.perf_counter()
    log = s.work / "logs" / f"{name}.log"
    log.parent.mkdir(exist_ok=True)
    try:
        # Run in WORKDIR, where whatever a command leaves beside its outputs stays.
        # JAX_LOG_COMPILES: each program's compile seconds in the log (`ctseg train` prints
        # them; commands that hold libraries' output print them with --verbose).
        env = {**os.environ, "JAX_LOG_COMPILES": "1"}
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, cwd=s.work, env=env
        )
    except subprocess.TimeoutExpired as exc:
        log.write_text(f"$ {' '.join(command)}\n{_text(exc.stdout)}{_text(exc.stderr)}")
        raise RuntimeError(f"no answer in {timeout:.0f} s: {' '.join(command[:3])} …") from None
    log.write_text(f"$ {' '.join(command)}\n{done.stdout}{done.stderr}")
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()] or ["(no message)"]
        raise RuntimeError(f"exit {done.returncode}: {lines[-1][:300]}")
    return time.perf_counter() - began, done.stdout


def _text(output: bytes | str | None) -> str:
    """What a timed-out command had written (bytes, even with text=True)."""
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


# ------------------------------------------------------------------ the checks


def bench_step(s: Settings, config: Path, name: str) -> dict:
    report = s.work / f"{name}.json"
    report.unlink(missing_ok=True)
    command = [*CTSEG, "bench", "--config", str(config), "--spatial", "1,1,1"]
    command += ["--partitioner", "halo", "--steps", "10", "--device", s.device]
    run(s, name, [*command, *s.sets(), "--json", str(report)], 300)
    result = json.loads(report.read_text())["results"][0]
    return {"step_seconds": result["step_seconds"], "gib": result["per_device_bytes"] / 2**30}


def profile_step(s: Settings) -> dict:
    """Where the 256³ step's device time goes, by kernel (`scripts/profile_step.py`)."""
    report = s.work / "profile256.json"
    report.unlink(missing_ok=True)
    config = REPO / "configs" / "demo.toml" if s.quick else LITS256
    command = [sys.executable, str(SCRIPTS / "profile_step.py"), "--config", str(config)]
    command += ["--device", s.device, "--out", str(s.work / "profile256"), "--json", str(report)]
    run(s, "profile256", command, 300)
    return json.loads(report.read_text())


def first_conv(s: Settings) -> dict:
    """The image's convolution (1 → 32 channels at 256³), each pass apart: ctseg's matrix
    products (`ctseg.model.image_conv`) against cuDNN's kernels as XLA tunes them, and
    PyTorch's on a GPU (`scripts/bench_conv.py`)."""
    command = [sys.executable, str(SCRIPTS / "bench_conv.py"), "--cin", "1", "--cout", "32"]
    command += ["--size", "32" if s.quick else "256", "--variants", "padding,matrix"]
    command += ["--device", s.device, *(["--torch"] if s.device == "gpu" else [])]
    _, out = run(s, "conv1", command, 180)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {line["variant"]: line for line in lines}


def anchor_step(s: Settings, size: int, compiled: bool) -> dict:
    if s.device != "gpu":
        return {"skipped": "the PyTorch anchor trains on a CUDA GPU only"}
    command = [sys.executable, str(SCRIPTS / "monai_anchor.py"), "train", "--size", str(size)]
    name = f"anchor{size}{'_compiled' if compiled else ''}"
    _, out = run(s, name, [*command, "--base", "32", *(["--compile"] if compiled else [])], 300)
    result = json.loads(out.strip().splitlines()[-1])
    return {"step_seconds": result["step_seconds"], "gib": result["peak_gib"]}


def train_start(s: Settings) -> dict:
    """`ctseg train` on four synthetic scans: first step, data wait, steps per second."""
    raw, prep, run_dir = s.work / "train-raw", s.work / "train-prep", s.work / "train-run"
    for folder in (raw, prep, run_dir):
        shutil.rmtree(folder, ignore_errors=True)
    size = "64" if s.quick else "256"
    run(
        s,
        "train-synth",
        [*CTSEG, "synth", str(raw), "--cases", "4", "--size", size, "--seed", "0"],
        300,
    )
    sets = s.sets()
    run(
        s,
        "train-preprocess",
        [*CTSEG, "preprocess", str(raw), str(prep), "--config", str(LITS256), *sets],
        300,
    )
    steps = 10 if s.quick else 100
    command = [*CTSEG, "train", "--config", str(LITS256), "--data", str(prep)]
    command += ["--workdir", str(run_dir), "--device", s.device, *sets]
    command += [f"--set=train.steps={steps}", "--set=train.log_every=1"]
    command += [f"--set=train.eval_every={steps}", f"--set=train.checkpoint_every={steps}"]
    began = time.time()
    wall, _ = run(s, "train", command, 400)
    entries = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first, last = entries[0], [e for e in entries if "val_dice_liver" not in e][-1]
    return {
        "first_step_seconds": first["time"] - began,
        "data_wait_fraction": last["data_wait_fraction"],
        "steps_per_second": last["steps_per_second"],
        "wall_seconds": wall,
    }


def predict512_folder(s: Settings) -> Path:
    """The predict check's work folder: one per size, as the run and scans made there are
    of that size (`bench_predict512.py` refuses a folder of another's)."""
    return s.work / ("predict512-quick" if s.quick else "predict512")


def predict512(s: Settings) -> dict:
    work = predict512_folder(s)
    command = [sys.executable, str(SCRIPTS / "bench_predict512.py"), str(work)]
    command += ["--device", s.device, "--scans", "3" if s.quick else "10"]
    demo = ["--config", str(REPO / "configs" / "demo.toml")]
    command += ["--size", "96", *demo] if s.quick else ["--anchor"]
    run(s, "predict", command, 600)
    return json.loads((work / "result.json").read_text())


def plans(s: Settings) -> dict:
    """lits512's network over the 512×512×63 phantom's grid box, as one whole-volume
    program and as fixed windows of 128 (`scripts/bench_windows.py`): each one's compile
    (with the GPU's autotuning) and run seconds. The windows do 2–3× the whole volume's
    work (their overlap) and compile once per model; the whole volume compiles per box
    shape. Which way a batch should run is this trade."""
    report = s.work / "plans.json"
    report.unlink(missing_ok=True)
    config, core, box = LITS512, "128", "[[560,560,320]]"
    if s.quick:
        config, core, box = REPO / "configs" / "demo.toml", "16", "[[48,48,48]]"
    command = [sys.executable, str(SCRIPTS / "bench_windows.py"), "--config", str(config)]
    command += ["--core", core, "--boxes", box, "--modes", "whole,windows"]
    run(s, "plans", [*command, "--device", s.device, "--json", str(report)], 500)
    rows = json.loads(report.read_text())
    keep = ("compile_seconds", "run_seconds", "stage_seconds", "plan")
    return {row["mode"]: {k: row[k] for k in keep} for row in rows}


def extents(s: Settings) -> dict:
    """Ten scans of ten extents (the phantom cut to fewer slices) in one `ctseg predict`,
    a second process on the predict check's compilation cache: the network's programs
    come from the cache, and those of the first scan serve the rest."""
    import nibabel as nib

    work = predict512_folder(s)
    # The scan the predict check made, by its name: not whatever else lies in the folder.
    run_dir, scan = work / "run", work / "scan" / "volume-0.nii.gz"
    if not scan.is_file() or not run_dir.is_dir():
        raise RuntimeError("needs the predict512 check's run and scan")
    cut, out = s.work / "extents", s.work / "extents-out"
    shutil.rmtree(cut, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    cut.mkdir(parents=True)
    image = nib.load(scan)
    slices = image.shape[2]
    for i in range(EXTENTS):
        keep = slices - i * max(slices // (2 * EXTENTS), 1)
        part = image.slicer[:, :, :keep]
        nib.save(part, cut / f"volume-{i}.nii.gz")
    command = [*CTSEG, "predict", str(run_dir), str(cut), "--out", str(out)]
    wall, _ = run(s, "extents", [*command, "--compile-cache", str(work / "xla-cache")], 600)
    stats = [json.loads(p.read_text()) for p in sorted(out.glob("*_stats.json"))]
    stats.sort(key=lambda st: st["seconds"].get("compile", 0.0), reverse=True)
    later = [st["seconds"].get("compile", 0.0) for st in stats[1:]]
    return {
        "scans": len(stats),
        "wall_seconds": wall,
        "first_compile_seconds": stats[0]["seconds"].get("compile", 0.0),
        "later_compile_seconds": sum(later),
        # The call's programs and those from the cache (each scan's record counts so far).
        "compiled": max((st["compiled"] for st in stats), key=lambda c: c["programs"]),
    }


# ------------------------------------------------------------------ the table


@dataclass(frozen=True)
class Row:
    check: str
    measured: Callable[[dict], float | None]
    target: str
    met: Callable[[float], bool] | None  # None: a measurement without a target
    unit: str = "s"


def _get(*keys: str) -> Callable[[dict], float | None]:
    def read(results: dict) -> float | None:
        value = results
        for key in keys:
            if not isinstance(value, dict) or key not in value:
                return None
            value = value[key]
        return value

    return read


def _percent(*keys: str) -> Callable[[dict], float | None]:
    def read(results: dict) -> float | None:
        value = _get(*keys)(results)
        return None if value is None else 100 * value

    return read


def _ratio(a: tuple[str, ...], b: tuple[str, ...]) -> Callable[[dict], float | None]:
    def read(results: dict) -> float | None:
        x, y = _get(*a)(results), _get(*b)(results)
        return None if x is None or not y else x / y

    return read


def _first_cold(results: dict) -> float | None:
    """The cold run's wall seconds less what its further scans added (warm)."""
    cold = _get("predict", "cold", "wall_seconds")(results)
    further = _get("predict", "warm", "wall_seconds_per_scan_after_first")(results)
    scans = _get("predict", "scans")(results)
    return None if None in (cold, further, scans) else cold - (scans - 1) * further


ROWS = (
    Row("train step 128³", _get("step128", "step_seconds"), "", None),
    Row(
        "  vs torch.compile",
        _ratio(("step128", "step_seconds"), ("anchor128_compiled", "step_seconds")),
        "≤ 1.0×",
        lambda v: v <= 1.0,
        "×",
    ),
    Row("train step 256³", _get("step256", "step_seconds"), "", None),
    Row(
        "  vs torch.compile",
        _ratio(("step256", "step_seconds"), ("anchor256_compiled", "step_seconds")),
        "≤ 1.0×",
        lambda v: v <= 1.0,
        "×",
    ),
    Row(
        "  memory vs PyTorch",
        _ratio(("step256", "gib"), ("anchor256_compiled", "gib")),
        "≤ 0.6×",
        lambda v: v <= 0.6,
        "×",
    ),
    Row(
        "  first conv's weight gradient vs PyTorch",
        _ratio(("conv1", "jax matrix", "wgrad_ms"), ("conv1", "torch", "wgrad_ms")),
        "",
        None,
        "×",
    ),
    Row("train: first step", _get("train", "first_step_seconds"), "≤ 60 s", lambda v: v <= 60),
    Row(
        "train: data wait", _percent("train", "data_wait_fraction"), "≤ 5 %", lambda v: v <= 5, "%"
    ),
    Row("predict: first scan, cold", _first_cold, "≤ 30 s", lambda v: v <= 30),
    Row(
        "predict: one scan, warm",
        _get("predict", "warm", "one_scan_wall_seconds"),
        "≤ 5 s",
        lambda v: v <= 5,
    ),
    Row(
        "predict: each further scan",
        _get("predict", "warm", "wall_seconds_per_scan_after_first"),
        "≤ 1 s",
        lambda v: v <= 1,
    ),
    Row(
        "predict: network vs MONAI",
        _get("predict", "network_vs_anchor"),
        "≤ 0.25×",
        lambda v: v <= 0.25,
        "×",
    ),
    Row("network, whole volume: compile", _get("plans", "whole", "compile_seconds"), "", None),
    Row("  run", _get("plans", "whole", "run_seconds"), "", None),
    Row("network, fixed windows: compile", _get("plans", "windows", "compile_seconds"), "", None),
    Row("  run", _get("plans", "windows", "run_seconds"), "", None),
    Row(
        f"predict: {EXTENTS} extents, compile after the first",
        _get("extents", "later_compile_seconds"),
        "0 s",
        lambda v: v == 0,
    ),
)


def table(results: dict) -> str:
    lines = [f"{'check':<44} {'measured':>10}  {'target':<10} met"]
    for row in ROWS:
        value = row.measured(results)
        shown = "–" if value is None else f"{value:.3g}{row.unit}"
        verdict = "–" if value is None or row.met is None else ("yes" if row.met(value) else "NO")
        lines.append(f"{row.check:<44} {shown:>10}  {row.target:<10} {verdict}")
    failed = {k: v["error"] for k, v in results.items() if isinstance(v, dict) and "error" in v}
    lines += [f"{name} failed: {error}" for name, error in failed.items()]
    return "\n".join(lines)


def mirror(work: Path, folder: Path) -> None:
    """WORKDIR's gpu_check.json and its logs, packed in one file, copied to `folder`: two
    files, each replaced whole, however far the check got."""
    folder.mkdir(parents=True, exist_ok=True)
    atomic.write_json(folder / "gpu_check.json", json.loads((work / "gpu_check.json").read_text()))
    with atomic.atomic_path(folder / "logs.tar.gz") as tmp, tarfile.open(tmp, "w:gz") as tar:
        if (work / "logs").is_dir():
            tar.add(work / "logs", arcname="logs")


class _Parser(argparse.ArgumentParser):
    """argparse, a mistake in the arguments one line as ctseg's commands say it."""

    def error(self, message: str) -> NoReturn:
        _refuse(message)


def _refuse(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def chosen_checks(only: str | None, checks: list[str]) -> list[str]:
    """The checks `--only` names, in its order (all of them without it); CtsegError for a
    name that is empty or no check's."""
    if only is None:
        return checks
    chosen = [name.strip() for name in only.split(",")]
    if not all(chosen):
        raise CtsegError(f"--only {only!r} names no check there; the checks: {', '.join(checks)}")
    unknown = [name for name in chosen if name not in checks]
    if unknown:
        raise CtsegError(f"no check named {', '.join(unknown)}; the checks: {', '.join(checks)}")
    return chosen


def main() -> None:
    parser = _Parser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    parser.add_argument("--quick", action="store_true", help="small grids: tests the script")
    parser.add_argument("--only", help="comma-separated checks to run, in this order")
    parser.add_argument(
        "--mirror",
        type=Path,
        help="after every check, also write gpu_check.json and logs.tar.gz here (a lent "
        "machine that gives back a few files of one folder)",
    )
    args = parser.parse_args()
    s = Settings(args.device, args.quick, args.workdir)
    # ctseg's own checks first, PyTorch's anchors last: a short lease keeps what is ours.
    # Training before the steps: its step compiled into the cache is step256's, which on a
    # fresh machine otherwise compiles for over 40 s before it times anything.
    checks: dict[str, Callable[[], dict]] = {
        "train": lambda: train_start(s),
        "predict": lambda: predict512(s),
        "extents": lambda: extents(s),
        "plans": lambda: plans(s),
        "step256": lambda: bench_step(s, LITS256, "step256"),
        "step128": lambda: bench_step(s, LITS128, "step128"),
        "profile256": lambda: profile_step(s),
        "conv1": lambda: first_conv(s),
        "anchor128": lambda: anchor_step(s, 128, False),
        "anchor128_compiled": lambda: anchor_step(s, 128, True),
        "anchor256": lambda: anchor_step(s, 256, False),
        "anchor256_compiled": lambda: anchor_step(s, 256, True),
    }
    try:
        chosen = chosen_checks(args.only, list(checks))
        folders = [args.workdir, *([] if args.mirror is None else [args.mirror])]
        for folder in folders:
            atomic.check_writable(folder)
        s.work, *mirrored = [atomic.output_folder(folder).resolve() for folder in folders]
    except CtsegError as exc:
        _refuse(str(exc))
    began = time.perf_counter()
    for name in chosen:
        check = checks[name]
        print(f"[{time.perf_counter() - began:5.0f} s] {name} …", flush=True)
        try:
            s.results[name] = check()
        except Exception as exc:  # one failed check is a row; the others go on
            s.results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        s.results["wall_seconds"] = time.perf_counter() - began
        atomic.write_json(s.work / "gpu_check.json", s.results)
        for folder in mirrored:
            mirror(s.work, folder)
    print(table(s.results))
    print(f"wrote {s.work / 'gpu_check.json'} ({s.results['wall_seconds']:.0f} s in all)")
    if any("error" in s.results[name] for name in chosen):
        sys.exit(1)  # each failed check is a line of the table above


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        # The check under way was stopped with it (`subprocess.run` kills its command); what
        # the checks before it measured is in gpu_check.json.
        print("interrupted (SIGINT)", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
