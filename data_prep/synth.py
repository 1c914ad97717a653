"""A synthetic LiTS-like data set: abdomen phantoms with a liver and hypodense tumours.

Each case is written as LiTS names it, ``volume-N.nii.gz`` (int16 with
scl_slope 1 / scl_inter -1024, as scanners store CT) and ``segmentation-N.nii.gz``
(uint8: 0 background, 1 liver, 2 tumour). The phantom is built in canonical RAS
voxel order on normalised coordinates u, v, w ∈ [-1, 1] (u towards the patient's
right, v anterior, w superior), so it fills the field of view whatever the
spacing. Spacing, slice count and the stored orientation (LPS or RAS) vary per
case, so a reader that ignores the affine gets the anatomy mirrored.

Most tumour volume sits in a few sizeable tumours (radius 8–20 % of the liver's
extent, so a small-grid model can learn them); a few tiny ones, only a few
voxels across, reward a finer grid.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import numpy as np
from scipy import ndimage

from ctseg.atomic import atomic_path, claim_folder, write_text

HU_AIR, HU_FAT, HU_SOFT_TISSUE = -1000.0, -100.0, 40.0
HU_BONE, HU_DISC, HU_SPINAL_CANAL = 700.0, 100.0, 20.0
HU_KIDNEY, HU_SPLEEN = 30.0, 50.0
# Stored raw = HU + 1024 with scl_inter = -1024, as CT scanners do.
RAW_INTERCEPT = -1024.0
RAW_MAX = 3071  # the usual 12-bit CT range ends at +3071 HU

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class Geometry:
    shape: tuple[int, int, int]  # canonical (RAS) voxel counts
    spacing: tuple[float, float, float]  # mm
    stored_as: str  # "RAS" or "LPS": the voxel order written to disk


@dataclass(frozen=True)
class Phantom:
    hu: np.ndarray  # float32 Hounsfield units, canonical order
    labels: np.ndarray  # uint8, canonical order


def random_geometry(rng: np.random.Generator, size: int, index: int) -> Geometry:
    """An abdominal field of view: 320–420 mm in-plane over `size` pixels, 150–250 mm
    of 1.5–5 mm slices (at most 1.25 × size of them); even cases LPS, odd RAS.

    The anatomy is drawn in normalised coordinates, so a small matrix still gives
    real-world volumes (a liver of about 1–2 L) and realistic voxel spacings.
    """
    in_plane = float(rng.uniform(320.0, 420.0)) / size
    slice_mm = float(rng.uniform(1.5, 5.0))
    slices = int(np.clip(round(rng.uniform(150.0, 250.0) / slice_mm), 8, round(1.25 * size)))
    return Geometry(
        shape=(size, size, slices),
        spacing=(in_plane, in_plane, slice_mm),
        stored_as="LPS" if index % 2 == 0 else "RAS",
    )


def _axes(shape: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Normalised voxel-centre coordinates u, v, w, shaped to broadcast against each other."""
    u, v, w = ((np.arange(n, dtype=np.float32) + 0.5) / n * 2 - 1 for n in shape)
    return u[:, None, None], v[None, :, None], w[None, None, :]


def _smooth_noise(rng: np.random.Generator, coords: tuple, terms: int = 5) -> np.ndarray:
    """A smooth random field of standard deviation about 0.5 (a few random cosines)."""
    u, v, w = coords
    field = np.zeros(np.broadcast_shapes(u.shape, v.shape, w.shape), dtype=np.float32)
    for _ in range(terms):
        fu, fv, fw = rng.normal(0.0, 1.2, size=3).astype(np.float32)
        phase = np.float32(rng.uniform(0, 2 * np.pi))
        field += np.cos(np.float32(np.pi) * (fu * u + fv * v + fw * w) + phase)
    return field * np.float32(0.5 / np.sqrt(terms / 2))


def _ellipsoid(coords: tuple, centre: tuple, radii: tuple) -> np.ndarray:
    """Squared normalised radius; < 1 inside the ellipsoid."""
    return sum(((c - c0) / r) ** 2 for c, c0, r in zip(coords, centre, radii, strict=True))


def _paint_body(hu: np.ndarray, rng: np.random.Generator, coords: tuple) -> np.ndarray:
    """Air, fat layer, soft tissue, spine and ribs; returns the mask organs may occupy."""
    u, v, w = coords
    scale = rng.uniform(0.9, 1.05)
    body_r2 = (u / (0.88 * scale)) ** 2 + (v / (0.68 * scale)) ** 2
    hu[np.broadcast_to(body_r2 < 1.0, hu.shape)] = HU_FAT
    inner = np.broadcast_to(body_r2 < 0.78, hu.shape)
    hu[inner] = HU_SOFT_TISSUE

    spine_v = -0.48 * scale
    spine_r2 = u**2 + (v - spine_v) ** 2
    vertebra = np.where(np.cos(w * np.float32(np.pi * 7)) > -0.7, HU_BONE, HU_DISC)
    spine = np.broadcast_to(spine_r2 < 0.1**2, hu.shape)
    hu[spine] = np.broadcast_to(vertebra, hu.shape)[spine]
    hu[np.broadcast_to(spine_r2 < 0.035**2, hu.shape)] = HU_SPINAL_CANAL

    # Ribs: short oblique bands in a ring just inside the fat layer, absent in front.
    angle = np.arctan2(v, u)
    ring = (body_r2 > 0.8) & (body_r2 < 0.88) & (np.sin(angle) < 0.6)
    bands = np.sin(w * np.float32(np.pi * 5) + 0.5 * angle) > 0.55
    hu[ring & bands] = HU_BONE
    return inner & ~spine


