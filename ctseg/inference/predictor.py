"""The per-scan prediction pipeline in memory: a run's model predicting one scan at a time.

One scan goes: read (canonical RAS, `ctseg.volume`) → the training preprocessing
(resampling to the run's R³ grid as int16 HU, the HU window: `Predictor.to_grid`) →
the inference engine (whole or exactly tiled, `Predictor.infer`) → class
probabilities on the grid → resampled linearly back to the scan's own voxels →
argmax → post-processing (`Predictor.to_scan`). `Predictor.predict` does all of it;
`ctseg.predict_files` writes the outputs of many scans, and `ctseg.evaluate`
scores a store's split with the same pipeline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ctseg.config import Config, InferenceOptions
from ctseg.data import grids as preprocess
from ctseg.data.grids import GridSpec
from ctseg.errors import CtsegError
from ctseg.inference import engine as infer
from ctseg.inference import postprocess, tiling
from ctseg.inference.engine import Engine
from ctseg.inference.jax_backend import COMPILED_SHARE, is_out_of_memory
from ctseg.inference.tiling import Shape
from ctseg.io import scans as volume
from ctseg.parallel import devices as dev
from ctseg.run import fingerprint, rundir
from ctseg.run.checkpoints import TrainedModel, load_model

# (stage, done, total): stages "read", "infer" (windows done of total), "postprocess", "write".
StageProgress = Callable[[str, int, int], None]
Seconds = dict[str, float]  # seconds per phase, `PHASES`
# Where a scan's time goes, as each `<name>_stats.json` records it. "load" and "compile"
# are the call's one-off costs (the plan is compiled before the first scan); a scan
# that finds a program missing (an out-of-memory retry) compiles it under its own name.
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
# Spacing-grid boxes are rounded up to this many voxels (or the alignment, if larger):
# scans of similar extent share one compiled program, at ≤ 15 voxels of air per side.
_BOX_MULTIPLE = 16
# Engines (compiled programs, weights on the devices) kept for boxes of other shapes.
_ENGINES_KEPT = 4


@dataclass
class Prediction:
    """A scan's prediction in canonical (RAS) voxel order, plus what was noticed on the way."""

    labels: np.ndarray  # post-processed, uint8, the scan's canonical shape
    grid_probabilities: Any  # [x, y, z, 3] on the run's grid, on the engine's devices (ONNX:
    # a host array); None for an ensemble
    probabilities: np.ndarray | None  # [..., 3] float32 on the scan's voxels, when asked for
    warnings: list[str] = field(default_factory=list)
    seconds: Seconds = field(default_factory=dict)  # this scan's own phases
    # Where the scan or its liver lie far outside the run's training data (`ctseg.fingerprint`).
    checks: list[str] = field(default_factory=list)

    @property
    def grid_labels(self) -> np.ndarray | None:
        """The raw argmax on the run's grid, uint8 (for grid-level Dice), fetched when asked;
        None for an ensemble (its members' grids differ)."""
        if self.grid_probabilities is None:
            return None
        return infer.grid_labels(self.grid_probabilities)


@dataclass
class OnGrid:
    """A scan brought to the run's grid, ready for the network."""

    unit: np.ndarray  # the HU-windowed box [x, y, z], float32: the grid, padded on the spacing grid
    grid: Shape  # the scan's grid, the box's first voxels


@contextlib.contextmanager
def timed(seconds: Seconds, phase: str) -> Iterator[None]:
    """Add the time the block takes to `seconds[phase]`."""
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - start


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


