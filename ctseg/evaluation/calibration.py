"""How well the prediction quality (`ctseg.inference.quality.scores`) finds the bad predictions.

Each evaluated case carries its quality (its verdict and scores, 0 good … 1 bad) beside
its Dice. Against the truth a case is *bad*

- for the liver: liver Dice below `LIVER_BAD_BELOW` (0.85);
- for the tumours: tumour Dice below `TUMOUR_BAD_BELOW` (0.5), or a reference tumour
  missed (not detected; `ctseg.evaluation.metrics.lesion_detection`). A case whose
  reference and prediction hold no tumour has Dice 1: good. Reported beside it
  (`tumour_measurable`, never calibrated on): bad only where a *measurable* tumour
  (from 10 mm across, `metrics.MEASURABLE_MM`) is missed, since a smaller one may
  leave no trace in the scan for any score to find.

`summarize` reports, for each, the AUROC of the structure's score (`auroc`: the chance
that a bad case scores higher than a good one, ties counting half; the Mann–Whitney U
divided by the pairs), when the cases hold both good and bad ones; the share of the bad
cases the verdict flags; and the share of good cases (good for both) sent to review, the
cost of the flags.

`choose_thresholds` calibrates the verdict on labelled cases (`make experiment-quality`
chose the defaults with it; `ctseg evaluate RUN --data STORE --calibrate` a run's own,
RUN_DIR/quality.json): every case's recorded concerns are judged again
(`ctseg.inference.quality.scores.rejudged`) under candidate thresholds, starting above every good
case's value (or at the hand-chosen `HAND_CHOSEN`, where that is higher), then lowered greedily, one
concern at a time, to wherever flags the most bad cases per good case flagged, while at
most `GOOD_FLAGGED_TARGET` of the good cases are flagged; then lowered further, whatever
it costs, until every liver of Dice < `LIVER_FAILED_BELOW` is flagged; each lowered
threshold is finally set midway between the bad value it reached and the highest good
value below it. A threshold never goes below its `FLOORS` value. NumPy only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ctseg.errors import CtsegError, OptionError
from ctseg.evaluation.metrics import MEASURABLE_MM
from ctseg.inference.quality.scores import (
    OK,  # the one verdict that flags nothing
    REVIEW_AT,
    UNLIKE,
    rejudged,
)
from ctseg.inference.quality.thresholds import HAND_CHOSEN, Thresholds, thresholds_path

LIVER_BAD_BELOW = 0.85
TUMOUR_BAD_BELOW = 0.5
LIVER_FAILED_BELOW = 0.5  # a liver this bad must always be flagged
GOOD_FLAGGED_TARGET = 0.10  # the share of good cases calibration may send to review
MIN_CASES = 10  # calibrating on fewer labelled cases is refused
# The lowest each threshold may be calibrated to (by concern): below these the measures
# are noise (an expected Dice within 2 % of 1, a liver 5 % outside the training range).
FLOORS = {
    "liver_uncertainty": 0.02,
    "tumour_uncertainty": 0.05,
    "intensity": 0.25,
    "liver_volume": 1.05,
    "fragments": 0.01,
    "liver_disagreement": 0.01,
    "tumour_disagreement": 0.05,
}
_FAILED_WEIGHT = 3  # a failed liver counts as this many bad cases while choosing


def auroc(scores: Sequence[float], bad: Sequence[bool]) -> float | None:
    """P(score of a bad case > score of a good case) + ½ P(equal), over every pair of one bad
    and one good case: U / (n_bad · n_good). None unless there are both."""
    scores = np.asarray(scores, dtype=np.float64)
    bad = np.asarray(bad, dtype=bool)
    high, low = scores[bad], scores[~bad]
    if not len(high) or not len(low):
        return None
    above = np.count_nonzero(high[:, None] > low[None, :])
    ties = np.count_nonzero(high[:, None] == low[None, :])
    return float((above + 0.5 * ties) / (len(high) * len(low)))


def liver_bad(case: dict[str, Any]) -> bool | None:
    """Whether the case's liver is bad (None: its Dice is undefined)."""
    dice = case["liver"]["dice"]
    return None if dice is None else bool(dice < LIVER_BAD_BELOW)


def tumour_bad(case: dict[str, Any]) -> bool | None:
    """Whether the case's tumours are bad: Dice below 0.5 or a reference tumour missed."""
    detection = case.get("detection") or {}
    return _tumours_bad(case, detection.get("n_detected", 0) < detection.get("n_ref", 0))


def measurable_tumour_bad(case: dict[str, Any]) -> bool | None:
    """Whether the case's tumours are bad counting only measurable ones missed: Dice
    below 0.5 or a reference tumour of 10 mm or more missed. None for a case scored
    before measurable lesions were counted (a report read back): not known."""
    detection = case.get("detection") or {}
    if "n_ref_measurable" not in detection:
        return None
    return _tumours_bad(case, detection["n_detected_measurable"] < detection["n_ref_measurable"])


