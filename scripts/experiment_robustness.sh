#!/usr/bin/env bash
# `make experiment-robustness`: does the demo's model hold on scans acquired differently?
#
# Held-out phantoms, and the same phantoms as another acquisition would show them
# (`ctseg.synth.reacquire`: rotated, larger and smaller patients, low-dose noise, a soft
# kernel, thick slices, a contrast phase), predicted by the demo's model trained as
# configured ("plain"), with nnU-Net's augmentations on the devices ("augment"), and with
# its intensity transforms alone ("intensity"), and with those and contrast phases
# ("phase": 30 % of the samples, "phase-often": 60 %; "phase-narrow": 30 %, drawn only
# near the contrast set's own phase; "phase-noise": "phase" with noise up to a low-dose
# scan's, 27 HU, for 20 % of the samples), each scored per case in the scans' own geometry,
# and under shifts of the liver's and the tumours' HU (phase_response.md). Everything
# goes under experiment/robustness (git-ignored); runs and predictions already there
# are kept.
# Override with OUT=…, HELDOUT=… (cases), STEPS=… (training steps of every run),
# VARIANTS=… (a subset).
set -euo pipefail
cd "$(dirname "$0")/.."
CTSEG=${CTSEG:-.venv/bin/ctseg}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-experiment/robustness}
HELDOUT=${HELDOUT:-24}
STEPS=${STEPS:-600}
read -r -a VARIANTS <<< "${VARIANTS:-plain augment intensity phase phase-often}"
CONFIG=configs/demo.toml
INTENSITY=(augment.noise_p=0.1 augment.blur_p=0.1 augment.brightness_p=0.15
           augment.contrast_p=0.15 augment.low_resolution_p=0.125 augment.gamma_p=0.3
           augment.gamma_inverted_p=0.1)
declare -A SETTINGS=([plain]="" [intensity]="${INTENSITY[*]}"
                     [augment]="augment.rotation_p=0.2 augment.scaling_p=0.2 ${INTENSITY[*]}"
                     [phase]="augment.phase_p=0.3 ${INTENSITY[*]}"
                     [phase-often]="augment.phase_p=0.6 ${INTENSITY[*]}"
                     [phase-narrow]="augment.phase_p=0.3 augment.phase_liver_hu=[95,110]
                                     augment.phase_tumour_share=[0.3,0.5] ${INTENSITY[*]}"
                     [phase-noise]="augment.phase_p=0.3 ${INTENSITY[*]} augment.noise_p=0.2
                                    augment.noise_std=[0,0.12]")

[ -f "$OUT/raw/segmentation-23.nii.gz" ] || "$CTSEG" synth "$OUT/raw" --cases 24 --size 96 --seed 0
last=$((HELDOUT - 1))
[ -f "$OUT/heldout/segmentation-$last.nii.gz" ] ||
  "$CTSEG" synth "$OUT/heldout" --cases "$HELDOUT" --size 96 --seed 1000
[ -f "$OUT/sets/contrast/segmentation-$last.nii.gz" ] ||
  "$PY" scripts/reacquire.py "$OUT/heldout" "$OUT/sets"
"$CTSEG" preprocess "$OUT/raw" "$OUT/prep" --config "$CONFIG" --workers 2
mkdir -p "$OUT/scores"
for variant in "${VARIANTS[@]}"; do
  options=(--config "$CONFIG" --set "train.steps=$STEPS")
  set -f  # the ranges' brackets are not globs
  for setting in ${SETTINGS[$variant]}; do options+=(--set "$setting"); done
  set +f
  echo "== $variant"
  "$CTSEG" train --data "$OUT/prep" --workdir "$OUT/run-$variant" "${options[@]}"
  for set in "$OUT"/sets/*/; do
    name=$(basename "$set")
    [ -f "$OUT/scores/$variant-$name.json" ] && continue
    "$CTSEG" predict "$OUT/run-$variant" "$set"volume-*.nii.gz --out "$OUT/pred-$variant/$name" --force > /dev/null
    "$CTSEG" evaluate --pred "$OUT/pred-$variant/$name" --ref "$set" \
      --json "$OUT/scores/$variant-$name.json" --force > /dev/null
  done
done
"$PY" scripts/robustness_table.py "$OUT" "${VARIANTS[@]}"
"$PY" scripts/phase_response.py "$OUT" "${VARIANTS[@]}"
