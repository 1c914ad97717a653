"""The per-scan prediction pipeline in memory: a run's model predicting one scan at a time.

One scan goes: read (canonical RAS, `ctseg.io.scans`) → the training preprocessing
(resampling to the run's grid as int16 HU, the HU window: `Predictor.to_grid`) → the
inference engine (whole or exactly tiled, `Predictor.infer`) → class probabilities on
the grid → resampled linearly back to the scan's own voxels and argmax
(`ctseg.inference.scan.way_back`) → post-processing and the scan's checks
(`Predictor.to_scan`). `Predictor.predict` does all of it; `ctseg.inference.files`
writes the outputs of many scans, and `ctseg.evaluation.runs` scores a store's split
with the same pipeline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ctseg.config import Config, InferenceOptions, TileRequest
from ctseg.data.grids import Shape
from ctseg.errors import CtsegError, OptionError
from ctseg.inference.inputs import read_roi, roi_mask
from ctseg.inference.member import Member, OnGrid
from ctseg.inference.network.backends import Backend
from ctseg.inference.network.engine import Engine
from ctseg.inference.quality import scan_checks, scores
from ctseg.inference.quality.uncertainty import Uncertainty
from ctseg.inference.scan import postprocess, way_back
from ctseg.inference.scan.region import Region, region_of
from ctseg.io.readers import check_extent
from ctseg.io.scans import Scan
from ctseg.parallel import devices as dev
from ctseg.parallel.compile_cache import compile_clock
from ctseg.progress import StageProgress
from ctseg.run import fingerprint, rundir
from ctseg.run.trained import TrainedModel, load_model

# (stage, done, total): stages "read", "infer" (windows done of total), "postprocess", "write".
Seconds = dict[str, float]  # seconds per phase, `PHASES`
# Where a scan's time goes, as each `<name>_stats.json` records it. "load" and "compile"
# are the call's one-off costs (the plan is compiled before the first scan); a scan
# that finds a program missing (an out-of-memory retry) compiles it under its own name.
PHASES = ("load", "compile", "read", "locate", "resample", "infer", "postprocess", "write")
# Around the located liver: TotalSegmentator's crops of organs take a few cm; 20 mm holds a
# coarse locator's border error (a few of its voxels) with room to spare.
DEFAULT_MARGIN_MM = 20.0


@dataclass
class Prediction:
    """A scan's prediction in canonical (RAS) voxel order, plus what was noticed on the way."""

    labels: np.ndarray  # post-processed, uint8, the scan's canonical shape
    # [x, y, z, 3] on the box whose first voxels are the run's grid (`grid`), on the engine's
    # devices (ONNX: a host array); None for an ensemble or a region's window
    grid_probabilities: Any
    probabilities: np.ndarray | None  # [..., 3] float32 on the scan's voxels, when asked for
    warnings: list[str] = field(default_factory=list)
    seconds: Seconds = field(default_factory=dict)  # this scan's own phases
    # Where the scan or its liver lie far outside the run's training data (`ctseg.run.fingerprint`).
    checks: list[str] = field(default_factory=list)
    # The region predicted at full resolution and where it came from (`Predictor.locate`);
    # None: the whole scan was predicted as asked.
    located: dict[str, Any] | None = None
    grid: Shape | None = None  # the run's grid of the scan, the first voxels of the box
    # The model's uncertainty, measured on the scan's voxels (a region's: those it predicts
    # exactly) by the way back (`ctseg.inference.scan.way_back`); None where not measured.
    uncertainty: Uncertainty | None = None

    @property
    def grid_labels(self) -> np.ndarray | None:
        """The raw argmax on the run's grid, uint8 (for grid-level Dice), fetched when asked;
        None for an ensemble (its members' grids differ)."""
        if self.grid_probabilities is None:
            return None
        return way_back.ON_DEVICES.grid_labels(self.grid_probabilities, self.grid)


@contextlib.contextmanager
def timed(seconds: Seconds, phase: str) -> Iterator[None]:
    """Add the time the block takes to `seconds[phase]`."""
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - start


def _plausible(shape: Shape, spacing: Sequence[float]) -> bool:
    """Whether a scan of `shape` voxels of `spacing` mm may be a CT (`readers.check_extent`)."""
    try:
        check_extent(Path("scan"), shape, spacing)
    except CtsegError:
        return False
    return True


