"""The table of `make experiment-quality`: the prediction quality's power to find bad cases.

    python scripts/quality_table.py OUT [--run RUN] SET…

OUT/scores/SET.json are `ctseg evaluate --pred/--ref` reports whose cases carry the quality
`ctseg predict` recorded. The cases of every set are pooled and the thresholds chosen on
them (`ctseg.evaluation.calibration.choose_thresholds`, starting from the hand-chosen ones,
as `ctseg evaluate --calibrate` does); then, per set and pooled, under the thresholds the
predictions were judged by (as recorded), under the chosen ones, and under thresholds
chosen without the set (leave one set out: how the choice holds on a kind of scan it
has not seen): the AUROC of the liver's score (bad: Dice < 0.85) and of the tumours'
(bad: Dice < 0.5 or a missed tumour), the share of good cases flagged, and how many livers
of Dice < 0.5 went unflagged; and, pooled, each concern's raw value alone as a score (its
AUROCs). Writes OUT/quality.json (the chosen thresholds, as a run
holds them: copy it to RUN/quality.json to use them), OUT/calibration.json (everything)
and OUT/table.md.
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

from ctseg.evaluation import calibration as power
from ctseg.inference.quality.thresholds import HAND_CHOSEN


def _fmt(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _row(name: str, summary: dict | None, cases: list[dict]) -> str:
    if summary is None:
        return f"| {name} | {len(cases)} | – | – | – | – | – | – | – | – |"
    liver, tumour = summary["liver"], summary["tumour"]
    good = [c for c in cases if not power.liver_bad(c) and not power.tumour_bad(c)]
    flagged_good = round((summary["good_flagged"] or 0) * len(good))
    missed = summary[f"liver_below_{power.LIVER_FAILED_BELOW:g}_not_flagged"]
    failed = sum(
        c["liver"]["dice"] is not None and c["liver"]["dice"] < power.LIVER_FAILED_BELOW
        for c in cases
    )
    return (
        f"| {name} | {summary['n_cases']} | {liver['n_bad']} | {_fmt(liver['auroc'])} | "
        f"{_fmt(liver['bad_flagged'])} | {tumour['n_bad']} | {_fmt(tumour['auroc'])} | "
        f"{_fmt(tumour['bad_flagged'])} | "
        f"{flagged_good}/{len(good)} ({_fmt(summary['good_flagged'])}) | "
        f"{failed - len(missed)}/{failed} |"
    )


HEADER = (
    "| set | cases | liver bad | liver AUROC | liver bad flagged | tumour bad | tumour AUROC | "
    "tumour bad flagged | good flagged | liver < 0.5 flagged |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def _diagnosis(judged: list[dict]) -> str:
    """Why the tumours' AUROC is what it is: the bad tumours that only a missed lesion
    makes bad, the AUROC were Dice < 0.5 alone bad, and what knowing the Dice would give."""
    only_missed = [
        c
        for c in judged
        if power.tumour_bad(c)
        and c["tumour"]["dice"] is not None
        and c["tumour"]["dice"] >= power.TUMOUR_BAD_BELOW
    ]
    pairs = [
        (c["quality"]["tumour"], c["tumour"]["dice"] < power.TUMOUR_BAD_BELOW)
        for c in judged
        if c["tumour"]["dice"] is not None
    ]
    dice_only = power.auroc([s for s, _ in pairs], [b for _, b in pairs])
    bad = sum(bool(power.tumour_bad(c)) for c in judged)
    measurable = power.summarize(judged)["tumour_measurable"]
    return (
        f"- tumour bad: {bad} of {len(judged)}; of these, {len(only_missed)} only by a missed "
        f"lesion (tumour Dice ≥ {power.TUMOUR_BAD_BELOW:g})\n"
        f"- tumour AUROC counting only measurable tumours missed ({measurable['bad']}): "
        f"{_fmt(measurable['auroc'])} ({measurable['n_bad']} bad)\n"
        f"- tumour AUROC were only Dice < {power.TUMOUR_BAD_BELOW:g} bad: {_fmt(dice_only)} "
        f"({sum(b for _, b in pairs)} bad)\n" + _ceilings(judged)
    )


def _ceilings(judged: list[dict]) -> str:
    """How far a tumour score could go that knew each case's tumour Dice and nothing of the
    lesions it missed: the truth itself as the score (its AUROC for the tumours
    `tumour_bad` calls bad), exactly and as Dice < 0.5 alone. What lies above these needs a
    score that finds the missed lesions themselves."""
    # A case with a tumour Dice is always judged, bad or good (`power.tumour_bad`).
    known = [
        (c["tumour"]["dice"], power.tumour_bad(c))
        for c in judged
        if c["tumour"]["dice"] is not None
    ]
    bad = [b for _, b in known]
    exact = power.auroc([-dice for dice, _ in known], bad)
    below = power.auroc([float(dice < power.TUMOUR_BAD_BELOW) for dice, _ in known], bad)
    return (
        f"- a tumour score that knew each case's tumour Dice, and nothing of its missed "
        f"lesions, would reach an AUROC of {_fmt(exact)}; knowing only whether it is below "
        f"{power.TUMOUR_BAD_BELOW:g}, {_fmt(below)}"
    )


def _each_concern(cases: list[dict]) -> str:
    """Each concern's raw value alone as a score: its AUROC for bad livers and bad tumours
    over the cases that measured it (the uncertainty and disagreement tell where the
    combined score's power comes from)."""
    rows = ["| concern | cases | liver AUROC | tumour AUROC |", "|---|---|---|---|"]
    names = sorted({n for c in cases for n in (c["quality"].get("concerns") or {})})
    for name in names:
        measured = [c for c in cases if name in (c["quality"].get("concerns") or {})]
        values = [power.concern_value(c, name) for c in measured]
        liver = power.auroc(values, [bool(power.liver_bad(c)) for c in measured])
        tumour = power.auroc(values, [bool(power.tumour_bad(c)) for c in measured])
        rows.append(f"| `{name}` | {len(measured)} | {_fmt(liver)} | {_fmt(tumour)} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("sets", nargs="+")
    parser.add_argument("--run", default="demo/run", help="the run the sets were predicted by")
    args = parser.parse_args()
    by_set = {}
    for name in args.sets:
        report = json.loads((args.out / "scores" / f"{name}.json").read_text())
        by_set[name] = [{**case, "set": name} for case in report["cases"]]
    pooled = [case for cases in by_set.values() for case in cases]
    on = f"{args.run} on {len(pooled)} phantoms of {len(by_set)} sets, {date.today()}"
    chosen = power.choose_thresholds(pooled, on, start=HAND_CHOSEN)
    thresholds = chosen.thresholds
    held_out: dict[str, list[dict]] = {}
    for name in by_set:
        rest = [case for case in pooled if case["set"] != name]
        without = power.choose_thresholds(rest, f"all but {name}", start=HAND_CHOSEN)
        held_out[name] = power.rejudge_cases(by_set[name], without.thresholds)

    sections = []
    for title, judge in (
        ("As predicted (the thresholds recorded with each case)", lambda cases: cases),
        (
            "Under the thresholds chosen on all the cases",
            lambda cases: power.rejudge_cases(cases, thresholds),
        ),
    ):
        rows = [HEADER]
        for name, cases in by_set.items():
            judged = judge(cases)
            rows.append(_row(name, power.summarize(judged), judged))
        judged = judge(pooled)
        rows.append(_row("**pooled**", power.summarize(judged), judged))
        sections.append(f"### {title}\n\n" + "\n".join(rows))
    rows = [HEADER]
    for name, judged in held_out.items():
        rows.append(_row(name, power.summarize(judged), judged))
    judged = [case for cases in held_out.values() for case in cases]
    rows.append(_row("**pooled**", power.summarize(judged), judged))
    sections.append(
        "### Each set judged by thresholds chosen without it (leave one set out)\n\n"
        + "\n".join(rows)
    )
    sections.append("### Each concern alone, pooled\n\n" + _each_concern(pooled))
    sections.append(
        "### The tumours, pooled under the chosen thresholds\n\n"
        + _diagnosis(power.rejudge_cases(pooled, thresholds))
    )
    values = thresholds.to_json()["thresholds"]
    sections.append(
        "### The chosen thresholds\n\n"
        + "\n".join(f"- {name}: {value:.4g}" for name, value in values.items())
        + "".join(f"\n- note: {note}" for note in chosen.notes)
    )
    table = "\n\n".join(sections) + "\n"
    (args.out / "table.md").write_text(table)
    thresholds.write(args.out / "quality.json")
    (args.out / "calibration.json").write_text(json.dumps(chosen.to_json(), indent=2) + "\n")
    print(table)
    print(f"thresholds in {args.out / 'quality.json'} (copy to {args.run}/quality.json to use)")


if __name__ == "__main__":
    main()
