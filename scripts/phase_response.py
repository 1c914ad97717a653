"""What a model reads in the liver and its tumours: Dice under shifts of their HU.

Usage: python scripts/phase_response.py EXPERIMENT_DIR VARIANT[@CHECKPOINT] ...
Predicts EXPERIMENT_DIR/heldout's scans that hold tumours with each
EXPERIMENT_DIR/run-<VARIANT> (the robustness experiment's runs; its best checkpoint,
or the step or "latest" after @) after moving the liver
and the tumours by the HU of `SHIFTS` (`ctseg.synth.reacquire.enhance`), and writes
phase_response.md beside them: mean Dice per case for each shift, of the liver's own
label (1, its tumours apart: the voxels each shift moves alike) and of the tumours.
A model that tells a tumour by its contrast to the liver keeps its tumour Dice when
both move together or the liver alone brightens; one that learnt the tumours' HU
loses it.
"""

import sys
from pathlib import Path

import nibabel as nib
import numpy as np

from ctseg import Segmenter
from ctseg.labels import LIVER, TUMOUR, mask_dice
from ctseg.synth.reacquire import enhance

# (liver, tumour) HU: as acquired, the robustness set's portal venous phase, the liver
# alone (the tumour more conspicuous), the tumour alone, both alike (the same contrast),
# half the portal venous phase.
SHIFTS = [(0, 0), (40, 15), (40, 0), (0, 15), (40, 40), (20, 8)]


def main(out: Path, variants: list[str]) -> None:
    scans = []
    for volume in sorted((out / "heldout").glob("volume-*.nii*")):
        labels = np.asarray(nib.load(str(volume).replace("volume-", "segmentation-")).dataobj)
        if (labels == TUMOUR).sum() >= 50:  # a few voxels' Dice is 0 or 1 by chance
            scans.append((nib.load(volume), labels))
    lines = [
        f"Mean Dice per case, liver (label 1) / tumour, on the {len(scans)} held-out scans with "
        "tumours, their HU moved by their labels.",
        "",
        "| liver HU | tumour HU | " + " | ".join(variants) + " |",
        "|---|---|" + "---|" * len(variants),
    ]
    cells = {}
    for variant in variants:
        name, _, checkpoint = variant.partition("@")
        segmenter = Segmenter(out / f"run-{name}", checkpoint=checkpoint or "best")
        for liver_hu, tumour_hu in SHIFTS:
            dice = []
            for image, labels in scans:
                hu = enhance(image.get_fdata(), labels, liver_hu, tumour_hu)
                moved = nib.Nifti1Image(np.rint(hu).astype(np.int16), image.affine)
                pred = segmenter(moved).labels
                dice.append(
                    (
                        mask_dice(pred == LIVER, labels == LIVER),
                        mask_dice(pred == TUMOUR, labels == TUMOUR),
                    )
                )
            liver, tumour = np.mean(dice, axis=0)
            cells[(variant, liver_hu, tumour_hu)] = f"{liver:.3f} / {tumour:.3f}"
            print(variant, liver_hu, tumour_hu, cells[(variant, liver_hu, tumour_hu)], flush=True)
    for liver_hu, tumour_hu in SHIFTS:
        row = " | ".join(cells[(v, liver_hu, tumour_hu)] for v in variants)
        lines.append(f"| {liver_hu:+d} | {tumour_hu:+d} | {row} |")
    (out / "phase_response.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
