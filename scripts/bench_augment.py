"""What nnU-Net's augmentations on the devices cost the demo's training, measured in one run.

    python scripts/bench_augment.py WORKDIR [--data demo/prep] [--steps 100] [--repeats 2]

1. **Training speed.** `ctseg train` of configs/demo.toml (16-way on simulated CPU
   devices) for --steps steps, as configured ("current") and with every transform of
   `[augment]` at nnU-Net's probabilities plus the contrast phase ("nnunet"),
   alternated --repeats times so that both see the machine alike. From each run's
   metrics.jsonl: steps per second and the share of time the loop waited for input
   (`data_wait_fraction`, as the progress bar reports it), at the last logged step
   before the final validation.
2. **Host time per sample.** For boxes of the demo's side and twice it (--boxes), every
   sample rotated and zoomed: what `Augmenter.inputs` costs the host (reading each
   device's preimage from the memory-mapped store and placing it), what the devices'
   program takes, and what `scipy.ndimage.affine_transform` of the box on the host takes
   (linear for the image, nearest for the labels: nnU-Net's way).

WORKDIR/result.json holds the numbers; ratios are taken within this one run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CTSEG = [sys.executable, "-m", "ctseg"]  # the command line of this Python's ctseg
CONFIG = REPO / "configs" / "demo.toml"
# nnU-Net's probabilities (blur and low resolution per sample × 0.5 per channel), and
# ctseg's own contrast phase at the robustness experiment's 30 %.
NNUNET = (
    "augment.rotation_p=0.2",
    "augment.scaling_p=0.2",
    "augment.noise_p=0.1",
    "augment.blur_p=0.1",
    "augment.brightness_p=0.15",
    "augment.contrast_p=0.15",
    "augment.low_resolution_p=0.125",
    "augment.gamma_p=0.3",
    "augment.gamma_inverted_p=0.1",
    "augment.phase_p=0.3",
)


def train(data: Path, run_dir: Path, steps: int, extra: tuple[str, ...]) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = [f"train.steps={steps}", f"train.eval_every={steps}", "train.frozen_norm_share=0"]
    sets += [f"train.checkpoint_every={steps}", *extra]
    command = [*CTSEG, "train", "--config", str(CONFIG), "--data", str(data)]
    command += ["--workdir", str(run_dir), *[a for s in sets for a in ("--set", s)]]
    began = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - began
    entries = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [e for e in entries if "val_dice_liver" not in e][-1]
    return {
        "step": last["step"],
        "steps_per_second": last["steps_per_second"],
        "data_wait_fraction": last["data_wait_fraction"],
        "wall_seconds": wall,
    }


def start_on_16_cpu_devices() -> None:
    """JAX on 16 simulated CPU devices, what its plugins print on starting held, as the
    commands hold it."""
    from ctseg.parallel import held_output, jax_start

    with held_output.held_start_output():  # importing JAX imports its plugins, which speak
        from ctseg.parallel.partition import configure_cpu_devices

        configure_cpu_devices(16)
    jax_start.start_quietly("cpu")


def host_times(data: Path, samples: int, box: int) -> dict:
    start_on_16_cpu_devices()
    import jax
    import numpy as np
    from scipy import ndimage

    from ctseg import config as cfg
    from ctseg.data.grids import hu_to_unit
    from ctseg.data.store import Store
    from ctseg.parallel.partition import make_mesh
    from ctseg.training import augment, draws, pipeline

    always = ["augment.rotation_p=1", "augment.scaling_p=1", f"data.resolution={box}"]
    config = cfg.load(CONFIG, [*NNUNET, *always])
    store = Store.open(data)
    mesh = make_mesh(config.mesh.spatial, config.mesh.data)
    began = time.perf_counter()
    largest = np.max([c.grid_shape for c in store.split("train")], axis=0)
    augmenter = augment.Augmenter(config, mesh, box, tuple(largest))
    compile_seconds = time.perf_counter() - began
    ids = [c.id for c in store.split("train")]
    centre = np.full(3, (box - 1) / 2)
    host, device, scipy_host = [], [], []
    for step in range(samples + 1):  # step 0 warms the device program's first run
        case = pipeline.cases_for_step(ids, config.train.seed, step, 1)[0]
        base = draws.draw_augmentation(config, step, 0)
        draw = draws.draw_sample(config, step, 0, base)
        offset = pipeline.draw_box_offset(config, store.case(case), box, step, 0)
        began = time.perf_counter()
        inputs = augmenter.inputs(store, [case], [offset], [base], [draw])
        jax.block_until_ready([a for a in inputs if a is not None])
        placed = time.perf_counter()
        jax.block_until_ready(augmenter(step, inputs))
        done = time.perf_counter()
        # nnU-Net's way: the host warps the box, reading the grid around it.
        shift = centre - draw.matrix @ centre + np.asarray(offset)
        unit = hu_to_unit(np.asarray(store.image(case)), config.data.hu_window)
        ndimage.affine_transform(unit, draw.matrix, shift, (box,) * 3, order=1, cval=-1.0)
        ndimage.affine_transform(
            np.asarray(store.label(case)), draw.matrix, shift, (box,) * 3, order=0
        )
        host_warp = time.perf_counter() - done
        if step:
            host.append(placed - began)
            device.append(done - placed)
            scipy_host.append(host_warp)
    median = statistics.median
    return {
        "box": box,
        "mesh": list(config.mesh.spatial),
        "block": list(augmenter.block),
        "compile_seconds": compile_seconds,
        "samples": samples,
        "host_read_and_place_ms": 1000 * median(host),
        "device_program_ms": 1000 * median(device),
        "scipy_affine_transform_ms": 1000 * median(scipy_host),
        "host_vs_scipy": median(host) / median(scipy_host),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--data", type=Path, default=REPO / "demo" / "prep")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument(
        "--boxes",
        type=lambda text: [int(v) for v in text.split(",")],
        default=[48, 96],
        help="box sides for the host's times (the demo trains on 48)",
    )
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"current": [], "nnunet": []}
    for repeat in range(args.repeats):
        for name, extra in (("current", ()), ("nnunet", NNUNET)):
            run = train(args.data, args.workdir / f"{name}-{repeat}", args.steps, extra)
            runs[name].append(run)
            print(name, json.dumps(run), flush=True)
    rate = {k: statistics.median(r["steps_per_second"] for r in v) for k, v in runs.items()}
    result = {
        "config": str(CONFIG.relative_to(REPO)),
        "steps": args.steps,
        "training": runs,
        "nnunet_vs_current_steps_per_second": rate["nnunet"] / rate["current"],
        "host": [host_times(args.data, args.samples, box) for box in args.boxes],
    }
    (args.workdir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
