"""Table of the geometry experiment: Dice on held-out scans, overall and by extent.

Usage: python scripts/geometry_table.py EXPERIMENT_DIR GRID1 GRID2 ...
Reads EXPERIMENT_DIR/heldout-<GRID>.json (`ctseg evaluate --pred --ref --json`) and
the kind of each held-out and training scan from the synth.json files that
`ctseg synth` writes (for real scans, `ctseg.synth.cases.extent_group` of the z-extent).
"""

import json
import sys
from pathlib import Path

import numpy as np

KINDS = ("liver-only", "abdominal", "chest-abdomen-pelvis")


def _kinds(folder: Path) -> dict[str, str]:
    """Scan number → kind, from `ctseg synth`'s synth.json."""
    entries = json.loads((folder / "synth.json").read_text())["cases"]
    return {entry["case"].split("-")[-1]: entry["kind"] for entry in entries}


def _mean(values: list[float | None]) -> str:
    values = [v for v in values if v is not None]
    return f"{np.mean(values):.3f}" if values else "–"


def main(out: Path, grids: list[str]) -> None:
    heldout, trained = _kinds(out / "heldout"), _kinds(out / "raw")
    counts = {kind: sum(k == kind for k in heldout.values()) for kind in KINDS}
    in_training = {kind: sum(k == kind for k in trained.values()) for kind in KINDS}
    lines = [
        "| grid | liver Dice | tumour Dice | "
        + " | ".join(f"liver / tumour, {k} ({counts[k]})" for k in KINDS)
        + " | liver: worst − best extent |",
        "|---" * (4 + len(KINDS)) + "|",
    ]
    for grid in grids:
        cases = json.loads((out / f"heldout-{grid}.json").read_text())["cases"]
        by_kind: dict[str, list[dict]] = {kind: [] for kind in KINDS}
        for case in cases:
            by_kind[heldout[case["case"].split("-")[-1]]].append(case)
        livers = {k: [c["liver"]["dice"] for c in v] for k, v in by_kind.items() if v}
        groups = " | ".join(
            f"{_mean([c['liver']['dice'] for c in by_kind[k]])} / "
            f"{_mean([c['tumour']['dice'] for c in by_kind[k]])}"
            for k in KINDS
        )
        means = [float(np.mean(v)) for v in livers.values()]
        lines.append(
            f"| {grid} | {_mean([c['liver']['dice'] for c in cases])} | "
            f"{_mean([c['tumour']['dice'] for c in cases])} | {groups} | "
            f"{min(means) - max(means):+.3f} |"
        )
    note = ", ".join(f"{in_training[k]} {k}" for k in KINDS)
    table = "\n".join(lines) + f"\n\nTraining scans: {note}. Dice per case, original geometry.\n"
    (out / "geometry.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
