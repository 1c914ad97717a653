"""ctseg from Python: segment scans with one trained run, or an ensemble of several.

    import nibabel as nib
    from ctseg import Segmenter

    segmenter = Segmenter("runs/lits256")            # or ["runs/fold0", "runs/fold1", …]
    result = segmenter(nib.load("volume-7.nii.gz"))   # or a path, a SimpleITK image, an array
    result.labels, result.affine, result.stats        # in the input's own voxel order
    result.quality.verdict, result.quality.reason     # "ok", "review" or "unlike the training
                                                      # data", and the one reason why
    result.save("volume-7_seg.nii.gz")                # only when asked
    for result in segmenter.map(paths): ...           # many files, pipelined as ctseg predict

Each call reads (or takes) one scan, predicts it exactly as `ctseg predict` does
(the same device policy, grid, tiles, TTA and post-processing), and returns the label
map in the scan's own geometry with its statistics and its quality (`result.quality`,
`ctseg.inference.quality.scores.Quality`: the verdict, the one reason that weighs most, the
scores, under the calibrated thresholds or the run's own), writing nothing. `segment`
does it once; `Segmenter.map` pipelines many files.

Every option is checked before a model loads, as the CLI checks it
(`inputs.inference_options`, `region.check_margin`). `save` and `segment(out=…)` never
write over the scan read, nor over a file that is not a label map ctseg wrote, unless
`force`.

Devices: the GPUs or TPUs JAX sees (`device="auto"`), else the CPU, as the commands
choose them. Where the user chose no platforms and JAX has not started, a machine
without accelerators starts only the CPU, with what JAX's plugins print on starting held
out of the user's terminal (`jax_start.start_quietly`); the library never sets up simulated
devices: a notebook that imported JAX first keeps its settings.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np

from ctseg import atomic
from ctseg.config import TileRequest
from ctseg.errors import CtsegError
from ctseg.inference.inputs import inference_options
from ctseg.inference.network.choice import start_backend
from ctseg.inference.pipeline import Ready, pipelined
from ctseg.inference.predictor import DEFAULT_MARGIN_MM, Prediction, Predictor, Seconds
from ctseg.inference.quality.scan_checks import volume_warnings
from ctseg.inference.quality.scores import Quality
from ctseg.inference.scan import postprocess
from ctseg.inference.scan.region import check_margin
from ctseg.io.scans import (
    Scan,
    nifti_geometry,
    nifti_image,
    read_scan,
    scan_from_image,
    to_original_order,
)
from ctseg.parallel.compile_cache import compile_cache_dir, use_compile_cache
from ctseg.reading import check_regular
from ctseg.run.rundir import CONFIG, load_config, member_runs

_log = logging.getLogger(__name__)
# In the NIfTI header of every label map `Segmentation.save` writes: what makes a file
# one that a later `save` may replace.
DESCRIPTION = b"ctseg labels"


def _is_our_labels(path: Path) -> bool:
    """Whether `path` is a NIfTI label map that `Segmentation.save` wrote."""
    try:
        check_regular(path)  # a FIFO's open would wait for a writer for ever
        header = nib.load(path).header
        return bytes(header["descrip"]).startswith(DESCRIPTION)
    except Exception:  # not a regular file, not NIfTI, unreadable: not ours
        return False


def check_out(out: str | Path, sources: Sequence[Path] = (), force: bool = False) -> Path:
    """Where labels may be saved: CtsegError, one line, for a folder, for one of the
    `sources` (the scan read, compared resolved; not even with `force`), or for an
    existing file that is no label map ctseg wrote (unless `force`)."""
    out = Path(out)
    if out.is_dir():
        raise CtsegError(
            f"{out} is a folder: give a file name for the labels, e.g. {out / 'scan_seg.nii.gz'}"
        )
    for source in sources:
        if out.resolve() == Path(source).resolve() or (
            out.exists() and source.exists() and out.samefile(source)
        ):
            raise CtsegError(f"{out} is the scan being segmented; save its labels elsewhere")
    if (out.exists() or out.is_symlink()) and not force and not _is_our_labels(out):
        raise CtsegError(
            f"{out} exists and is not a label map ctseg wrote; give another path, or "
            "force=True to replace it"
        )
    return out


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
    # Whether to trust it: verdict ("ok", "review", "unlike the training data"), reason,
    # scores (`ctseg.inference.quality.scores`: calibrated thresholds, or the run's own).
    quality: Quality | None = None

    def to_nifti(self) -> nib.Nifti1Image:
        """The labels as a NIfTI image of the input's geometry (its header, for NIfTI)."""
        image = nifti_image(self.scan, self.labels, np.uint8)
        image.header["descrip"] = DESCRIPTION
        return image

    def save(self, path: str | Path, force: bool = False) -> None:
        """Write the labels as NIfTI at `path`, atomically (ITK-SNAP, 3D Slicer overlay it).

        Never over the scan read; over an existing file only when it is a label map ctseg
        wrote, or with `force`."""
        # A file the scan was read from (an image in memory is named, not read).
        read = self.scan is not None and Path(self.scan.source).exists()
        path = check_out(path, [Path(self.scan.source)] if read else [], force)
        with atomic.atomic_path(path) as tmp:
            nib.save(self.to_nifti(), tmp)


