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
  wall (25–45 HU, drawn per case) with ribs (down to the costal margin) and a
  sternum; the spine runs the whole length of chest, abdomen and pelvis (vertebrae
  and discs, canal, posterior elements); the aorta in front of it;
- above the diaphragm (z > 0): lungs (about -850 HU) inside the ribcage, the
  heart on the left dome, the trachea;
- below it: the liver (1.3–2.1 L in all, 145–205 mm tall, on the right, its left
  lobe crossing the midline), stomach, spleen, kidneys in their fat (soft-tissue
  look-alikes touching the liver), some bowel gas, and between them bowel loops in
  visceral fat (25–70 % of the abdomen, more in fatter patients), as real livers border;
- further down: pelvic bone (iliac wings, sacrum, hips, pubis), the bladder and,
  below the pelvis, the thighs with their femurs.

Tumours are sized in millimetres and clipped to the liver: most cases have 1–3
sizeable ones (15–60 mm across), and 0–3 small ones (3–10 mm, at least one
voxel: they reward a finer grid).

Every case is acquired in one contrast phase (`cases.ONE_PHASE`, unenhanced: liver
40–70 HU, tumours 10–30 HU, spleen 45 HU); with `phases`, each case's phase is drawn as an
archive holds them (`cases.PHASES`: 15 % unenhanced, 15 % arterial, 55 % portal
venous, 15 % delayed): the liver 50–65 HU unenhanced to 100–135 HU portal venous,
its tumours darker in every phase, spleen, kidneys, aorta and heart enhancing with
it, so that no one phase's numbers tell the liver.

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

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from ctseg.labels import BACKGROUND, LIVER, TUMOUR
from ctseg.synth.body import (
    BodyPlan,
    Organ,
    abdominal_organs,
    organ_mask,
    paint_body,
    paint_chest,
    paint_organs,
    paint_skeleton,
    paint_viscera,
    plan_body,
)
from ctseg.synth.cases import LARGE_TUMOUR_MM, SMALL_TUMOUR_MM, Case
from ctseg.synth.drawing import (
    ellipsoid,
    smooth_noise,
)


@dataclass(frozen=True)
class Phantom:
    hu: np.ndarray  # float32 Hounsfield units, canonical order
    labels: np.ndarray  # uint8, canonical order
    tumours: int  # tumours with at least one voxel in the scan


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


def _liver(rng: np.random.Generator, case: Case, plan: BodyPlan, organs: list[Organ]) -> _Liver:
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
        found = organ_mask(plan, organ, slab) if organ.keeps_liver_out else None
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
    deform = 0.5 * smooth_noise(rng, x.ravel(), y.ravel(), z, 160.0)
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
        left = ellipsoid(
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
    rng: np.random.Generator, plan: BodyPlan, liver: _Liver
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
    plan = plan_body(rng, case)
    hu = np.empty(shape, dtype=np.float32)
    paint_body(hu, rng, case, plan)
    paint_chest(hu, rng, case, plan)
    paint_viscera(hu, rng, case, plan)
    organs = abdominal_organs(rng, case, plan)
    paint_organs(hu, plan, organs)

    liver = _liver(rng, case, plan, organs)
    tumours = _tumours(rng, plan, liver)
    region_labels = np.where(liver.mask, LIVER, BACKGROUND).astype(np.uint8)
    grid = plan.grid
    x, y = grid.x[liver.region[0]], grid.y[liver.region[1]]
    phase = case.phase
    liver_hu = rng.uniform(*phase.liver) + 8 * smooth_noise(rng, x, y, grid.z_at(*liver.slab), 60.0)
    for box, mask in tumours:
        liver_hu[box][mask] = rng.uniform(*phase.tumour)
        region_labels[box][mask] = TUMOUR
    scan, cut = liver.in_scan(shape[2])
    labels = np.zeros(shape, dtype=np.uint8)
    labels[(*liver.region, scan)] = region_labels[:, :, cut]
    target = hu[(*liver.region, scan)]
    target[liver.mask[:, :, cut]] = liver_hu[:, :, cut][liver.mask[:, :, cut]]
    paint_skeleton(hu, rng, case, plan)

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
