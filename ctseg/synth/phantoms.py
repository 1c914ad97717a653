"""A synthetic LiTS-like data set: CT phantoms at physical scale, with a liver and tumours.

Each case is written as LiTS names it, ``volume-N.nii.gz`` (int16 with
scl_slope 1 / scl_inter -1024, as scanners store CT) and ``segmentation-N.nii.gz``
(uint8: 0 background, 1 liver, 2 tumour), and described in ``synth.json``.

The anatomy is drawn in millimetres in a patient frame: x towards the patient's
right, y anterior, z superior, with z = 0 at the top of the liver (the right
dome of the diaphragm). The voxel grid is canonical RAS order (array axis 0
increases towards the patient's right, axis 1 anterior, axis 2 superior), so the
liver lies at high x. Organs keep their size whatever the field of view, the
matrix or the slice thickness:

- body 280–380 mm wide and 200–280 mm deep with an 8–30 mm fat layer, a muscle
  wall with ribs (down to the costal margin) and a sternum; the spine runs the
  whole length of chest, abdomen and pelvis (vertebrae and discs, canal,
  posterior elements); the aorta in front of it;
- above the diaphragm (z > 0): lungs (about -850 HU) inside the ribcage, the
  heart on the left dome, the trachea;
- below it: the liver (1.3–2.1 L in all, 145–205 mm tall, on the right, its left
  lobe crossing the midline), stomach, spleen, kidneys in their fat (soft-tissue
  look-alikes touching the liver), some bowel gas;
- further down: pelvic bone (iliac wings, sacrum, hips, pubis), the bladder and,
  below the pelvis, the thighs with their femurs.

Tumours are sized in millimetres and clipped to the liver: most cases have 1–3
sizeable ones (15–60 mm across), and 0–3 small ones (3–10 mm, at least one
voxel: they reward a finer grid).

Every case is one of three kinds of scan, drawn per case (30 % liver-only, 40 %
abdominal, 30 % chest-abdomen-pelvis), each with the z-extent of its kind
(`Z_EXTENT_MM`) and the liver at a height that kind puts it: centred (± a
shift that may cut about 10 mm off the liver's top or bottom) in a liver-only
scan, near the top of an abdominal one, in the middle third of a CAP one. The
in-plane field of view is 290–500 mm (the body plus a margin), always over
`size`×`size` pixels; slices are 0.7–5 mm thick (log-uniform), but a scan has at
most `MAX_SLICES_PER_SIZE` × `size` of them: where thin slices over a long scan
would need more, the slices are made thicker (the anatomy is never cut). The
stored orientation alternates per case (LPS for even N, RAS for odd), so a reader
that ignores the affine gets the anatomy mirrored. Everything is deterministic in
(seed, case index).

`extent_group` sorts any scan (a real one, without synth.json, too) into the
three kinds by its z-extent alone.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import numpy as np
from scipy import ndimage

from ctseg.atomic import atomic_path, claim_folder, is_json_with, write_json, write_text

HU_AIR, HU_LUNG, HU_FAT, HU_WATER, HU_SOFT_TISSUE = -1000.0, -850.0, -100.0, 10.0, 40.0
HU_BONE, HU_DISC, HU_SPINAL_CANAL, HU_MARROW = 700.0, 100.0, 20.0, 80.0
HU_KIDNEY, HU_SPLEEN, HU_HEART, HU_AORTA, HU_BOWEL_GAS = 30.0, 50.0, 45.0, 50.0, -950.0
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

MARKER = ".ctseg-synth"  # written first into the output folder: synth's own folder
SIDECAR = "synth.json"  # what was drawn for each case

Progress = Callable[[int, int, str], None]


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


@dataclass(frozen=True)
class Phantom:
    hu: np.ndarray  # float32 Hounsfield units, canonical order
    labels: np.ndarray  # uint8, canonical order
    tumours: int  # tumours with at least one voxel in the scan


def _uniform(rng: np.random.Generator, bounds: tuple[float, float]) -> float:
    return float(rng.uniform(*bounds))


def _random_patient(rng: np.random.Generator) -> Patient:
    """A body and a liver that fits in it: larger patients have more fat and larger
    livers, and a large liver in a slim body is a tall one."""
    build = float(rng.uniform(0, 1))
    width, depth = np.clip(build + rng.normal(0, 0.15, 2), 0, 1)
    half_width = float(BODY_HALF_WIDTH_MM[0] + np.ptp(BODY_HALF_WIDTH_MM) * width)
    half_depth = float(BODY_HALF_DEPTH_MM[0] + np.ptp(BODY_HALF_DEPTH_MM) * depth)
    fat = float(rng.uniform(8.0, 12.0) + 18.0 * build * rng.uniform(0.3, 1.0))
    wall = _uniform(rng, (10.0, 16.0))
    volume = float(LIVER_ML[0] + np.ptp(LIVER_ML) * (0.7 * build + 0.3 * rng.uniform(0, 1)))
    # The liver takes at most about 0.7 of the box of the body's cavity over its height
    # (more and it would fill the abdomen from wall to wall).
    cavity = (half_width - fat - wall) * (half_depth - fat - wall) / 1000.0  # mL per mm
    height = min(max(_uniform(rng, LIVER_HEIGHT_MM), volume / (0.7 * cavity)), LIVER_HEIGHT_MM[1])
    return Patient(
        half_width=half_width,
        half_depth=half_depth,
        fat=fat,
        wall=wall,
        liver_height=height,
        liver_ml=max(min(volume, 0.75 * cavity * height), LIVER_ML[0]),
    )


def random_case(rng: np.random.Generator, size: int, index: int) -> Case:
    """Draw the kind of scan, the patient, the field of view, the slices and the liver's height."""
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
        extent = _uniform(rng, Z_EXTENT_MM[kind])
        z_top = float(rng.uniform(10.0, 60.0))  # from 10–60 mm above the liver
    else:
        extent = _uniform(rng, Z_EXTENT_MM[kind])
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
    )


