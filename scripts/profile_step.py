"""Where a training step's device time goes: the kernels of a few profiled steps, summed.

    python scripts/profile_step.py --config configs/lits256_16way.toml [--resolution 256]
        [--steps 5] [--device gpu] [--out DIR] [--json FILE]

Compiles the step of `--config` on one device (unpartitioned, as `ctseg bench
--spatial 1,1,1`), runs a warm-up step, then profiles `--steps` steps with JAX's profiler
and prints, for each of the device's timelines (on a GPU: its streams, and XLA's ops by
HLO name), the events that took most time per step. The optimized HLO and the Perfetto
trace go to `--out`, so that a fusion's name can be looked up there; `--json` also writes
the printed figures. On the CPU there is no device timeline: the host's threads are
summed instead (useful to test the script).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOP = 25


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "lits128.toml")
    parser.add_argument("--resolution", type=int, help="the grid's side (default: the config's)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="gpu", choices=["cpu", "gpu", "tpu"])
    parser.add_argument("--out", type=Path, default=Path("profile-step"))
    parser.add_argument("--json", type=Path, help="also write the figures printed here")
    return parser.parse_args()


def profiled_step(args: argparse.Namespace) -> Path:
    """Run the profiled steps; the Perfetto trace's path."""
    from ctseg.parallel import jax_start

    jax_start.start_quietly(args.device)  # with ctseg's XLA options, as its commands start
    import jax
    from jax.sharding import NamedSharding

    from ctseg.config import load
    from ctseg.model import aot, bench, step
    from ctseg.parallel.partition import REPLICATED, make_mesh

    config = load(args.config, [f"data.resolution={args.resolution}"] if args.resolution else [])
    config = bench.layout_config(config, (1, 1, 1), "halo")
    mesh = make_mesh(config.mesh.spatial, config.mesh.data, jax.devices(args.device)[:1])
    graphdef, state = step.init_state(config)
    state = jax.device_put(state, NamedSharding(mesh, REPLICATED))
    image, label = bench.random_batch(config, mesh, config.train.seed)
    compiled = aot.compile_train_step(graphdef, config, mesh, state, image, label)
    (args.out / "train_step.hlo.txt").write_text(compiled.as_text())
    state, metrics = compiled(state, image, label)
    jax.block_until_ready((state, metrics))
    trace_dir = args.out / "trace"
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(args.steps):
            state, metrics = compiled(state, image, label)
        jax.block_until_ready((state, metrics))
    trace = next(trace_dir.rglob("*perfetto_trace.json.gz"))
    kept = shutil.copy(trace, args.out / "perfetto_trace.json.gz")
    shutil.rmtree(trace_dir)
    return Path(kept)


def timelines(trace: Path) -> dict[str, Counter]:
    """Microseconds per event name, for each (process, thread) of the trace."""
    events = json.loads(gzip.open(trace).read())
    events = events["traceEvents"] if isinstance(events, dict) else events
    names: dict[tuple[str, int, int | None], str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[(e["name"], e["pid"], e.get("tid") if e["name"] == "thread_name" else None)] = e[
                "args"
            ]["name"]
    sums: dict[str, Counter] = defaultdict(Counter)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        process = names.get(("process_name", e["pid"], None), str(e["pid"]))
        thread = names.get(("thread_name", e["pid"], e.get("tid")), str(e.get("tid")))
        sums[f"{process} / {thread}"][e["name"]] += e["dur"]
    return sums


def per_step(sums: dict[str, Counter], steps: int, device: str) -> dict[str, dict]:
    """Each timeline that took time: its milliseconds per step, and its `TOP` events'."""
    shown = {k: v for k, v in sums.items() if "/device:" in k} if device != "cpu" else sums
    figures = {}
    for line, counts in sorted(shown.items()):
        total = sum(counts.values()) / steps / 1e3
        if total >= 0.05:
            top = [[name, us / steps / 1e3] for name, us in counts.most_common(TOP)]
            figures[line] = {"ms_per_step": total, "names": len(counts), "top": top}
    return figures


def report(figures: dict[str, dict]) -> None:
    for line, timeline in figures.items():
        total = timeline["ms_per_step"]
        print(f"\n{line}: {total:.2f} ms per step over {timeline['names']} names")
        for name, ms in timeline["top"]:
            print(f"  {ms:8.3f} ms  {ms / total:6.1%}  {name[:110]}")


def main() -> None:
    args = parse()
    args.out.mkdir(parents=True, exist_ok=True)
    trace = profiled_step(args)
    figures = per_step(timelines(trace), args.steps, args.device)
    report(figures)
    if args.json is not None:
        args.json.write_text(json.dumps({"steps": args.steps, "timelines": figures}, indent=1))


if __name__ == "__main__":
    main()
