"""Per-scan quality control: how far to trust a prediction, and a verdict users act on.

Every prediction gets a `Quality` (`assess`): a few *concerns*, each a number in
[0, 1] with a name and a sentence, from three sources —

- the model's own uncertainty (`liver_uncertainty`, `tumour_uncertainty`): one minus
  the Dice the class probabilities themselves expect of the predicted structure
  (`expected_dice`): 2·Σ_pred p / (|pred| + Σ p), the probabilities that a voxel is the
  structure summed where it was predicted and everywhere. Mirrored TTA's disagreement
  shows as probabilities near ½ and lowers it. Computed where the probabilities are (on
  the devices for a JAX engine: only six scalars come back), on a lone run's grid or a
  region's exact voxels (`Prediction.uncertainty`); an ensemble's only from probabilities
  kept on the scan's voxels;
- how unlike the training data the scan is: the run's fingerprint checks
  (`ctseg.inference.scan_checks.checks`, any of which makes the verdict
  `unlike the training data`), and the median HU inside the predicted liver against the
  training livers' (`intensity`, in the training voxels' standard deviations);
- plausibility: no liver at all (`no_liver`), a liver volume outside the training livers'
  range (`liver_volume`), a liver in pieces (`fragments`, the share of it outside its
  largest connected piece).

A concern is 0 where nothing is wrong, ½ at its review threshold and 1 at twice it
(`_ramp`). The liver's score is the largest liver concern, the tumours' the larger of
the tumour uncertainty and the liver's score (tumours are found inside the liver), and
the scan's score the largest of all; 1 where a fingerprint check fires. The verdict:
`unlike the training data` (a check fired; its first line is the reason), `review` (the
score reaches `REVIEW_AT`; the largest concern's sentence is the reason), else `ok`.

The thresholds (`Thresholds`: where each concern reaches its review point) are
CALIBRATED against the truth: `DEFAULT_THRESHOLDS` were chosen by `make
experiment-quality` (docs/experiments/quality.md: the demo's model on held-out phantoms
re-acquired seven ways and on scans it was not made for: MR, chest-only, other contrast
phases) with `ctseg.evaluation.quality.choose_thresholds`, starting from the first
version's hand-chosen ones (`HAND_CHOSEN`). A run may hold its own (RUN_DIR/quality.json,
`THRESHOLDS_FILE`: a version and what they were calibrated on), written by `ctseg
evaluate RUN --data STORE --calibrate` from the user's labelled cases; `Reference.of_run`
loads them, so that `ctseg predict`, `ctseg evaluate` and the Python API judge by them.
Every recorded quality names what its thresholds were calibrated on, and keeps each
concern's raw value, so that it can be judged again by others (`rejudged`).

Cost: a few NumPy passes over the labels (a count, and a strided sample of at most
`SAMPLED`³ voxels for the median HU and the connected pieces) and one reduction over the
grid's probabilities where they are.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy import ndimage

from ctseg.inference.thresholds import DEFAULT_THRESHOLDS, Thresholds, read_thresholds
from ctseg.labels import liver_mask
from ctseg.run import rundir
from ctseg.run.fingerprint import sample_step

OK, REVIEW, UNLIKE = "ok", "review", "unlike the training data"
VERDICTS = (OK, REVIEW, UNLIKE)

REVIEW_AT = 0.5  # a scan whose score reaches this is sent to review (a concern's midpoint)
# ---- how the uncertainty is measured (fixed: the calibrated thresholds are on its scale)
# Probabilities below this are left out of Σ p: a model's faint probability spread over a
# whole scan would otherwise swamp a small structure. At most ⅓, so that every voxel an
# argmax predicts counts (its class has ≥ ⅓) and the expected Dice stays ≤ 1.
PROBABILITY_FLOOR = 0.25
# Added to both sides of the expected Dice (voxels of the grid), as soft Dice's smoothing:
# a faint trace where nothing was predicted is not a missed structure.
SMOOTH_VOXELS = 8.0
# The intensity and piece measures read a strided sample of at most this many voxels per axis.
SAMPLED = 128
_MIN_SPREAD_HU = 5.0  # a training spread below this (a flat phantom) counts as this

LIVER, TUMOUR = "liver", "tumour"


@dataclass(frozen=True)
class Concern:
    """One component of a prediction's quality."""

    name: str  # e.g. "liver_uncertainty"
    structure: str  # "liver" or "tumour": whose score it counts towards
    value: float  # the raw measure (its unit is the name's: see the module docstring)
    concern: float  # [0, 1]: 0 nothing wrong, `REVIEW_AT` at the review threshold
    reason: str  # a short sentence for users

    def to_json(self) -> dict[str, Any]:
        return {
            "structure": self.structure,
            "value": round(self.value, 4) if math.isfinite(self.value) else None,
            "concern": round(self.concern, 4),
            "reason": self.reason,
        }


