"""The body around the liver: its outline, fat and muscle wall, the chest (lungs, heart,
ribs), the skeleton, the pelvis, the abdominal organs that look like liver and what fills
the abdomen between them (fat and bowel)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ctseg.synth.cases import Case
from ctseg.synth.drawing import (
    HU_AIR,
    HU_BONE,
    HU_BOWEL_GAS,
    HU_DISC,
    HU_FAT,
    HU_LUNG,
    HU_MARROW,
    HU_SOFT_TISSUE,
    HU_SPINAL_CANAL,
    HU_WATER,
    Grid,
    ellipsoid,
    paint,
    smooth_noise,
    superellipse,
)


@dataclass(frozen=True)
class BodyPlan:
    """Per-case anatomy: 2-D maps over the slice and landmark heights (mm)."""

    grid: Grid
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


def plan_body(rng: np.random.Generator, case: Case) -> BodyPlan:
    grid, p = Grid(case), case.patient
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
    return BodyPlan(
        grid=grid,
        X=X,
        Y=Y,
        a_cav=a_cav,
        b_cav=b_cav,
        inner=superellipse(X, Y, a_in, b_in),
        cavity=(superellipse(X, Y, a_cav, b_cav) < 1) & ~column,
        dome=dome.astype(np.float32),
        spine_y=spine_y,
        vertebra_r=vertebra_r,
        apex=float(rng.uniform(200.0, 250.0)),
        crest=crest,
        hip=hip,
        thigh=hip - float(rng.uniform(60.0, 80.0)),
    )


@dataclass(frozen=True)
class Organ:
    centre: tuple[float, float, float]
    radii: tuple[float, float, float]
    hu: float
    keeps_liver_out: bool = True  # the liver grows around it, not over it
    air_in_front_of: float | None = None  # y above which it holds air (a supine stomach)


def organ_mask(
    plan: BodyPlan, organ: Organ, slab: tuple[int, int] | None = None
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
    inside = (ellipsoid(coords, organ.centre, organ.radii) < 1) & plan.cavity[box[:2]][:, :, None]
    inside &= coords[2] < plan.dome[box[:2]][:, :, None] - 4.0
    return box, inside


def abdominal_organs(rng: np.random.Generator, case: Case, plan: BodyPlan) -> list[Organ]:
    """Bowel gas, stomach, spleen, kidneys in their fat and the bladder: what the liver
    touches (and the model must tell from it)."""
    a_cav, b_cav = plan.a_cav, plan.b_cav

    def jitter(radii: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(float(r * rng.uniform(0.85, 1.15)) for r in radii)

    # Bowel gas first: the organs it lies against cover it.
    organs: list[Organ] = []
    for _ in range(rng.integers(2, 6)):
        centre = (
            rng.uniform(-0.6, 0.6) * a_cav,
            rng.uniform(-0.1, 0.7) * b_cav,
            rng.uniform(plan.crest - 40.0, -0.6 * case.patient.liver_height),
        )
        radii = tuple(float(r) for r in rng.uniform(8.0, 25.0, 3))
        organs.append(Organ(centre, radii, HU_BOWEL_GAS, keeps_liver_out=False))
    # The stomach under the left dome: fluid, with air in front (the patient lies supine).
    centre = (-0.42 * a_cav, 0.15 * b_cav, -60.0 + rng.uniform(-10, 10))
    radii = jitter((45.0, 42.0, 55.0))
    organs.append(Organ(centre, radii, HU_WATER, air_in_front_of=centre[1] + 0.4 * radii[1]))
    spleen = (-a_cav + 40.0, -0.4 * b_cav, -70.0 + rng.uniform(-15, 15))
    organs.append(Organ(spleen, jitter((32.0, 50.0, 55.0)), case.phase.spleen + rng.normal(0, 3)))
    for side, top in ((1, -105.0), (-1, -90.0)):  # the right kidney lies lower
        centre = (
            side * rng.uniform(65.0, 80.0),
            plan.spine_y + rng.uniform(0.0, 15.0),
            top - 55.0 + rng.uniform(-15, 15),
        )
        radii = jitter((27.0, 22.0, 55.0))
        organs.append(Organ(centre, tuple(r + 8.0 for r in radii), HU_FAT))
        organs.append(Organ(centre, radii, case.phase.kidney + rng.normal(0, 3)))
    bladder = (0.0, 0.35 * b_cav, plan.hip + 10.0)
    organs.append(Organ(bladder, jitter((45.0, 35.0, 40.0)), HU_WATER, keeps_liver_out=False))
    return organs


def paint_organs(hu: np.ndarray, plan: BodyPlan, organs: list[Organ]) -> None:
    for organ in organs:
        found = organ_mask(plan, organ)
        if found is None:
            continue
        box, inside = found
        value = np.float32(organ.hu)
        if organ.air_in_front_of is not None:
            y = plan.grid.y[box[1]][None, :, None]
            value = np.where(y > organ.air_in_front_of, HU_AIR + 50, value)
            value = np.broadcast_to(value, inside.shape)[inside]
        hu[box][inside] = value


# Muscle's HU about the soft tissue's, drawn per case: unenhanced muscle measures 25–50 HU
# (less where fat infiltrates it, as in older patients' back muscles).
MUSCLE_OFFSET_HU = (-15.0, 5.0)


def paint_body(hu: np.ndarray, rng: np.random.Generator, case: Case, plan: BodyPlan) -> None:
    """Air, the fat layer and muscle over the trunk; below the pelvis two thighs. The
    muscle's HU is drawn from a stream of its own (`own_stream`)."""
    p, X, Y = case.patient, plan.X, plan.Y
    muscle = HU_SOFT_TISSUE + own_stream(rng, "muscle").uniform(*MUSCLE_OFFSET_HU)
    trunk = np.where(superellipse(X, Y, p.half_width, p.half_depth) < 1, HU_FAT, HU_AIR)
    trunk = np.where(plan.inner < 1, muscle, trunk).astype(np.float32)
    hu[...] = trunk[:, :, None]
    k_thigh = plan.grid.k_range(-np.inf, plan.thigh)[1]
    if k_thigh:
        radius = 0.48 * p.half_width
        legs = np.full_like(trunk, HU_AIR)
        for side in (-1, 1):
            r = np.hypot(X - side * 0.5 * p.half_width, Y + 0.05 * p.half_depth)
            legs[r < radius] = HU_FAT
            legs[r < radius - p.fat] = muscle
            femur = np.hypot(X - side * 0.52 * p.half_width, Y)
            legs[femur < 14.0] = HU_BONE
            legs[femur < 8.0] = HU_MARROW
        hu[:, :, :k_thigh] = legs[:, :, None]


