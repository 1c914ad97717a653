"""`ctseg train`: partitioned whole-volume training with checkpoints and live validation."""

import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ctseg.cli.app import app
from ctseg.cli.options import (
    CompileCacheOption,
    ConfigOption,
    CoordinatorOption,
    DeviceChoice,
    DeviceOption,
    NumProcessesOption,
    ProcessIdOption,
    SetOption,
    config_from_options,
    start_jax,
    warn,
)
from ctseg.parallel.layouts import TrainingLayout, fit_training
from ctseg.progress import StepProgress

if TYPE_CHECKING:  # the loop imports JAX: only after start_jax
    from ctseg.training.loop import TrainingSummary, Validation


def _dice(validation: "Validation") -> str:
    return f"liver {validation.liver:.3f}, tumour {validation.tumour:.3f}"


@app.command()
def train(
    data: Annotated[
        Path, typer.Option("--data", help="Prepared store written by `ctseg preprocess`.")
    ],
    workdir: Annotated[
        Path,
        typer.Option(
            "--workdir",
            help="Run directory; an existing one is resumed from its latest checkpoint.",
        ),
    ],
    config_path: ConfigOption = None,
    overrides: SetOption = None,
    fold: Annotated[
        int | None,
        typer.Option(
            "--fold",
            help="Train cross-validation fold I of the store (`ctseg folds`): validate on "
            "fold I, train on the other folds (the same as --set train.fold=I).",
            metavar="I",
            show_default=False,
        ),
    ] = None,
    device: DeviceOption = DeviceChoice.auto,
    exact_mesh: Annotated[
        bool,
        typer.Option(
            "--exact-mesh",
            help="Train on exactly the config's mesh: an error, not a fitted layout, when "
            "there are fewer devices.",
        ),
    ] = False,
    compile_cache: CompileCacheOption = None,
    coordinator: CoordinatorOption = None,
    num_processes: NumProcessesOption = None,
    process_id: ProcessIdOption = None,
) -> None:
    """Train the U-Net on whole volumes, spatially partitioned over the devices here.

    The config's mesh is a request: with fewer devices than it needs, the grid is
    split over those there are (the same model: partitioned training equals
    unpartitioned training); the first line says what runs where. On a machine
    without accelerators the mesh's devices are simulated on the CPU. Ctrl-C
    (or SIGTERM) saves a checkpoint and stops; running the same command again
    resumes, on this layout or another. One `ctseg train` at a time per WORKDIR.
    With --fold I it trains one cross-validation fold of the store.
    """
    extra = [] if fold is None else [f"train.fold={fold}"]
    config = config_from_options(config_path, [*(overrides or []), *extra])
    chosen = start_jax(
        config,
        coordinator,
        num_processes,
        process_id,
        device=device.value,
        compile_cache=compile_cache,
    )
    layout = fit_training(config, chosen.devices, exact_mesh)
    console = Console(highlight=False)
    console.print(layout.line)
    summary = _train(layout, data, workdir, console)
    _print_summary(summary, console)


def _train(
    layout: TrainingLayout, data: Path, workdir: Path, console: Console
) -> "TrainingSummary":
    """`train_and_evaluate` on the layout's devices, its steps on a progress bar. On Ctrl-C
    or SIGTERM (a checkpoint saved) the command exits as a death by that signal would."""
    from ctseg.training.loop import train_and_evaluate  # after start_jax: imports start JAX

    columns = (
        TextColumn("[bold]train[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("train", total=layout.config.train.steps, status="compiling…")

        def report(p: StepProgress) -> None:
            bar.update(task, completed=p.step, status=_status(p))
            if p.validated and p.val_dice:  # a line above the bar: each validation stays
                console.print(_validation_line(p.step, p.val_dice))

        try:
            return train_and_evaluate(
                layout.config,
                data,
                workdir,
                report,
                layout.devices,
                layout.line,
                warn,
                say=lambda line: console.print(escape(line)),
            )
        except KeyboardInterrupt as stop:
            console.print(
                "[yellow]interrupted:[/] checkpoint saved; run the same command to resume"
            )
            # The shell's status for a death by the signal: 130 for Ctrl-C, 143 for SIGTERM.
            raise typer.Exit(128 + (stop.args[0] if stop.args else signal.SIGINT)) from None


def _status(p: StepProgress) -> str:
    """The progress bar's words after a step: short enough for an 80-column terminal."""
    status = f"loss {p.loss:.4f}  {p.steps_per_second:.2f} steps/s"
    return status + "  frozen batch-norm" if p.frozen_norm else status


def _validation_line(step: int, dice: dict[str, float]) -> str:
    return f"step {step}: validation Dice liver {dice['liver']:.3f}, tumour {dice['tumour']:.3f}"


def _print_summary(summary: "TrainingSummary", console: Console) -> None:
    """What a finished run says: its step, its validation, the checkpoint predict takes."""
    console.print(
        f"done: step {summary.step}, data wait {100 * summary.data_wait_fraction:.1f} % "
        f"of step time; run directory {summary.run_dir} "
        "(metrics.jsonl, curves.png, checkpoints/)"
    )
    if summary.fold is not None:
        console.print(
            f"fold {summary.fold}: trained on {summary.train_cases} case(s), validated on "
            f"the fold's {summary.val_cases} (fold.json)"
        )
    best, last = summary.best_validation, summary.last_validation
    if last:
        console.print(
            f"validation Dice: last (step {last.step}) {_dice(last)}; "
            f"best (step {best.step}) {_dice(best)}"
        )
    which = "best" if best else "latest"
    console.print(
        f"`ctseg predict` and `ctseg evaluate` use checkpoint {summary.predict_checkpoint} "
        f"({which}; --checkpoint latest or a step number for another)"
    )
    if not summary.val_cases:
        console.print(
            "[yellow]warning:[/] the store has no validation cases: no validation Dice was "
            "measured and `best` is simply the latest checkpoint (preprocess with "
            "data.val_fraction > 0)"
        )