class Segmenter:
    """One run's model, or an ensemble of runs' models, ready to segment scans."""

    def __init__(
        self,
        runs: str | Path | Sequence[str | Path],
        *,
        checkpoint: str | int = "best",
        tile: TileRequest | int | None = None,
        backend: str | None = None,
        device: str = "auto",
        tta: bool | None = None,
        compile_cache: str | None = None,
        locate: str | Path | None = None,
        margin_mm: float | None = None,
    ):
        """`runs`: a run directory, a folder of them, or several (an ensemble). The options
        are `ctseg predict`'s: the checkpoint (best, latest or a step number, a string or
        an int), level-wise tiles (a `TileRequest`, or its int: -1 automatic, 0 the whole
        volume, an even core size; None: the run's config),
        the backend (None: JAX on accelerators, else ONNX Runtime when installed), the
        device (auto, cpu, gpu or tpu) and mirrored TTA (None: the run's config);
        `compile_cache` a folder or "off" (default: ctseg's cache folder); `locate` a
        coarse run that finds the liver first, the full-resolution models then running on
        its box plus `margin_mm` only (`ctseg predict --locate`; default 20 mm; only with
        `locate`). Every option is checked before a model loads, one line (CtsegError)
        for each mistake, as the CLI checks it."""
        paths = [runs] if isinstance(runs, str | Path) else list(runs)
        run_dirs = member_runs([Path(path) for path in paths])  # each run once, as the CLI
        configs = [load_config(run_dir) for run_dir in run_dirs]
        options = inference_options(configs[0], checkpoint, tile, backend, device, tta)
        check_margin(margin_mm, locate is not None)
        problem = use_compile_cache(compile_cache_dir(compile_cache))
        if problem is not None:
            _log.warning("%s", problem)
        backend = start_backend(options)  # before JAX starts: its plugins' lines held
        self.predictor = Predictor.from_run(run_dirs, backend, options, configs)
        if locate is not None:
            margin_mm = DEFAULT_MARGIN_MM if margin_mm is None else margin_mm
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
        DICOM series of another modality (refused otherwise, as `ctseg predict` does). An
        array of HU: integers or floats (float16 is taken as float32, exactly); a boolean
        array is a mask, not a CT, and is refused."""
        if isinstance(image, str | Path):
            scan = read_scan(image, allow_non_ct)
        else:
            scan = scan_from_image(_hu_array(image, name), affine, name)
        return _segmentation(self.predictor, scan, self.predictor.predict(scan, with_probabilities))

    def map(
        self,
        paths: Iterable[str | Path],
        *,
        with_probabilities: bool = False,
        allow_non_ct: bool = False,
    ) -> Iterator[Segmentation]:
        """Segment scan files (or DICOM series folders) one after another, yielding each
        one's result in order, as `ctseg predict` pipelines them: the next scan is read
        and brought to the grid, and the last one brought back to its voxels and
        post-processed, in threads beside the network's pass over the current one. A scan
        that cannot be read or segmented (its file, its header, the memory it needs) raises
        its error when its turn comes, after the results before it; a header that lies
        (`nifti_geometry`) sizes nothing for the others."""
        paths = [Path(path) for path in paths]
        self.predictor.expect(g for g in map(nifti_geometry, paths) if g is not None)
        stages = _MapStages(self.predictor, with_probabilities, allow_non_ct)
        return pipelined(list(enumerate(paths)), stages)


def _segmentation(predictor: Predictor, scan: Scan, prediction: Prediction) -> Segmentation:
    """The result of a scan's prediction, in the scan's own voxel order."""
    stats = postprocess.scan_stats(prediction.labels, scan.affine)
    stats["located"] = prediction.located  # as _stats.json: the region, if one was used
    judged = predictor.judge(prediction, scan)
    probabilities = prediction.probabilities
    return Segmentation(
        labels=to_original_order(scan, prediction.labels),
        affine=np.array(scan.original_affine),
        stats=stats,
        warnings=prediction.warnings + volume_warnings(stats),
        checks=prediction.checks,
        probabilities=None if probabilities is None else to_original_order(scan, probabilities),
        scan=scan,
        quality=judged,
    )


@dataclass
class _MapStages:
    """`Segmenter.map`'s stages of the scan pipeline: a file read and brought to the grids,
    the network, the labels back on the scan's voxels as a `Segmentation`."""

    predictor: Predictor
    with_probabilities: bool
    allow_non_ct: bool
    # Each scan's seconds and the network's warnings, from its pass to its result (by index:
    # a path given twice is two scans).
    passes: dict[int, tuple[Seconds, list[str]]] = field(default_factory=dict)

    def read(self, item: tuple[int, Path]) -> Ready:
        index, path = item
        scan, seconds = read_scan(path, self.allow_non_ct), {}
        self.passes[index] = (seconds, [])
        return Ready(scan, self.predictor.to_grid(scan, seconds))

    def infer(self, item: tuple[int, Path], ready: Ready) -> Any:
        seconds, warnings = self.passes[item[0]]
        return self.predictor.infer(ready.on_grids, seconds, None, warnings)

    def finish(self, item: tuple[int, Path], ready: Ready, probabilities: Any) -> Segmentation:
        seconds, warnings = self.passes.pop(item[0])
        scan = ready.scan
        prediction = self.predictor.to_scan(
            scan, probabilities, ready.on_grids, seconds, self.with_probabilities
        )
        prediction.warnings[:0] = warnings
        return _segmentation(self.predictor, scan, prediction)


