#!/usr/bin/env bash
# `make demo`: the whole pipeline on synthetic data, everything under demo/.
# Re-running it resumes: finished cases and checkpoints are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
CTSEG=${CTSEG:-.venv/bin/ctseg}
CONFIG=${DEMO_CONFIG:-configs/demo.toml}
OUT=${DEMO_OUT:-demo}  # DEMO_OUT=… and DEMO_CONFIG=… run it elsewhere, on another config
start=$(date +%s)

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "1/5 synthetic LiTS-like scans (24 cases + 1 held-out scan)"
[ -f "$OUT/raw/segmentation-23.nii.gz" ] || "$CTSEG" synth "$OUT/raw" --cases 24 --size 96 --seed 0
[ -f "$OUT/heldout/volume-0.nii.gz" ] || "$CTSEG" synth "$OUT/heldout" --cases 1 --size 96 --seed 1000

step "2/5 preprocess onto the demo grid"
"$CTSEG" preprocess "$OUT/raw" "$OUT/prep" --config "$CONFIG" --workers 2

step "3/5 train, 16-way spatially partitioned on simulated CPU devices"
"$CTSEG" train --config "$CONFIG" --data "$OUT/prep" --workdir "$OUT/run"

step "4/5 evaluate the validation split in the scans' own geometry"
"$CTSEG" evaluate "$OUT/run" --data "$OUT/prep" --split val --out "$OUT/eval"

step "5/5 predict the held-out scan"
"$CTSEG" predict "$OUT/run" "$OUT/heldout/volume-0.nii.gz" --out "$OUT/pred" --force

cat <<MSG

Done in $(( $(date +%s) - start )) s. Artefacts:
  $OUT/run/curves.png              training loss and validation Dice
  $OUT/run/metrics.jsonl           one JSON line per logged step
  $OUT/run/checkpoints/            orbax checkpoints (latest + best)
  $OUT/eval/summary.json           LiTS metrics per case and summary (also metrics.csv)
  $OUT/pred/volume-0_seg.nii.gz    predicted labels in the scan's own geometry
  $OUT/pred/volume-0_stats.json    liver and tumour volumes, tumour count, burden
  $OUT/pred/volume-0_preview.png   axial, coronal and sagittal overlay

Review the predictions in the browser (a local page; Ctrl-C stops it):
  $CTSEG review $OUT/eval          the validation scans, worst first, with their Dice
  $CTSEG review $OUT/pred          the held-out scan

Next, full resolution only where the liver is (about 5 minutes more on 2 cores): a
coarse locator run finds the liver, the demo's model predicts its box alone, with the
labels it gives there on the whole scan (docs/guides/prediction.md):
  $CTSEG preprocess $OUT/raw $OUT/prep-locator --config configs/locator.toml --workers 2
  $CTSEG train --config configs/locator.toml --data $OUT/prep-locator --workdir $OUT/locator
  $CTSEG predict $OUT/run $OUT/heldout/volume-0.nii.gz --out $OUT/pred-located --locate $OUT/locator
MSG