# Visceral fat: its share of the abdomen, for the slimmest and the fattest build (real
# abdomens: from a few bowel loops packed together to loops far apart in fat).
VISCERAL_FAT_SHARE = (0.25, 0.7)
BOWEL_HU = (10.0, 45.0)  # bowel loops (wall and content), drawn per case


def paint_viscera(hu: np.ndarray, rng: np.random.Generator, case: Case, plan: BodyPlan) -> None:
    """The abdomen below the diaphragm: bowel loops in fat, not one soft tissue. Real livers
    border fat and bowel; in a cavity of uniform soft tissue the liver would be told by its
    HU alone (docs/experiments/realct.md). Drawn from a stream of its own (`own_stream`),
    so that everything else of the case is drawn as before."""
    rng = own_stream(rng, "viscera")
    grid, p = plan.grid, case.patient
    ii, jj = np.nonzero(plan.cavity)
    if not len(ii):
        return
    region = (slice(ii.min(), ii.max() + 1), slice(jj.min(), jj.max() + 1))
    x, y, z = grid.x[region[0]], grid.y[region[1]], grid.z
    below = plan.cavity[region][:, :, None] & (z < plan.dome[region][:, :, None] - 4.0)
    if not below.any():
        return
    # Loops of 2–5 cm (three patterns of plane waves: round, not streaks) in a coarser
    # pattern of where they gather.
    field = sum(smooth_noise(rng, x, y, z, wavelength) for wavelength in (35.0, 45.0, 60.0))
    field += 1.2 * smooth_noise(rng, x, y, z, 120.0)
    obesity = np.clip((p.fat - 8.0) / 22.0, 0, 1)
    low, high = VISCERAL_FAT_SHARE
    share = float(np.clip(low + (high - low) * obesity + rng.normal(0, 0.08), low, high))
    threshold = np.quantile(field[below], share)
    bowel = rng.uniform(*BOWEL_HU) + 10.0 * smooth_noise(rng, x, y, z, 20.0)
    values = np.where(field < threshold, np.float32(HU_FAT), bowel)
    target = hu[region]
    target[below] = values[below]


def own_stream(rng: np.random.Generator, part: str) -> np.random.Generator:
    """A stream of its own for one part of a phantom: fixed by the case's seed (the seed
    sequence `rng` was made from) and the part's name, whatever else draws from `rng`."""
    seq = rng.bit_generator.seed_seq
    key = int.from_bytes(part.encode()[:8], "little")
    return np.random.default_rng(
        np.random.SeedSequence(seq.entropy, spawn_key=(*seq.spawn_key, key))
    )


