"""`ctseg evaluate`: metrics of predicted label maps against references."""

from collections.abc import Callable
from datetime import date
from functools import partial
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from ctseg.cli.app import app
from ctseg.cli.evaluate_report import auroc_of, fmt, print_result
from ctseg.cli.options import CompileCacheOption, DeviceChoice, start_inference, warn
from ctseg.cli.predict_options import BackendOption, TtaOption
from ctseg.cli.progress import counting
from ctseg.config import InferenceOptions
from ctseg.errors import CtsegError
from ctseg.evaluation import calibration as quality_power
from ctseg.evaluation.cross_validation import evaluate_cross_validation
from ctseg.evaluation.reports import (
    CrossValidationReport,
    LocatedCounts,
    Report,
    RunReport,
)
from ctseg.evaluation.runs import evaluate_run
from ctseg.evaluation.scoring import claim_reports, evaluate_folders, write_reports
from ctseg.evaluation.skeleton import check_request
from ctseg.run import evaluations, rundir

console = Console(highlight=False)


def _run_with_progress(run: Callable[..., Report]) -> Report:
    """Call `run(progress=...)` under a progress bar of cases."""
    with counting("evaluating") as report:
        return run(progress=report)


def _evaluate_run(
    run_dirs: list[Path],
    data: Path,
    split: str,
    out: Path | None,
    options: InferenceOptions,
    compile_cache: str | None,
    force: bool,
    locate: Path | None = None,
    margin: float | None = None,
) -> RunReport:
    """The RUN_DIR form: predict the store's split with the run's model (or the mean of an
    ensemble's), on the located liver's region with `locate`, then score it."""
    configs = [rundir.load_config(run_dir) for run_dir in run_dirs]
    backend = start_inference(configs[0], options, compile_cache)
    out = evaluations.evaluation_dir(run_dirs[0], out)
    run = partial(
        evaluate_run,
        run_dirs,
        data,
        split,
        out,
        options,
        configs,
        locate,
        margin,
        force=force,
        warn=warn,
        backend=backend,
    )
    result = _run_with_progress(run)
    head = result.run
    if head.ensemble is None:
        grid = result.summary.grid_dice or {}
        model = (
            f"checkpoint step {head.checkpoint_step}; grid Dice liver "
            f"{fmt(grid.get('liver'))}, tumour {fmt(grid.get('tumour'))}"
        )
    else:
        model = f"an ensemble of {len(head.ensemble)} runs"
    console.print(
        f"{escape(head.engine.device)}; {model}; "
        f"reports in {escape(str(out))} (summary.json, metrics.csv)"
    )
    if head.locate is not None:
        counts = result.summary.located or LocatedCounts(0, 0)
        console.print(
            f"located by {escape(head.locate.run_dir)} (checkpoint step "
            f"{head.locate.checkpoint_step}, margin {head.locate.margin_mm:g} mm): "
            f"{counts.region} case(s) predicted on the liver's region, "
            f"{counts.whole_scan} on the whole scan"
        )
    return result


def _evaluate_cross_validation(
    run_dirs: list[Path],
    data: Path,
    out: Path,
    options: InferenceOptions,
    compile_cache: str | None,
    force: bool,
) -> CrossValidationReport:
    """The --cross-validation form: each fold run predicts its fold, scored as one table."""
    configs = [rundir.load_config(run_dir) for run_dir in run_dirs]
    backend = start_inference(configs[0], options, compile_cache)
    run = partial(
        evaluate_cross_validation,
        run_dirs,
        data,
        out,
        options,
        configs,
        force=force,
        warn=warn,
        backend=backend,
    )
    result = _run_with_progress(run)
    for entry in result.runs:
        liver, tumour = entry.summary.liver, entry.summary.tumour
        console.print(
            f"fold {entry.fold}: {escape(entry.run_dir)}, checkpoint step "
            f"{entry.checkpoint_step}, {len(entry.cases)} case(s): Dice per case liver "
            f"{fmt(liver['dice_per_case'])}, tumour {fmt(tumour['dice_per_case'])}"
        )
    grid = result.summary.grid_dice or {}
    console.print(
        f"{escape(result.cross_validation.engine.device)}; cross-validation over "
        f"{len(result.runs)} folds; grid Dice liver {fmt(grid.get('liver'))}, tumour "
        f"{fmt(grid.get('tumour'))}; reports in {escape(str(out))} (summary.json, metrics.csv)"
    )
    return result


