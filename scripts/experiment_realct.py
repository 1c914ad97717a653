"""Score a prediction of the real CT (scripts/realct/) against TotalSegmentator's liver.

    python scripts/experiment_realct.py PRED_DIR [--scan CT] [--ref SEG] [--json OUT]
        [--figures DIR] [--tissues]

PRED_DIR is `ctseg predict`'s output folder for the scan: <name>_seg.nii.gz (our liver is
labels 1 and 2, liver and tumour) and <name>_stats.json (the verdict). The reference is
TotalSegmentator's label 5 (liver). Prints the liver Dice, the predicted and reference
volumes in mL and the verdict; `--json` keeps them. `--figures` draws every third slice
of the scan with the reference's and the prediction's outlines (PNG); `--tissues` prints
the scan's HU per tissue, by TotalSegmentator's labels (`make experiment-realct` runs
all three; docs/experiments/realct.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import nibabel as nib
import numpy as np

REALCT = Path(__file__).resolve().parent / "realct"
TS_LIVER = 5
# TotalSegmentator's classes (its `total` task, v2) that lie in this slab, grouped.
TS_TISSUES = {
    "liver": (5,),
    "spleen": (1,),
    "kidneys": (2, 3),
    "gallbladder": (4,),
    "stomach": (6,),
    "pancreas": (7,),
    "bowel (small, duodenum, colon)": (18, 19, 20),
    "aorta": (52,),
    "inferior vena cava": (63,),
    "portal and splenic veins": (64,),
    "back muscles": (86, 87),
    "psoas": (88, 89),
    "vertebrae": (30, 31, 32, 33),
    "ribs": tuple(range(92, 116)),
    "lungs": tuple(range(10, 15)),
}


def _canonical(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The image's voxels in RAS order, and its voxel sizes (mm)."""
    image = nib.as_closest_canonical(nib.load(path))
    return np.asarray(image.dataobj), np.asarray(image.header.get_zooms()[:3], float)


def _dice(a: np.ndarray, b: np.ndarray) -> float:
    total = int(a.sum()) + int(b.sum())
    return 1.0 if total == 0 else 2.0 * int((a & b).sum()) / total


def score(pred_dir: Path, scan: Path, ref: Path) -> dict:
    """The liver's Dice, the volumes and the verdict of the prediction of `scan`."""
    name = scan.name.removesuffix(".gz").removesuffix(".nii")
    predicted, spacing = _canonical(pred_dir / f"{name}_seg.nii.gz")
    reference, ref_spacing = _canonical(ref)
    if predicted.shape != reference.shape or not np.allclose(spacing, ref_spacing):
        raise SystemExit(f"error: {pred_dir} does not predict {scan} (other geometry)")
    ours, theirs = np.isin(predicted, (1, 2)), reference == TS_LIVER
    ml = float(np.prod(spacing)) / 1000.0
    stats = json.loads((pred_dir / f"{name}_stats.json").read_text())
    quality = stats.get("quality", {})
    return {
        "scan": str(scan),
        "liver_dice": round(_dice(ours, theirs), 4),
        "predicted_ml": round(float(ours.sum()) * ml, 1),
        "reference_ml": round(float(theirs.sum()) * ml, 1),
        "overlap_ml": round(float((ours & theirs).sum()) * ml, 1),
        "tumour_ml": round(float((predicted == 2).sum()) * ml, 1),
        "verdict": quality.get("verdict"),
        "reason": quality.get("reason"),
        "checks": quality.get("checks", []),
    }


