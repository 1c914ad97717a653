"""The command line's words for the options the library names in its errors.

The library names an option as its Python API or config spells it, in backquotes
(`OptionError`: `` `margin_mm` must not be negative``); a command-line user typed a flag,
and reads the same message with the flag in its place: every command's `OptionError`
(`cli/app.py`) and a scan's failed row (`said`). One table for every command: a library
name means one flag everywhere.
"""

from ctseg.errors import respelled

FLAGS = {
    "backend": "--backend",
    "checkpoint": "--checkpoint",
    "csv_path": "--csv",
    "cross_validation": "--cross-validation",
    "coordinator": "--coordinator",
    "device": "--device",
    "devices": "--devices",
    "exact": "--exact-mesh",
    "folds": "--k",
    "json_path": "--json",
    "force": "--force",
    "locate": "--locate",
    "margin_mm": "--margin",
    "num_processes": "--num-processes",
    "out_dir": "--out",
    "pred_dir": "--pred",
    "process_id": "--process-id",
    "ref_dir": "--ref",
    "roi": "--roi",
    "run_dir": "--workdir",
    "overrides": "--set",
    "seed": "--seed",
    "size": "--size",
    "steps": "--steps",
    "target": "--target",
    "target_file": "--target-file",
    "tile": "--tile",
    "tta": "--tta",
    "workers": "--workers",
}


def said(message: str) -> str:
    """A library's message with the options it names as this command line's flags."""
    return respelled(message, FLAGS)