def _paint_organs(
    hu: np.ndarray, rng: np.random.Generator, coords: tuple, room: np.ndarray
) -> None:
    """Kidneys and spleen: soft-tissue look-alikes the model must tell from liver and tumour."""
    for side in (-1, 1):
        kidney = _ellipsoid(coords, (0.33 * side, -0.33, -0.25), (0.11, 0.14, 0.25)) < 1
        hu[kidney & room] = HU_KIDNEY + rng.normal(0, 3)
    spleen = _ellipsoid(coords, (-0.5, -0.15, 0.3), (0.14, 0.2, 0.25)) < 1
    hu[spleen & room] = HU_SPLEEN + rng.normal(0, 3)


def _liver(
    rng: np.random.Generator, coords: tuple, room: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The liver mask, an ellipsoid on the patient's right deformed by smooth noise.

    Also returns its squared base radius, which tells the liver's core from its rim.
    """
    centre = (0.38 + rng.uniform(-0.05, 0.05), rng.uniform(0.0, 0.1), rng.uniform(0.1, 0.3))
    radii = tuple(r * rng.uniform(0.85, 1.1) for r in (0.36, 0.45, 0.5))
    base_r2 = _ellipsoid(coords, centre, radii)
    liver = (base_r2 < 1 + 0.6 * _smooth_noise(rng, coords)) & room
    return liver, base_r2


def _tumour_radii(rng: np.random.Generator, liver: np.ndarray) -> list[np.ndarray]:
    """Per-axis radii in voxels: 1–3 sizeable tumours in most cases, and 0–3 tiny ones."""
    extent = np.ptp(np.argwhere(liver), axis=0) + 1
    large = rng.integers(1, 4) if rng.random() < 0.85 else 0
    tiny = rng.integers(0, 4)
    radii = [extent * rng.uniform(0.08, 0.2) for _ in range(large)]
    radii += [np.full(3, rng.uniform(1.0, 1.8)) for _ in range(tiny)]
    return radii[:6]


def _tumours(rng: np.random.Generator, liver: np.ndarray, base_r2: np.ndarray) -> list[np.ndarray]:
    """Masks of the tumours (each clipped to the liver), centred in the liver's core."""
    if not liver.any():
        return []
    core = np.argwhere(liver & (base_r2 < 0.4))
    candidates = core if len(core) else np.argwhere(liver)
    masks = []
    for radii in _tumour_radii(rng, liver):
        centre = candidates[rng.integers(len(candidates))]
        lo = np.maximum(centre - np.ceil(radii).astype(int) - 1, 0)
        hi = np.minimum(centre + np.ceil(radii).astype(int) + 2, liver.shape)
        box = tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))
        grid = np.ogrid[box]
        inside = sum(((g - c) / r) ** 2 for g, c, r in zip(grid, centre, radii, strict=True)) < 1
        mask = np.zeros_like(liver)
        mask[box] = inside & liver[box]
        masks.append(mask)
    return masks


def make_phantom(rng: np.random.Generator, shape: tuple[int, int, int]) -> Phantom:
    """One abdomen phantom in canonical RAS order, with partial-volume blur and noise."""
    coords = _axes(shape)
    hu = np.full(shape, HU_AIR, dtype=np.float32)
    room = _paint_body(hu, rng, coords)
    _paint_organs(hu, rng, coords, room)
    liver, base_r2 = _liver(rng, coords, room)
    hu[liver] = rng.uniform(55, 70) + 8 * _smooth_noise(rng, coords)[liver]
    labels = liver.astype(np.uint8)
    for mask in _tumours(rng, liver, base_r2):
        hu[mask] = rng.uniform(10, 30)
        labels[mask] = 2
    hu = ndimage.gaussian_filter(hu, sigma=0.7)  # partial-volume effect at edges
    hu += rng.normal(0, rng.uniform(10, 20), size=shape).astype(np.float32)
    return Phantom(hu=hu, labels=labels)


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


def write_case(out_dir: Path, index: int, size: int, seed: int) -> tuple[Path, Path]:
    """Write volume-<index>.nii.gz and segmentation-<index>.nii.gz; return their paths."""
    rng = np.random.default_rng((seed, index))
    geometry = random_geometry(rng, size, index)
    phantom = make_phantom(rng, geometry.shape)
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
    return volume_path, label_path


# Written first into the output folder: it marks the folder as synth's own, to write into again.
MARKER = ".ctseg-synth"


def write_dataset(
    out_dir: str | Path,
    cases: int,
    size: int,
    seed: int,
    progress: Progress | None = None,
    force: bool = False,
) -> list[tuple[Path, Path]]:
    """Write `cases` synthetic LiTS-style cases of size×size×(0.4–1.0·size) voxels.

    Into a new or empty folder, one that synth wrote before, or (`force`) any folder:
    pointed at real data by mistake, it must not overwrite a LiTS volume-0.nii.gz.
    """
    out_dir = claim_folder(out_dir, (MARKER,), force)
    write_text(out_dir / MARKER, "synthetic cases written by `ctseg synth`\n")
    written = []
    for index in range(cases):
        written.append(write_case(out_dir, index, size, seed))
        if progress is not None:
            progress(index + 1, cases, f"volume-{index}")
    return written
