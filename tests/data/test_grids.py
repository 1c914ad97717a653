"""Grid resampling, its inverse (the tests' scipy reference, `helpers.from_grid`) and the HU
window."""

import numpy as np
from helpers import from_grid

from ctseg.data.grids import (
    grid_affine,
    hu_to_int16,
    hu_to_unit,
    to_grid,
)

SHAPE = (20, 14, 9)


def _ramp(shape=SHAPE) -> np.ndarray:
    x, y, z = np.indices(shape, dtype=np.float32)
    return 3 * x - 2 * y + 5 * z + 1


def test_to_grid_shapes_and_dtypes():
    image = np.zeros(SHAPE, np.int16)
    assert to_grid(image, 8, order=1).shape == (8, 8, 8)
    assert to_grid(image, 8, order=1).dtype == np.float32
    assert to_grid(image.astype(np.uint8), 8, order=0).dtype == np.uint8


def test_constant_stays_constant():
    grid = to_grid(np.full(SHAPE, -37.0, np.float32), 16, order=1)
    np.testing.assert_allclose(grid, -37.0)
    np.testing.assert_allclose(from_grid(grid, SHAPE), -37.0)


def test_linear_ramp_follows_voxel_centre_convention():
    resolution = 8
    grid = to_grid(_ramp(), resolution, order=1)
    # grid voxel i sits at source coordinate (i + 0.5) n / R - 0.5
    i = np.arange(resolution)
    coords = [(i + 0.5) * n / resolution - 0.5 for n in SHAPE]
    # Interior voxels only: 'nearest' clamps source coordinates outside [0, n-1].
    inside = [(c >= 0) & (c <= n - 1) for c, n in zip(coords, SHAPE, strict=True)]
    x, y, z = np.meshgrid(*coords, indexing="ij")
    expected = 3 * x - 2 * y + 5 * z + 1
    mask = np.ix_(*inside)
    np.testing.assert_allclose(grid[mask], expected[mask], rtol=1e-5, atol=1e-4)


def test_round_trip_of_smooth_volume():
    x, y, z = np.indices(SHAPE, dtype=np.float32)
    smooth = np.sin(x / 6) + np.cos(y / 5) * z / 9
    back = from_grid(to_grid(smooth, 20, order=1), SHAPE)
    assert back.shape == SHAPE
    assert np.abs(back - smooth).max() < 0.05


def test_same_shape_round_trip_is_identity():
    ramp = _ramp((8, 8, 8))
    np.testing.assert_allclose(from_grid(to_grid(ramp, 8, order=1), (8, 8, 8)), ramp, atol=1e-4)


def test_labels_keep_their_values_with_order_zero():
    labels = np.random.default_rng(1).choice(np.array([0, 2], np.uint8), SHAPE)
    for resolution in (7, 32):
        grid = to_grid(labels, resolution, order=0)
        assert set(np.unique(grid)) <= {0, 2}
    back = from_grid(to_grid(labels, 32, order=0), SHAPE, order=0)
    assert set(np.unique(back)) <= {0, 2}


def test_grid_affine_maps_grid_centres_onto_the_scan():
    affine = np.diag([0.8, 0.8, 2.5, 1.0])
    affine[:3, 3] = [-10, 5, 30]
    grid = grid_affine(affine, SHAPE, 8)
    # The grid's first and last voxel faces coincide with the scan's.
    corner_scan = affine @ [-0.5, -0.5, -0.5, 1]
    corner_grid = grid @ [-0.5, -0.5, -0.5, 1]
    np.testing.assert_allclose(corner_grid, corner_scan)
    far_scan = affine @ [*(np.array(SHAPE) - 0.5), 1]
    np.testing.assert_allclose(grid @ [7.5, 7.5, 7.5, 1], far_scan)


def test_hu_to_unit_range_and_clipping():
    hu = np.array([-1000, -200, 25, 250, 3000], np.int16)
    unit = hu_to_unit(hu, (-200.0, 250.0))
    assert unit.dtype == np.float32
    np.testing.assert_allclose(unit, [-1, -1, 0, 1, 1], atol=1e-6)


def test_hu_to_int16_rounds_and_clips():
    out = hu_to_int16(np.array([-0.6, 1.4, 1e6, -1e6]))
    assert out.dtype == np.int16
    assert out.tolist() == [-1, 1, 32767, -32768]