def _tumours_bad(case: dict[str, Any], missed: bool) -> bool | None:
    dice = case["tumour"]["dice"]
    if dice is None:
        return True if missed else None
    return bool(missed or dice < TUMOUR_BAD_BELOW)


def _share(numerator: int, denominator: int) -> float | None:
    return numerator / denominator if denominator else None


def _structure(
    cases: list[dict[str, Any]], structure: str, bad_of: Any, bad_in_words: str
) -> dict[str, Any]:
    pairs = [(c, bad_of(c)) for c in cases]
    pairs = [(c, b) for c, b in pairs if b is not None]
    bad = [b for _, b in pairs]
    flagged_bad = sum(c["quality"]["verdict"] != OK for c, b in pairs if b)
    return {
        "bad": bad_in_words,
        "n_bad": sum(bad),
        "n_good": len(bad) - sum(bad),
        "auroc": auroc([c["quality"][structure] for c, _ in pairs], bad),
        "bad_flagged": _share(flagged_bad, sum(bad)),
    }


def summarize(cases: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The quality's power over the cases that carry one (None: none does)."""
    judged = [c for c in cases if isinstance(c.get("quality"), dict)]
    if not judged:
        return None
    verdicts: dict[str, int] = {}
    for case in judged:
        verdicts[case["quality"]["verdict"]] = verdicts.get(case["quality"]["verdict"], 0) + 1
    good = [c for c in judged if liver_bad(c) is False and tumour_bad(c) in (False, None)]
    failed = [
        c["case"]
        for c in judged
        if c["liver"]["dice"] is not None
        and c["liver"]["dice"] < LIVER_FAILED_BELOW
        and c["quality"]["verdict"] == OK
    ]
    recorded = {str(c["quality"].get("thresholds", "unknown")) for c in judged}
    return {
        # What the cases' thresholds were calibrated on (as each case's quality records it).
        "thresholds": recorded.pop() if len(recorded) == 1 else "several",
        "n_cases": len(judged),
        "verdicts": verdicts,
        "liver": _structure(judged, "liver", liver_bad, f"Dice < {LIVER_BAD_BELOW:g}"),
        "tumour": _structure(
            judged, "tumour", tumour_bad, f"Dice < {TUMOUR_BAD_BELOW:g} or a tumour missed"
        ),
        "tumour_measurable": _structure(
            judged,
            "tumour",
            measurable_tumour_bad,
            f"Dice < {TUMOUR_BAD_BELOW:g} or a tumour of {MEASURABLE_MM:g} mm or more missed",
        ),
        "good_flagged": _share(sum(c["quality"]["verdict"] != OK for c in good), len(good)),
        f"liver_below_{LIVER_FAILED_BELOW:g}_not_flagged": failed,
    }


# ---------------------------------------------------------------- calibration


@dataclass(frozen=True)
class Calibration:
    """Thresholds chosen on labelled cases, and how the cases fare under them."""

    thresholds: Thresholds
    summary: dict[str, Any]  # `summarize` of the cases judged by the thresholds
    notes: tuple[str, ...] = ()  # where a target could not be met

    def to_json(self) -> dict[str, Any]:
        return {
            "thresholds": self.thresholds.to_json(),
            "summary": self.summary,
            "notes": list(self.notes),
        }


def rejudge_cases(cases: Sequence[dict[str, Any]], thresholds: Thresholds) -> list[dict]:
    """The cases with their recorded quality judged again by `thresholds` (those without a
    quality as they are)."""
    found = []
    for case in cases:
        if isinstance(case.get("quality"), dict):
            case = {**case, "quality": rejudged(case["quality"], thresholds).to_json()}
        found.append(case)
    return found


def concern_value(case: dict[str, Any], name: str) -> float:
    """A concern's raw value in a case's record (−inf: not measured; +inf: not finite)."""
    entry = (case["quality"].get("concerns") or {}).get(name)
    if not isinstance(entry, dict):
        return -math.inf
    value = entry.get("value")
    return math.inf if value is None else float(value)


def _always_flagged(case: dict[str, Any]) -> bool:
    """Flagged whatever the thresholds: a fingerprint check, or a concern without a
    threshold at its review point (no liver found)."""
    quality = case["quality"]
    checks = quality.get("checks")
    if checks if checks is not None else quality.get("verdict") == UNLIKE:
        return True
    return any(
        name not in Thresholds.CONCERNS and float(entry.get("concern", 0)) >= REVIEW_AT
        for name, entry in (quality.get("concerns") or {}).items()
    )


def choose_thresholds(
    cases: Sequence[dict[str, Any]],
    calibrated_on: str,
    target: float = GOOD_FLAGGED_TARGET,
    start: Thresholds = HAND_CHOSEN,
) -> Calibration:
    """The thresholds that flag the most bad cases of `cases` (evaluated cases carrying
    their quality) with at most `target` of the good ones flagged, and every liver of Dice
    < `LIVER_FAILED_BELOW` (see the module docstring). Cases whose recorded concerns are
    NaN or missing are left out, and a note says how many. CtsegError where the cases
    cannot calibrate: fewer than `MIN_CASES` with a usable quality and a liver Dice, no bad
    case or no good one."""
    judged, left_out = _calibration_cases(cases)
    table = _Concerns.of(judged)
    budget = math.floor(target * table.good.sum() + 1e-9)
    chosen = table.starting(start)
    lowered = table.lower_greedily(chosen, budget)
    notes = table.flag_failed(chosen, lowered, judged)
    if left_out:
        notes.insert(
            0,
            f"{left_out} case(s) left out: their recorded concerns are NaN or missing; the "
            f"thresholds were chosen on the other {len(judged)}",
        )
    table.midway(chosen, lowered)
    thresholds = dataclasses.replace(
        start.replace(**chosen), calibrated_on=calibrated_on, n_cases=len(judged)
    )
    summary = summarize(rejudge_cases(judged, thresholds))
    assert summary is not None
    share = summary["good_flagged"]
    if share is not None and share > target + 1e-9:
        notes.append(
            f"{share:.0%} of the good cases are flagged, above the target of {target:.0%}: "
            "flagging every liver of Dice < 0.5 took more"
        )
    return Calibration(thresholds, summary, tuple(notes))


def _calibration_cases(cases: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The cases with a quality and a liver Dice, checked to hold enough, bad and good; and
    how many of them were left out, their recorded concerns unusable (`_unusable`)."""
    labelled = [
        c for c in cases if isinstance(c.get("quality"), dict) and c["liver"]["dice"] is not None
    ]
    judged = [c for c in labelled if not _unusable(c["quality"])]
    left_out = len(labelled) - len(judged)
    if len(judged) < MIN_CASES:
        spoilt = f" ({left_out} more left out: concerns NaN or missing)" if left_out else ""
        raise CtsegError(
            f"calibrating the quality thresholds needs at least {MIN_CASES} labelled cases "
            f"with a prediction quality; there are {len(judged)}{spoilt}"
        )
    bad = [bool(liver_bad(c)) or bool(tumour_bad(c)) for c in judged]
    if not any(bad):
        raise CtsegError(
            f"none of the {len(judged)} cases is bad (liver Dice < {LIVER_BAD_BELOW:g}, "
            f"tumour Dice < {TUMOUR_BAD_BELOW:g} or a missed tumour): there is nothing to "
            "calibrate the thresholds against"
        )
    if all(bad):
        raise CtsegError(
            f"every one of the {len(judged)} cases is bad: there is no good case to keep "
            "out of review, nothing to calibrate the thresholds against"
        )
    return judged, left_out


def _unusable(recorded: dict[str, Any]) -> bool:
    """Whether a case's recorded quality cannot be judged again: its concerns not a table of
    raw values, one of them missing or NaN (a value too large to measure is recorded as
    null, +inf: that one is kept), or its checks not a list. Calibrating on it would judge
    it as if nothing were wrong."""
    concerns, checks = recorded.get("concerns"), recorded.get("checks", [])
    if not isinstance(concerns, dict) or not isinstance(checks, list):
        return True
    for entry in concerns.values():
        if not isinstance(entry, dict) or "value" not in entry:
            return True
        for key in ("value", "concern"):
            value = entry.get(key)
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not (value is None or (number and not math.isnan(value))):
                return True
    return False


@dataclasses.dataclass(frozen=True)
class _Concerns:
    """The cases' raw concern values [case, concern] and what the truth says of each case."""

    names: list[str]
    values: np.ndarray
    fixed: np.ndarray  # flagged whatever the thresholds (a fingerprint check, no liver)
    bad: np.ndarray
    failed: np.ndarray  # liver Dice < LIVER_FAILED_BELOW: flagged whatever it costs
    gain: np.ndarray  # what flagging each case wins (a failed liver counts more)

    @classmethod
    def of(cls, judged: Sequence[dict[str, Any]]) -> _Concerns:
        names = list(Thresholds.CONCERNS)
        bad = np.array([bool(liver_bad(c)) or bool(tumour_bad(c)) for c in judged])
        failed = np.array([c["liver"]["dice"] < LIVER_FAILED_BELOW for c in judged])
        return cls(
            names,
            np.array([[concern_value(c, name) for name in names] for c in judged]),
            np.array([_always_flagged(c) for c in judged]),
            bad,
            failed,
            np.where(failed, _FAILED_WEIGHT, 1) * bad,
        )

    @property
    def good(self) -> np.ndarray:
        return ~self.bad

    def flagged(self, thresholds: dict[str, float]) -> np.ndarray:
        limits = np.array([thresholds[name] for name in self.names])
        return self.fixed | np.any(self.values >= limits, axis=1)

    def starting(self, start: Thresholds) -> dict[str, float]:
        """Where no good case is flagged by a threshold (or `start`, if higher)."""
        chosen = {}
        for index, name in enumerate(self.names):
            column = self.values[self.good, index]
            column = column[np.isfinite(column)]
            above = float(np.nextafter(column.max(), np.inf)) if len(column) else -np.inf
            chosen[name] = max(float(start.of(name)), above, FLOORS[name])
        return chosen

    def lower_greedily(self, chosen: dict[str, float], budget: int) -> set[str]:
        """Lower thresholds (in place) to flag the cheapest bad cases first, while at most
        `budget` good cases are flagged; the names of those lowered."""
        lowered: set[str] = set()
        while (best := self._cheapest(chosen, budget)) is not None:
            _, name, value = best
            chosen[name] = value
            lowered.add(name)
        return lowered

    def _cheapest(self, chosen: dict[str, float], budget: int) -> tuple | None:
        """The threshold value that wins the most bad cases per good case flagged."""
        current = self.flagged(chosen)
        best = None
        for index, name in enumerate(self.names):
            column = self.values[:, index]
            for value in np.unique(column[self.bad & ~current & np.isfinite(column)]):
                if value >= chosen[name] or value < FLOORS[name]:
                    continue
                new = current | (column >= value)
                extra_good = int((new & self.good & ~current).sum())
                if (current & self.good).sum() + extra_good > budget:
                    continue
                won = int(self.gain[new & ~current].sum())
                key = (won / (extra_good + 1), won, value)
                if won and (best is None or key > best[0]):
                    best = (key, name, float(value))
        return best

    def flag_failed(
        self, chosen: dict[str, float], lowered: set[str], judged: Sequence[dict[str, Any]]
    ) -> list[str]:
        """Lower thresholds (in place) until every failed liver is flagged, whatever it
        costs, each by the concern that flags the fewest good cases; notes of those none can."""
        notes = []
        for case_index in np.flatnonzero(self.failed & ~self.flagged(chosen)):
            current = self.flagged(chosen)
            if current[case_index]:
                continue
            options = []
            for index, name in enumerate(self.names):
                value = self.values[case_index, index]
                if np.isfinite(value) and value >= FLOORS[name]:
                    column = self.values[:, index]
                    extra_good = int(((column >= value) & self.good & ~current).sum())
                    options.append((extra_good, -value, name, float(value)))
            if not options:
                case = judged[case_index]
                notes.append(
                    f"{case['case']}: its liver (Dice {case['liver']['dice']:.2f}) cannot be "
                    "flagged by any threshold"
                )
                continue
            _, _, name, value = min(options)
            chosen[name] = min(chosen[name], value)
            lowered.add(name)
        return notes

    def midway(self, chosen: dict[str, float], lowered: set[str]) -> None:
        """Each lowered threshold (in place) midway between the lowest bad value it reached
        and the highest good value below it: the same good cases flagged, no fewer bad."""
        for index, name in enumerate(self.names):
            if name not in lowered:
                continue
            column = self.values[:, index]
            below = column[self.good & (column < chosen[name])]
            below = below[np.isfinite(below)]
            if len(below):
                chosen[name] = max((chosen[name] + float(below.max())) / 2, FLOORS[name])


def check_calibration_target(run_dir: Path, force: bool = False, ensemble: bool = False) -> None:
    """CtsegError (one line) where the run holds its thresholds (for itself, or for the
    ensembles it leads) already and not `force`."""
    path = thresholds_path(run_dir, ensemble)
    if path.exists() and not force:
        whose = "the ensembles it leads" if ensemble else "the run"
        raise OptionError(
            f"{path} holds the quality thresholds of {whose} already: give `force` to replace them"
        )


def calibrate_run(
    run_dir: Path,
    cases: Sequence[dict[str, Any]],
    calibrated_on: str,
    force: bool = False,
    ensemble: bool = False,
) -> Calibration:
    """`choose_thresholds` of a run's (or an `ensemble`'s, led by the run) evaluated `cases`,
    written (atomically) into the run, where `Reference.of_run` finds them. CtsegError,
    nothing written, where the run holds them already (without `force`) or the cases
    cannot calibrate."""
    check_calibration_target(run_dir, force, ensemble)
    calibration = choose_thresholds(cases, calibrated_on)
    calibration.thresholds.write(thresholds_path(run_dir, ensemble))
    return calibration
