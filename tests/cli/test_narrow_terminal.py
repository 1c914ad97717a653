"""The terminal's view: tables in a narrow terminal (every letter of a name, every digit), and
the commands as `ctseg --help` lists them."""

from rich.console import Console

from ctseg.cli.evaluate_report import _case_table
from ctseg.evaluation.reports import CaseRecord


def _case(name: str) -> CaseRecord:
    metrics = {
        "liver": {"dice": 0.911, "assd": 3.73, "hd95": 19.88},
        "tumour": {"dice": 0.888},
        "detection": {"n_detected": 12, "n_ref": 15},
    }
    return CaseRecord(name, metrics)


def test_evaluate_folds_the_names_and_never_cuts_the_numbers():
    names = ["segmentation-1", "segmentation-12", "LIVER_patient_0001_portal_venous"]
    console = Console(record=True, width=60)
    console.print(_case_table([_case(name) for name in names]))
    rows = [line.split("│")[1:-1] for line in console.export_text().splitlines() if line[0] == "│"]
    assert "".join(row[0].strip() for row in rows) == "".join(names)
    numbers = [[cell.strip() for cell in row[1:]] for row in rows if row[1].strip()]
    assert numbers == [["0.911", "0.888", "3.73", "19.88", "12/15"]] * len(names)


def test_the_help_lists_every_command_in_the_pipelines_order():
    from typer.testing import CliRunner

    import ctseg.cli.main  # noqa: F401  (registers the commands)
    from ctseg.cli.app import COMMANDS, app

    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    commands = result.output.split("Commands")[1]
    listed = [line.split()[1] for line in commands.splitlines() if line[2:3].isalpha()]
    assert listed == list(COMMANDS)
