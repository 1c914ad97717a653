#!/usr/bin/env bash
# `make experiment-realct`: the demo's model on a real CT.
#
# The scan is TotalSegmentator's public test example (scripts/realct/, Apache-2.0: an
# unenhanced abdominal CT, 30 slices at 3 mm, a 90 mm slab through the liver); its
# reference is TotalSegmentator's own liver (label 5), a model's labels, not a
# radiologist's. `ctseg predict` segments it with the run; scripts/experiment_realct.py
# prints the liver Dice (ours: liver and tumour), the predicted and reference volumes in
# mL, the verdict of _stats.json, the scan's HU per tissue, and draws the slices with both
# outlines (docs/experiments/realct.md). Everything goes under experiment/realct
# (git-ignored). Override with RUN=… (default demo/run), OUT=…, SCAN=…, REF=….
#
# PROBES=1 also asks why (scripts/experiment_realct_probes.py, a few minutes more): the
# real CT with its HU moved (all, or the liver's alone), and 8 held-out phantoms
# (`ctseg synth --seed 1000`, drawn by this checkout's code) whole and cut to a 90 mm slab
# through the liver as the real CT is, each predicted by the run and scored.
set -euo pipefail
cd "$(dirname "$0")/.."
CTSEG=${CTSEG:-.venv/bin/ctseg}
PY=${PY:-.venv/bin/python}
RUN=${RUN:-demo/run}
OUT=${OUT:-experiment/realct}
SCAN=${SCAN:-scripts/realct/example_ct_sm.nii.gz}
REF=${REF:-scripts/realct/example_seg.nii.gz}

if [ ! -f "$RUN/config.toml" ]; then
  echo "no trained run at $RUN: run \`make demo\` first (or give RUN=…)" >&2
  exit 1
fi
mkdir -p "$OUT"
"$CTSEG" predict "$RUN" "$SCAN" --out "$OUT/pred" --force > "$OUT/predict.log" 2>&1 ||
  { cat "$OUT/predict.log" >&2; exit 1; }
echo "run: $RUN"
"$PY" scripts/experiment_realct.py "$OUT/pred" --scan "$SCAN" --ref "$REF" \
  --json "$OUT/score.json" --figures "$OUT" --tissues

if [ -n "${PROBES:-}" ]; then
  probes="$OUT/probes"
  [ -f "$probes/heldout/segmentation-7.nii.gz" ] ||
    "$CTSEG" synth "$probes/heldout" --cases 8 --size 96 --seed 1000 > /dev/null
  "$PY" scripts/experiment_realct_probes.py make "$probes" --heldout "$probes/heldout"
  for set in real slab full; do
    "$CTSEG" predict "$RUN" "$probes/$set"/volume-*.nii.gz --out "$probes/pred-$set" --force \
      > "$probes/predict-$set.log" 2>&1 || { cat "$probes/predict-$set.log" >&2; exit 1; }
  done
  "$PY" scripts/experiment_realct_probes.py score "$probes"
fi
