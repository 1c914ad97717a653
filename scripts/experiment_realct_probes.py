"""Probes of why a model misses the real CT's liver: the same scans changed one way each.

    python scripts/experiment_realct_probes.py make OUT --heldout DIR
    python scripts/experiment_realct_probes.py score OUT

`make` writes, under OUT:

- real/: the real CT (scripts/realct/) with every HU moved by each of `SHIFTS_HU`
  (``volume-shift+15.nii.gz``: the unenhanced liver at 45 HU moved to the phantoms' 55–70), and
  with the liver alone (by TotalSegmentator's label) moved by each (``volume-liver+15``);
- slab/ and full/: each held-out phantom of DIR (`ctseg synth` output) cut to a slab of
  `SLAB_MM` through its liver as the real CT's is (from `SLAB_BOTTOM_MM` above the
  liver's lowest slice), and the same phantom whole: the field of view alone changed.

`score` reads the predictions `ctseg predict` wrote to OUT/pred-real, OUT/pred-slab and
OUT/pred-full (scripts/experiment_realct.sh with PROBES=1 runs it all) and prints the
liver Dice of each probe: for the real CT against TotalSegmentator's liver, for the
phantoms within the slab's slices, whole scan and slab alike.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nibabel as nib
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from experiment_realct import REALCT, TS_LIVER, _canonical, _dice  # noqa: E402

SHIFTS_HU = (-15, 15, 30)
SLAB_MM = 90.0  # the real CT's 30 slices of 3 mm
SLAB_BOTTOM_MM = 10.0  # it begins just above the tip of the right lobe


def _write(array: np.ndarray, like: nib.Nifti1Image, path: Path, *, hu: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = nib.Nifti1Image(array.astype(np.int16 if hu else np.uint8), like.affine)
    image.header.set_xyzt_units("mm")
    nib.save(image, path)


def make_real(out: Path) -> None:
    ct = nib.load(REALCT / "example_ct_sm.nii.gz")
    hu = np.asarray(ct.dataobj).astype(np.float32)
    liver = np.asarray(nib.load(REALCT / "example_seg.nii.gz").dataobj) == TS_LIVER
    for shift in SHIFTS_HU:
        _write(hu + shift, ct, out / "real" / f"volume-shift{shift:+d}.nii.gz", hu=True)
        _write(hu + shift * liver, ct, out / "real" / f"volume-liver{shift:+d}.nii.gz", hu=True)


def slab_of(labels: np.ndarray, dz: float) -> slice:
    """The slices of the slab through the liver of `labels` (canonical order)."""
    rows = np.flatnonzero(labels.any(axis=(0, 1)))
    start = int(rows[0] + round(SLAB_BOTTOM_MM / dz))
    return slice(start, min(start + max(int(round(SLAB_MM / dz)), 1), labels.shape[2]))


def make_phantoms(out: Path, heldout: Path) -> None:
    for volume_path in sorted(heldout.glob("volume-*.nii.gz")):
        name = volume_path.name.removeprefix("volume-")
        volume = nib.as_closest_canonical(nib.load(volume_path))
        segmentation = nib.as_closest_canonical(nib.load(heldout / f"segmentation-{name}"))
        hu = np.asarray(volume.dataobj).astype(np.float32)
        labels = np.asarray(segmentation.dataobj)
        cut = slab_of(labels, float(volume.header.get_zooms()[2]))
        affine = volume.affine.copy()
        affine[:3, 3] = volume.affine[:3, :3] @ [0, 0, cut.start] + volume.affine[:3, 3]
        slab = nib.Nifti1Image(np.zeros(1), affine)
        for folder, image in (("full", volume), ("slab", slab)):
            array = hu if folder == "full" else hu[:, :, cut]
            truth = labels if folder == "full" else labels[:, :, cut]
            _write(array, image, out / folder / f"volume-{name}", hu=True)
            _write(truth, image, out / folder / f"segmentation-{name}", hu=False)


def score(out: Path) -> None:
    ref, _ = _canonical(REALCT / "example_seg.nii.gz")
    print("real CT, liver Dice (predicted mL):")
    for path in sorted((out / "pred-real").glob("*_seg.nii.gz")):
        predicted, spacing = _canonical(path)
        ours = np.isin(predicted, (1, 2))
        ml = float(ours.sum() * np.prod(spacing)) / 1000
        name = path.name.removeprefix("volume-").removesuffix("_seg.nii.gz")
        print(f"  {name:10} {_dice(ours, ref == TS_LIVER):.3f}  ({ml:,.0f} mL)")
    print("phantoms, liver Dice within the slab: whole scan / slab alone")
    slab_dice, full_dice = [], []
    for truth_path in sorted((out / "slab").glob("segmentation-*.nii.gz")):
        name = truth_path.name.removeprefix("segmentation-").removesuffix(".nii.gz")
        truth = _canonical(truth_path)[0] > 0
        slab = _canonical(out / "pred-slab" / f"volume-{name}_seg.nii.gz")[0] > 0
        full_truth = _canonical(out / "full" / f"segmentation-{name}.nii.gz")[0]
        full = _canonical(out / "pred-full" / f"volume-{name}_seg.nii.gz")[0] > 0
        spacing = float(nib.load(out / "full" / f"volume-{name}.nii.gz").header.get_zooms()[2])
        cut = slab_of(full_truth, spacing)
        full_dice.append(_dice(full[:, :, cut], truth))
        slab_dice.append(_dice(slab, truth))
        print(f"  volume-{name:4} {full_dice[-1]:.3f} / {slab_dice[-1]:.3f}")
    if slab_dice:
        print(f"  mean        {np.mean(full_dice):.3f} / {np.mean(slab_dice):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("make", "score"))
    parser.add_argument("out", type=Path)
    parser.add_argument("--heldout", type=Path, help="held-out phantoms (ctseg synth)")
    args = parser.parse_args()
    if args.action == "score":
        score(args.out)
        return
    make_real(args.out)
    if args.heldout:
        make_phantoms(args.out, args.heldout)


if __name__ == "__main__":
    main()
