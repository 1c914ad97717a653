"""ctseg from Python: segment scans with one trained run, or an ensemble of several.

    import nibabel as nib
    from ctseg import Segmenter

    segmenter = Segmenter("runs/lits256")            # or ["runs/fold0", "runs/fold1", …]
    result = segmenter(nib.load("volume-7.nii.gz"))   # or a path, a SimpleITK image, an array
    result.labels, result.affine, result.stats        # in the input's own voxel order
    result.save("volume-7_seg.nii.gz")                # only when asked

Each call reads (or takes) one scan, predicts it exactly as `ctseg predict` does
(the same device policy, grid, tiles, TTA and post-processing), and returns the label
map in the scan's own geometry with its statistics, writing nothing. `segment` does
it once.

Devices: the GPUs or TPUs JAX sees (`device="auto"`), else the CPU, as the commands
choose them. Unlike the commands, the library never configures JAX's platforms or
simulated devices itself: a notebook that imported JAX first keeps its settings.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np

from ctseg import atomic
from ctseg.config import InferenceOptions
from ctseg.inference import postprocess
from ctseg.inference.predictor import DEFAULT_MARGIN_MM, Predictor
from ctseg.inference.scan_checks import volume_warnings
from ctseg.io.scans import Scan, nifti_image, read_scan, scan_from_image, to_original_order
from ctseg.parallel.compile_cache import compile_cache_dir, use_compile_cache
from ctseg.run.rundir import member_runs

_log = logging.getLogger(__name__)


@dataclass
class Segmentation:
    """A scan's segmentation in the scan's own geometry."""

    labels: np.ndarray  # uint8, 0 background, 1 liver, 2 tumour, the input's voxel order
    affine: np.ndarray  # the input's voxel → RAS mm
    stats: dict[str, Any]  # liver and tumour volumes (mL), tumours, burden: as _stats.json
    warnings: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)  # far outside the training data
    probabilities: np.ndarray | None = None  # [..., 3] float32, when asked for
    scan: Scan | None = field(default=None, repr=False)  # the input, as read

    def to_nifti(self) -> nib.Nifti1Image:
        """The labels as a NIfTI image of the input's geometry (its header, for NIfTI)."""
        return nifti_image(self.scan, self.labels, np.uint8)

    def save(self, path: str | Path) -> None:
        """Write the labels as NIfTI at `path`, atomically (ITK-SNAP, 3D Slicer overlay it)."""
        with atomic.atomic_path(path) as tmp:
            nib.save(self.to_nifti(), tmp)


class Segmenter:
    """One run's model, or an ensemble of runs' models, ready to segment scans."""

    def __init__(
        self,
        runs: str | Path | Sequence[str | Path],
        *,
        checkpoint: str = "best",
        tile: int | None = None,
        backend: str | None = None,
        device: str = "auto",
        tta: bool | None = None,
        compile_cache: str | None = None,
        locate: str | Path | None = None,
        margin_mm: float = DEFAULT_MARGIN_MM,
    ):
        """`runs`: a run directory, a folder of them, or several (an ensemble). The options
        are `ctseg predict`'s: the checkpoint, level-wise tiles (None: the run's config),
        the backend (None: JAX on accelerators, else ONNX Runtime when installed), the
        device (auto, cpu, gpu or tpu) and mirrored TTA (None: the run's config);
        `compile_cache` a folder or "off" (default: ctseg's cache folder); `locate` a
        coarse run that finds the liver first, the full-resolution models then running on
        its box plus `margin_mm` only (`ctseg predict --locate`)."""
        paths = [runs] if isinstance(runs, str | Path) else list(runs)
        run_dirs = member_runs([Path(path) for path in paths])  # each run once, as the CLI
        problem = use_compile_cache(compile_cache_dir(compile_cache))
        if problem is not None:
            _log.warning("%s", problem)
        options = InferenceOptions(checkpoint, tile, backend, device, tta)
        self.predictor = Predictor.from_run(run_dirs, options)
        if locate is not None:
            self.predictor.predict_region(Path(locate), None, margin_mm, options)

    @property
    def summary(self) -> str:
        """What runs where, as `ctseg predict`'s first line says it."""
        return self.predictor.summary

    def __call__(
        self,
        image: str | Path | nib.spatialimages.SpatialImage | Any,
        affine: np.ndarray | None = None,
        *,
        with_probabilities: bool = False,
        name: str = "scan",
        allow_non_ct: bool = False,
    ) -> Segmentation:
        """Segment one scan: a file or DICOM series folder, a nibabel image, a SimpleITK
        image, or a 3-D array with its 4×4 voxel → RAS `affine` (mm). `allow_non_ct`: a
        DICOM series of another modality (refused otherwise, as `ctseg predict` does)."""
        if isinstance(image, str | Path):
            scan = read_scan(image, allow_non_ct)
        else:
            scan = scan_from_image(image, affine, name)
        prediction = self.predictor.predict(scan, with_probabilities)
        stats = postprocess.scan_stats(prediction.labels, scan.affine)
        stats["located"] = prediction.located  # as _stats.json: the region, if one was used
        probabilities = prediction.probabilities
        return Segmentation(
            labels=to_original_order(scan, prediction.labels),
            affine=np.array(scan.original_affine),
            stats=stats,
            warnings=prediction.warnings + volume_warnings(stats),
            checks=prediction.checks,
            probabilities=None if probabilities is None else to_original_order(scan, probabilities),
            scan=scan,
        )


def segment(
    image: str | Path | nib.spatialimages.SpatialImage | Any,
    runs: str | Path | Sequence[str | Path],
    affine: np.ndarray | None = None,
    out: str | Path | None = None,
    **options: Any,
) -> Segmentation:
    """Segment one scan with `runs` (`Segmenter`'s options as keywords); with `out`, also
    write the labels there as NIfTI. For many scans, make one `Segmenter` and call it."""
    result = Segmenter(runs, **options)(image, affine)
    if out is not None:
        result.save(out)
    return result
