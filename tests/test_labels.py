"""The label values' one definition: checks, the liver as an organ, the tumour burden."""

import numpy as np
import pytest

from ctseg.errors import CtsegError
from ctseg.labels import bounding_box, check_labels, liver_mask, tumour_burden, tumour_mask


def test_check_labels_names_every_value_outside_0_1_2():
    assert check_labels(np.array([0.0, 1.0, 2.0]), "seg").dtype == np.uint8
    with pytest.raises(CtsegError, match="segmentation-3.nii has label values outside .*: 3"):
        check_labels(np.array([0, 1, 3], np.uint8), "segmentation-3.nii")
    # LiTS stores some segmentations as floats: 1.5 is no label, nor is a negative value.
    with pytest.raises(
        CtsegError, match=r"outside 0 \(background\), 1 \(liver\), 2 \(tumour\): -1, 1.5"
    ):
        check_labels(np.array([[0.0, 1.5], [-1.0, 2.0]]), "the reference")


def test_the_liver_is_liver_and_tumour_and_the_burden_their_ratio():
    labels = np.array([[0, 1, 1], [2, 1, 0]], np.uint8)
    assert liver_mask(labels).sum() == 4 and tumour_mask(labels).sum() == 1
    assert tumour_burden(labels) == 0.25
    assert tumour_burden(np.zeros((2, 2), np.uint8)) is None
    assert bounding_box(liver_mask(labels)) == (slice(0, 2), slice(0, 3))
