"""The small-data benchmark's second held-out family lies outside every range the scanner-randomised pretraining set
draws (pixel spacing, kernel), with a noise inside its range, and is built by the same path as the first."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.ndimage import binary_erosion

from vit_ct.sim.anatomy import Tissue
from vit_ct.sim.cohort import COHORT_STREAM, CohortConfig, draw_patient
from vit_ct.sim.phantom import simulate_slices
from vit_ct.sim.projector import Kernel


@pytest.fixture(scope="module")
def sd():
    from benchmarks import small_data

    return small_data


def test_far_family_lies_outside_every_pretraining_range(sd):
    config = CohortConfig()
    spacings = [draw_patient(0, index, config)[3].pixel_spacing_mm for index in range(400)]
    assert max(spacings) < sd.HELDOUT_FAR.pixel_spacing_mm  # even with the field of view raised to fit big heads
    low, high = config.scanner.pixel_spacing_mm_range
    assert not low <= sd.HELDOUT_FAR.pixel_spacing_mm <= high
    for kernel in sd.HELDOUT_FAR.kernels:
        assert isinstance(kernel, Kernel)  # not a named window, which the cohort draws too
        assert kernel.half_response > config.scanner.half_response_range[1]
        assert kernel.edge_boost > config.scanner.edge_boost_range[1]
    assert sd.HELDOUT_FAMILIES == {"near": (sd.HELDOUT, sd.HELDOUT_SEED), "far": (sd.HELDOUT_FAR, sd.HELDOUT_FAR_SEED)}
    assert sd.HELDOUT_FAR_SEED not in (sd.HELDOUT_SEED, 0, COHORT_STREAM)


def test_far_family_noise_is_inside_the_pretraining_range(sd):
    slices = simulate_slices(np.random.default_rng(0), sd.HELDOUT_FAR, 3, bleed_types=["none"] * 3)
    noise = [(s.hu - s.hu_true)[binary_erosion(s.tissue == Tissue.WHITE, iterations=3)].std() for s in slices]
    assert 6 <= np.mean(noise) <= 13  # HU; the cohort's 5th-95th percentiles: 3-13 (benchmarks/small_data.py)
    assert slices[0].kernel == "G1.30B1.50" and slices[0].pixel_spacing_mm == 1.25