def _fallback_warning(located: dict | None) -> list[str]:
    if located is None or located["fallback"] is None:
        return []
    return [f"{located['fallback']}: predicted the whole scan ({located['source']})"]


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
        backend: Backend,
        options: InferenceOptions | None = None,
        run_dirs: Sequence[Path | None] | None = None,
    ):
        """`backend`: where the network runs, chosen once by whoever started JAX
        (`ctseg.inference.network.choice`); `options`: tile (a `TileRequest`, or its int)
        and TTA (None: each run's config)."""
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
                raise OptionError(
                    f"test-time augmentation mirrors the scan, but {which} trained without "
                    "flips (train.flip = false) and has never seen mirrored anatomy; leave "
                    "out `tta`"
                )
        self.clock = compile_clock()
        self.backend = backend  # a locator runs on it too
        asked = None if options.tile is None else TileRequest.of(options.tile)
        self.members = [
            Member(
                model,
                asked or TileRequest.from_int(model.config.predict.tile, "predict.tile"),
                backend,
                run_dir,
            )
            for model, run_dir in zip(models, run_dirs, strict=True)
        ]
        # One-off costs of the whole call (loading, compiling ahead), filled in by `from_run`.
        self.seconds: Seconds = {}
        # The (first) run's training data, for `to_scan`'s checks (None: nothing checked),
        # and what its predictions are judged against (`judge`), read once.
        first = run_dirs[0]
        self.fingerprint = None if first is None else fingerprint.load(first)
        self.reference = scores.Reference.of_run(first, ensemble=len(models) > 1)
        # Full resolution only where the liver is: a coarse run's prediction, or a mask.
        self.locator: Predictor | None = None
        self.roi: Path | None = None
        self.margin_mm = DEFAULT_MARGIN_MM

    @classmethod
    def from_run(
        cls,
        run_dirs: Path | Sequence[Path],
        backend: Backend,
        options: InferenceOptions | None = None,
        configs: Config | Sequence[Config] | None = None,
    ) -> Predictor:
        """The runs' models on `backend` (chosen once where JAX started), whatever layout
        trained them: one run, or several (an ensemble). `options`: the checkpoint, tile
        and TTA; `configs`: the runs' config.toml if already read."""
        options = options or InferenceOptions()
        run_dirs = [Path(run_dirs)] if isinstance(run_dirs, str | Path) else list(run_dirs)
        if isinstance(configs, Config):
            configs = [configs]
        configs = list(configs or [None] * len(run_dirs))
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
            predictor = cls(models, backend, options, run_dirs)
        predictor.seconds = seconds
        return predictor

    def predict_region(
        self,
        locate: Path | None = None,
        roi: Path | None = None,
        margin_mm: float = DEFAULT_MARGIN_MM,
        options: InferenceOptions | None = None,
    ) -> None:
        """From now on, predict at full resolution only where the liver is: the box of the
        liver that `locate`'s run (a coarse model) predicts, or of the `roi` mask (a folder:
        each scan's, `roi_mask`), grown by `margin_mm`; inside it the labels equal the
        whole scan's, outside it is background.
        `options`: the locator's checkpoint; it runs on this predictor's backend."""
        if locate is not None and roi is not None:
            raise OptionError("give `locate` or `roi`, not both")
        if margin_mm < 0:
            raise OptionError(f"`margin_mm` must not be negative, got {margin_mm:g} mm")
        if roi is not None and not Path(roi).exists():
            raise OptionError(f"`roi` {roi}: no such mask file or folder")
        self.margin_mm = float(margin_mm)
        self.roi = None if roi is None else Path(roi)
        if locate is not None:
            options = dataclasses.replace(options or InferenceOptions(), tile=None, tta=False)
            self.locator = Predictor.from_run(Path(locate), self.backend, options)

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
        backend = self.backend
        where = dev.describe(backend.devices)  # none under ONNX Runtime: the host's CPU
        # Materialised activations: the compute dtype under JAX, float32 in ONNX Runtime.
        dtype = backend.dtype(self.config).name
        mirrored = ", mirrored 8× (TTA)" if self.tta else ""
        if len(self.members) == 1:
            plan = self.members[0].plan
        else:
            members = "; ".join(f"{m.name}: {m.plan}" for m in self.members)
            plan = f"ensemble of {len(self.members)}: {members}"
        return f"{where}, {backend.runtime}, {dtype}, {plan}{mirrored}"

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
        return engine.plan_line

    def to_grid(self, scan: Scan, seconds: Seconds) -> list[OnGrid]:
        """The scan on each member's grid, HU-windowed: exactly its training preprocessing;
        with a locator or a region mask, only the box of each grid the region needs."""
        region, located = self.locate(scan, seconds)
        with self._canvases_kept_on_failure():
            scan_box = self.backend.boxes.scan_box(scan.array.shape)
            with timed(seconds, "resample"):
                on_grids = [member.to_grid(scan, region, scan_box) for member in self.members]
        return [dataclasses.replace(g, located=located) for g in on_grids]

    @contextlib.contextmanager
    def _canvases_kept_on_failure(self) -> Iterator[None]:
        """The canvases as they were, where the block fails: a scan too large for the
        devices fails alone, and does not leave the canvas it grew for every scan after it."""
        canvases = [self.backend.boxes.scan_canvas, *(m.boxes.canvas for m in self.members)]
        canvases = [canvas for canvas in canvases if canvas is not None]
        before = [canvas.shape for canvas in canvases]
        try:
            yield
        except BaseException:
            for canvas, shape in zip(canvases, before, strict=True):
                canvas.restore(shape)
            raise

    def expect(self, geometries: Iterable[tuple[Shape, Sequence[float]]]) -> None:
        """Size the canvases, where the backend has them (`ctseg.inference.scan.canvas`), for
        scans of these canonical shapes and spacings before they come: a batch then
        compiles nothing after its first scan's programs. A locator predicts the same
        scans: its canvases too. Without canvases, `geometries` is never iterated (no
        header read for nothing). A geometry no CT has (`readers.check_extent`) is left out:
        its scan fails when read."""
        boxes = self.backend.boxes  # the locator's too: it runs on this backend
        if boxes.scan_canvas is None:
            return
        members = [*self.members, *(self.locator.members if self.locator else [])]
        for shape, spacing in geometries:
            if _plausible(shape, spacing):
                boxes.scan_box(shape)
                for member in members:
                    member.expect(shape, spacing)

    def locate(self, scan: Scan, seconds: Seconds) -> tuple[Region | None, dict | None]:
        """The region to predict at full resolution, and its record: the liver's box of the
        locator's prediction or of the region mask, grown by the margin; None (the whole
        scan, with the reason in the record) where it finds no liver or a cut one."""
        if self.locator is None and self.roi is None:
            return None, None
        with timed(seconds, "locate"):
            if self.roi is not None:
                path = roi_mask(self.roi, scan.source)
                mask, source = read_roi(path, scan), f"mask {path}"
            else:
                mask = self.locator.predict(scan).labels
                source = f"locator {self.locator.members[0].name}"
            region, fallback = region_of(mask, scan.spacing, self.margin_mm, self.roi is None)
        located = {
            "source": source,
            "margin_mm": self.margin_mm,
            "region": None if region is None else region.to_json(),
            "fallback": fallback,
        }
        return region, located

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
            began = time.perf_counter()
            own: Seconds = {}
            with timed(own, "infer"):
                probabilities.append(member.infer(on_grid, self.tta, tiles, warnings))
            compiling = self.clock.seconds_since(began)
            seconds["infer"] = seconds.get("infer", 0.0) + own["infer"] - compiling
            seconds["compile"] = seconds.get("compile", 0.0) + compiling
            if len(self.members) > 1:
                seconds[f"infer.{index}"] = own["infer"] - compiling
        return probabilities

    def to_scan(
        self,
        scan: Scan,
        probabilities: Sequence[Any],
        on_grids: Sequence[OnGrid],
        seconds: Seconds,
        with_probabilities: bool = False,
    ) -> Prediction:
        """The members' box probabilities → post-processed labels on the scan's own canonical
        voxels (averaged there for an ensemble)."""
        options = self.config.predict
        with timed(seconds, "resample"):
            # Where the backend runs: from the devices only the labels, the uncertainty's
            # sums (and asked-for probabilities) come back.
            shape, space = scan.array.shape, self.backend.boxes.space
            scan_box = on_grids[0].scan_box
            if on_grids[0].window is not None:
                on_scan = space.window_labels(probabilities, on_grids, shape, with_probabilities)
            elif len(probabilities) == 1:
                on_scan = space.scan_labels(
                    probabilities[0], shape, with_probabilities, on_grids[0].grid, scan_box
                )
            else:
                grids_of = [g.grid for g in on_grids]
                on_scan = space.mean_scan_labels(
                    probabilities, shape, with_probabilities, grids_of, scan_box
                )
        with timed(seconds, "postprocess"):
            labels = postprocess.clean_labels(
                on_scan.labels, options.keep_largest_liver, options.tumour_inside_liver
            )
            checks = scan_checks.checks(self.fingerprint, scan, labels)
        # On the grid: a lone run's whole one (training validates there); an ensemble has none.
        whole = len(probabilities) == 1 and on_grids[0].window is None
        return Prediction(
            labels=labels,
            grid_probabilities=probabilities[0] if whole else None,
            grid=on_grids[0].grid if whole else None,
            probabilities=on_scan.probabilities,
            warnings=scan_checks.hu_warnings(scan.array)
            + scan_checks.geometry_warnings(scan)
            + _fallback_warning(on_grids[0].located),
            seconds=seconds,
            checks=checks,
            located=on_grids[0].located,
            uncertainty=on_scan.uncertainty,
        )

    def judge(self, prediction: Prediction, scan: Scan) -> scores.Quality:
        """Whether to trust `prediction` of `scan`: its quality under the (first) run's
        reference and thresholds (`ctseg.inference.quality.scores`)."""
        return scores.of_prediction(prediction, scan, self.reference)

    def predict(
        self,
        scan: Scan,
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
