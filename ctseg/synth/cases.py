"""What each synthetic case is drawn to be: its kind of scan (liver-only, abdominal,
chest-abdomen-pelvis), its geometry (field of view, slices, stored orientation), its
patient (body size, liver volume and height) and its contrast phase, deterministic in
(seed, case index)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Stored raw = HU + 1024 with scl_inter = -1024, as CT scanners do.
RAW_INTERCEPT = -1024.0
RAW_MAX = 3071  # the usual 12-bit CT range ends at +3071 HU

LIVER_ONLY, ABDOMINAL, CHEST_ABDOMEN_PELVIS = "liver-only", "abdominal", "chest-abdomen-pelvis"
KINDS = (LIVER_ONLY, ABDOMINAL, CHEST_ABDOMEN_PELVIS)
KIND_SHARES = (0.3, 0.4, 0.3)  # how often each kind is drawn
# Cranio-caudal extent of each kind of scan, mm (a liver-only scan is the liver's
# height plus -10…60 mm, within this range).
Z_EXTENT_MM = {
    LIVER_ONLY: (160.0, 260.0),
    ABDOMINAL: (300.0, 450.0),
    CHEST_ABDOMEN_PELVIS: (600.0, 900.0),
}
# `extent_group`: below the first bound liver-only, below the second abdominal, else CAP.
EXTENT_GROUP_BOUNDS_MM = (280.0, 550.0)
FOV_MM = (290.0, 500.0)  # in-plane field of view (LiTS: 512 pixels of 0.56–1.0 mm)
SLICE_MM = (0.7, 5.0)  # slice thickness, drawn log-uniform
MAX_SLICES_PER_SIZE = 2.5  # a scan has at most 2.5 × size slices
BODY_HALF_WIDTH_MM, BODY_HALF_DEPTH_MM = (140.0, 190.0), (100.0, 140.0)
LIVER_ML = (1300.0, 2100.0)  # the whole liver, tumours included
LIVER_HEIGHT_MM = (145.0, 205.0)  # nominal cranio-caudal height
LIVER_CUT_MM = 10.0  # a liver-only scan may cut this much off the liver's top or bottom
LARGE_TUMOUR_MM, SMALL_TUMOUR_MM = (15.0, 60.0), (3.0, 10.0)  # diameters


@dataclass(frozen=True)
class Phase:
    """A contrast phase: what the enhancing tissues measure in it, HU (typical CT values
    of abdominal imaging; the tumours are hypovascular metastases, darker than the liver
    in every phase, as most of LiTS's are)."""

    name: str
    share: float  # of an archive's scans (LiTS is mostly portal venous)
    liver: tuple[float, float]  # the parenchyma's mean, drawn per case
    tumour: tuple[float, float]  # drawn per tumour
    spleen: float
    kidney: float
    aorta: float
    heart: float  # its blood pool


# Every case's phase unless phases are drawn: the demo's data, one phase (unenhanced). Its
# livers reach down to 40 HU: unenhanced livers measure 40–70 HU (TotalSegmentator's
# example, scripts/realct/, 45 HU); drawn from 55 HU up, the demo's model found no liver
# at 45 HU and Dice 0.82 with the real CT's liver moved to 60 (docs/experiments/realct.md).
ONE_PHASE = Phase("one phase", 1.0, (40.0, 70.0), (10.0, 30.0), 45.0, 30.0, 45.0, 45.0)
# Drawn with `phases`: as archives hold them.
PHASES = (
    Phase("unenhanced", 0.15, (50.0, 65.0), (10.0, 30.0), 45.0, 30.0, 45.0, 45.0),
    Phase("arterial", 0.15, (65.0, 85.0), (25.0, 45.0), 95.0, 150.0, 250.0, 200.0),
    Phase("portal venous", 0.55, (100.0, 135.0), (45.0, 80.0), 120.0, 160.0, 160.0, 150.0),
    Phase("delayed", 0.15, (80.0, 100.0), (35.0, 60.0), 95.0, 130.0, 110.0, 110.0),
)


def extent_group(z_extent_mm: float) -> str:
    """The kind of scan a cranio-caudal extent suggests (synthetic or real):
    ``liver-only`` below 280 mm, ``abdominal`` below 550 mm, else ``chest-abdomen-pelvis``."""
    low, high = EXTENT_GROUP_BOUNDS_MM
    if z_extent_mm < low:
        return LIVER_ONLY
    return ABDOMINAL if z_extent_mm < high else CHEST_ABDOMEN_PELVIS


def max_slices(size: int) -> int:
    """The most slices a scan of `size`×`size` pixels gets (thin slices over a long scan
    are made thicker to stay within it)."""
    return math.floor(MAX_SLICES_PER_SIZE * size)


@dataclass(frozen=True)
class Geometry:
    shape: tuple[int, int, int]  # canonical (RAS) voxel counts
    spacing: tuple[float, float, float]  # mm
    stored_as: str  # "RAS" or "LPS": the voxel order written to disk


@dataclass(frozen=True)
class Patient:
    """The body plan, mm."""

    half_width: float  # of the trunk, x
    half_depth: float  # y
    fat: float  # subcutaneous fat
    wall: float  # muscle and ribs inside the fat
    liver_height: float  # nominal, cranio-caudal
    liver_ml: float  # the whole liver (a liver-only scan may cut a little off)


@dataclass(frozen=True)
class Case:
    """What one scan covers: the patient, the grid and where the grid lies on the patient."""

    kind: str
    geometry: Geometry
    patient: Patient
    z_top: float  # patient z (liver top = 0) of the scan's upper edge, mm
    centre: tuple[float, float]  # the body's centre in the field of view (x, y), mm
    phase: Phase = ONE_PHASE


def uniform(rng: np.random.Generator, bounds: tuple[float, float]) -> float:
    return float(rng.uniform(*bounds))


def _random_patient(rng: np.random.Generator) -> Patient:
    """A body and a liver that fits in it: larger patients have more fat and larger
    livers, and a large liver in a slim body is a tall one."""
    build = float(rng.uniform(0, 1))
    width, depth = np.clip(build + rng.normal(0, 0.15, 2), 0, 1)
    half_width = float(BODY_HALF_WIDTH_MM[0] + np.ptp(BODY_HALF_WIDTH_MM) * width)
    half_depth = float(BODY_HALF_DEPTH_MM[0] + np.ptp(BODY_HALF_DEPTH_MM) * depth)
    fat = float(rng.uniform(8.0, 12.0) + 18.0 * build * rng.uniform(0.3, 1.0))
    wall = uniform(rng, (10.0, 16.0))
    volume = float(LIVER_ML[0] + np.ptp(LIVER_ML) * (0.7 * build + 0.3 * rng.uniform(0, 1)))
    # The liver takes at most about 0.7 of the box of the body's cavity over its height
    # (more and it would fill the abdomen from wall to wall).
    cavity = (half_width - fat - wall) * (half_depth - fat - wall) / 1000.0  # mL per mm
    height = min(max(uniform(rng, LIVER_HEIGHT_MM), volume / (0.7 * cavity)), LIVER_HEIGHT_MM[1])
    return Patient(
        half_width=half_width,
        half_depth=half_depth,
        fat=fat,
        wall=wall,
        liver_height=height,
        liver_ml=max(min(volume, 0.75 * cavity * height), LIVER_ML[0]),
    )


def random_case(rng: np.random.Generator, size: int, index: int, phases: bool = False) -> Case:
    """Draw the kind of scan, the patient, the field of view, the slices, the liver's height
    and, with `phases`, the contrast phase (else `ONE_PHASE`)."""
    phase = ONE_PHASE
    if phases:
        # From a stream of its own (spawning does not advance `rng`): every other draw of
        # the case is the one without phases.
        own = rng.spawn(1)[0]
        phase = PHASES[int(own.choice(len(PHASES), p=[p.share for p in PHASES]))]
    kind = KINDS[int(rng.choice(len(KINDS), p=KIND_SHARES))]
    patient = _random_patient(rng)
    height = patient.liver_height
    if kind == LIVER_ONLY:
        # Planned on the liver: its height plus a margin, the liver about centred.
        extent = float(np.clip(height + rng.uniform(-LIVER_CUT_MM, 60.0), *Z_EXTENT_MM[kind]))
        spare = extent - height  # ≥ -10 mm
        # At most LIVER_CUT_MM off its top (z_top < 0) or its bottom.
        z_top = float(rng.uniform(-LIVER_CUT_MM, spare + LIVER_CUT_MM))
    elif kind == ABDOMINAL:
        extent = uniform(rng, Z_EXTENT_MM[kind])
        z_top = float(rng.uniform(10.0, 60.0))  # from 10–60 mm above the liver
    else:
        extent = uniform(rng, Z_EXTENT_MM[kind])
        z_top = float(rng.uniform(0.26, 0.40)) * extent  # the chest above the liver
    fov = float(np.clip(2 * patient.half_width + rng.uniform(10.0, 120.0), *FOV_MM))
    thickness = float(np.exp(rng.uniform(*np.log(SLICE_MM))))
    slices = int(np.clip(round(extent / thickness), 1, max_slices(size)))
    # Off the scanner's axis by up to 15 mm sideways and, lying on the table, a little
    # lower (posterior) more often than higher; the body stays in the field of view.
    room = np.array([fov / 2 - patient.half_width, fov / 2 - patient.half_depth])
    shift = rng.uniform(-1, 1, size=2) * [15.0, 20.0] - [0.0, 10.0]
    centre = np.clip(shift, -room, room)
    return Case(
        kind=kind,
        geometry=Geometry(
            shape=(size, size, slices),
            spacing=(fov / size, fov / size, extent / slices),
            stored_as="LPS" if index % 2 == 0 else "RAS",
        ),
        patient=patient,
        z_top=z_top,
        centre=(float(centre[0]), float(centre[1])),
        phase=phase,
    )
