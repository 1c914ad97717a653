"""A synthetic data set on disk (`ctseg synth`): cases written as LiTS names them, NIfTI
as scanners store CT, described in synth.json; resumable, deterministic."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np

from ctseg.atomic import atomic_path, claim_folder, is_json_with, write_json, write_text
from ctseg.config import check_seed
from ctseg.errors import OptionError
from ctseg.memory import host_memory, human_bytes
from ctseg.progress import Progress
from ctseg.synth.cases import (
    ABDOMINAL,
    CHEST_ABDOMEN_PELVIS,
    EXTENT_GROUP_BOUNDS_MM,
    KINDS,
    LIVER_ONLY,
    MAX_SLICES_PER_SIZE,
    RAW_INTERCEPT,
    RAW_MAX,
    Case,
    Geometry,
    max_slices,
    random_case,
)
from ctseg.synth.phantoms import Phantom, make_phantom

# Bytes a case takes while it is drawn, per voxel of its largest scan: the phantom's HU
# (float64), its labels and the stored int16 copy, with numpy's temporaries; above what
# was measured (docs/experiments/design-figures.md#synthetic-cases).
BYTES_PER_VOXEL = 24
MARKER = ".ctseg-synth"  # written first into the output folder: synth's own folder
SIDECAR = "synth.json"  # what was drawn for each case


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
        "phase": case.phase.name,
        "stored_as": geometry.stored_as,
    }


def _write_case(
    out_dir: Path, index: int, size: int, seed: int, phases: bool = False
) -> tuple[tuple[Path, Path], dict]:
    rng = np.random.default_rng((seed, index))
    case = random_case(rng, size, index, phases)
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


def check_size(size: int, available: int | None = None) -> None:
    """OptionError when a case of `size` pixels a side (its largest scan: `max_slices` slices)
    would not fit the memory `available` (default: this machine's), before anything is
    written or allocated."""
    if size < 1:
        raise OptionError(f"`size` must be positive, got {size}")
    voxels = size * size * max_slices(size)
    needed = voxels * BYTES_PER_VOXEL
    available = host_memory() if available is None else available
    if needed > available:
        largest = int((available / (MAX_SLICES_PER_SIZE * BYTES_PER_VOXEL)) ** (1 / 3)) + 1
        while largest > 1 and largest**2 * max_slices(largest) * BYTES_PER_VOXEL > available:
            largest -= 1
        raise OptionError(
            f"`size` {size}: a case of up to {size}×{size}×{max_slices(size)} voxels needs "
            f"about {human_bytes(needed)} of memory while it is drawn, more than the "
            f"{human_bytes(available)} available here; use `size` {largest} or less"
        )


def write_dataset(
    out_dir: str | Path,
    cases: int,
    size: int,
    seed: int,
    progress: Progress | None = None,
    force: bool = False,
    phases: bool = False,
) -> list[tuple[Path, Path]]:
    """Write `cases` synthetic LiTS-style cases of size×size×(at most 2.5·size) voxels, and
    synth.json, which describes each (updated after every case). `phases`: each case's
    contrast phase drawn as archives hold them (`cases.PHASES`), else one phase.

    Into a new or empty folder, one that synth wrote before, or (`force`) any folder:
    pointed at real data by mistake, it must not overwrite a LiTS volume-0.nii.gz.
    """
    check_seed("seed", seed)
    check_size(size)
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
        paths, entry = _write_case(out_dir, index, size, seed, phases)
        written.append(paths)
        entries[entry["case"]] = entry
        _write_sidecar(out_dir, entries)
        if progress is not None:
            progress(index + 1, cases, f"volume-{index}")
    return written