@dataclass(frozen=True)
class Quality:
    """A prediction's quality: its verdict with the one reason that weighs most, its
    scores (0 good … 1 bad) and the concerns they come from."""

    verdict: str  # one of `VERDICTS`
    reason: str | None  # None for `ok`
    score: float  # the scan's: the largest concern, 1 when unlike the training data
    liver: float
    tumour: float
    concerns: tuple[Concern, ...] = ()
    checks: tuple[str, ...] = ()  # the fingerprint's findings that made it `unlike`
    thresholds: str = DEFAULT_THRESHOLDS.calibrated_on  # what the thresholds were chosen on

    @property
    def flagged(self) -> bool:
        """Whether a user should look at it (`review` or `unlike the training data`)."""
        return self.verdict != OK

    def to_json(self) -> dict[str, Any]:
        """As `_stats.json` and the evaluation's cases record it."""
        return {
            "verdict": self.verdict,
            "reason": self.reason,
            "score": round(self.score, 4),
            "liver": round(self.liver, 4),
            "tumour": round(self.tumour, 4),
            "concerns": {c.name: c.to_json() for c in self.concerns},
            "checks": list(self.checks),
            "thresholds": self.thresholds,  # what they were calibrated on
        }


@dataclass(frozen=True)
class Reference:
    """What of the run's training data (its fingerprint.json) the quality compares with, and
    the thresholds it judges by (the run's own `THRESHOLDS_FILE`, else the defaults)."""

    liver_hu_median: float | None = None
    liver_hu_sd: float | None = None
    liver_volume_ml: tuple[float, float] | None = None  # the training livers' min, max
    thresholds: Thresholds = DEFAULT_THRESHOLDS

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None) -> Reference:
        """From a fingerprint's JSON (`ctseg.run.fingerprint`); empty for None or one that
        lacks the fields (nothing compared)."""
        if not isinstance(raw, dict):
            return cls()
        try:
            hu, volume = raw.get("liver_hu"), raw.get("liver_volume_ml")
            return cls(
                liver_hu_median=None if hu is None else float(hu["median"]),
                liver_hu_sd=None if hu is None else float(hu["std"]),
                liver_volume_ml=None
                if volume is None
                else (float(volume["min"]), float(volume["max"])),
            )
        except (KeyError, TypeError, ValueError):
            return cls()

    @classmethod
    def of_run(cls, run_dir: Path | None) -> Reference:
        """The (first) run's reference: its fingerprint (none compared for a run without
        one, or no run) and its thresholds (RUN_DIR/quality.json, `ctseg evaluate
        --calibrate`'s; the defaults where it has none). CtsegError (one line) for a
        thresholds file that cannot be read or is malformed."""
        if run_dir is None:
            return cls()
        thresholds = read_thresholds(Path(run_dir))
        try:
            reference = cls.from_json(rundir.read_fingerprint(Path(run_dir)))
        except Exception:  # an unreadable fingerprint is the checks' to report, not ours
            reference = cls()
        return dataclasses.replace(reference, thresholds=thresholds)


