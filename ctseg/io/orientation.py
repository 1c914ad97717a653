"""Whether two scans hold the same voxels, whatever order each file stores them in.

A label map may be stored mirrored or transposed against its scan, its affine to match
(another tool's writer, a viewer's "save as"): read into canonical (RAS) order, as
`ctseg.io.scans.read_scan` reads every scan, its voxels are the scan's. So grids are
compared there, never in the files' own orders.
"""

from __future__ import annotations

from ctseg.io.scans import Scan, geometry_difference


def voxels_difference(first: Scan, second: Scan) -> str:
    """How two scans' voxel grids differ in the world, in words ("" when they are one grid):
    compared in canonical order, so that the same voxels stored in another order are the
    same grid."""
    return geometry_difference(first.array.shape, first.affine, second.array.shape, second.affine)