class _Grid:
    """Voxel-centre coordinates of a case in the patient frame (mm), float32.

    A *slab* (k0, k1) is a run of slices on the scan's spacing; it may reach beyond
    the scan, so that the liver can be drawn whole and cut where the scan ends.
    """

    def __init__(self, case: Case):
        (nx, ny, nz), (dx, dy, dz) = case.geometry.shape, case.geometry.spacing
        self.shape, self.spacing = (nx, ny, nz), (dx, dy, dz)
        self.x = ((np.arange(nx) + 0.5 - nx / 2) * dx - case.centre[0]).astype(np.float32)
        self.y = ((np.arange(ny) + 0.5 - ny / 2) * dy - case.centre[1]).astype(np.float32)
        self.z_bottom = case.z_top - nz * dz
        self.z = self.z_at(0, nz)

    def z_at(self, k0: int, k1: int) -> np.ndarray:
        return (self.z_bottom + (np.arange(k0, k1) + 0.5) * self.spacing[2]).astype(np.float32)

    def k_range(self, z_lo: float, z_hi: float, clip: bool = True) -> tuple[int, int]:
        """Slices whose centres lie in [z_lo, z_hi] (beyond the scan too unless `clip`)."""
        dz, span = self.spacing[2], (self.shape[2] + 1) * self.spacing[2]
        z_lo, z_hi = max(z_lo, self.z_bottom - span), min(z_hi, self.z_bottom + 2 * span)
        k0 = math.ceil((z_lo - self.z_bottom) / dz - 0.5)
        k1 = math.floor((z_hi - self.z_bottom) / dz - 0.5) + 1
        if clip:
            k0, k1 = max(k0, 0), min(k1, self.shape[2])
        return k0, max(k0, k1)

    def box(
        self, lo: tuple, hi: tuple, slab: tuple[int, int] | None = None
    ) -> tuple[tuple[slice, ...], tuple[np.ndarray, ...]] | None:
        """The voxels of `slab` (the scan by default) whose centres lie in the box [lo, hi]
        (mm): slices relative to the slab and their coordinates, shaped to broadcast;
        None if there are none."""
        k0, k1 = slab or (0, self.shape[2])
        i = np.searchsorted(self.x, [lo[0], hi[0]])
        j = np.searchsorted(self.y, [lo[1], hi[1]])
        ka, kb = self.k_range(lo[2], hi[2], clip=False)
        ka, kb = max(ka, k0), min(kb, k1)
        if i[1] <= i[0] or j[1] <= j[0] or kb <= ka:
            return None
        box = (slice(*i), slice(*j), slice(ka - k0, kb - k0))
        return box, (self.x[box[0], None, None], self.y[None, box[1], None], self.z_at(ka, kb))


def _smooth_noise(
    rng: np.random.Generator, x: np.ndarray, y: np.ndarray, z: np.ndarray, wavelength: float
) -> np.ndarray:
    """A smooth random field of standard deviation about 0.5 on the grid x × y × z (1-D, mm):
    a sum of plane waves of random direction and about this wavelength.

    Each wave cos(k·r + φ) is the real part of a product of one factor per axis, so
    the sum over waves is one matrix product (inner size 12), not a pass over the volume
    per wave.
    """
    terms = 6
    k = rng.normal(size=(terms, 3))
    k *= (2 * np.pi / wavelength * rng.uniform(0.7, 1.4, terms) / np.linalg.norm(k, axis=1))[
        :, None
    ]
    phase = rng.uniform(0, 2 * np.pi, terms)
    ex = np.exp(1j * (np.outer(x, k[:, 0]) + phase))
    ey = np.exp(1j * np.outer(y, k[:, 1]))
    ez = np.exp(1j * np.outer(z, k[:, 2])) * (0.5 / np.sqrt(terms / 2))
    exy = (ex[:, None, :] * ey[None, :, :]).reshape(len(x) * len(y), terms)
    left = np.concatenate([exy.real, -exy.imag], axis=1).astype(np.float32)
    right = np.ascontiguousarray(np.concatenate([ez.real, ez.imag], axis=1).T, np.float32)
    # einsum's own loop, not BLAS: OpenBLAS's threads would spin on after each small product.
    return np.einsum("ik,kj->ij", left, right).reshape(len(x), len(y), len(z))


def _ellipsoid(coords: tuple, centre: tuple, radii: tuple) -> np.ndarray:
    """Squared normalised radius; < 1 inside the ellipsoid."""
    return sum(
        ((c - np.float32(c0)) / np.float32(r)) ** 2
        for c, c0, r in zip(coords, centre, radii, strict=True)
    )


def _superellipse(x: np.ndarray, y: np.ndarray, a: float, b: float, p: float = 2.5) -> np.ndarray:
    """Normalised radius of a rounded-rectangle cross-section: < 1 inside."""
    return ((np.abs(x) / a) ** p + (np.abs(y) / b) ** p) ** (1 / p)