class Member:
    """One run's model on the devices: its grid, and one inference engine per box shape."""

    def __init__(
        self,
        model: TrainedModel,
        tile: int,
        backend: str,
        devices: list[Any],
        run_dir: Path | None = None,
    ):
        self.model = model
        self.config = model.config
        self.run_dir = run_dir
        self.grid = GridSpec.of(self.config.data)
        self.tile, self.backend, self.devices = tile, backend, devices
        # One engine per box shape (scans of one grid share one). The cube's one box is
        # planned and compiled here, before the first scan; a spacing grid's boxes follow
        # the scans' extents, and each new one is planned when a scan first needs it.
        self._engines: OrderedDict[Shape, Engine] = OrderedDict()
        self.engine: Engine | None = None  # the one that ran (or will run) the latest scan
        if self.grid.kind == "cube":
            self.engine_for(tiling.grid_shape(self.config))

    def engine_for(self, box: Shape) -> Engine:
        """The engine for boxes of `box` voxels, planned (and compiled) when first asked for."""
        if box in self._engines:
            self._engines.move_to_end(box)
        else:
            self._engines[box] = Engine(
                self.model, self.tile, self.backend, self.devices, shape=box
            )
            # Each engine holds its programs and a copy of the weights on the devices: a
            # batch of scans of many extents keeps only the latest few.
            while len(self._engines) > _ENGINES_KEPT:
                self._engines.popitem(last=False)
        self.engine = self._engines[box]
        return self.engine

    @property
    def name(self) -> str:
        """`runs/fold0 (step 600)`, as the first line of an ensemble names its members."""
        where = "a model" if self.run_dir is None else str(self.run_dir)
        return f"{where} (step {self.model.step})"

    @property
    def plan(self) -> str:
        """The plan in words: the cube's one, or the latest box's on the spacing grid."""
        if self.engine is not None:
            return self.engine.description
        return f"the scan at {self.grid.voxel_size}, boxes of its extent"

    def to_grid(self, scan: volume.Scan) -> OnGrid:
        """The scan on the run's grid, HU-windowed: exactly the training preprocessing. On
        the spacing grid the box holds the scan's whole grid, padded with air to the
        model's alignment."""
        grid = self.grid.grid_of(scan.array.shape, scan.spacing)
        box = grid
        if self.grid.kind == "spacing":
            box = preprocess.inference_box(grid, max(self.config.alignment, _BOX_MULTIPLE))
        hu = preprocess.to_box(scan.array, grid, (0, 0, 0), box, order=1)  # int16, as stored
        return OnGrid(preprocess.hu_to_unit(hu, self.config.data.hu_window), grid)

    def infer(
        self,
        unit: np.ndarray,
        tta: bool,
        progress: infer.TileProgress,
        warnings: list[str] | None,
    ) -> Any:
        """Class probabilities [x, y, z, 3] of a box (`OnGrid.unit`), on the devices.

        An accelerator that runs out of memory is tried once more with smaller tiles
        (the engine is replaced for the scans after too), which `warnings` records;
        a second failure is this scan's `CtsegError`.
        """
        box = tuple(unit.shape)
        try:
            return self._probabilities(self.engine_for(box), unit, tta, progress)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
        before = self.engine.description
        self.engine = self._engines[box] = self.engine.smaller()
        if warnings is not None:
            warnings.append(f"out of memory with {before}; retried with {self.engine.description}")
        try:
            return self._probabilities(self.engine, unit, tta, progress)
        except Exception as again:
            if not is_out_of_memory(again):
                raise
            raise CtsegError(
                f"out of memory on {dev.describe(self.engine.devices)}, also with "
                f"{self.engine.description}; try a smaller --tile"
            ) from None

    @staticmethod
    def _probabilities(
        engine: Engine, unit: np.ndarray, tta: bool, progress: infer.TileProgress
    ) -> Any:
        """The engine's probabilities, waited for: a device's failure surfaces here."""
        return jax.block_until_ready(infer.probabilities(engine, unit, tta, progress))


