"""How well the prediction quality (`ctseg.inference.quality`) finds the bad predictions.

Each evaluated case carries its quality (its verdict and scores, 0 good … 1 bad) beside
its Dice. Against the truth a case is *bad*

- for the liver: liver Dice below `LIVER_BAD_BELOW` (0.85);
- for the tumours: tumour Dice below `TUMOUR_BAD_BELOW` (0.5), or a reference tumour
  missed (not detected; `ctseg.evaluation.metrics.lesion_detection`). A case whose
  reference and prediction hold no tumour has Dice 1: good.

`summarize` reports, for each, the AUROC of the structure's score (`auroc`: the chance
that a bad case scores higher than a good one, ties counting half; the Mann–Whitney U
divided by the pairs), when the cases hold both good and bad ones; the share of the bad
cases the verdict flags; and the share of good cases (good for both) sent to review, the
cost of the flags. NumPy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ctseg.inference.quality import OK  # the one verdict that flags nothing

LIVER_BAD_BELOW = 0.85
TUMOUR_BAD_BELOW = 0.5
LIVER_FAILED_BELOW = 0.5  # a liver this bad must always be flagged


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
    missed = detection.get("n_detected", 0) < detection.get("n_ref", 0)
    dice = case["tumour"]["dice"]
    if dice is None:
        return True if missed else None
    return bool(missed or dice < TUMOUR_BAD_BELOW)


def _share(numerator: int, denominator: int) -> float | None:
    return numerator / denominator if denominator else None


def _structure(cases: list[dict[str, Any]], structure: str, bad_of: Any) -> dict[str, Any]:
    pairs = [(c, bad_of(c)) for c in cases]
    pairs = [(c, b) for c, b in pairs if b is not None]
    bad = [b for _, b in pairs]
    flagged_bad = sum(c["quality"]["verdict"] != OK for c, b in pairs if b)
    return {
        "bad": f"Dice < {LIVER_BAD_BELOW:g}"
        if structure == "liver"
        else f"Dice < {TUMOUR_BAD_BELOW:g} or a tumour missed",
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
    return {
        "thresholds": "provisional",  # chosen by hand, not yet calibrated against the truth
        "n_cases": len(judged),
        "verdicts": verdicts,
        "liver": _structure(judged, "liver", liver_bad),
        "tumour": _structure(judged, "tumour", tumour_bad),
        "good_flagged": _share(sum(c["quality"]["verdict"] != OK for c in good), len(good)),
        f"liver_below_{LIVER_FAILED_BELOW:g}_not_flagged": failed,
    }
