"""What `ctseg evaluate` prints: each case's metrics, the summary over the cases, the
quality's power against the truth, the cases left unpaired and those that failed."""

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ctseg.evaluation.metrics import MEASURABLE_MM
from ctseg.evaluation.reports import CaseRecord, Report, Summary


def fmt(value: float | None, digits: int = 3) -> str:
    """`value` to `digits` places; a dash where there is none."""
    return "–" if value is None else f"{value:.{digits}f}"


def _case_table(cases: list[CaseRecord]) -> Table:
    table = Table(title="Per case")
    # In a narrow terminal every letter of a case's name shows, folded over lines: cut
    # short, segmentation-1 and segmentation-12 both read "segmentat…".
    table.add_column("case", overflow="fold")
    for heading in (
        "liver\nDice",
        "tumour\nDice",
        "liver\nASSD mm",
        "liver\nHD95 mm",
        "lesions\ndet/ref",
    ):
        table.add_column(heading, justify="right", no_wrap=True)  # numbers are never cut
    located = any(case.located is not None for case in cases)  # --locate: where predicted
    if located:
        table.add_column("predicted")
    for case in cases:
        liver, detection = case.metrics["liver"], case.metrics["detection"]
        row = [
            escape(case.case),
            fmt(liver["dice"]),
            fmt(case.metrics["tumour"]["dice"]),
            fmt(liver["assd"], 2),
            fmt(liver["hd95"], 2),
            f"{detection['n_detected']}/{detection['n_ref']}",
        ]
        if located:
            region = (case.located or {}).get("region")
            row.append("region" if region else "[yellow]whole scan[/]")
        table.add_row(*row)
    return table


def _summary_table(summary: Summary) -> Table:
    table = Table(title=f"Summary over {summary.n_cases} case(s)")
    table.add_column("metric")
    table.add_column("liver", justify="right")
    table.add_column("tumour", justify="right")
    liver, tumour = summary.liver, summary.tumour
    rows = [
        ("Dice, mean per case", "dice_per_case", 3),
        ("Dice, global", "dice_global", 3),
        ("VOE", "voe", 3),
        ("RVD", "rvd", 3),
        ("ASSD mm", "assd", 2),
        ("HD95 mm", "hd95", 2),
        ("MSSD mm", "mssd", 2),
    ]
    for label, key, digits in rows:
        table.add_row(label, fmt(liver[key], digits), fmt(tumour[key], digits))
    table.add_row("detection precision", "", fmt(tumour["detection_precision"]))
    table.add_row("detection recall", "", fmt(tumour["detection_recall"]))
    table.add_row(
        f"  of tumours ≥ {MEASURABLE_MM:g} mm", "", fmt(tumour["detection_recall_measurable"])
    )
    table.add_row("burden error", "", fmt(tumour["burden_error"], 4))
    return table


def print_result(console: Console, result: Report) -> None:
    """The cases, the summary, the quality's power, what was unpaired, every failure."""
    if result.cases:
        console.print(_case_table(result.cases))
        console.print(_summary_table(result.summary))
        if result.summary.quality:
            console.print(quality_line(result.summary.quality))
    unpaired = result.unpaired
    if unpaired.pred or unpaired.ref:
        console.print(
            escape(
                f"unpaired predictions: {', '.join(unpaired.pred) or 'none'}; "
                f"unpaired references: {', '.join(unpaired.ref) or 'none'}"
            )
        )
    for error in result.errors:
        console.print(f"[bold red]case {escape(error.case)} failed:[/] {escape(error.message)}")


def auroc_of(power: dict) -> str:
    """A structure's AUROC with the bad and good cases behind it (over a few cases it says
    little): `0.25 (4 / 1)`."""
    return f"{fmt(power['auroc'], 2)} ({power['n_bad']} / {power['n_good']})"


def quality_line(quality: dict) -> str:
    """The prediction quality's power against the truth, in one line."""
    return escape(
        f"quality against the truth (bad / good cases): AUROC liver "
        f"{auroc_of(quality['liver'])}, tumour {auroc_of(quality['tumour'])}, "
        f"{auroc_of(quality['tumour_measurable'])} counting only tumours "
        f"≥ {MEASURABLE_MM:g} mm missed; good cases sent to review "
        f"{fmt(quality['good_flagged'], 2)} (thresholds: {quality['thresholds']})"
    )
