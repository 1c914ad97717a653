"""Prediction's programs per box shape: the whole volume, level-wise tiles, fixed windows.

    python scripts/bench_windows.py [--config configs/demo.toml] [--core 32]
        [--boxes '[[80,80,80],[96,96,64],[64,80,112]]'] [--modes windows,whole,tiles]
        [--device cpu|gpu|tpu] [--json FILE]

For each mode and each box shape in turn, through one backend (as one `ctseg predict`
meets scans of several extents): the first pass's wall seconds, the seconds JAX spent
compiling for it and the programs it compiled, by name, and the best of two further
passes. The whole volume compiles one program per shape; level-wise tiles one per stage
and shape; fixed windows their window programs once (`window_program`) and, per new
shape, only the small programs that cut and stitch the windows (`_begin`,
`_add_then_cut`); `windows1` runs them one window per dispatch (deep stages' small windows
are otherwise batched). Each row also gives a pass's seconds per stage (waited on after
each: their sum exceeds the run's). The model is untrained (its weights change no time).
On a GPU the compiles include XLA's autotuning, which the window programs pay once.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# How each mode asks for its plan (`Engine`'s arguments); `core` fills in the sizes.
MODES = {
    "whole": lambda boxes, core: {"tile": 0},
    "tiles": lambda boxes, core: {"tile": core},
    "windows": lambda boxes, core: {"tile": core, "windows": boxes.windows(core)},
    # one window per dispatch
    "windows1": lambda boxes, core: {"tile": core, "windows": boxes.windows(core)},
}


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "demo.toml")
    parser.add_argument("--core", type=int, default=32, help="tiles' and windows' core")
    parser.add_argument("--boxes", default="[[80,80,80],[96,96,64],[64,80,112]]")
    parser.add_argument("--modes", default="windows,whole,tiles")
    parser.add_argument("--device", default="cpu", choices=["cpu", "gpu", "tpu"])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    args.boxes = [tuple(box) for box in json.loads(args.boxes)]
    args.modes = args.modes.split(",")
    if unknown := set(args.modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}; choose from {sorted(MODES)}")
    return args


def _stage_ends(engine, placed) -> list[float]:
    """The clock at a pass's start and after each stage (waited on)."""
    ends = [time.perf_counter()]
    engine.logits(placed, lambda *_: ends.append(time.perf_counter()))
    return ends


def main() -> None:
    args = parse()
    from ctseg.parallel import jax_start

    jax_start.start_quietly(args.device)
    import jax
    import numpy as np

    from ctseg import config as cfg
    from ctseg.inference.network.engine import Engine
    from ctseg.inference.network.jax.backend import JaxBackend
    from ctseg.model import unet
    from ctseg.parallel.compile_cache import compile_clock
    from ctseg.run.trained import TrainedModel

    config = cfg.load(args.config, [])
    graphdef, params, stats = unet.create(config.model, seed=0)
    model = TrainedModel(config, graphdef, params, stats, step=0)
    clock = compile_clock()
    devices = jax.devices(args.device)[:1]
    backends = {
        "windows1": JaxBackend(devices, fixed_windows=True, most_batched=1),
        **{mode: JaxBackend(devices, fixed_windows=True) for mode in MODES if mode != "windows1"},
    }
    rows = []
    for mode in args.modes:
        backend = backends[mode]
        for box in args.boxes:
            image = np.random.default_rng(0).uniform(-1, 1, box).astype(np.float32)
            seconds, programs = clock.seconds, dict(clock.by_name)
            start = time.perf_counter()
            engine = Engine(model, backend, shape=box, **MODES[mode](backend.boxes, args.core))
            placed = engine.place(image)
            jax.block_until_ready(engine.logits(placed))
            first = time.perf_counter() - start
            compiled = {
                name: count - programs.get(name, 0)
                for name, count in clock.by_name.items()
                if count > programs.get(name, 0)
            }
            runs = []
            for _ in range(2):
                start = time.perf_counter()
                jax.block_until_ready(engine.logits(placed))
                runs.append(time.perf_counter() - start)
            stage_ends = _stage_ends(engine, placed)
            row = {
                "mode": mode,
                "box": list(box),
                "plan": engine.description,
                "first_seconds": round(first, 3),
                "compile_seconds": round(clock.seconds - seconds, 3),
                "run_seconds": round(min(runs), 3),
                "stage_seconds": [round(b - a, 3) for a, b in itertools.pairwise(stage_ends)],
                "programs": compiled,
            }
            rows.append(row)
            print(json.dumps(row, ensure_ascii=False), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