def _set(hu: np.ndarray, mask: np.ndarray, ks: np.ndarray | slice, value: float) -> None:
    """Set `value` where the 2-D `mask` lies on slices `ks` (a slice or slice numbers)."""
    ii, jj = np.nonzero(mask)
    ks = np.arange(hu.shape[2])[ks] if isinstance(ks, slice) else ks
    if len(ii) and len(ks):
        hu[ii[:, None], jj[:, None], ks[None, :]] = value


@dataclass(frozen=True)
class _Plan:
    """Per-case anatomy: 2-D maps over the slice and landmark heights (mm)."""

    grid: _Grid
    X: np.ndarray  # (nx, 1) x
    Y: np.ndarray  # (1, ny) y
    a_cav: float  # half-width of the body's cavity (inside fat and muscle wall)
    b_cav: float  # its half-depth
    inner: np.ndarray  # (nx, ny) normalised radius inside the fat (< 1 inside)
    cavity: np.ndarray  # (nx, ny) bool: inside the muscle wall, less spine and aorta
    dome: np.ndarray  # (nx, ny) z of the diaphragm's upper surface
    spine_y: float  # centre of the vertebral bodies
    vertebra_r: float
    apex: float  # lung apex
    crest: float  # iliac crest
    hip: float  # centre of the femoral heads
    thigh: float  # below this the legs are apart


def _plan(rng: np.random.Generator, case: Case) -> _Plan:
    grid, p = _Grid(case), case.patient
    X, Y = grid.x[:, None], grid.y[None, :]
    a_in, b_in = p.half_width - p.fat, p.half_depth - p.fat
    a_cav, b_cav = a_in - p.wall, b_in - p.wall
    spine_y = -p.half_depth + p.fat + float(rng.uniform(50.0, 65.0))
    vertebra_r = float(rng.uniform(17.0, 22.0))
    # Spine and aorta (and the muscles behind): no organ reaches there.
    column = ((X + 5.0) / 50.0) ** 2 + ((Y - spine_y - 5.0) / (vertebra_r + 35.0)) ** 2 < 1
    column |= (np.abs(X) < 35.0) & (Y < spine_y)
    # The diaphragm: a dome over each side, the right one (over the liver) higher; it
    # dips at the sides and most at the back (the lungs' recesses behind the liver).
    left_top = -float(rng.uniform(10.0, 25.0))
    dome = np.maximum(
        3.0 - 120.0 * ((X - 0.45 * a_cav) / a_cav) ** 2 - 60.0 * (Y / b_cav) ** 2,
        left_top - 120.0 * ((X + 0.45 * a_cav) / a_cav) ** 2 - 60.0 * (Y / b_cav) ** 2,
    )
    crest = -p.liver_height - float(rng.uniform(40.0, 80.0))
    hip = crest - float(rng.uniform(110.0, 140.0))
    return _Plan(
        grid=grid,
        X=X,
        Y=Y,
        a_cav=a_cav,
        b_cav=b_cav,
        inner=_superellipse(X, Y, a_in, b_in),
        cavity=(_superellipse(X, Y, a_cav, b_cav) < 1) & ~column,
        dome=dome.astype(np.float32),
        spine_y=spine_y,
        vertebra_r=vertebra_r,
        apex=float(rng.uniform(200.0, 250.0)),
        crest=crest,
        hip=hip,
        thigh=hip - float(rng.uniform(60.0, 80.0)),
    )


@dataclass(frozen=True)
class _Organ:
    centre: tuple[float, float, float]
    radii: tuple[float, float, float]
    hu: float
    keeps_liver_out: bool = True  # the liver grows around it, not over it
    air_in_front_of: float | None = None  # y above which it holds air (a supine stomach)


def _organ_mask(
    plan: _Plan, organ: _Organ, slab: tuple[int, int] | None = None
) -> tuple[tuple[slice, ...], np.ndarray] | None:
    """Where an organ (an ellipsoid in the cavity, below the diaphragm) lies on `slab`."""
    found = plan.grid.box(
        [c - r for c, r in zip(organ.centre, organ.radii, strict=True)],
        [c + r for c, r in zip(organ.centre, organ.radii, strict=True)],
        slab,
    )
    if found is None:
        return None
    box, coords = found
    inside = (_ellipsoid(coords, organ.centre, organ.radii) < 1) & plan.cavity[box[:2]][:, :, None]
    inside &= coords[2] < plan.dome[box[:2]][:, :, None] - 4.0
    return box, inside


