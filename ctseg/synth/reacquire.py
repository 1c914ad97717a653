"""Held-out scans as acquired differently: the robustness set.

Real scans differ from a training set in the patient's position and size, the dose
(noise), the reconstruction kernel (sharpness), the slice thickness and the contrast
phase. Each change here takes a scan and its labels (any NIfTI pair, in the files' own
voxel order, voxel sizes from the affine) and gives the same patient as that other
acquisition would have shown it: geometric changes move image and labels together
(linear for HU, nearest for labels); the others change the HU alone.

`write_sets` writes every change of a folder of held-out pairs (`scripts/reacquire.py`
runs it); `make experiment-robustness` scores models on every set.

`OTHER_SCANS` are not acquisitions a CT model should cope with but scans it was not made
for, with their truth: another modality (`mr`: the HU remapped to a T1-weighted MR's
intensities) and a chest scan that holds only the liver's dome (`chest`). `make
experiment-quality` asks whether the prediction quality (`ctseg.inference.quality.scores`) flags
them; `write_sets` writes them only when asked for by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import nibabel as nib
import numpy as np
from scipy import ndimage

from ctseg.atomic import atomic_path
from ctseg.labels import LIVER, TUMOUR

AIR_HU = -1000.0
# The changes and what each does; the numbers are what clinical scans differ by.
CHANGES = {
    "clean": "as acquired",
    "rotated": "patient turned 15° about the body's long axis and tilted 8°",
    "larger": "a patient 15 % larger in every direction",
    "smaller": "a patient 13 % smaller in every direction (1 / 1.15)",
    "noise": "low dose: Gaussian noise of 25 HU added",
    "soft": "soft reconstruction kernel: Gaussian blur of 1.2 mm",
    "thick": "5 mm slices, each the mean of the thin slices it covers",
    "contrast": "portal venous phase: liver +40 HU, tumour +15 HU",
}
# Scans of other kinds, with their truth (not in the robustness set: written only by name).
OTHER_SCANS = {
    "mr": "another modality: a T1-weighted MR's intensities (fat bright, liver grey, water, "
    "bone and air dark; no Hounsfield units)",
    "chest": "a chest scan: the liver's top 25 mm (its dome) and what lies above it",
}
# The MR remapping, piecewise linear in HU: air, lung, fat, water, muscle, liver, enhanced
# blood, bone → T1 signal (arbitrary units, ≥ 0, as an MR scanner writes them).
_MR_FROM_HU = (-1000.0, -850.0, -100.0, 0.0, 40.0, 60.0, 150.0, 400.0, 1500.0)
_MR_SIGNAL = (0.0, 20.0, 850.0, 150.0, 350.0, 500.0, 250.0, 120.0, 50.0)
CHEST_DOME_MM = 25.0


def _spacing(affine: np.ndarray) -> np.ndarray:
    return np.linalg.norm(np.asarray(affine)[:3, :3], axis=0)


def _warp(
    hu: np.ndarray, labels: np.ndarray, spacing: np.ndarray, physical: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Resample both about the volume's centre: output point p reads the input at
    centre + M (p − centre), M the voxel-space form of the mm-space map `physical`."""
    scale = np.diag(spacing)
    matrix = np.linalg.inv(scale) @ physical @ scale
    centre = (np.asarray(hu.shape) - 1) / 2
    offset = centre - matrix @ centre
    image = ndimage.affine_transform(hu, matrix, offset, order=1, mode="constant", cval=AIR_HU)
    label = ndimage.affine_transform(labels, matrix, offset, order=0, mode="constant", cval=0)
    return image, label


def _rotation(about_z: float, about_x: float) -> np.ndarray:
    a, b = math.radians(about_z), math.radians(about_x)
    rz = np.array([[math.cos(a), -math.sin(a), 0], [math.sin(a), math.cos(a), 0], [0, 0, 1]])
    rx = np.array([[1, 0, 0], [0, math.cos(b), -math.sin(b)], [0, math.sin(b), math.cos(b)]])
    return rz @ rx


