"""The Typer application that every command module registers itself on."""

import typer
from typer.core import TyperGroup

import ctseg
from ctseg.cli.flags import FLAGS
from ctseg.errors import CtsegError, OptionError

# The order `ctseg --help` lists the commands in: the pipeline's, then the sizing tools.
COMMANDS = (
    "synth",
    "preprocess",
    "folds",
    "train",
    "evaluate",
    "predict",
    "review",
    "plan",
    "bench",
)


class _PipelineOrder(TyperGroup):
    def list_commands(self, ctx: typer.Context) -> list[str]:
        return sorted(self.commands, key=COMMANDS.index)

    def invoke(self, ctx: typer.Context) -> object:
        """Every command's run: an `OptionError` said with the flags the user typed."""
        try:
            return super().invoke(ctx)
        except OptionError as exc:
            raise CtsegError(exc.respelled(FLAGS)) from None


app = typer.Typer(
    name="ctseg",
    help="Liver and liver-tumour segmentation of CT scans with a spatially partitioned 3D U-Net.",
    cls=_PipelineOrder,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"ctseg {ctseg.__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(
        False,
        "--version",
        help="Print the version and exit.",
        callback=_print_version,
        is_eager=True,
    ),
) -> None:
    """Liver and liver-tumour segmentation of CT scans with a spatially partitioned 3D U-Net."""
