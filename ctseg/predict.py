"""The per-scan prediction pipeline, and evaluating a run on a prepared store's split.

One scan goes: read (canonical RAS) → the training preprocessing (resampling to
the run's R³ grid as int16 HU, the HU window) → the inference engine (whole or
exactly tiled) → class probabilities on the grid → resampled linearly back to
the scan's own voxels → argmax → post-processing. `predict_files` writes, named
after the input::

    OUT_DIR/<name>_seg.nii.gz     labels 0/1/2 in exactly the input's geometry
    OUT_DIR/<name>_probs.nii.gz   class probabilities (only with predict.save_probabilities)
    OUT_DIR/<name>_stats.json     volumes, tumour count and size, burden
    OUT_DIR/<name>_preview.png    three slices through the liver with the labels overlaid

`evaluate_run` puts every case of a store's split through the same pipeline
and scores it against the case's original label file (LiTS style, in the
original geometry), plus the grid-level Dice that training reports.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ctseg import (
    atomic,
    evaluate,
    infer,
    lock,
    metrics,
    postprocess,
    preprocess,
    report,
    volume,
)
from ctseg import devices as dev
from ctseg.errors import CtsegError
from ctseg.infer import Engine, Model, load_model
from ctseg.store import Store

# (stage, done, total): stages "read", "infer" (windows done of total), "postprocess", "write".
StageProgress = Callable[[str, int, int], None]
FileProgress = Callable[[str, str, int, int], None]  # (scan name, stage, done, total)
CaseProgress = Callable[[int, int, str], None]  # (cases done, cases in total, current case)
# Where a scan's time goes, as each `<name>_stats.json` records it. "load" and "compile"
# count once for the whole call (the first scan compiles; later ones find the programs).
PHASES = ("load", "compile", "read", "resample", "infer", "postprocess", "write")

# Percentiles of a CT scan in Hounsfield units lie within air (−1000) and dense bone or
# contrast (~3000); a little slack for noise. Outside, the image is probably not in HU.
_HU_RANGE = (-1100.0, 3100.0)
_HU_SAMPLE_STEP = 4  # every 4th voxel along each axis is plenty for percentiles
# CT voxels are 0.2–1 mm in-plane and 0.5–10 mm between slices; a scan of the
# abdomen is a few cm to 2 m long (a whole body) and has more than a handful of slices.
_SPACING_MM = (0.1, 10.0)
_EXTENT_MM = (20.0, 2000.0)
_MIN_VOXELS = 8
# Adult livers measure 1–3 L; the largest ever (polycystic) about 10 L.
_MAX_LIVER_ML = 12_000.0


@dataclass
class Prediction:
    """A scan's prediction in canonical (RAS) voxel order, plus what was noticed on the way."""

    labels: np.ndarray  # post-processed, uint8, the scan's canonical shape
    grid_probabilities: Any  # [R, R, R, 3] on the engine's devices (a host array in ONNX)
    probabilities: np.ndarray | None  # [..., 3] float32 on the scan's voxels, when asked for
    warnings: list[str] = field(default_factory=list)

    @property
    def grid_labels(self) -> np.ndarray:
        """The raw argmax on the R³ grid, uint8 (for grid-level Dice); fetched when asked."""
        return infer.grid_labels(self.grid_probabilities)


def hu_warnings(hu: np.ndarray) -> list[str]:
    """Warnings when the intensities do not look like CT in Hounsfield units."""
    sample = hu[::_HU_SAMPLE_STEP, ::_HU_SAMPLE_STEP, ::_HU_SAMPLE_STEP]
    low, high = (float(v) for v in np.percentile(sample, (1, 99)))
    if float(sample.min()) >= 0:
        return [
            f"all intensities are ≥ 0 (1st–99th percentile {low:g}…{high:g}); the image may "
            "not be in Hounsfield units (missing rescale slope/intercept?)"
        ]
    if low < _HU_RANGE[0] or high > _HU_RANGE[1]:
        return [
            f"the 1st–99th intensity percentiles {low:g}…{high:g} lie outside "
            f"[{_HU_RANGE[0]:g}, {_HU_RANGE[1]:g}]; the image may not be CT in Hounsfield units"
        ]
    return []


@dataclass
class Prepared:
    """A scan read and brought to the run's grid, ready for the network."""

    scan: volume.Scan
    unit: np.ndarray  # the HU-windowed R³ grid, float32
    seconds: dict[str, float]