# ---------------------------------------------------------------- the components


def _ramp(value: float, review_at: float) -> float:
    """0 at 0, `REVIEW_AT` at `review_at`, 1 at twice it (and beyond)."""
    if not math.isfinite(value):
        return 1.0
    return float(min(1.0, max(0.0, REVIEW_AT * value / review_at)))


def _sums(probabilities: Any, xp: Any, inside: Any = None) -> Any:
    """[Σ_pred p, |pred|, Σ_{p ≥ floor} p] of the liver (labels ≥ 1) and tumours (label 2),
    the prediction being the argmax: six numbers, on the array's own devices. `inside`: the
    voxels that count (None: all)."""
    p = probabilities if probabilities.dtype == xp.float32 else probabilities.astype(xp.float32)
    background, liver, tumour = p[..., 0], p[..., 1], p[..., 2]
    # The argmax's classes by comparisons (ties to the lower class, as the argmax breaks
    # them): an argmax over a last axis of 3 is many times slower in NumPy.
    organ_predicted = (liver > background) | (tumour > background)
    tumour_predicted = (tumour > background) & (tumour > liver)
    found = []
    for prob, predicted in ((liver + tumour, organ_predicted), (tumour, tumour_predicted)):
        likely = prob >= PROBABILITY_FLOOR
        if inside is not None:
            predicted, likely = predicted & inside, likely & inside
        found += [
            xp.sum(xp.where(predicted, prob, 0.0)),
            xp.sum(predicted.astype(xp.float32)),
            xp.sum(xp.where(likely, prob, 0.0)),
        ]
    return xp.stack(found)


def _device_sums(probabilities: Any, lo: Any, hi: Any) -> Any:
    """`_sums` of the box's voxels [lo, hi) per axis (traced [3] arrays: one program per box
    shape, as the engine has, whatever the span inside it)."""
    import jax.numpy as jnp

    x, y, z = (jnp.arange(n) for n in probabilities.shape[:3])
    inside = (
        ((x >= lo[0]) & (x < hi[0]))[:, None, None]
        & ((y >= lo[1]) & (y < hi[1]))[None, :, None]
        & ((z >= lo[2]) & (z < hi[2]))[None, None, :]
    )
    return _sums(probabilities, jnp, inside)


_jitted_sums = None


def probability_sums(probabilities: Any, span: Sequence[Sequence[int]] | None = None) -> np.ndarray:
    """`_sums` of the class probabilities [x, y, z, 3] on their voxels [lo, hi) per axis of
    `span` (None: all of them): with jax.numpy where they are a JAX array (only the six
    scalars leave the devices), else NumPy."""
    if span is None:
        span = [(0, n) for n in probabilities.shape[:3]]
    lo, hi = (np.asarray([int(ends[i]) for ends in span], dtype=np.int32) for i in (0, 1))
    if isinstance(probabilities, np.ndarray):
        cropped = probabilities[tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))]
        return np.asarray(_sums(cropped, np), dtype=np.float64)
    global _jitted_sums
    import jax

    if _jitted_sums is None:
        _jitted_sums = jax.jit(_device_sums)
    found = _jitted_sums(probabilities, lo, hi)
    return np.asarray(jax.device_get(found), dtype=np.float64)


def expected_dice(in_prediction: float, predicted: float, mass: float) -> float:
    """The Dice the probabilities expect of the prediction: (2·Σ_pred p + s) / (|pred| +
    Σ p + s), with s = `SMOOTH_VOXELS`; 1 for nothing predicted and nothing likely."""
    return float((2.0 * in_prediction + SMOOTH_VOXELS) / (predicted + mass + SMOOTH_VOXELS))


