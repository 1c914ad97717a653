"""Per-scan quality control: how far to trust a prediction, and a verdict users act on.

Every prediction gets a `Quality` (`assess`): a few *concerns*, each a number in
[0, 1] with a name and a sentence, from three sources —

- the model's own uncertainty (`ctseg.inference.quality.uncertainty`, measured on the scan's
  voxels by the way back, where the probabilities are: only a few sums leave the devices):
  `liver_uncertainty`, `tumour_uncertainty`, one minus the Dice the class probabilities
  expect of the predicted structure (mirrored TTA's and an ensemble's disagreement show in
  the mean as probabilities near ½ and lower it); and for an ensemble,
  `liver_disagreement`, `tumour_disagreement`, one minus the Dice of its members' argmaxes
  with each other's;
- how unlike the training data the scan is: the run's fingerprint checks
  (`ctseg.inference.quality.scan_checks.checks`, any of which makes the verdict
  `unlike the training data`), and the median HU inside the predicted liver against the
  training livers' (`intensity`, in the training voxels' standard deviations);
- plausibility: no liver at all (`no_liver`), a liver too large or too small against the
  training livers' range (`liver_volume`: its share of the body over its slices, which a
  larger patient's larger liver keeps; its volume against a fingerprint without shares),
  a liver in pieces (`fragments`, the share of it outside its largest connected piece).

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
phases) with `ctseg.evaluation.calibration.choose_thresholds`, starting from the first
version's hand-chosen ones (`HAND_CHOSEN`). A run may hold its own (RUN_DIR/quality.json,
`THRESHOLDS_FILE`: a version and what they were calibrated on), written by `ctseg
evaluate RUN --data STORE --calibrate` from the user's labelled cases; `Reference.of_run`
loads them, so that `ctseg predict`, `ctseg evaluate` and the Python API judge by them.
Every recorded quality names what its thresholds were calibrated on, and keeps each
concern's raw value, so that it can be judged again by others (`rejudged`).

Cost: a few NumPy passes over the labels (a count, and a strided sample of at most
`SAMPLED`³ voxels for the median HU and the connected pieces), and the uncertainty's
reductions inside the way back to the scan (on the devices under JAX).
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

from ctseg.inference.quality.thresholds import (
    DEFAULT_ENSEMBLE_THRESHOLDS,
    DEFAULT_THRESHOLDS,
    Thresholds,
    read_thresholds,
)
from ctseg.inference.quality.uncertainty import Uncertainty
from ctseg.labels import liver_mask
from ctseg.run import rundir
from ctseg.run.fingerprint import liver_body_share, sample_step

OK, REVIEW, UNLIKE = "ok", "review", "unlike the training data"
VERDICTS = (OK, REVIEW, UNLIKE)

REVIEW_AT = 0.5  # a scan whose score reaches this is sent to review (a concern's midpoint)
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
    # The training livers' min and max share of the body over their slices (fingerprints
    # made before it have none: the volume is compared instead).
    liver_body_share: tuple[float, float] | None = None
    thresholds: Thresholds = DEFAULT_THRESHOLDS

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None) -> Reference:
        """From a fingerprint's JSON (`ctseg.run.fingerprint`); empty for None or one that
        lacks the fields (nothing compared)."""
        if not isinstance(raw, dict):
            return cls()
        try:
            hu = raw.get("liver_hu")
            return cls(
                liver_hu_median=None if hu is None else float(hu["median"]),
                liver_hu_sd=None if hu is None else float(hu["std"]),
                liver_volume_ml=_range(raw.get("liver_volume_ml")),
                liver_body_share=_range(raw.get("liver_body_share")),
            )
        except (KeyError, TypeError, ValueError):
            return cls()

    @classmethod
    def of_run(cls, run_dir: Path | None, ensemble: bool = False) -> Reference:
        """The (first) run's reference: its fingerprint (none compared for a run without
        one, or no run) and its thresholds, for itself or for an `ensemble` it leads
        (`ctseg.inference.quality.thresholds.read_thresholds`: `ctseg evaluate --calibrate`'s; the
        defaults where it has none). CtsegError (one line) for a thresholds file that
        cannot be read or is malformed."""
        if run_dir is None:
            return cls(thresholds=DEFAULT_ENSEMBLE_THRESHOLDS if ensemble else DEFAULT_THRESHOLDS)
        thresholds = read_thresholds(Path(run_dir), ensemble)
        try:
            reference = cls.from_json(rundir.read_fingerprint(Path(run_dir)))
        except Exception:  # an unreadable fingerprint is the checks' to report, not ours
            reference = cls()
        return dataclasses.replace(reference, thresholds=thresholds)


def _range(distribution: dict[str, Any] | None) -> tuple[float, float] | None:
    """A fingerprint distribution's (min, max)."""
    if distribution is None:
        return None
    return float(distribution["min"]), float(distribution["max"])


