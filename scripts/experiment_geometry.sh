#!/usr/bin/env bash
# `make experiment-geometry`: the cube or the spacing grid, on phantoms of LiTS-like extents?
#
# Trains the demo's U-Net (unpartitioned: partitioning changes nothing but memory)
# on the same synthetic scans twice, with the same R³ box, steps and budget: once
# with every field of view stretched onto the cube, once at a fixed spacing (R³ boxes
# around the liver for training, each scan's whole extent for prediction). Both
# predict the same held-out scans (liver-only, abdominal and chest-abdomen-pelvis
# extents), scored in the scans' own geometry, overall and by extent.
# Everything goes under experiment/ (git-ignored). Override with STEPS=…,
# RESOLUTION=…, SPACING=… (mm, isotropic), LIVER_BOXES=… (share of training boxes
# around the liver), HELDOUT=… (cases), OUT=… (folder), SETTINGS="KEY=VALUE …" (more
# config settings for both runs, e.g. "train.frozen_norm_share=0").
set -euo pipefail
cd "$(dirname "$0")/.."
CTSEG=${CTSEG:-.venv/bin/ctseg}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-experiment}
STEPS=${STEPS:-600}
RESOLUTION=${RESOLUTION:-48}
SPACING=${SPACING:-5}
LIVER_BOXES=${LIVER_BOXES:-0.5}
HELDOUT=${HELDOUT:-18}
COMMON=(--config configs/demo.toml --set "mesh.spatial=[1,1,1]" --set "train.steps=$STEPS"
        --set "data.resolution=$RESOLUTION")
read -ra settings <<< "${SETTINGS:-}"  # words, not globs: [1,8,16] stays as written
for setting in "${settings[@]}"; do COMMON+=(--set "$setting"); done
declare -A GRID=(
  [cube]="--set data.grid=cube"
  [spacing]="--set data.grid=spacing --set data.spacing=[$SPACING,$SPACING,$SPACING]
             --set train.liver_boxes=$LIVER_BOXES"
)

[ -f "$OUT/raw/segmentation-23.nii.gz" ] || "$CTSEG" synth "$OUT/raw" --cases 24 --size 96 --seed 0
last=$((HELDOUT - 1))
[ -f "$OUT/heldout/segmentation-$last.nii.gz" ] ||
  "$CTSEG" synth "$OUT/heldout" --cases "$HELDOUT" --size 96 --seed 1000
for grid in cube spacing; do
  echo "== $grid"
  # shellcheck disable=SC2086  # the grid's options are words
  options=("${COMMON[@]}" ${GRID[$grid]})
  "$CTSEG" preprocess "$OUT/raw" "$OUT/prep-$grid" "${options[@]}" --workers 2
  "$CTSEG" train --data "$OUT/prep-$grid" --workdir "$OUT/run-$grid" "${options[@]}"
  "$CTSEG" predict "$OUT/run-$grid" "$OUT"/heldout/volume-*.nii.gz --out "$OUT/pred-$grid"
  "$CTSEG" evaluate --pred "$OUT/pred-$grid" --ref "$OUT/heldout" \
    --json "$OUT/heldout-$grid.json" --force > /dev/null
done
"$PY" scripts/geometry_table.py "$OUT" cube spacing