def uncertainty_concerns(
    sums: np.ndarray, thresholds: Thresholds = DEFAULT_THRESHOLDS
) -> list[Concern]:
    """The liver's and the tumours' uncertainty from `probability_sums`."""
    found = []
    for (structure, review), (inside, count, mass) in zip(
        (
            (LIVER, thresholds.liver_uncertainty),
            (TUMOUR, thresholds.tumour_uncertainty),
        ),
        np.asarray(sums, dtype=np.float64).reshape(2, 3),
        strict=True,
    ):
        dice = expected_dice(inside, count, mass)
        where = "the liver" if structure == LIVER else "the tumours"
        missed = count == 0 and dice < 1.0
        reason = f"the model is unsure of {where}: it expects a Dice of {dice:.2f}" + (
            " (none predicted, but some likely)" if missed else ""
        )
        name = f"{structure}_uncertainty"
        found.append(Concern(name, structure, 1.0 - dice, _ramp(1.0 - dice, review), reason))
    return found


def liver_concerns(
    labels: np.ndarray, hu: np.ndarray | None, voxel_ml: float, reference: Reference
) -> list[Concern]:
    """Plausibility and intensity of the predicted liver (labels ≥ 1, canonical)."""
    thresholds = reference.thresholds
    voxels = int(np.count_nonzero(liver_mask(labels)))
    if voxels == 0:
        return [Concern("no_liver", LIVER, 1.0, 1.0, "no liver was found")]
    found = []
    volume = voxels * voxel_ml
    if reference.liver_volume_ml is not None:
        low, high = reference.liver_volume_ml
        factor = max(low / volume, volume / high, 1.0) if low > 0 and high > 0 else 1.0
        found.append(
            Concern(
                "liver_volume",
                LIVER,
                factor,
                _ramp(math.log(factor), math.log(thresholds.liver_volume_factor)),
                f"the liver's volume, {_ml(volume)} mL, is {factor:.1f}× outside the training "
                f"livers' ({_ml(low)}–{_ml(high)} mL)",
            )
        )
    step = sample_step(labels.shape, SAMPLED)
    liver = liver_mask(labels[::step, ::step, ::step])
    if liver.any():
        pieces, count = ndimage.label(liver, structure=np.ones((3, 3, 3), bool))
        sizes = np.bincount(pieces.ravel())[1:]
        share = 1.0 - float(sizes.max()) / float(sizes.sum())
        found.append(
            Concern(
                "fragments",
                LIVER,
                share,
                _ramp(share, thresholds.fragments),
                f"the liver is in {count} piece{'s' * (count > 1)}, {share:.0%} of it outside "
                "the largest",
            )
        )
        if hu is not None and reference.liver_hu_median is not None:
            median = float(np.median(np.asarray(hu[::step, ::step, ::step])[liver]))
            spread = max(float(reference.liver_hu_sd or 0.0), _MIN_SPREAD_HU)
            distance = abs(median - reference.liver_hu_median) / spread
            found.append(
                Concern(
                    "intensity",
                    LIVER,
                    distance,
                    _ramp(distance, thresholds.intensity_sd),
                    f"the liver's median intensity, {median:.0f} HU, is {distance:.1f} SD from "
                    f"the training livers' ({reference.liver_hu_median:.0f} HU)",
                )
            )
    return found