# ---------------------------------------------------------------- the components


def _ramp(value: float, review_at: float) -> float:
    """0 at 0, `REVIEW_AT` at `review_at`, 1 at twice it (and beyond)."""
    if not math.isfinite(value):
        return 1.0
    return float(min(1.0, max(0.0, REVIEW_AT * value / review_at)))


def uncertainty_concerns(
    uncertainty: Uncertainty, thresholds: Thresholds = DEFAULT_THRESHOLDS
) -> list[Concern]:
    """The liver's and the tumours' uncertainty (1 − the Dice the probabilities expect),
    and where several members were averaged, their disagreement (1 − their agreement)."""
    found = []
    for structure in (LIVER, TUMOUR):
        dice = uncertainty.expected(structure)
        where = "the liver" if structure == LIVER else "the tumours"
        missed = uncertainty.predicted_voxels(structure) == 0 and dice < 1.0
        reason = f"the model is unsure of {where}: it expects a Dice of {dice:.2f}" + (
            " (none predicted, but some likely)" if missed else ""
        )
        name = f"{structure}_uncertainty"
        review = thresholds.of(name)
        found.append(Concern(name, structure, 1.0 - dice, _ramp(1.0 - dice, review), reason))
        agreement = uncertainty.agreement(structure)
        if agreement is not None:
            name = f"{structure}_disagreement"
            reason = (
                f"the {uncertainty.members} models disagree on {where}: a Dice of "
                f"{agreement:.2f} between them"
            )
            value = 1.0 - agreement
            found.append(Concern(name, structure, value, _ramp(value, thresholds.of(name)), reason))
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
    step = sample_step(labels.shape, SAMPLED)
    liver = liver_mask(labels[::step, ::step, ::step])
    size = _size_concern(liver, hu, step, voxels * voxel_ml, reference)
    if size is not None:
        found.append(size)
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


def _size_concern(
    liver: np.ndarray, hu: np.ndarray | None, step: int, volume: float, reference: Reference
) -> Concern | None:
    """How many times the liver's size lies outside the training livers' range
    (`liver_volume`). Its share of the body over its slices, where the fingerprint holds
    the training livers' shares and the scan's HU are given (a larger patient's larger
    liver keeps its share); else its volume."""
    review = math.log(reference.thresholds.liver_volume_factor)
    share = None
    if reference.liver_body_share is not None and hu is not None:
        share = liver_body_share(liver, hu[::step, ::step, ::step])
    if share is not None:
        low, high = reference.liver_body_share
        factor = _outside(share, low, high)
        reason = (
            f"the liver takes {share:.0%} of the body over its slices, {factor:.1f}× outside "
            f"the training livers' ({low:.0%}–{high:.0%})"
        )
    elif reference.liver_volume_ml is not None:
        low, high = reference.liver_volume_ml
        factor = _outside(volume, low, high)
        reason = (
            f"the liver's volume, {_ml(volume)} mL, is {factor:.1f}× outside the training "
            f"livers' ({_ml(low)}–{_ml(high)} mL)"
        )
    else:
        return None
    return Concern("liver_volume", LIVER, factor, _ramp(math.log(factor), review), reason)


def _outside(value: float, low: float, high: float) -> float:
    """How many times `value` lies outside [low, high]: 1 inside it."""
    return max(low / value, value / high, 1.0) if low > 0 and high > 0 and value > 0 else 1.0


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
    uncertainty: Uncertainty | None = None,
    checks: Sequence[str] = (),
    reference: Reference | None = None,
) -> Quality:
    """The quality of a prediction: its post-processed canonical `labels` (voxel → mm
    `affine`), the scan's canonical HU, the model's `uncertainty` (None: not measured), the
    fingerprint's `checks`."""
    reference = reference or Reference()
    thresholds = reference.thresholds
    voxel_ml = abs(float(np.linalg.det(np.asarray(affine)[:3, :3]))) / 1000.0
    # Plausibility first: of equal concerns the first is the reason, and "no liver was
    # found" says more than the uncertainty of a liver that is not there.
    concerns = liver_concerns(labels, hu, voxel_ml, reference)
    if uncertainty is not None:
        concerns += uncertainty_concerns(uncertainty, thresholds)
    return verdict_of(concerns, checks, thresholds)


def of_prediction(prediction: Any, scan: Any, reference: Reference | None = None) -> Quality:
    """`assess` of a `ctseg.inference.predictor.Prediction` of `scan` (a `Scan`)."""
    return assess(
        prediction.labels,
        scan.affine,
        scan.array,
        prediction.uncertainty,
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
