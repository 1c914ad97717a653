"""Tables in a narrow terminal: every letter of a case's name and every digit shows."""

from rich.console import Console

from ctseg.cli.evaluate_report import _case_table


def _case(name: str) -> dict:
    return {
        "case": name,
        "liver": {"dice": 0.911, "assd": 3.73, "hd95": 19.88},
        "tumour": {"dice": 0.888},
        "detection": {"n_detected": 12, "n_ref": 15},
    }


def test_evaluate_folds_the_names_and_never_cuts_the_numbers():
    names = ["segmentation-1", "segmentation-12", "LIVER_patient_0001_portal_venous"]
    console = Console(record=True, width=60)
    console.print(_case_table([_case(name) for name in names]))
    rows = [line.split("│")[1:-1] for line in console.export_text().splitlines() if line[0] == "│"]
    assert "".join(row[0].strip() for row in rows) == "".join(names)
    numbers = [[cell.strip() for cell in row[1:]] for row in rows if row[1].strip()]
    assert numbers == [["0.911", "0.888", "3.73", "19.88", "12/15"]] * len(names)