def _ml(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


# ---------------------------------------------------------------- the verdict


def verdict_of(
    concerns: Sequence[Concern],
    checks: Sequence[str] = (),
    thresholds: Thresholds = DEFAULT_THRESHOLDS,
) -> Quality:
    """The scores and the verdict of `concerns` (each judged by `thresholds` already), and of
    the fingerprint's `checks` (any makes the scan `unlike the training data`)."""

    def worst(structure: str | None) -> float:
        values = [c.concern for c in concerns if structure in (None, c.structure)]
        return max(values, default=0.0)

    unlike = 1.0 if checks else 0.0
    liver = max(worst(LIVER), unlike)
    tumour = max(worst(TUMOUR), liver)
    score = max(liver, tumour)
    if checks:
        verdict, reason = UNLIKE, checks[0]
    elif score >= REVIEW_AT:
        top = max(concerns, key=lambda c: c.concern)  # the first of equals
        verdict, reason = REVIEW, top.reason
    else:
        verdict, reason = OK, None
    return Quality(
        verdict,
        reason,
        score,
        liver,
        tumour,
        tuple(concerns),
        tuple(checks),
        thresholds.calibrated_on,
    )


def rejudged(recorded: dict[str, Any], thresholds: Thresholds) -> Quality:
    """A recorded quality (`Quality.to_json`, as `_stats.json` and an evaluation's cases hold
    it) judged again by other `thresholds`: each concern's raw value against its new
    threshold (no prediction needed; how calibration compares candidates). A record
    without its "checks" (an earlier ctseg's) counts as unlike the training data where its
    verdict says so."""
    concerns = []
    for name, entry in (recorded.get("concerns") or {}).items():
        value = entry.get("value")
        value = math.inf if value is None else float(value)
        review = thresholds.of(name)
        if review is None:  # no threshold: as recorded (no_liver is 1 whatever the thresholds)
            concern = float(entry.get("concern", 0.0))
        elif name == "liver_volume":
            concern = _ramp(math.log(max(value, 1.0)), math.log(review))
        else:
            concern = _ramp(value, review)
        concerns.append(
            Concern(name, entry.get("structure", LIVER), value, concern, entry.get("reason", ""))
        )
    checks = recorded.get("checks")
    if checks is None:
        checks = [recorded.get("reason") or UNLIKE] if recorded.get("verdict") == UNLIKE else []
    return verdict_of(concerns, checks, thresholds)


def assess(
    labels: np.ndarray,
    affine: np.ndarray,
    hu: np.ndarray | None = None,
    probabilities: Any = None,
    span: Sequence[Sequence[int]] | None = None,
    checks: Sequence[str] = (),
    reference: Reference | None = None,
) -> Quality:
    """The quality of a prediction: its post-processed canonical `labels` (voxel → mm
    `affine`), the scan's canonical HU, the class probabilities [x, y, z, 3] (on the run's
    grid or a region's box of it, their voxels [lo, hi) per axis of `span` where they hold,
    or on the scan's voxels; None: the uncertainty is not measured, as for an ensemble),
    the fingerprint's `checks`."""
    reference = reference or Reference()
    thresholds = reference.thresholds
    voxel_ml = abs(float(np.linalg.det(np.asarray(affine)[:3, :3]))) / 1000.0
    # Plausibility first: of equal concerns the first is the reason, and "no liver was
    # found" says more than the uncertainty of a liver that is not there.
    concerns = liver_concerns(labels, hu, voxel_ml, reference)
    if probabilities is not None:
        concerns += uncertainty_concerns(probability_sums(probabilities, span), thresholds)
    return verdict_of(concerns, checks, thresholds)


def of_prediction(prediction: Any, scan: Any, reference: Reference | None = None) -> Quality:
    """`assess` of a `ctseg.inference.predictor.Prediction` of `scan` (a `Scan`): the model's
    uncertainty from its probabilities where they hold (`Prediction.uncertainty`: a lone
    run's grid, or a region's exact voxels), else from those on the scan's voxels when
    asked for."""
    probabilities, span = prediction.uncertainty or (prediction.probabilities, None)
    return assess(
        prediction.labels,
        scan.affine,
        scan.array,
        probabilities,
        span,
        prediction.checks,
        reference,
    )


def batch_line(verdicts: Iterable[str | None]) -> str | None:
    """The batch's summary, e.g. `3 of 40 to review (1 unlike the training data)`; None when
    no scan has a verdict."""
    known = [v for v in verdicts if v in VERDICTS]
    if not known:
        return None
    flagged = sum(v != OK for v in known)
    unlike = sum(v == UNLIKE for v in known)
    more = f" ({unlike} unlike the training data)" if unlike else ""
    return f"{flagged} of {len(known)} to review{more}"