def _abdominal_organs(rng: np.random.Generator, case: Case, plan: _Plan) -> list[_Organ]:
    """Bowel gas, stomach, spleen, kidneys in their fat and the bladder: what the liver
    touches (and the model must tell from it)."""
    a_cav, b_cav = plan.a_cav, plan.b_cav

    def jitter(radii: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(float(r * rng.uniform(0.85, 1.15)) for r in radii)

    # Bowel gas first: the organs it lies against cover it.
    organs: list[_Organ] = []
    for _ in range(rng.integers(2, 6)):
        centre = (
            rng.uniform(-0.6, 0.6) * a_cav,
            rng.uniform(-0.1, 0.7) * b_cav,
            rng.uniform(plan.crest - 40.0, -0.6 * case.patient.liver_height),
        )
        radii = tuple(float(r) for r in rng.uniform(8.0, 25.0, 3))
        organs.append(_Organ(centre, radii, HU_BOWEL_GAS, keeps_liver_out=False))
    # The stomach under the left dome: fluid, with air in front (the patient lies supine).
    centre = (-0.42 * a_cav, 0.15 * b_cav, -60.0 + rng.uniform(-10, 10))
    radii = jitter((45.0, 42.0, 55.0))
    organs.append(_Organ(centre, radii, HU_WATER, air_in_front_of=centre[1] + 0.4 * radii[1]))
    spleen = (-a_cav + 40.0, -0.4 * b_cav, -70.0 + rng.uniform(-15, 15))
    organs.append(_Organ(spleen, jitter((32.0, 50.0, 55.0)), HU_SPLEEN + rng.normal(0, 3)))
    for side, top in ((1, -105.0), (-1, -90.0)):  # the right kidney lies lower
        centre = (
            side * rng.uniform(65.0, 80.0),
            plan.spine_y + rng.uniform(0.0, 15.0),
            top - 55.0 + rng.uniform(-15, 15),
        )
        radii = jitter((27.0, 22.0, 55.0))
        organs.append(_Organ(centre, tuple(r + 8.0 for r in radii), HU_FAT))
        organs.append(_Organ(centre, radii, HU_KIDNEY + rng.normal(0, 3)))
    bladder = (0.0, 0.35 * b_cav, plan.hip + 10.0)
    organs.append(_Organ(bladder, jitter((45.0, 35.0, 40.0)), HU_WATER, keeps_liver_out=False))
    return organs


def _paint_organs(hu: np.ndarray, plan: _Plan, organs: list[_Organ]) -> None:
    for organ in organs:
        found = _organ_mask(plan, organ)
        if found is None:
            continue
        box, inside = found
        value = np.float32(organ.hu)
        if organ.air_in_front_of is not None:
            y = plan.grid.y[box[1]][None, :, None]
            value = np.where(y > organ.air_in_front_of, HU_AIR + 50, value)
            value = np.broadcast_to(value, inside.shape)[inside]
        hu[box][inside] = value


def _paint_body(hu: np.ndarray, case: Case, plan: _Plan) -> None:
    """Air, the fat layer and soft tissue over the trunk; below the pelvis two thighs."""
    p, X, Y = case.patient, plan.X, plan.Y
    trunk = np.where(_superellipse(X, Y, p.half_width, p.half_depth) < 1, HU_FAT, HU_AIR)
    trunk = np.where(plan.inner < 1, HU_SOFT_TISSUE, trunk).astype(np.float32)
    hu[...] = trunk[:, :, None]
    k_thigh = plan.grid.k_range(-np.inf, plan.thigh)[1]
    if k_thigh:
        radius = 0.48 * p.half_width
        legs = np.full_like(trunk, HU_AIR)
        for side in (-1, 1):
            r = np.hypot(X - side * 0.5 * p.half_width, Y + 0.05 * p.half_depth)
            legs[r < radius] = HU_FAT
            legs[r < radius - p.fat] = HU_SOFT_TISSUE
            femur = np.hypot(X - side * 0.52 * p.half_width, Y)
            legs[femur < 14.0] = HU_BONE
            legs[femur < 8.0] = HU_MARROW
        hu[:, :, :k_thigh] = legs[:, :, None]


def _paint_chest(hu: np.ndarray, rng: np.random.Generator, plan: _Plan) -> None:
    """Lungs inside the ribcage above the diaphragm, the heart on its left dome, the trachea."""
    grid, X, Y, a_cav, b_cav = plan.grid, plan.X, plan.Y, plan.a_cav, plan.b_cav
    lowest = float(plan.dome[plan.cavity].min()) if plan.cavity.any() else 0.0
    found = grid.box((-a_cav, -b_cav, lowest + 4.0), (a_cav, b_cav, plan.apex))
    if found is not None:
        box, (x, y, z) = found
        r2 = (
            np.minimum(
                ((x - 0.5 * a_cav) / (0.47 * a_cav)) ** 2,
                ((x + 0.5 * a_cav) / (0.45 * a_cav)) ** 2,
            )
            + ((y + 0.08 * b_cav) / (0.88 * b_cav)) ** 2
        )[:, :, 0]
        r2 = np.where(plan.cavity[box[:2]] & (np.abs(x[:, :, 0]) > 20.0), r2, np.inf)
        # Full width low down, narrowing to the apex.
        top = 0.55 * plan.apex
        taper = 1 - np.clip((z - top) / (plan.apex - top), 0, 1) ** 2
        lung = (r2[:, :, None] < taper) & (z > plan.dome[box[:2]][:, :, None] + 4.0)
        texture = _smooth_noise(rng, x.ravel(), y.ravel(), z, wavelength=25.0)
        hu[box][lung] = HU_LUNG + 40 * texture[lung]

    # The heart in its fat, on the diaphragm.
    x, y = -0.15 * a_cav, 0.25 * b_cav
    i = min(int(np.searchsorted(grid.x, x)), len(grid.x) - 1)
    j = min(int(np.searchsorted(grid.y, y)), len(grid.y) - 1)
    centre = (x, y, float(plan.dome[i, j]) + 50.0 + rng.uniform(0, 15))
    radii = tuple(r * rng.uniform(0.9, 1.1) for r in (60.0, 50.0, 58.0))
    heart_hu = HU_HEART + rng.normal(0, 3)
    for value, grow in ((HU_FAT, 7.0), (heart_hu, 0.0)):
        size = tuple(r + grow for r in radii)
        found = grid.box(
            [c - r for c, r in zip(centre, size, strict=True)],
            [c + r for c, r in zip(centre, size, strict=True)],
        )
        if found is not None:
            box, coords = found
            inside = _ellipsoid(coords, centre, size) < 1
            inside &= coords[2] > plan.dome[box[:2]][:, :, None] + 4.0
            hu[box][inside] = value
    airway = np.hypot(X, Y - (plan.spine_y + plan.vertebra_r + 17.0)) < 9.0
    _set(hu, airway, slice(*grid.k_range(plan.apex - 80.0, np.inf)), HU_AIR + 20)


def _paint_skeleton(hu: np.ndarray, rng: np.random.Generator, case: Case, plan: _Plan) -> None:
    """Aorta and spine (the whole trunk), ribs and sternum, pelvic bone."""
    grid, p, X, Y = plan.grid, case.patient, plan.X, plan.Y
    sy, rv = plan.spine_y, plan.vertebra_r
    aorta = np.hypot(X + 15.0, Y - (sy + rv + 15.0)) < rng.uniform(10.0, 13.0)
    _set(hu, aorta, slice(*grid.k_range(plan.crest + 20.0, plan.apex - 40.0)), HU_AORTA)

    # Vertebrae (bodies and posterior elements) alternate with discs along z.
    ks = np.arange(*grid.k_range(plan.thigh, np.inf))
    period, phase = rng.uniform(27.0, 33.0), rng.uniform(0, 2 * np.pi)
    vertebra = np.cos(2 * np.pi * grid.z[ks] / period + phase) > -0.55
    body = np.hypot(X, Y - sy) < rv
    canal_y = sy - rv - 9.0
    canal = np.hypot(X, Y - canal_y) < 8.0
    behind = (np.hypot(X, Y - canal_y + 3.0) < 14.0) & ~canal
    behind |= (np.abs(X) < 4.0) & (Y < canal_y) & (Y > -p.half_depth + p.fat + 12.0)
    behind |= (np.abs(X) < 38.0) & (np.abs(Y - canal_y) < 5.0) & (np.abs(X) > 8.0)
    _set(hu, body, ks[~vertebra], HU_DISC)
    _set(hu, body | behind, ks[vertebra], HU_BONE)
    _set(hu, canal, ks, HU_SPINAL_CANAL)

    # Ribs: oblique bands in the wall, lower in front than at the back, down to the
    # costal margin; none in front (cartilage) but the sternum.
    ring = (plan.inner < 1 - 2.0 / p.half_depth) & (plan.inner > 1 - 13.0 / p.half_depth)
    ring &= _superellipse(X, Y, plan.a_cav, plan.b_cav) >= 1
    ii, jj = np.nonzero(ring)
    k0, k1 = grid.k_range(-150.0, plan.apex + 10.0)
    if len(ii) and k1 > k0:
        z = grid.z[k0:k1][None, :]
        sin = np.sin(np.arctan2(grid.y[jj] / plan.b_cav, grid.x[ii] / plan.a_cav))[:, None]
        rib_period = rng.uniform(26.0, 32.0)
        bands = np.sin(2 * np.pi * (z + 60.0 * (1 + sin)) / rib_period) > 0.35
        ribs = bands & (sin < 0.75) & (z > -150.0 + 45.0 * (1 + sin))
        sternum = (np.abs(grid.x[ii]) < 15.0)[:, None] & (sin > 0) & (z > -40.0)
        sternum &= z < plan.apex - 40.0
        r, k = np.nonzero(ribs | sternum)
        hu[ii[r], jj[r], k0 + k] = HU_BONE

    _paint_pelvis(hu, rng, case, plan)


def _paint_pelvis(hu: np.ndarray, rng: np.random.Generator, case: Case, plan: _Plan) -> None:
    """Iliac wings, sacrum, femoral heads in their sockets, pubic rami, ischia, upper femurs."""
    grid, p, X, Y = plan.grid, case.patient, plan.X, plan.Y
    a_cav, b_cav, sy = plan.a_cav, plan.b_cav, plan.spine_y
    if grid.k_range(plan.thigh, plan.crest)[1] <= grid.k_range(plan.thigh, plan.crest)[0]:
        return
    in_body = plan.inner < 1
    head_x = min(rng.uniform(80.0, 95.0), 0.6 * p.half_width)
    for side in (-1, 1):
        # The iliac wing: a curved plate from the sacrum out and forward, narrowing downwards.
        lo, hi = (-a_cav, sy - 0.7 * b_cav, plan.hip + 25.0), (a_cav, sy + 0.5 * b_cav, plan.crest)
        found = grid.box(lo, hi)
        if found is not None:
            box, (x, y, z) = found
            down = np.clip((plan.crest - z) / (plan.crest - plan.hip), 0, 1)
            width = (1 - 0.35 * down) * 0.55 * a_cav
            r = np.sqrt(((side * x - 0.25 * a_cav) / width) ** 2 + ((y - sy) / (0.6 * b_cav)) ** 2)
            wing = (
                (np.abs(r - 1) < 9.0 / (0.55 * a_cav)) & (side * x > 30.0) & (y < sy + 0.45 * b_cav)
            )
            hu[box][wing & in_body[box[:2]][:, :, None]] = HU_BONE
        # The femoral head in its socket.
        centre = (side * head_x, 0.0, plan.hip)
        found = grid.box([c - 36.0 for c in centre], [c + 36.0 for c in centre])
        if found is not None:
            box, coords = found
            r = np.sqrt(_ellipsoid(coords, centre, (1.0, 1.0, 1.0)))
            bone = (r < 24.0) | ((r > 28.0) & (r < 36.0) & (coords[2] > plan.hip - 15.0))
            hu[box][bone & in_body[box[:2]][:, :, None]] = HU_BONE
        shaft = np.hypot(X - side * (head_x + 20.0), Y) < 14.0
        _set(hu, shaft & in_body, slice(*grid.k_range(plan.thigh, plan.hip - 20.0)), HU_BONE)
    sacrum = (np.abs(X) < 45.0) & (np.abs(Y - sy + 5.0) < 16.0) & in_body
    _set(hu, sacrum, slice(*grid.k_range(plan.hip, plan.crest - 10.0)), HU_BONE)
    # Pubic rami: an arc in front from the hips to the symphysis; the ischia behind the hips.
    arc = np.hypot(X / (head_x + 5.0), Y / (0.75 * b_cav))
    rami = (np.abs(arc - 1) < 10.0 / (0.75 * b_cav)) & (Y > 0) & in_body
    _set(hu, rami, slice(*grid.k_range(plan.hip - 43.0, plan.hip - 7.0)), HU_BONE)
    ischium = (np.hypot((np.abs(X) - 60.0) / 15.0, (Y + 0.25 * b_cav) / 25.0) < 1) & in_body
    _set(hu, ischium, slice(*grid.k_range(plan.hip - 50.0, plan.hip)), HU_BONE)


@dataclass(frozen=True)
class _Liver:
    """The liver over the cavity's bounding box, on a slab that may reach beyond the scan."""

    region: tuple[slice, slice]  # of the scan's x and y
    slab: tuple[int, int]  # slices k0…k1 (the scan is 0…nz)
    mask: np.ndarray  # bool over region × slab
    level: np.ndarray  # its level field: < 1 in the liver, < 0.5 in its core

    def in_scan(self, nz: int) -> tuple[slice, slice]:
        """The scan's slices that the slab covers, and the same slices of the slab."""
        k0, k1 = max(self.slab[0], 0), max(min(self.slab[1], nz), max(self.slab[0], 0))
        return slice(k0, k1), slice(k0 - self.slab[0], k1 - self.slab[0])


def _liver(rng: np.random.Generator, case: Case, plan: _Plan, organs: list[_Organ]) -> _Liver:
    """The liver: a right lobe against the right wall under the dome, thinner and more
    lateral towards its lower tip, and a left lobe crossing the midline in front,
    deformed by smooth noise, around the organs it touches, and grown or shrunk to the
    drawn volume. Drawn whole, also where it reaches beyond the scan.
    """
    grid, p, a_cav, b_cav = plan.grid, case.patient, plan.a_cav, plan.b_cav
    height, volume_mm3 = p.liver_height, p.liver_ml * 1000.0
    slab = grid.k_range(-height - 60.0, 10.0, clip=False)
    found = grid.box((-a_cav, -b_cav, -np.inf), (a_cav, b_cav, np.inf), slab)
    if found is None:  # a matrix too small to hold a cavity
        found = grid.box((-np.inf,) * 3, (np.inf,) * 3, slab)
    box, (x, y, z) = found
    region = box[:2]
    room = plan.cavity[region][:, :, None] & (z < plan.dome[region][:, :, None] - 4.0)
    for organ in organs:
        found = _organ_mask(plan, organ, slab) if organ.keeps_liver_out else None
        if found is None:
            continue
        (i, j, k), inside = found
        # The organ's box relative to the region (both are ranges of the scan's x and y).
        i0, j0 = i.start - region[0].start, j.start - region[1].start
        ci = slice(max(i0, 0), min(i0 + inside.shape[0], room.shape[0]))
        cj = slice(max(j0, 0), min(j0 + inside.shape[1], room.shape[1]))
        part = inside[ci.start - i0 : ci.stop - i0, cj.start - j0 : cj.stop - j0]
        room[ci, cj, k] &= ~part
    voxels = int(round(volume_mm3 / np.prod(grid.spacing)))
    voxels = min(max(voxels, 1), int(room.sum()) - 1)

    rz = (height + 10.0) / 2
    cz = 5.0 - rz
    down = np.clip((cz - z) / rz, 0, 1)  # 0 in the upper half, 1 at the lower tip
    ry = 0.8 * b_cav * rng.uniform(0.9, 1.05)
    # The right lobe holds about 85 % of the volume; cut by the dome and tapered, about
    # 0.7 of its ellipsoid.
    rx = 0.85 * volume_mm3 / (0.7 * 4 / 3 * np.pi * ry * rz)
    left_centre = (-0.12 * a_cav, 0.42 * b_cav, -0.22 * height)
    left_radii = (0.4 * a_cav * rng.uniform(0.8, 1.2), 0.32 * b_cav, 0.28 * height)
    deform = 0.5 * _smooth_noise(rng, x.ravel(), y.ravel(), z, 160.0)
    scale = 1.0
    for _ in range(3):
        # A threshold far from 1 would swell the liver against its room or shrink it to
        # its core: scale its cross-section instead, keeping its height. The right lobe
        # spans at most the right side and the depth of the cavity.
        sx, sy = min(rx * scale, 0.6 * a_cav), min(ry * scale, 0.95 * b_cav)
        left_scale = min(scale, 1.3)
        right = (
            ((x - (a_cav - sx + 0.3 * sx * down)) / (sx * (1 - 0.3 * down))) ** 2
            + (y / (sy * (1 - 0.35 * down))) ** 2
            + ((z - cz) / rz) ** 2
        )
        left = _ellipsoid(
            (x, y, z),
            left_centre,
            (left_radii[0] * left_scale, left_radii[1] * left_scale, left_radii[2]),
        )
        level = np.where(room, np.minimum(right, left) - deform, np.float32(np.inf))
        threshold = float(np.partition(level.ravel(), voxels)[voxels])
        if 0.85 < threshold < 1.2:
            break
        scale *= threshold**0.75
    # Where its room is too small for the drawn volume, the liver stays a liver.
    threshold = min(threshold, 1.35)
    return _Liver(region, slab, level < threshold, level / np.float32(threshold))


def _tumours(
    rng: np.random.Generator, plan: _Plan, liver: _Liver
) -> list[tuple[tuple[slice, ...], np.ndarray]]:
    """The tumours (clipped to the liver): boxes of the liver's arrays and masks there,
    each centred on a liver voxel inside the scan, the sizeable ones in its core."""
    inside = np.zeros(liver.mask.shape, dtype=bool)
    cut = liver.in_scan(plan.grid.shape[2])[1]
    inside[:, :, cut] = liver.mask[:, :, cut]
    large = int(rng.integers(1, 4)) if rng.random() < 0.85 else 0
    small = int(rng.integers(0, 4))
    if not inside.any():
        return []
    diameters = [rng.uniform(*LARGE_TUMOUR_MM) for _ in range(large)]
    diameters += [rng.uniform(*SMALL_TUMOUR_MM) for _ in range(small)]
    core = np.argwhere(inside & (liver.level < 0.5))
    anywhere = np.argwhere(inside)
    spacing = np.asarray(plan.grid.spacing)
    tumours = []
    for n, diameter in enumerate(diameters):
        candidates = core if n < large and len(core) else anywhere
        centre = candidates[rng.integers(len(candidates))]
        radii = diameter / 2 * rng.uniform(0.85, 1.15, 3) / spacing  # voxels
        reach = np.ceil(radii).astype(int)
        lo = np.maximum(centre - reach, 0)
        hi = np.minimum(centre + reach + 1, liver.mask.shape)
        box = tuple(slice(s, e) for s, e in zip(lo, hi, strict=True))
        grid = np.ogrid[box]
        ball = sum(((g - c) / r) ** 2 for g, c, r in zip(grid, centre, radii, strict=True)) < 1
        tumours.append((box, ball & liver.mask[box]))
    return tumours


def make_phantom(rng: np.random.Generator, case: Case) -> Phantom:
    """One phantom of `case` in canonical RAS order, with partial-volume blur and noise."""
    shape = case.geometry.shape
    plan = _plan(rng, case)
    hu = np.empty(shape, dtype=np.float32)
    _paint_body(hu, case, plan)
    _paint_chest(hu, rng, plan)
    organs = _abdominal_organs(rng, case, plan)
    _paint_organs(hu, plan, organs)

    liver = _liver(rng, case, plan, organs)
    tumours = _tumours(rng, plan, liver)
    region_labels = liver.mask.astype(np.uint8)
    grid = plan.grid
    x, y = grid.x[liver.region[0]], grid.y[liver.region[1]]
    liver_hu = rng.uniform(55, 70) + 8 * _smooth_noise(rng, x, y, grid.z_at(*liver.slab), 60.0)
    for box, mask in tumours:
        liver_hu[box][mask] = rng.uniform(10, 30)
        region_labels[box][mask] = 2
    scan, cut = liver.in_scan(shape[2])
    labels = np.zeros(shape, dtype=np.uint8)
    labels[(*liver.region, scan)] = region_labels[:, :, cut]
    target = hu[(*liver.region, scan)]
    target[liver.mask[:, :, cut]] = liver_hu[:, :, cut][liver.mask[:, :, cut]]
    _paint_skeleton(hu, rng, case, plan)

    hu = ndimage.gaussian_filter(hu, sigma=0.7, truncate=2.5)  # partial-volume effect at edges
    hu += rng.standard_normal(size=shape, dtype=np.float32) * np.float32(rng.uniform(10, 20))
    present = sum(1 for box, mask in tumours if mask[:, :, _shift(cut, box[2])].any())
    return Phantom(hu=hu, labels=labels, tumours=present)


def _shift(window: slice, box: slice) -> slice:
    """`window` (slices of an array) relative to `box` (a part of the same array), clipped."""
    size = box.stop - box.start
    return slice(
        min(max(window.start - box.start, 0), size), min(max(window.stop - box.start, 0), size)
    )


def _stored_affine(geometry: Geometry) -> np.ndarray:
    """RAS affine of the array as stored; the canonical field of view is centred on 0."""
    spacing = np.array(geometry.spacing)
    canonical = np.diag([*spacing, 1.0])
    canonical[:3, 3] = -0.5 * (np.array(geometry.shape) - 1) * spacing
    if geometry.stored_as == "RAS":
        return canonical
    # LPS: stored voxel i of the first two axes is canonical voxel n - 1 - i.
    nx, ny, _ = geometry.shape
    flip = np.array([[-1, 0, 0, nx - 1], [0, -1, 0, ny - 1], [0, 0, 1, 0], [0, 0, 0, 1]], float)
    return canonical @ flip


def _stored_order(array: np.ndarray, geometry: Geometry) -> np.ndarray:
    """A canonical array in the voxel order the case is stored in."""
    return array if geometry.stored_as == "RAS" else array[::-1, ::-1, :]


def _nifti(array: np.ndarray, affine: np.ndarray) -> nib.Nifti1Image:
    image = nib.Nifti1Image(np.ascontiguousarray(array), affine)
    image.header.set_xyzt_units("mm")
    image.set_qform(affine, code=1)
    image.set_sform(affine, code=1)
    return image


def _describe(index: int, size: int, seed: int, case: Case, phantom: Phantom) -> dict:
    """The synth.json entry of a case (shape and spacing in canonical RAS order)."""
    geometry = case.geometry
    nz = geometry.shape[2]
    per_slice = np.count_nonzero(phantom.labels, axis=(0, 1))  # liver and tumour voxels
    centre = (per_slice @ (np.arange(nz) + 0.5)) / max(per_slice.sum(), 1) / nz
    return {
        "case": f"volume-{index}",
        "kind": case.kind,
        "seed": seed,
        "size": size,
        "shape": list(geometry.shape),
        "spacing_mm": [round(s, 4) for s in geometry.spacing],
        "z_extent_mm": round(nz * geometry.spacing[2], 2),
        "in_plane_fov_mm": round(geometry.shape[0] * geometry.spacing[0], 2),
        "liver_ml": round(float(per_slice.sum()) * float(np.prod(geometry.spacing)) / 1000, 1),
        "liver_centre_height": round(float(centre), 4),
        "tumours": phantom.tumours,
        "stored_as": geometry.stored_as,
    }


def _write_case(out_dir: Path, index: int, size: int, seed: int) -> tuple[tuple[Path, Path], dict]:
    rng = np.random.default_rng((seed, index))
    case = random_case(rng, size, index)
    phantom = make_phantom(rng, case)
    geometry = case.geometry
    raw = np.clip(np.rint(phantom.hu - RAW_INTERCEPT), 0, RAW_MAX - RAW_INTERCEPT)
    raw = _stored_order(raw.astype(np.int16), geometry)
    labels = _stored_order(phantom.labels, geometry)
    affine = _stored_affine(geometry)

    volume = _nifti(raw, affine)
    volume.header.set_slope_inter(1.0, RAW_INTERCEPT)
    volume_path = out_dir / f"volume-{index}.nii.gz"
    label_path = out_dir / f"segmentation-{index}.nii.gz"
    for image, path in ((volume, volume_path), (_nifti(labels, affine), label_path)):
        with atomic_path(path) as tmp:
            nib.save(image, tmp)
    return (volume_path, label_path), _describe(index, size, seed, case, phantom)


def write_case(out_dir: Path, index: int, size: int, seed: int) -> tuple[Path, Path]:
    """Write volume-<index>.nii.gz and segmentation-<index>.nii.gz; return their paths."""
    return _write_case(Path(out_dir), index, size, seed)[0]


def _earlier_entries(out_dir: Path) -> dict[str, dict]:
    """synth.json's entries of the cases an earlier run left in the folder (files still there)."""
    path = out_dir / SIDECAR
    if not is_json_with(path, ["cases"]):
        return {}
    entries = json.loads(path.read_text())["cases"]
    if not isinstance(entries, list):
        return {}
    return {
        e["case"]: e
        for e in entries
        if isinstance(e, dict)
        and isinstance(e.get("case"), str)
        and e.get("kind") in KINDS
        and (out_dir / f"{e['case']}.nii.gz").is_file()
        and (out_dir / f"{e['case'].replace('volume', 'segmentation', 1)}.nii.gz").is_file()
    }


def _write_sidecar(out_dir: Path, entries: dict[str, dict]) -> None:
    ordered = sorted(entries.values(), key=lambda e: (len(e["case"]), e["case"]))
    write_json(
        out_dir / SIDECAR,
        {
            "written_by": "ctseg synth",
            "frame": "shape and spacing in canonical RAS order (x right, y anterior, z superior)",
            "extent_groups_mm": {
                LIVER_ONLY: [0.0, EXTENT_GROUP_BOUNDS_MM[0]],
                ABDOMINAL: list(EXTENT_GROUP_BOUNDS_MM),
                CHEST_ABDOMEN_PELVIS: [EXTENT_GROUP_BOUNDS_MM[1], None],
            },
            "cases": ordered,
        },
    )


def write_dataset(
    out_dir: str | Path,
    cases: int,
    size: int,
    seed: int,
    progress: Progress | None = None,
    force: bool = False,
) -> list[tuple[Path, Path]]:
    """Write `cases` synthetic LiTS-style cases of size×size×(at most 2.5·size) voxels, and
    synth.json, which describes each (updated after every case).

    Into a new or empty folder, one that synth wrote before, or (`force`) any folder:
    pointed at real data by mistake, it must not overwrite a LiTS volume-0.nii.gz.
    """
    out_dir = claim_folder(out_dir, (MARKER,), force)
    # An earlier synth's cases that this run leaves keep their entries (another's
    # synth.json, in a folder written into with `force`, is replaced).
    earlier = _earlier_entries(out_dir) if (out_dir / MARKER).is_file() else {}
    write_text(out_dir / MARKER, "synthetic cases written by `ctseg synth`\n")
    # The entries of the cases this run rewrites go first: synth.json never describes a
    # file wrongly (a run killed half-way leaves files without their entry at most).
    entries = {
        name: entry
        for name, entry in earlier.items()
        if name not in {f"volume-{i}" for i in range(cases)}
    }
    _write_sidecar(out_dir, entries)
    written = []
    for index in range(cases):
        paths, entry = _write_case(out_dir, index, size, seed)
        written.append(paths)
        entries[entry["case"]] = entry
        _write_sidecar(out_dir, entries)
        if progress is not None:
            progress(index + 1, cases, f"volume-{index}")
    return written