def _check_form(
    run_dirs: list[Path], pred: Path | None, ref: Path | None, run_options: dict
) -> None:
    """Exactly one of the two forms: RUN_DIR…, or --pred with --ref."""
    if run_dirs and (pred is not None or ref is not None):
        raise CtsegError("give either RUN_DIR or --pred/--ref, not both")
    if not run_dirs:
        given = [f"--{name}" for name, value in run_options.items() if value not in (None, False)]
        if given:
            raise CtsegError(f"{', '.join(given)} only apply with RUN_DIR")
        if pred is None or ref is None:
            raise CtsegError("give --pred PRED_DIR and --ref REF_DIR (or a RUN_DIR with --data)")
    cross_validation = run_options["cross-validation"]
    if cross_validation and run_options["locate"] is not None:
        raise CtsegError(
            "--locate does not apply to --cross-validation: evaluate a fold run alone "
            "(RUN_DIR --data PREP_DIR --locate COARSE_RUN)"
        )
    if cross_validation and run_options["split"] is not None:
        raise CtsegError(
            "--split does not apply to --cross-validation: each fold run predicts its own fold"
        )
    if cross_validation and run_options["calibrate"]:
        raise CtsegError(
            "--calibrate does not apply to --cross-validation: calibrate one run "
            "(RUN_DIR --data PREP_DIR --calibrate)"
        )


def _check_run_form(
    run_dirs: list[Path],
    data: Path | None,
    json_path: Path | None,
    csv_path: Path | None,
    calibrate: bool,
    force: bool,
) -> None:
    """The RUN_DIR form's own options: --data given, no --json/--csv, --calibrate into the
    first run, whose thresholds (its own, or an ensemble's) may be written (checked before
    anything is predicted)."""
    if calibrate:
        quality_power.check_calibration_target(run_dirs[0], force, len(run_dirs) > 1)
    if json_path is not None or csv_path is not None:
        raise CtsegError("--json/--csv apply to --pred/--ref; with RUN_DIR reports go to --out")
    if data is None:
        raise CtsegError("give --data PREP_DIR: the prepared store whose split to evaluate")


def _calibrate(run_dirs: list[Path], result: Report, data: Path, split: str, force: bool) -> None:
    """--calibrate: the thresholds chosen on the evaluated cases, written into the (first)
    run: its own, or those of the ensembles it leads."""
    cases = [case.to_json() for case in result.cases]  # as summary.json holds them
    ensemble, run_dir = len(run_dirs) > 1, run_dirs[0]
    on = f"{len(cases)} case(s) of the {split!r} split of {data}, {date.today().isoformat()}"
    if ensemble:
        on = f"an ensemble of {len(run_dirs)} runs led by {run_dir.name}, {on}"
    calibration = quality_power.calibrate_run(run_dir, cases, on, force, ensemble)
    thresholds = calibration.thresholds.to_json()["thresholds"]
    chosen = ", ".join(f"{name} {value:.3g}" for name, value in thresholds.items())
    summary = calibration.summary
    missed = summary[f"liver_below_{quality_power.LIVER_FAILED_BELOW:g}_not_flagged"]
    console.print(
        escape(
            f"quality thresholds chosen on {summary['n_cases']} case(s), written to "
            f"{quality_power.thresholds_path(run_dir, ensemble)}: {chosen}. Under them "
            f"(bad / good cases): AUROC liver {auroc_of(summary['liver'])}, tumour "
            f"{auroc_of(summary['tumour'])}; good cases sent to review "
            f"{fmt(summary['good_flagged'], 2)}; livers of Dice < "
            f"{quality_power.LIVER_FAILED_BELOW:g} not flagged: {len(missed)}"
        )
    )
    for note in calibration.notes:
        warn(note)