def _thick(
    hu: np.ndarray, labels: np.ndarray, affine: np.ndarray, mm: float = 5.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slices of `mm`: the mean of each group of thin slices, the label of its middle one."""
    step = max(1, round(mm / _spacing(affine)[2]))
    count = hu.shape[2] // step
    image = hu[:, :, : count * step].reshape(*hu.shape[:2], count, step).mean(axis=3)
    label = labels[:, :, step // 2 : count * step : step]
    thick = np.array(affine, dtype=float)
    thick[:3, 3] += thick[:3, 2] * (step - 1) / 2  # the first thick slice's centre
    thick[:3, 2] *= step
    return image, label, thick


def reacquire(
    change: str, hu: np.ndarray, labels: np.ndarray, affine: np.ndarray, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(hu, labels, affine) of the scan as `change` (one of `CHANGES` or `OTHER_SCANS`)
    acquires it."""
    if change not in CHANGES and change not in OTHER_SCANS:
        known = ", ".join([*CHANGES, *OTHER_SCANS])
        raise ValueError(f"unknown change {change!r}; one of {known}")
    hu = np.asarray(hu, np.float32)
    labels = np.asarray(labels, np.uint8)
    spacing = _spacing(affine)
    geometric: dict[str, Callable[[], np.ndarray]] = {
        "rotated": lambda: _rotation(15.0, 8.0),
        "larger": lambda: np.eye(3) / 1.15,  # output reads nearer the centre: magnified
        "smaller": lambda: np.eye(3) * 1.15,
    }
    if change in geometric:
        image, label = _warp(hu, labels, spacing, geometric[change]())
        return image, label, affine
    if change == "noise":
        rng = np.random.default_rng(seed)
        return hu + rng.normal(0.0, 25.0, hu.shape).astype(np.float32), labels, affine
    if change == "soft":
        return ndimage.gaussian_filter(hu, 1.2 / spacing), labels, affine
    if change == "thick":
        return _thick(hu, labels, affine)
    if change == "contrast":
        return enhance(hu, labels, liver_hu=40.0, tumour_hu=15.0), labels, affine
    if change == "mr":
        signal = np.interp(hu, _MR_FROM_HU, _MR_SIGNAL).astype(np.float32)
        if seed is not None:  # an MR's noise: Rician-like, a few % of the liver's signal
            rng = np.random.default_rng(seed)
            signal = np.abs(signal + rng.normal(0.0, 15.0, hu.shape).astype(np.float32))
        return signal, labels, affine
    if change == "chest":
        return chest_only(hu, labels, affine)
    return hu, labels, affine


def chest_only(
    hu: np.ndarray, labels: np.ndarray, affine: np.ndarray, dome_mm: float = CHEST_DOME_MM
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The slices from `dome_mm` below the liver's top to the scan's head end: a chest scan
    that catches the liver's dome. Head is +z in the world (RAS and LPS alike); a scan
    without a liver is returned whole."""
    affine = np.asarray(affine, dtype=float)
    slices = np.flatnonzero(np.any(labels > 0, axis=(0, 1)))
    if not len(slices):
        return hu, labels, affine
    up = affine[2, 2] > 0  # whether the slice index grows towards the head
    step = _spacing(affine)[2]
    keep = max(1, int(math.ceil(dome_mm / step)))
    if up:
        first, last = int(slices.max()) - keep + 1, hu.shape[2]
    else:
        first, last = 0, int(slices.min()) + keep
    first = max(first, 0)
    cropped = np.array(affine)
    cropped[:3, 3] += cropped[:3, 2] * first
    return hu[:, :, first:last], labels[:, :, first:last], cropped


def enhance(hu: np.ndarray, labels: np.ndarray, liver_hu: float, tumour_hu: float) -> np.ndarray:
    """The scan with its liver's voxels `liver_hu` brighter and its tumours' `tumour_hu`,
    by their labels: another contrast phase of the same patient."""
    shift = np.where(labels == LIVER, liver_hu, 0.0) + np.where(labels == TUMOUR, tumour_hu, 0.0)
    return (hu + shift).astype(np.float32)


def write_sets(heldout: Path, out: Path, changes: list[str] | None = None) -> list[Path]:
    """OUT/<change>/volume-N.nii.gz and segmentation-N.nii.gz for every pair in `heldout`."""
    folders = []
    pairs = sorted(heldout.glob("volume-*.nii*"))
    for change in changes or list(CHANGES):
        folder = out / change
        folder.mkdir(parents=True, exist_ok=True)
        for index, volume in enumerate(pairs):
            segmentation = volume.with_name(volume.name.replace("volume-", "segmentation-", 1))
            image, seg = nib.load(volume), nib.load(segmentation)
            hu, labels, affine = reacquire(
                change, image.get_fdata(), np.asarray(seg.dataobj), image.affine, seed=index
            )
            written = np.clip(np.rint(hu), -1024, 3071).astype(np.int16)
            for array, name in ((written, volume.name), (labels, segmentation.name)):
                with atomic_path(folder / name) as tmp:
                    nib.save(nib.Nifti1Image(array, affine), tmp)
        folders.append(folder)
    return folders
