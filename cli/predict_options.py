"""The options of `ctseg predict`, as typer reads them; `ctseg evaluate` shares the model's
(checkpoint, tile, backend, TTA)."""

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from ctseg.inference.network.backends import BACKENDS
from ctseg.io import dicom

RunDirArgument = Annotated[
    Path,
    typer.Argument(
        help="Run directory of `ctseg train`, or a folder of run directories (an ensemble).",
        metavar="RUN_DIR",
    ),
]
CheckpointOption = Annotated[
    str, typer.Option(help="Checkpoint to load: best, latest or a step number.")
]
TileOption = Annotated[
    int | None,
    typer.Option(
        help="Core size in voxels (even) of level-wise tiles, at every U-Net level; "
        "0 = whole volume; -1 = from available memory. Default: the run's predict.tile."
    ),
]


class OutputType(StrEnum):
    """`ctseg.inference.files.OUTPUT_TYPES`, as a choice for the command line."""

    nifti = "nifti"
    dicom_seg = "dicom-seg"


# `ctseg.inference.network.backends.BACKENDS`, as a choice for the command line.
BackendChoice = StrEnum("BackendChoice", {name: name for name in BACKENDS})


BackendOption = Annotated[
    BackendChoice | None,  # None: the device policy chooses
    typer.Option(
        help="Inference backend: jax (XLA on the chosen devices) or onnx (ONNX Runtime on "
        "the CPU, several times faster than XLA there; needs pip install 'ctseg\\[onnx]'). "
        "Default: jax on GPUs/TPUs, else onnx when installed.",
    ),
]


TtaOption = Annotated[
    bool | None,
    typer.Option(
        "--tta/--no-tta",
        help="Test-time augmentation: average the probabilities of the 8 mirrorings of each "
        "scan (8× the inference time; models trained with flips). Default: the run's "
        "predict.tta.",
        show_default=False,
    ),
]
InputsArgument = Annotated[
    list[Path],
    typer.Argument(
        help="NIfTI/NRRD/MHA files, folders of them, or DICOM series folders.",
        metavar="INPUT...",
    ),
]

OutOption = Annotated[Path, typer.Option("--out", help="Folder for the outputs.")]

RunsOption = Annotated[
    list[Path] | None,
    typer.Option(
        "--run",
        help="Another run (or folder of runs) of an ensemble: each model predicts on its "
        "own grid and their probabilities are averaged on the scan's voxels "
        "(repeatable; each run once). RUN_DIR may also be a folder of runs, e.g. one "
        "per cross-validation fold.",
        metavar="RUN",
    ),
]

OutputTypeOption = Annotated[
    OutputType,
    typer.Option(
        "--output-type",
        help="The label map as NIfTI (<name>_seg.nii.gz), or as a DICOM Segmentation "
        "object referencing the source series (<name>_seg.dcm; DICOM inputs only; "
        "pip install 'ctseg\\[dicom]').",
    ),
]

VerboseOption = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        help="Print the plan (its memory per device against what is free), where "
        "the time went before the first scan (imports, devices, loading, compiling) "
        "and in each scan, and the libraries' own output (ITK, GDCM, XLA).",
    ),
]

AllowNonCtOption = Annotated[
    bool,
    typer.Option(
        dicom.ALLOW_NON_CT,
        help="Segment DICOM series of another modality than CT (MR, PET, X-ray) too; "
        "refused by default, as the model knows CT only. Objects that are no images "
        "(SEG, RT dose, secondary captures) and localizers are refused all the same.",
    ),
]

LocateOption = Annotated[
    Path | None,
    typer.Option(
        "--locate",
        help="A coarse run that finds the liver first: the full-resolution model then "
        "runs only on the liver's box plus --margin, where its labels equal the whole "
        "scan's exactly; background outside. No liver, or one cut at the scan's top or "
        "bottom: the whole scan, with a warning.",
        metavar="COARSE_RUN",
    ),
]

RoiOption = Annotated[
    Path | None,
    typer.Option(
        "--roi",
        help="A liver (or region) mask of the one scan given, in its geometry (any "
        "label > 0): as --locate, with the region taken from it. For several scans, a "
        "folder of masks named as the scans (NAME.nii.gz or NAME_seg.nii.gz).",
        metavar="MASK|FOLDER",
    ),
]

MarginOption = Annotated[
    float | None,
    typer.Option(
        "--margin",
        help="Millimetres around the located liver or the mask (with --locate or --roi; "
        "default 20; finite, not negative; one beyond the scan takes all of it).",
        show_default=False,
    ),
]

ForceOption = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Predict every scan again, replacing its outputs (by default a scan whose "
        "outputs are all there, for the same request and scan content, is done earlier "
        "and skipped; outputs of another request, files of an output's name that ctseg "
        "did not write, and its own files changed since (a label map corrected by "
        "hand), fail the scan). Inputs (scans, --roi masks) are never replaced.",
    ),
]
