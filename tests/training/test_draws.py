"""A sample's augmentation drawn on the host (`ctseg.training.draws`): flips and quarter
turns read by index arithmetic, block by block, as the whole volume transformed."""

import numpy as np
import pytest

from ctseg.training import draws


def test_augmented_block_equals_block_of_augmented_volume():
    volume = np.arange(6 * 6 * 4).reshape(6, 6, 4)
    full_transform = {
        draws.Augmentation((1, 0, 2), (True, False, True)): np.flip(
            np.transpose(volume, (1, 0, 2)), (0, 2)
        ),
        draws.Augmentation((0, 1, 2), (False, True, False)): np.flip(volume, 1),
    }
    index = (slice(2, 5), slice(0, 3), slice(1, 4))
    for aug, augmented in full_transform.items():
        np.testing.assert_array_equal(aug.read(volume, index), augmented[index])


@pytest.mark.parametrize("k", range(4))
def test_rotations_are_exactly_np_rot90(k):
    volume = np.arange(4 * 4 * 2).reshape(4, 4, 2)
    source_axis, reverse = draws._ROTATIONS[k]
    aug = draws.Augmentation(source_axis, reverse)
    np.testing.assert_array_equal(aug.read(volume, (slice(None),) * 3), np.rot90(volume, k))