class Predictor:
    """A run's model, or an ensemble of several runs' models, predicting one scan at a time.

    An ensemble's members each predict on their own grid, exactly as alone (runs of
    other grid sizes or grids are welcome); their probabilities are averaged on the
    scan's own voxels, and mirrored TTA applies to each. Post-processing follows the
    first member's config.
    """

    def __init__(
        self,
        models: TrainedModel | Sequence[TrainedModel],
        options: InferenceOptions | None = None,
        devices: Sequence[Any] | None = None,
        run_dirs: Sequence[Path | None] | None = None,
    ):
        """`options`: tile, backend and TTA (None: each run's config; backend None is JAX);
        `devices`: where a JAX engine runs (`from_run` chooses them from `options.device`)."""
        options = options or InferenceOptions()
        models = [models] if isinstance(models, TrainedModel) else list(models)
        if not models:
            raise CtsegError("an ensemble needs at least one run")
        run_dirs = list(run_dirs or [None] * len(models))
        self.config = models[0].config  # post-processing, probabilities, the HU check
        self.tta = self.config.predict.tta if options.tta is None else options.tta
        for model, run_dir in zip(models, run_dirs, strict=True):
            if self.tta and not model.config.train.flip:
                which = "this model was" if len(models) == 1 else f"the model of {run_dir} was"
                raise CtsegError(
                    f"test-time augmentation mirrors the scan, but {which} trained without "
                    "flips (train.flip = false) and has never seen mirrored anatomy; leave "
                    "out --tta"
                )
        self.clock = dev.compile_clock()
        self.backend = options.backend or "jax"
        # ONNX Runtime runs on the host's cores (no JAX device); JAX on `devices`.
        jax_devices = list(devices or jax.local_devices()[:1])
        self.devices: list[Any] = jax_devices if self.backend == "jax" else []
        self.members = [
            Member(
                model,
                model.config.predict.tile if options.tile is None else options.tile,
                self.backend,
                self.devices,
                run_dir,
            )
            for model, run_dir in zip(models, run_dirs, strict=True)
        ]
        # One-off costs of the whole call (loading, compiling ahead), filled in by `from_run`.
        self.seconds: Seconds = {}
        # The (first) run's training data, for `to_scan`'s checks (None: nothing checked).
        self.fingerprint: fingerprint.Fingerprint | None = None

    @classmethod
    def from_run(
        cls,
        run_dirs: Path | Sequence[Path],
        options: InferenceOptions | None = None,
        configs: Config | Sequence[Config] | None = None,
    ) -> Predictor:
        """The runs' models on the devices `options.device` asks for (`ctseg.devices`),
        whatever layout trained them: one run, or several (an ensemble). `configs`: the
        runs' config.toml if already read."""
        options = options or InferenceOptions()
        run_dirs = [Path(run_dirs)] if isinstance(run_dirs, str | Path) else list(run_dirs)
        if isinstance(configs, Config):
            configs = [configs]
        configs = list(configs or [None] * len(run_dirs))
        found = dev.choose(options.device, dev.visible())
        backend = dev.inference_backend(
            options.backend, options.device, found, dev.onnx_available()
        )
        if backend == "jax" and not dev.is_accelerator(found):
            # Simulated CPU devices share the host's cores: one window at a time, with all
            # the memory (16 side by side ran 4 % faster but cut 512³ cores from 128 to 48).
            found = found[:1]
        seconds: Seconds = {}
        models = []
        with timed(seconds, "load"):
            for run_dir, config in zip(run_dirs, configs, strict=True):
                try:
                    config = rundir.load_config(run_dir) if config is None else config
                    models.append(load_model(Path(run_dir), options.checkpoint, config))
                except CtsegError as exc:
                    raise CtsegError(f"{run_dir}: {exc}") from None
        with timed(seconds, "compile"):  # AOT compiles, ONNX export and sessions, placement
            options = dataclasses.replace(options, backend=backend)
            predictor = cls(models, options, found, run_dirs)
        predictor.seconds = seconds
        predictor.fingerprint = fingerprint.load(run_dirs[0])  # None for runs trained before
        return predictor

    @property
    def model(self) -> TrainedModel:
        """The (first) member's model."""
        return self.members[0].model

    @property
    def engine(self) -> Engine | None:
        """The engine that ran the latest scan (of the first member)."""
        return self.members[0].engine

    @property
    def summary(self) -> str:
        """What runs where, e.g. `1 × NVIDIA H100 80GB HBM3, XLA, bfloat16, whole volume 512³`
        (on the spacing grid: `…, the scan at 1.5 × 1.5 × 1.5 mm, boxes of its extent`; an
        ensemble names its members: `…, ensemble of 2: runs/a (step 600): whole volume
        48³; runs/b (step 400): …`)."""
        runtime = "ONNX Runtime" if self.backend == "onnx" else "XLA"
        where = dev.describe(self.devices)  # none under ONNX Runtime: the host's CPU
        # Materialised activations: the compute dtype under JAX, float32 in ONNX Runtime.
        dtype = self.config.model.dtype if self.backend == "jax" else "float32"
        mirrored = ", mirrored 8× (TTA)" if self.tta else ""
        if len(self.members) == 1:
            plan = self.members[0].plan
        else:
            members = "; ".join(f"{m.name}: {m.plan}" for m in self.members)
            plan = f"ensemble of {len(self.members)}: {members}"
        return f"{where}, {runtime}, {dtype}, {plan}{mirrored}"

    @property
    def plan(self) -> str:
        """The plans in words (an ensemble's joined by `; `)."""
        return "; ".join(member.plan for member in self.members)

    @property
    def plan_line(self) -> str:
        """The (first) engine's plan and what it needs, e.g. `whole volume 512³: 51.2 GiB per
        device of 78.1 GiB free (compiled; plans take 85 %)`."""
        engine = self.engine
        if engine is None:
            return "a plan for each box shape, made when a scan first needs it"
        if engine.backend == "onnx":
            free = dev.human_bytes(engine.memory)
            return f"{engine.description} in ONNX Runtime, {free} of RAM free"
        share = f"plans take {COMPILED_SHARE:.0%}"
        spill = "; levels wait on the host" if engine.spills else ""
        return (
            f"{engine.description}: {dev.human_bytes(engine.needed)} per device of "
            f"{dev.human_bytes(engine.memory)} free (compiled; {share}){spill}"
        )

    def to_grid(self, scan: volume.Scan, seconds: Seconds) -> list[OnGrid]:
        """The scan on each member's grid, HU-windowed: exactly its training preprocessing."""
        with timed(seconds, "resample"):
            return [member.to_grid(scan) for member in self.members]

    def infer(
        self,
        on_grids: Sequence[OnGrid],
        seconds: Seconds,
        progress: StageProgress | None = None,
        warnings: list[str] | None = None,
    ) -> list[Any]:
        """Each member's class probabilities on its box (on the devices); compiling (a first
        plan for a box's shape, or a retry's) is timed apart, and an ensemble's members
        apart too (`infer.0`, `infer.1`, …)."""

        def tiles(done: int, total: int) -> None:
            if progress is not None:
                progress("infer", done, total)

        probabilities = []
        for index, (member, on_grid) in enumerate(zip(self.members, on_grids, strict=True)):
            compiled_before = self.clock.seconds
            own: Seconds = {}
            with timed(own, "infer"):
                probabilities.append(member.infer(on_grid.unit, self.tta, tiles, warnings))
            compiling = self.clock.seconds - compiled_before
            seconds["infer"] = seconds.get("infer", 0.0) + own["infer"] - compiling
            seconds["compile"] = seconds.get("compile", 0.0) + compiling
            if len(self.members) > 1:
                seconds[f"infer.{index}"] = own["infer"] - compiling
        return probabilities

    def to_scan(
        self,
        scan: volume.Scan,
        probabilities: Sequence[Any],
        on_grids: Sequence[OnGrid],
        seconds: Seconds,
        with_probabilities: bool = False,
    ) -> Prediction:
        """The members' box probabilities → post-processed labels on the scan's own canonical
        voxels (averaged there for an ensemble)."""
        options = self.config.predict
        with timed(seconds, "resample"):
            # On the engine's devices: only the labels (and asked-for probabilities) come back.
            grids = [infer.crop(p, g.grid) for p, g in zip(probabilities, on_grids, strict=True)]
            shape = scan.array.shape
            if len(grids) == 1:
                labels, on_scan = infer.scan_labels(grids[0], shape, with_probabilities)
            else:
                labels, on_scan = infer.mean_scan_labels(grids, shape, with_probabilities)
        with timed(seconds, "postprocess"):
            labels = postprocess.clean_labels(
                labels, options.keep_largest_liver, options.tumour_inside_liver
            )
            checks = fingerprint.checks(self.fingerprint, scan, labels)
        return Prediction(
            labels=labels,
            # On the grid: a lone run's (training validates there); an ensemble has none.
            grid_probabilities=grids[0] if len(grids) == 1 else None,
            probabilities=on_scan,
            warnings=hu_warnings(scan.array) + geometry_warnings(scan),
            seconds=seconds,
            checks=checks,
        )

    def predict(
        self,
        scan: volume.Scan,
        with_probabilities: bool = False,
        progress: StageProgress | None = None,
    ) -> Prediction:
        """Labels (and optionally probabilities) of a scan on its own canonical voxels."""
        seconds: Seconds = {}
        warnings: list[str] = []
        on_grids = self.to_grid(scan, seconds)
        probabilities = self.infer(on_grids, seconds, progress, warnings)
        prediction = self.to_scan(scan, probabilities, on_grids, seconds, with_probabilities)
        prediction.warnings[:0] = warnings
        return prediction
