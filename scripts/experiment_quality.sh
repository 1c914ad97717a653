#!/usr/bin/env bash
# `make experiment-quality`: does the prediction quality find the predictions that are wrong?
#
# The demo's model (`make demo` first: demo/run) predicts held-out phantoms as acquired
# (clean), re-acquired the seven ways of `ctseg.synth.reacquire` (rotated, larger, smaller,
# noise, soft, thick, contrast), and scans it was not made for, with their truth: another
# modality (mr: the HU remapped to a T1-weighted MR's intensities), a chest scan holding
# only the liver's dome (chest), and phantoms in contrast phases the training scans never
# had (phases: `ctseg synth --phases`). Each set is predicted by `ctseg predict` (which
# records each scan's quality in its _stats.json) and scored by `ctseg evaluate
# --pred/--ref` (each case's quality beside its Dice); scripts/quality_table.py pools the
# cases, chooses the thresholds from them (`ctseg.evaluation.calibration.choose_thresholds`,
# as `ctseg evaluate --calibrate` does), and reports per set and pooled: the AUROC of the
# liver's and the tumours' scores, the share of good cases sent to review, and whether every
# liver of Dice < 0.5 is flagged (docs/experiments/quality.md). Everything goes under
# experiment/quality (git-ignored); sets and scores already there are kept (delete
# experiment/quality/scores after changing the quality's code).
# Override with OUT=…, RUN=…, CASES=… (per set); ENSEMBLE="RUN2 RUN3 …" predicts with an
# ensemble of RUN and those runs (`ctseg predict --run`), which adds its members' agreement;
# TTA=1 predicts with mirrored test-time augmentation (`--tta`: a run trained with flips).
set -euo pipefail
cd "$(dirname "$0")/.."
CTSEG=${CTSEG:-.venv/bin/ctseg}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-experiment/quality}
RUN=${RUN:-demo/run}
CASES=${CASES:-16}
MEMBERS=()
for member in ${ENSEMBLE:-}; do MEMBERS+=(--run "$member"); done
[ -n "${TTA:-}" ] && MEMBERS+=(--tta)
SETS=(clean rotated larger smaller noise soft thick contrast mr chest)

if [ ! -f "$RUN/config.toml" ]; then
  echo "no trained run at $RUN: run \`make demo\` first (or give RUN=…)" >&2
  exit 1
fi
last=$((CASES - 1))
[ -f "$OUT/heldout/segmentation-$last.nii.gz" ] ||
  "$CTSEG" synth "$OUT/heldout" --cases "$CASES" --size 96 --seed 1000
[ -f "$OUT/sets/phases/segmentation-$last.nii.gz" ] ||
  "$CTSEG" synth "$OUT/sets/phases" --cases "$CASES" --size 96 --seed 2000 --phases
[ -f "$OUT/sets/chest/segmentation-$last.nii.gz" ] ||
  "$PY" scripts/reacquire.py "$OUT/heldout" "$OUT/sets" --changes "${SETS[@]}"
mkdir -p "$OUT/scores"
start=$(date +%s)
for name in "${SETS[@]}" phases; do
  [ -f "$OUT/scores/$name.json" ] && continue
  echo "== $name"
  "$CTSEG" predict "$RUN" ${MEMBERS[@]+"${MEMBERS[@]}"} "$OUT/sets/$name"/volume-*.nii.gz --out "$OUT/pred/$name" --force \
    > "$OUT/pred-$name.log"
  "$CTSEG" evaluate --pred "$OUT/pred/$name" --ref "$OUT/sets/$name" \
    --json "$OUT/scores/$name.json" --force > /dev/null
done
echo "predicted and scored in $(( $(date +%s) - start )) s"
"$PY" scripts/quality_table.py "$OUT" --run "$RUN${ENSEMBLE:+ + $ENSEMBLE}" "${SETS[@]}" phases