@app.command()
def evaluate(
    run_dirs: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Run directory whose model predicts the split to evaluate, or a folder of run "
            "directories. Several runs: an ensemble (their probabilities averaged; needs "
            "--out); with --cross-validation, one fold run per fold of the store.",
            metavar="RUN_DIR...",
            show_default=False,
        ),
    ] = None,
    cross_validation: Annotated[
        bool,
        typer.Option(
            "--cross-validation",
            help="Evaluate the RUN_DIRs (one `ctseg train --fold` run per fold of --data) as "
            "one cross-validation: every labelled case predicted by the run that did not "
            "train on it. Needs --out.",
        ),
    ] = False,
    data: Annotated[
        Path | None, typer.Option(help="Prepared store holding the split (RUN_DIR form).")
    ] = None,
    split: Annotated[
        str | None, typer.Option(help="Split of the prepared store to evaluate (default: val).")
    ] = None,
    checkpoint: Annotated[
        str | None,
        typer.Option(help="Checkpoint to load: best, latest or a step number (default: best)."),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Folder for the predictions and reports (default: RUN_DIR/eval; required with "
            "--cross-validation). It holds one evaluation: another run's or checkpoint's is "
            "replaced only with --force."
        ),
    ] = None,
    device: Annotated[
        DeviceChoice | None,
        typer.Option(
            help="Where to predict (RUN_DIR form): auto (the GPUs or TPUs here, else the "
            "CPU), cpu, gpu or tpu (default: auto)."
        ),
    ] = None,
    backend: BackendOption = None,
    tta: TtaOption = None,
    locate: Annotated[
        Path | None,
        typer.Option(
            "--locate",
            help="A coarse run that finds the liver first, as in `ctseg predict --locate`: "
            "each case is predicted only on the liver's box plus --margin, where its labels "
            "equal the whole scan's exactly; background outside. No liver, or one cut at "
            "the scan's top or bottom: the whole scan. Each case's record says which "
            "(located). RUN_DIR form, not --cross-validation.",
            metavar="COARSE_RUN",
        ),
    ] = None,
    margin: Annotated[
        float | None,
        typer.Option(
            "--margin",
            help="Millimetres around the located liver (default: ctseg predict's, 20).",
            show_default=False,
        ),
    ] = None,
    compile_cache: CompileCacheOption = None,
    pred: Annotated[
        Path | None,
        typer.Option(help="Folder of predicted label maps (.nii / .nii.gz).", metavar="PRED_DIR"),
    ] = None,
    ref: Annotated[
        Path | None,
        typer.Option(
            help="Folder of reference label maps (.nii / .nii.gz, any case); scans beside "
            "them (LiTS's volume-N) are no references. A reference without its prediction, "
            "or a prediction that cannot be read or is the reference itself (a link), is a "
            "failed case (exit 1).",
            metavar="REF_DIR",
        ),
    ] = None,
    json_path: Annotated[
        Path | None,
        typer.Option("--json", help="Write the full report (cases, summary, errors) as JSON here."),
    ] = None,
    csv_path: Annotated[
        Path | None, typer.Option("--csv", help="Write one CSV row of metrics per case here.")
    ] = None,
    calibrate: Annotated[
        bool,
        typer.Option(
            "--calibrate",
            help="After evaluating RUN_DIR, choose the prediction quality's thresholds "
            "from these labelled cases (at least 10, some of them bad: liver Dice < 0.85, "
            "tumour Dice < 0.5 or a missed tumour) and write them into the run "
            "(RUN_DIR/quality.json; for an ensemble, its first run's "
            "quality-ensemble.json), which ctseg predict, evaluate and the Python API then "
            "judge by. An existing file is replaced only with --force.",
        ),
    ] = False,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Replace a --json/--csv file that is not an earlier report, or (RUN_DIR form) "
            "the evaluation of another run or checkpoint in --out, or with --calibrate the "
            "run's quality thresholds. Inputs are never replaced.",
        ),
    ] = False,
) -> None:
    """Compare label maps with references: Dice, VOE, RVD, ASSD, HD95, MSSD, lesion detection.

    Either --pred/--ref folders of NIfTI label maps (0 background, 1 liver, 2
    tumour; paired by file name), or a RUN_DIR whose model predicts a split (several:
    an ensemble, their probabilities averaged), or (--cross-validation) one fold run
    per fold of the store, each predicting its fold.
    With --calibrate, the prediction quality's thresholds are then chosen from the
    evaluated cases and written into the run (RUN_DIR/quality.json).
    Exits 1 when any case could not be evaluated. An existing --json/--csv file is
    replaced only when it is an earlier report of `ctseg evaluate` (or with --force).
    """
    run_dirs = run_dirs or []
    run_options = {
        "cross-validation": cross_validation,
        "data": data,
        "split": split,
        "checkpoint": checkpoint,
        "out": out,
        "device": device,
        "backend": backend,
        "tta": tta,
        "locate": locate,
        "margin": margin,
        "compile-cache": compile_cache,
        "calibrate": calibrate,
    }
    _check_form(run_dirs, pred, ref, run_options)
    run_dirs = rundir.member_runs(run_dirs)  # folders of runs expanded
    if run_dirs:
        # The library's one check of what is asked (in the command's words: `cli/flags.py`),
        # before JAX starts.
        check_request(run_dirs, out, locate, margin, cross_validation)
        _check_run_form(run_dirs, data, json_path, csv_path, calibrate, force)
        options = InferenceOptions(
            checkpoint or "best",
            backend=backend and backend.value,
            device=(device or DeviceChoice.auto).value,
            tta=tta,
        )
        if cross_validation:
            result = _evaluate_cross_validation(run_dirs, data, out, options, compile_cache, force)
        else:
            result = _evaluate_run(
                run_dirs, data, split or "val", out, options, compile_cache, force, locate, margin
            )
    else:
        claim_reports(json_path, csv_path, [pred, ref], force)
        result = _run_with_progress(partial(evaluate_folders, pred, ref, warn=warn))
        write_reports(result, json_path=json_path, csv_path=csv_path)

    print_result(console, result)
    if calibrate:
        _calibrate(run_dirs, result, data, split or "val", force)
    if result.errors:
        raise typer.Exit(1)