def _hu_array(image: Any, name: str) -> Any:
    """An array of HU as `scan_from_image` takes it: float16 widened to float32 (exactly);
    CtsegError for a boolean array (a mask, not a CT). Images pass as they are."""
    if not isinstance(image, np.ndarray):
        return image
    if image.dtype == np.bool_:
        raise CtsegError(
            f"{name} is a boolean array: a mask, not a CT; give the scan's HU (integers or floats)"
        )
    if image.dtype == np.float16:
        return image.astype(np.float32)
    return image


def segment(
    image: str | Path | nib.spatialimages.SpatialImage | Any,
    runs: str | Path | Sequence[str | Path],
    affine: np.ndarray | None = None,
    out: str | Path | None = None,
    force: bool = False,
    **options: Any,
) -> Segmentation:
    """Segment one scan with `runs` (`Segmenter`'s options as keywords); with `out`, also
    write the labels there as NIfTI (checked before the model loads: never a folder, never
    the scan itself, and an existing file only when it is a label map ctseg wrote, or with
    `force`). For many scans, make one `Segmenter` and call it, or its `map`."""
    if isinstance(image, str | Path) and (Path(image) / CONFIG).is_file():
        raise CtsegError(
            f"{image} is a run directory, given as the scan: segment(image, runs) takes "
            "the scan first"
        )
    if out is not None:
        check_out(out, [Path(image)] if isinstance(image, str | Path) else [], force)
    result = Segmenter(runs, **options)(image, affine)
    if out is not None:
        result.save(out, force)
    return result