@contextlib.contextmanager
def _timed(seconds: dict[str, float], phase: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - start


def geometry_warnings(scan: volume.Scan) -> list[str]:
    """Warnings when a scan's voxels or extent are outside what a CT scan can be."""
    spacing = np.array(scan.spacing)
    extent = spacing * np.array(scan.array.shape)
    warnings = []
    if spacing.min() < _SPACING_MM[0] or spacing.max() > _SPACING_MM[1]:
        warnings.append(
            f"voxel spacing {' × '.join(f'{v:g}' for v in spacing)} mm is outside "
            f"{_SPACING_MM[0]:g}–{_SPACING_MM[1]:g} mm: the header's geometry is probably wrong"
        )
    if min(scan.array.shape) < _MIN_VOXELS or not (
        _EXTENT_MM[0] <= extent.min() and extent.max() <= _EXTENT_MM[1]
    ):
        warnings.append(
            f"the scan is {' × '.join(str(n) for n in scan.array.shape)} voxels, "
            f"{' × '.join(f'{v:.4g}' for v in extent)} mm: not the volume of an abdominal CT"
        )
    return warnings


def volume_warnings(stats: dict[str, Any]) -> list[str]:
    """Warnings when the predicted liver volume is not that of a human liver."""
    liver = stats["liver_volume_ml"]
    if liver == 0:
        return ["no liver was found"]
    if liver > _MAX_LIVER_ML:
        return [f"a liver of {liver:,.0f} mL is larger than any human liver: check the geometry"]
    return []


class Predictor:
    """A run's model with its inference engine, predicting one scan at a time."""

    def __init__(
        self,
        model: Model,
        tile: int | None = None,
        backend: str = "jax",
        devices: Sequence[Any] | None = None,
        tta: bool | None = None,
    ):
        """`tile`: core size of exact tiles, 0 whole, −1 automatic; None: the run's config.

        `backend` and `devices`: as `infer.Engine` takes them; `from_run` chooses them.
        `tta`: mirrored test-time augmentation (`infer.probabilities`); None: the run's config.
        """
        self.model = model
        self.config = model.config
        tile = self.config.predict.tile if tile is None else tile
        self.tta = self.config.predict.tta if tta is None else tta
        if self.tta and not self.config.train.flip:
            raise CtsegError(
                "test-time augmentation mirrors the scan, but this model was trained without "
                "flips (train.flip = false) and has never seen mirrored anatomy; leave out --tta"
            )
        self.clock = dev.compile_clock()
        self.engine = Engine(model, tile, backend, devices)
        # One-off costs of the whole call, filled in by `from_run`.
        self.seconds: dict[str, float] = {}

    @classmethod
    def from_run(
        cls,
        run_dir: Path,
        checkpoint: str = "best",
        tile: int | None = None,
        backend: str | None = None,
        device: str = "auto",
        tta: bool | None = None,
    ) -> Predictor:
        """The run's model on the devices `device` asks for (`ctseg.devices`), whatever
        layout trained it. `backend` None: JAX on accelerators, else ONNX Runtime if
        installed, else JAX."""
        found = dev.choose(device, dev.visible())
        backend = dev.inference_backend(backend, device, found, dev.onnx_available())
        if backend == "jax" and not dev.is_accelerator(found):
            # Simulated CPU devices share the host's cores: one window at a time, with all
            # the memory (16 side by side ran 4 % faster but cut 512³ cores from 128 to 48).
            found = found[:1]
        seconds: dict[str, float] = {}
        with _timed(seconds, "load"):
            try:
                model = load_model(Path(run_dir), checkpoint)
            except CtsegError as exc:
                raise CtsegError(f"{run_dir}: {exc}") from None
        with _timed(seconds, "compile"):  # AOT compiles, ONNX export and sessions, placement
            predictor = cls(model, tile, backend, found, tta)
        predictor.seconds = seconds
        return predictor

    @property
    def summary(self) -> str:
        """What runs where, e.g. `1 × NVIDIA H100 80GB HBM3, XLA, bfloat16, whole volume 512³`."""
        engine = self.engine
        runtime = "ONNX Runtime" if engine.backend == "onnx" else "XLA"
        where = dev.describe(engine.devices)  # none under ONNX Runtime: the host's CPU
        mirrored = ", mirrored 8× (TTA)" if self.tta else ""
        return f"{where}, {runtime}, {engine.dtype}, {engine.description}{mirrored}"

    @property
    def plan_line(self) -> str:
        """The engine's plan and what it needs, e.g. `whole volume 512³: 51.2 GiB per device
        of 78.1 GiB free (compiled; plans take 85 %)`."""
        engine = self.engine
        if engine.backend == "onnx":
            free = dev.human_bytes(engine.memory)
            return f"{engine.description} in ONNX Runtime, {free} of RAM free"
        share = f"plans take {infer.COMPILED_SHARE:.0%}"
        spill = "; levels wait on the host" if engine.spills else ""
        return (
            f"{engine.description}: {dev.human_bytes(engine.needed)} per device of "
            f"{dev.human_bytes(engine.memory)} free (compiled; {share}){spill}"
        )

    def prepare(self, scan: volume.Scan, seconds: dict[str, float]) -> np.ndarray:
        """The scan on the run's grid, HU-windowed: exactly the training preprocessing."""
        data = self.config.data
        with _timed(seconds, "resample"):
            grid = preprocess.image_to_grid(scan.array, data.resolution)  # int16 HU, as the store
            return preprocess.hu_to_unit(grid, data.hu_window)

    def infer(
        self,
        unit: np.ndarray,
        seconds: dict[str, float],
        progress: StageProgress | None = None,
        warnings: list[str] | None = None,
    ) -> Any:
        """Class probabilities [R, R, R, 3] on the grid, on the engine's devices; compiling is
        timed apart.

        An accelerator that runs out of memory is tried once more with smaller tiles
        (the engine is replaced for the scans after too), which `warnings` records;
        a second failure is this scan's `CtsegError`.
        """

        def tiles(done: int, total: int) -> None:
            if progress is not None:
                progress("infer", done, total)

        compiled_before = self.clock.seconds
        with _timed(seconds, "infer"):
            try:
                probabilities = self._probabilities(unit, tiles)
            except Exception as exc:
                if not infer.is_out_of_memory(exc):
                    raise
                before = self.engine.description
                self.engine = self._smaller_engine()
                if warnings is not None:
                    warnings.append(
                        f"out of memory with {before}; retried with {self.engine.description}"
                    )
                try:
                    probabilities = self._probabilities(unit, tiles)
                except Exception as again:
                    if not infer.is_out_of_memory(again):
                        raise
                    raise CtsegError(
                        f"out of memory on {dev.describe(self.engine.devices)}, also with "
                        f"{self.engine.description}; try a smaller --tile"
                    ) from None
        compiling = self.clock.seconds - compiled_before
        seconds["infer"] -= compiling
        seconds["compile"] = seconds.get("compile", 0.0) + compiling
        return probabilities

    def _probabilities(self, unit: np.ndarray, progress: infer.TileProgress) -> Any:
        """The engine's probabilities, waited for: a device's failure surfaces here."""
        probabilities = infer.probabilities(self.engine, unit, self.tta, progress)
        return jax.block_until_ready(probabilities)

    def _smaller_engine(self) -> Engine:
        """An automatic plan for half the memory the failed plan's programs needed."""
        engine = self.engine
        memory = int(engine.needed / 2 / infer.COMPILED_SHARE)
        return Engine(self.model, -1, engine.backend, engine.devices, memory=memory)

    def finish(
        self,
        scan: volume.Scan,
        probabilities: np.ndarray,
        seconds: dict[str, float],
        with_probabilities: bool = False,
    ) -> Prediction:
        """Grid probabilities → post-processed labels on the scan's own canonical voxels."""
        options = self.config.predict
        with _timed(seconds, "resample"):
            # On the engine's devices: only the labels (and asked-for probabilities) come back.
            labels, on_scan = infer.scan_labels(probabilities, scan.array.shape, with_probabilities)
        with _timed(seconds, "postprocess"):
            labels = postprocess.clean_labels(
                labels, options.keep_largest_liver, options.tumour_inside_liver
            )
        return Prediction(
            labels=labels,
            grid_probabilities=probabilities,
            probabilities=on_scan,
            warnings=hu_warnings(scan.array) + geometry_warnings(scan),
        )

    def predict(
        self,
        scan: volume.Scan,
        with_probabilities: bool = False,
        progress: StageProgress | None = None,
    ) -> Prediction:
        """Labels (and optionally probabilities) of a scan on its own canonical voxels."""
        seconds: dict[str, float] = {}
        probabilities = self.infer(self.prepare(scan, seconds), seconds, progress)
        return self.finish(scan, probabilities, seconds, with_probabilities)


# --------------------------------------------------------------------------- files


@dataclass
class ScanOutcome:
    """What `predict_files` did with one input."""

    source: Path
    name: str
    stats: dict[str, Any] | None = None
    outputs: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    error: str | None = None  # the one-line reason the scan failed
    seconds: dict[str, float] = field(default_factory=dict)  # per phase, `PHASES`
    done_earlier: bool = False  # its outputs, by this model, were all there: left as they were


def expand_inputs(
    inputs: Sequence[Path], out_dir: Path | None = None
) -> tuple[list[Path], list[ScanOutcome]]:
    """Scans named by files, folders and DICOM series folders; inputs that fail, as outcomes.

    Earlier outputs of `ctseg predict` are not scans and are left out; a scan whose
    outputs in `out_dir` would overwrite an input of this call fails, even with --force.
    """
    scans: list[Path] = []
    failed: list[ScanOutcome] = []
    for item in inputs:
        try:
            scans.extend(s for s in volume.find_scans([Path(item)]) if not is_earlier_output(s))
        except CtsegError as exc:
            failed.append(ScanOutcome(Path(item), volume.scan_name(Path(item)), error=str(exc)))
    # Outputs are named after the scan, so two scans of one name (a/volume-0.nii and
    # b/volume-0.nii) would write the same files: the first keeps the name.
    first_of: dict[str, Path] = {}
    unique = []
    input_paths = {scan.resolve() for scan in scans}
    for scan in dict.fromkeys(scans):
        name = volume.scan_name(scan)
        if name in first_of:
            reason = f"its outputs would overwrite those of {first_of[name]} (both are {name!r}); "
            failed.append(ScanOutcome(scan, name, error=reason + "predict it into another --out"))
        elif clash := _inputs_overwritten(name, out_dir, input_paths):
            reason = f"its output {clash} would overwrite an input of this call; use another --out"
            failed.append(ScanOutcome(scan, name, error=reason))
        else:
            first_of[name] = scan
            unique.append(scan)
    return unique, failed


def is_earlier_output(path: Path) -> bool:
    """A label or probability map that `predict_files` wrote: its stats file lies beside it."""
    match = re.fullmatch(r"(.+)_(seg|probs)\.nii\.gz", path.name)
    return match is not None and (path.parent / f"{match[1]}_stats.json").is_file()


def _inputs_overwritten(name: str, out_dir: Path | None, inputs: set[Path]) -> Path | None:
    """The first output of scan `name` in `out_dir` that is one of the (resolved) `inputs`."""
    if out_dir is None:
        return None
    outputs = output_paths(Path(out_dir), name, with_probabilities=True).values()
    return next((path for path in outputs if path.resolve() in inputs), None)


def output_paths(out_dir: Path, name: str, with_probabilities: bool) -> dict[str, Path]:
    paths = {
        "seg": out_dir / f"{name}_seg.nii.gz",
        "stats": out_dir / f"{name}_stats.json",
        "preview": out_dir / f"{name}_preview.png",
    }
    if with_probabilities:
        paths["probs"] = out_dir / f"{name}_probs.nii.gz"
    return paths


def predict_files(
    predictor: Predictor,
    sources: Sequence[Path],
    out_dir: Path,
    force: bool = False,
    progress: FileProgress | None = None,
    run_dir: Path | None = None,
) -> Iterator[ScanOutcome]:
    """Predict scans one after another and write their outputs; yields each scan's outcome.

    Reading and resampling the next scan, and post-processing and writing the
    last one, run in threads beside the inference of the current one (the
    network, NumPy, SciPy and the image libraries release the GIL). A problem
    with a scan is its outcome's error, never an exception.

    A scan's outputs appear together, its stats file last: a scan whose stats
    file is missing is unfinished and predicted again. Without `force`, a scan
    whose outputs are all there, by the same model (`run_dir`, checkpoint step,
    TTA), is `done_earlier` and left alone; outputs of another model fail the
    scan rather than be mixed with this one's. The caller holds `out_dir`'s lock.
    """
    out_dir = Path(out_dir)
    model = _model_of(predictor, run_dir)
    with (
        ThreadPoolExecutor(1, thread_name_prefix="ctseg-read") as reader,
        ThreadPoolExecutor(1, thread_name_prefix="ctseg-write") as writer,
    ):
        reads = [
            reader.submit(_read, predictor, Path(s), out_dir, force, model) for s in sources[:1]
        ]
        written: Future | None = None
        for index in range(len(sources)):
            outcome, prepared = reads[index].result()
            if index + 1 < len(sources):
                source = Path(sources[index + 1])
                reads.append(reader.submit(_read, predictor, source, out_dir, force, model))
            reads[index] = None  # done with: `prepared` holds what is left of it
            probabilities = None
            if prepared is not None:
                probabilities = _guarded(
                    outcome,
                    predictor.infer,
                    prepared.unit,
                    prepared.seconds,
                    _stage_progress(progress, outcome.name),
                    outcome.warnings,
                )
                prepared.unit = None  # the grid is freed once inferred
            if written is not None:
                yield written.result()
            written = writer.submit(
                _write, predictor, outcome, prepared, probabilities, out_dir, model
            )
        if written is not None:
            yield written.result()


def _stage_progress(progress: FileProgress | None, name: str) -> StageProgress | None:
    if progress is None:
        return None
    return lambda stage, done, total: progress(name, stage, done, total)


def _guarded(outcome: ScanOutcome, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, or None with the scan's one-line error on `outcome`."""
    try:
        return fn(*args)
    except CtsegError as exc:
        outcome.error = str(exc)
    except MemoryError:
        outcome.error = "out of memory; try a smaller --tile"
    except Exception as exc:  # an accelerator's out-of-memory fails the scan, not the batch
        if not infer.is_out_of_memory(exc):
            raise
        outcome.error = "the accelerator ran out of memory; try a smaller --tile"
    return None


def _model_of(predictor: Predictor, run_dir: Path | None) -> dict[str, Any]:
    """What makes two predictions of a scan the same, as its stats file records it."""
    return {
        "run_dir": None if run_dir is None else str(Path(run_dir).resolve()),
        "run_step": predictor.model.step,
        "tta": predictor.tta,
    }


def _earlier_prediction(stats_path: Path, model: dict[str, Any]) -> dict[str, Any]:
    """The stats of an earlier prediction of a scan by this `model`; CtsegError for another's."""
    try:
        earlier = json.loads(stats_path.read_text())
    except (OSError, ValueError):
        earlier = None
    if not isinstance(earlier, dict):
        what = "cannot be read as the stats of an earlier prediction"
    elif any(earlier.get(key) != model[key] for key in model):
        what = (
            f"is of another prediction (run {earlier.get('run_dir') or '?'}, step "
            f"{earlier.get('run_step')}{', TTA' if earlier.get('tta') else ''})"
        )
    else:
        return earlier
    raise CtsegError(
        f"{stats_path.name} in {stats_path.parent} {what}; use --force to replace it, "
        "or another --out"
    )


def _read(
    predictor: Predictor, source: Path, out_dir: Path, force: bool, model: dict[str, Any]
) -> tuple[ScanOutcome, Prepared | None]:
    outcome = ScanOutcome(source, volume.scan_name(source))

    def read() -> Prepared | None:
        paths = output_paths(out_dir, outcome.name, predictor.config.predict.save_probabilities)
        # Without its stats file a scan is unfinished (see `_write_outputs`): predicted again.
        if paths["stats"].exists() and not force:
            earlier = _earlier_prediction(paths["stats"], model)
            if all(path.exists() for path in paths.values()):
                outcome.done_earlier = True
                outcome.stats, outcome.outputs = earlier, list(paths.values())
                return None
        seconds: dict[str, float] = {}
        with _timed(seconds, "read"):
            scan = volume.read_scan(source)
        return Prepared(scan, predictor.prepare(scan, seconds), seconds)

    return outcome, _guarded(outcome, read)


def _write(
    predictor: Predictor,
    outcome: ScanOutcome,
    prepared: Prepared | None,
    probabilities: np.ndarray | None,
    out_dir: Path,
    model: dict[str, Any],
) -> ScanOutcome:
    if prepared is not None and probabilities is not None:
        _guarded(
            outcome, _write_outputs, predictor, outcome, prepared, probabilities, out_dir, model
        )
    return outcome


def _write_outputs(
    predictor: Predictor,
    outcome: ScanOutcome,
    prepared: Prepared,
    probabilities: np.ndarray,
    out_dir: Path,
    model: dict[str, Any],
) -> None:
    scan, seconds = prepared.scan, prepared.seconds
    with_probabilities = predictor.config.predict.save_probabilities
    prediction = predictor.finish(scan, probabilities, seconds, with_probabilities)
    del probabilities
    with _timed(seconds, "postprocess"):
        stats = postprocess.scan_stats(prediction.labels, scan.affine)
    outcome.warnings += prediction.warnings + volume_warnings(stats)
    paths = output_paths(out_dir, outcome.name, with_probabilities)
    # Every output under a temporary name, then renamed with the stats file last: a kill
    # half-way leaves no stats file, so the next run predicts the scan again.
    order = [key for key in paths if key != "stats"] + ["stats"]
    with atomic.atomic_group([paths[key] for key in order]) as temporaries:
        tmp = dict(zip(order, temporaries))
        with _timed(seconds, "write"):
            volume.write_labels(scan, prediction.labels, tmp["seg"])
            if prediction.probabilities is not None:
                volume.write_volume(scan, prediction.probabilities, tmp["probs"], np.float32)
            report.plot_preview(
                scan.array,
                prediction.labels,
                scan.spacing,
                tmp["preview"],
                title=outcome.name,
                window=predictor.config.data.hu_window,
            )
        # The call's one-off costs (loading, compiling ahead) beside this scan's own phases.
        outcome.seconds = {
            phase: round(predictor.seconds.get(phase, 0.0) + seconds.get(phase, 0.0), 3)
            for phase in PHASES
        }
        record = {
            "scan": str(outcome.source),
            **model,
            "device": predictor.summary,
            "shape": list(scan.original_shape),
            "spacing_mm": list(scan.spacing),
            **stats,
            "warnings": outcome.warnings,
            "seconds": outcome.seconds,
            # Programs this call compiled so far, and how many came from the persistent cache.
            "compiled": {
                "programs": predictor.clock.programs,
                "from_cache": predictor.clock.cache_hits,
            },
        }
        tmp["stats"].write_text(json.dumps(record, indent=2) + "\n")
    outcome.stats = stats
    outcome.outputs = list(paths.values())


# --------------------------------------------------------------------------- evaluation


def evaluate_run(
    run_dir: Path,
    data_dir: Path,
    split: str = "val",
    checkpoint: str = "best",
    out_dir: Path | None = None,
    progress: CaseProgress | None = None,
    tile: int | None = None,
    backend: str | None = None,
    device: str = "auto",
    tta: bool | None = None,
    force: bool = False,
    warn: Callable[[str], None] | None = None,
) -> dict:
    """Predict a store's split with a run and score it; writes summary.json and metrics.csv.

    `out_dir` holds one evaluation: `EVALUATED` records its run, checkpoint, store
    and split. Another one is replaced only with `force`; every evaluation first
    clears what an earlier one wrote, so that predictions are never mixed. The
    folder's lock is held throughout (`ctseg.lock`; `warn` hears of a dead holder's).

    Metrics compare the post-processed prediction, mapped back to the case's
    original scan, with its original label file (the LiTS way); each case also
    gets the Dice of the raw prediction on the grid against the store's label
    (`grid_dice`, what training validates with). A case that fails is listed
    under "errors" and the rest go on. Returns the report (the JSON's content).
    """
    run_dir, data_dir = Path(run_dir), Path(data_dir)
    out_dir = run_dir / "eval" if out_dir is None else Path(out_dir)
    store = Store.open(data_dir)
    try:
        cases = store.split(split)
    except ValueError as exc:
        raise CtsegError(str(exc)) from None
    cases = [case for case in cases if case.labelled]
    if not cases:
        raise CtsegError(f"the store at {data_dir} has no labelled cases in the {split!r} split")
    with lock.hold(out_dir, warn):
        atomic.claim_folder(out_dir, ("summary.json", "predictions", EVALUATED), force=None)
        predictor = Predictor.from_run(run_dir, checkpoint, tile, backend, device, tta)
        if store.resolution != predictor.config.data.resolution:
            raise CtsegError(
                f"{data_dir} holds a {store.resolution}³ grid but the run was trained on "
                f"{predictor.config.data.resolution}³"
            )
        _claim_evaluation(
            out_dir, _evaluation_of(run_dir, predictor.model.step, data_dir, split), force
        )
        records, errors = [], []
        for done, case in enumerate(cases):
            if progress is not None:
                progress(done, len(cases), case.id)
            try:
                records.append(_evaluate_case(predictor, store, case, out_dir))
            except CtsegError as exc:
                errors.append({"case": case.id, "message": str(exc)})
        if progress is not None:
            progress(len(cases), len(cases), "")
        summary = metrics.summarize(records)
        summary["grid_dice"] = {
            key: metrics.mean_defined([r["grid_dice"][key] for r in records])
            for key in ("liver", "tumor")
        }
        result = {
            "run": {
                "run_dir": str(run_dir),
                "checkpoint_step": predictor.model.step,
                "data": str(data_dir),
                "split": split,
                "tiling": predictor.engine.description,
                "backend": predictor.engine.backend,
                "tta": predictor.tta,
                "device": predictor.summary,
            },
            "cases": records,
            "summary": summary,
            "errors": errors,
            "unpaired": {"pred": [], "ref": []},  # the --pred/--ref report's shape
        }
        evaluate.write_reports(result, out_dir / "summary.json", out_dir / "metrics.csv")
        return result


EVALUATED = "evaluated.json"  # in an evaluation's --out: the run, checkpoint, store and split


def _evaluation_of(run_dir: Path, step: int, data_dir: Path, split: str) -> dict[str, Any]:
    return {
        "run_dir": str(Path(run_dir).resolve()),
        "checkpoint_step": step,
        "data": str(Path(data_dir).resolve()),
        "split": split,
    }


def _claim_evaluation(out_dir: Path, evaluation: dict[str, Any], force: bool) -> None:
    """Make `out_dir` the folder of `evaluation`: refuse another's unless `force`, then clear."""
    record, summary = out_dir / EVALUATED, out_dir / "summary.json"
    earlier = None
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        if record.exists():
            earlier = json.loads(record.read_text())
            earlier = earlier if isinstance(earlier, dict) else None
        elif summary.exists():  # written before the record existed: its "run" says the same
            run = json.loads(summary.read_text())["run"]
            earlier = _evaluation_of(
                run["run_dir"], run["checkpoint_step"], run["data"], run["split"]
            )
    has_files = record.exists() or summary.exists() or (out_dir / "predictions").exists()
    if earlier != evaluation and has_files and not force:
        what = (
            "an evaluation that cannot be read"
            if earlier is None
            else f"the evaluation of {earlier['run_dir']} (checkpoint "
            f"{earlier['checkpoint_step']}, {earlier['data']} split {earlier['split']!r})"
        )
        raise CtsegError(f"{out_dir} holds {what}; give another --out, or --force to replace it")
    # An evaluation is never resumed: what an earlier one wrote goes, so that the
    # predictions and reports here are all of this one, even if it stops half-way.
    predictions = out_dir / "predictions"
    if predictions.is_dir():
        for path in predictions.iterdir():
            if path.name.endswith("_seg.nii.gz") or path.name.startswith(atomic.TEMP_PREFIX):
                path.unlink()
    for name in ("summary.json", "metrics.csv"):
        (out_dir / name).unlink(missing_ok=True)
    atomic.write_json(record, evaluation)


def _evaluate_case(predictor: Predictor, store: Store, case: Any, out_dir: Path) -> dict:
    scan = volume.read_scan(case.image_source)
    # A source is outside the store: use it only while it is the scan the case was made from.
    if scan.original_shape != case.original_shape or not np.allclose(
        scan.original_affine, case.original_affine, rtol=0, atol=evaluate.AFFINE_TOLERANCE_MM
    ):
        raise CtsegError(
            f"{case.image_source} is not the scan case {case.id} was prepared from (its geometry "
            "differs from the store manifest's); re-run `ctseg preprocess --force`"
        )
    reference = volume.read_scan(case.label_source)
    same_affine = np.allclose(
        scan.original_affine, reference.original_affine, rtol=0, atol=evaluate.AFFINE_TOLERANCE_MM
    )
    if scan.original_shape != reference.original_shape or not same_affine:
        raise CtsegError(f"{case.label_source} does not have its scan's geometry")
    prediction = predictor.predict(scan)
    volume.write_labels(scan, prediction.labels, out_dir / "predictions" / f"{case.id}_seg.nii.gz")
    # Canonical order is a flip/permutation of the file's, and scan.spacing is canonical: the
    # metrics equal those computed in the file's own voxel order.
    record = evaluate.evaluate_arrays(case.id, prediction.labels, reference.array, scan.spacing)
    record["grid_dice"] = metrics.grid_dice(
        prediction.grid_labels, np.asarray(store.label(case.id))
    )
    return record
