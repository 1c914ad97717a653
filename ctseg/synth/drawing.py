"""The means of drawing a phantom: Hounsfield units of tissues, the patient-frame grid in
millimetres, smooth noise and the shapes organs are made of."""

from __future__ import annotations

import math

import numpy as np

from ctseg.synth.cases import Case

HU_AIR, HU_LUNG, HU_FAT, HU_WATER, HU_SOFT_TISSUE = -1000.0, -850.0, -100.0, 10.0, 40.0
HU_BONE, HU_DISC, HU_SPINAL_CANAL, HU_MARROW = 700.0, 100.0, 20.0, 80.0
HU_BOWEL_GAS = -950.0  # the enhancing organs' values are the contrast phase's (cases.PHASES)


class Grid:
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


def smooth_noise(
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


def ellipsoid(coords: tuple, centre: tuple, radii: tuple) -> np.ndarray:
    """Squared normalised radius; < 1 inside the ellipsoid."""
    return sum(
        ((c - np.float32(c0)) / np.float32(r)) ** 2
        for c, c0, r in zip(coords, centre, radii, strict=True)
    )


def superellipse(x: np.ndarray, y: np.ndarray, a: float, b: float, p: float = 2.5) -> np.ndarray:
    """Normalised radius of a rounded-rectangle cross-section: < 1 inside."""
    return ((np.abs(x) / a) ** p + (np.abs(y) / b) ** p) ** (1 / p)


def paint(hu: np.ndarray, mask: np.ndarray, ks: np.ndarray | slice, value: float) -> None:
    """Set `value` where the 2-D `mask` lies on slices `ks` (a slice or slice numbers)."""
    ii, jj = np.nonzero(mask)
    ks = np.arange(hu.shape[2])[ks] if isinstance(ks, slice) else ks
    if len(ii) and len(ks):
        hu[ii[:, None], jj[:, None], ks[None, :]] = value