def paint_chest(hu: np.ndarray, rng: np.random.Generator, case: Case, plan: BodyPlan) -> None:
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
        texture = smooth_noise(rng, x.ravel(), y.ravel(), z, wavelength=25.0)
        hu[box][lung] = HU_LUNG + 40 * texture[lung]

    # The heart in its fat, on the diaphragm.
    x, y = -0.15 * a_cav, 0.25 * b_cav
    i = min(int(np.searchsorted(grid.x, x)), len(grid.x) - 1)
    j = min(int(np.searchsorted(grid.y, y)), len(grid.y) - 1)
    centre = (x, y, float(plan.dome[i, j]) + 50.0 + rng.uniform(0, 15))
    radii = tuple(r * rng.uniform(0.9, 1.1) for r in (60.0, 50.0, 58.0))
    heart_hu = case.phase.heart + rng.normal(0, 3)
    for value, grow in ((HU_FAT, 7.0), (heart_hu, 0.0)):
        size = tuple(r + grow for r in radii)
        found = grid.box(
            [c - r for c, r in zip(centre, size, strict=True)],
            [c + r for c, r in zip(centre, size, strict=True)],
        )
        if found is not None:
            box, coords = found
            inside = ellipsoid(coords, centre, size) < 1
            inside &= coords[2] > plan.dome[box[:2]][:, :, None] + 4.0
            hu[box][inside] = value
    airway = np.hypot(X, Y - (plan.spine_y + plan.vertebra_r + 17.0)) < 9.0
    paint(hu, airway, slice(*grid.k_range(plan.apex - 80.0, np.inf)), HU_AIR + 20)


def paint_skeleton(hu: np.ndarray, rng: np.random.Generator, case: Case, plan: BodyPlan) -> None:
    """Aorta and spine (the whole trunk), ribs and sternum, pelvic bone."""
    grid, p, X, Y = plan.grid, case.patient, plan.X, plan.Y
    sy, rv = plan.spine_y, plan.vertebra_r
    aorta = np.hypot(X + 15.0, Y - (sy + rv + 15.0)) < rng.uniform(10.0, 13.0)
    paint(hu, aorta, slice(*grid.k_range(plan.crest + 20.0, plan.apex - 40.0)), case.phase.aorta)

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
    paint(hu, body, ks[~vertebra], HU_DISC)
    paint(hu, body | behind, ks[vertebra], HU_BONE)
    paint(hu, canal, ks, HU_SPINAL_CANAL)

    # Ribs: oblique bands in the wall, lower in front than at the back, down to the
    # costal margin; none in front (cartilage) but the sternum.
    ring = (plan.inner < 1 - 2.0 / p.half_depth) & (plan.inner > 1 - 13.0 / p.half_depth)
    ring &= superellipse(X, Y, plan.a_cav, plan.b_cav) >= 1
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

    paint_pelvis(hu, rng, case, plan)


def paint_pelvis(hu: np.ndarray, rng: np.random.Generator, case: Case, plan: BodyPlan) -> None:
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
            r = np.sqrt(ellipsoid(coords, centre, (1.0, 1.0, 1.0)))
            bone = (r < 24.0) | ((r > 28.0) & (r < 36.0) & (coords[2] > plan.hip - 15.0))
            hu[box][bone & in_body[box[:2]][:, :, None]] = HU_BONE
        shaft = np.hypot(X - side * (head_x + 20.0), Y) < 14.0
        paint(hu, shaft & in_body, slice(*grid.k_range(plan.thigh, plan.hip - 20.0)), HU_BONE)
    sacrum = (np.abs(X) < 45.0) & (np.abs(Y - sy + 5.0) < 16.0) & in_body
    paint(hu, sacrum, slice(*grid.k_range(plan.hip, plan.crest - 10.0)), HU_BONE)
    # Pubic rami: an arc in front from the hips to the symphysis; the ischia behind the hips.
    arc = np.hypot(X / (head_x + 5.0), Y / (0.75 * b_cav))
    rami = (np.abs(arc - 1) < 10.0 / (0.75 * b_cav)) & (Y > 0) & in_body
    paint(hu, rami, slice(*grid.k_range(plan.hip - 43.0, plan.hip - 7.0)), HU_BONE)
    ischium = (np.hypot((np.abs(X) - 60.0) / 15.0, (Y + 0.25 * b_cav) / 25.0) < 1) & in_body
    paint(hu, ischium, slice(*grid.k_range(plan.hip - 50.0, plan.hip)), HU_BONE)
