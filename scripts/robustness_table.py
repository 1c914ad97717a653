"""Table and plot of the robustness experiment: Dice per case on each re-acquired set.

Usage: python scripts/robustness_table.py EXPERIMENT_DIR VARIANT1 VARIANT2 ...
Reads EXPERIMENT_DIR/scores/<VARIANT>-<SET>.json (`ctseg evaluate --pred --ref --json`)
for the sets of `ctseg.synth.reacquire.CHANGES`; writes robustness.md (mean Dice per
case, and each set's drop from the clean set) and robustness.png beside them.
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ctseg.synth.reacquire import CHANGES  # noqa: E402


def _mean_dice(path: Path, organ: str) -> float:
    cases = json.loads(path.read_text())["cases"]
    values = [c[organ]["dice"] for c in cases if c[organ]["dice"] is not None]
    return float(np.mean(values)) if values else float("nan")


def main(out: Path, variants: list[str]) -> None:
    sets = [
        s for s in CHANGES if all((out / "scores" / f"{v}-{s}.json").is_file() for v in variants)
    ]
    dice = {
        (v, s, organ): _mean_dice(out / "scores" / f"{v}-{s}.json", organ)
        for v in variants
        for s in sets
        for organ in ("liver", "tumour")
    }
    lines = [
        "| set | what changed | "
        + " | ".join(f"{v}: liver / tumour (drop)" for v in variants)
        + " |",
        "|---|---|" + "---|" * len(variants),
    ]
    for s in sets:
        cells = []
        for v in variants:
            liver, tumour = dice[(v, s, "liver")], dice[(v, s, "tumour")]
            if s == "clean":
                cells.append(f"{liver:.3f} / {tumour:.3f}")
            else:
                drop_l = liver - dice[(v, "clean", "liver")]
                drop_t = tumour - dice[(v, "clean", "tumour")]
                cells.append(f"{liver:.3f} / {tumour:.3f} ({drop_l:+.3f} / {drop_t:+.3f})")
        lines.append(f"| {s} | {CHANGES[s]} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n\nMean Dice per case, in the scans' own geometry.\n"
    (out / "robustness.md").write_text(table)
    print(table)

    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    width = 0.8 / len(variants)
    for ax, organ in zip(axes, ("liver", "tumour"), strict=True):
        for i, v in enumerate(variants):
            ax.bar(
                np.arange(len(sets)) + i * width,
                [dice[(v, s, organ)] for s in sets],
                width,
                label=v,
            )
        ax.set_xticks(np.arange(len(sets)) + width * (len(variants) - 1) / 2, sets, rotation=30)
        ax.set_title(f"{organ} Dice per case")
        ax.set_ylim(0, 1)
    axes[0].legend(loc="lower left")
    figure.tight_layout()
    figure.savefig(out / "robustness.png", dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