def tissues(scan: Path, ref: Path) -> list[tuple[str, int, float, float, float]]:
    """Per tissue: voxels, mean, median and SD of the HU; fat and the body as a whole are
    found by HU (the body: above -500 HU, the CT table's rows excluded by its labels
    being absent)."""
    hu, _ = _canonical(scan)
    labels, _ = _canonical(ref)
    hu = hu.astype(np.float32)
    rows = [(name, np.isin(labels, values)) for name, values in TS_TISSUES.items()]
    unlabelled = labels == 0
    rows.append(("fat (-190…-30 HU, unlabelled)", unlabelled & (hu > -190) & (hu < -30)))
    rows.append(("soft tissue (-30…150 HU, unlabelled)", unlabelled & (hu > -30) & (hu < 150)))
    table = []
    for name, mask in rows:
        if mask.any():
            values = hu[mask]
            mean, median, sd = float(values.mean()), float(np.median(values)), float(values.std())
            table.append((name, int(mask.sum()), mean, median, sd))
    return table


def figures(pred_dir: Path, scan: Path, ref: Path, out: Path) -> list[Path]:
    """Every third axial slice, window 40 ± 200 HU, the reference's liver outlined in green
    and the prediction's liver in red (tumour filled in yellow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name = scan.name.removesuffix(".gz").removesuffix(".nii")
    hu, _ = _canonical(scan)
    reference, _ = _canonical(ref)
    predicted, _ = _canonical(pred_dir / f"{name}_seg.nii.gz")
    slices = range(0, hu.shape[2], 3)
    fig, axes = plt.subplots(2, (len(slices) + 1) // 2, figsize=(3 * len(slices) / 2, 6.5))

    def radiological(plane: np.ndarray) -> np.ndarray:
        """A RAS slice as radiologists look at it: anterior up, the patient's right left."""
        return plane[::-1, ::-1].T

    for ax, k in zip(axes.ravel(), slices, strict=False):
        ax.imshow(radiological(hu[:, :, k]), cmap="gray", vmin=-160, vmax=240)
        theirs = radiological(reference[:, :, k] == TS_LIVER)
        ax.contour(theirs, [0.5], colors="lime", linewidths=0.8)
        ours = radiological(np.isin(predicted[:, :, k], (1, 2)))
        if ours.any():
            ax.contour(ours, [0.5], colors="red", linewidths=0.8)
        tumour = radiological(predicted[:, :, k] == 2)
        if tumour.any():
            ax.imshow(np.ma.masked_where(~tumour, tumour), cmap="autumn_r", alpha=0.6)
        ax.set_title(f"slice {k}", fontsize=8)
        ax.axis("off")
    for ax in axes.ravel()[len(slices) :]:
        ax.axis("off")
    fig.suptitle(f"{pred_dir}: green TotalSegmentator's liver, red ours", fontsize=9)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}_slices.png"
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return [path]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pred_dir", type=Path)
    parser.add_argument("--scan", type=Path, default=REALCT / "example_ct_sm.nii.gz")
    parser.add_argument("--ref", type=Path, default=REALCT / "example_seg.nii.gz")
    parser.add_argument("--json", type=Path, help="write the scores here")
    parser.add_argument("--figures", type=Path, help="folder for the slices' PNG")
    parser.add_argument("--tissues", action="store_true", help="print the HU per tissue")
    args = parser.parse_args()
    if args.tissues:
        print(f"{'tissue':38} {'voxels':>7} {'mean':>6} {'median':>6} {'SD':>5}  (HU)")
        for name, n, mean, median, sd in tissues(args.scan, args.ref):
            print(f"{name:38} {n:7d} {mean:6.0f} {median:6.0f} {sd:5.0f}")
        print()
    result = score(args.pred_dir, args.scan, args.ref)
    print(
        f"liver Dice {result['liver_dice']:.3f}: predicted {result['predicted_ml']:,.1f} mL"
        f" (tumour {result['tumour_ml']:,.1f}), reference {result['reference_ml']:,.1f} mL,"
        f" overlap {result['overlap_ml']:,.1f} mL"
    )
    print(f"verdict: {result['verdict']}" + (f" ({result['reason']})" if result["reason"] else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.figures:
        for path in figures(args.pred_dir, args.scan, args.ref, args.figures):
            print(f"slices: {path}")


if __name__ == "__main__":
    main()
