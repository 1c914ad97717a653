"""Table and plot of the resolution experiment: Dice in original geometry vs grid size.

Usage: python scripts/resolution_table.py EXPERIMENT_DIR R1 R2 ...
Reads EXPERIMENT_DIR/eval<R>/summary.json (written by `ctseg evaluate RUN --out`).
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(out: Path, resolutions: list[int]) -> None:
    rows = []
    for r in resolutions:
        summary = json.loads((out / f"eval{r}" / "summary.json").read_text())["summary"]
        liver, tumour = summary["liver"], summary["tumour"]
        rows.append(
            (
                r,
                liver["dice_per_case"],
                liver["dice_global"],
                tumour["dice_per_case"],
                tumour["dice_global"],
                tumour.get("detection_recall"),
            )
        )
    lines = [
        "| grid | liver Dice (per case) | liver Dice (global) | tumour Dice (per case) "
        "| tumour Dice (global) | lesion recall |",
        "|---|---|---|---|---|---|",
    ]
    for r, *values in rows:
        cells = " | ".join("–" if v is None else f"{v:.3f}" for v in values)
        lines.append(f"| {r}³ | {cells} |")
    table = "\n".join(lines)
    (out / "resolution.md").write_text(table + "\n")
    print(table)

    fig, ax = plt.subplots(figsize=(5, 3.4), constrained_layout=True)
    grids = [r for r, *_ in rows]
    ax.plot(grids, [row[1] for row in rows], "o-", label="liver", color="tab:red")
    ax.plot(grids, [row[3] for row in rows], "o-", label="tumour", color="tab:green")
    ax.set(
        xlabel="grid side R (voxels)",
        ylabel="Dice, original geometry",
        ylim=(0, 1),
        xticks=grids,
        title="Dice against grid resolution",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(out / "resolution.png", dpi=110)
    print(f"wrote {out / 'resolution.md'} and {out / 'resolution.png'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), [int(r) for r in sys.argv[2:]])
