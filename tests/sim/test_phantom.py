"""Synthetic head anatomy: HU per tissue (textbook head-CT ranges), exact bleed masks, class balance and CT noise."""

import numpy as np
import pytest
from scipy.ndimage import binary_dilation, binary_erosion

from vit_ct.sim.phantom import BLEED_TYPES, PhantomConfig, Tissue, sample_head, simulate_slice, simulate_slices

SMALL = PhantomConfig(size=128, pixel_spacing_mm=1.8)
TINY = PhantomConfig(size=64, pixel_spacing_mm=3.6)

HU_RANGES = {  # typical head-CT values: CSF 0-15, white matter 20-30, grey 35-45, acute blood 50-90 HU
    Tissue.AIR: (-1000, -1000),
    Tissue.SCALP: (20, 60),
    Tissue.BONE: (700, 2000),
    Tissue.DIPLOE: (300, 700),
    Tissue.CSF: (0, 15),
    Tissue.GREY: (35, 45),
    Tissue.WHITE: (20, 30),
    Tissue.FALX: (40, 60),
    Tissue.CALCIFICATION: (100, 400),
    Tissue.OEDEMA: (10, 20),
    Tissue.BLEED: (50, 90),
}


@pytest.fixture(scope="module")
def noiseless():
    rng = np.random.default_rng(0)
    kinds = BLEED_TYPES * 4
    config = PhantomConfig(lookalike_probability=1.0)
    return [simulate_slice(rng, config, bleed_type=kind, acquire=False) for kind in kinds]


def test_tissue_hu_ranges(noiseless):
    seen = set()
    for simulated in noiseless:
        for tissue, (low, high) in HU_RANGES.items():
            values = simulated.hu_true[simulated.tissue == tissue]
            if values.size:
                seen.add(tissue)
                assert low <= values.min() and values.max() <= high, tissue.name
        assert simulated.hu.dtype == np.float32 and simulated.hu.shape == (256, 256)
    assert seen == set(HU_RANGES)  # every tissue occurs somewhere


def test_mask_is_exactly_the_bleed(noiseless):
    for simulated in noiseless:
        np.testing.assert_array_equal(simulated.mask, simulated.tissue == Tissue.BLEED)
        assert simulated.label == int(simulated.mask.any()) == int(simulated.bleed_type != "none")
        if simulated.label:
            low, high = HU_RANGES[Tissue.BLEED]
            assert ((simulated.hu_true[simulated.mask] >= low) & (simulated.hu_true[simulated.mask] <= high)).all()
            # inside the cranial cavity: never touching scalp or air
            ring = binary_dilation(simulated.mask) & ~simulated.mask
            assert not np.isin(simulated.tissue[ring], (Tissue.AIR, Tissue.SCALP)).any()


def test_about_half_of_slices_bleed_and_every_type_occurs():
    slices = simulate_slices(np.random.default_rng(1), TINY, 300, acquire=False)
    labels = np.array([s.label for s in slices])
    assert 0.42 <= labels.mean() <= 0.58
    assert {s.bleed_type for s in slices} == {"none", *TINY.bleed_types}


def test_same_seed_same_slice_and_batch_equals_singles():
    one = simulate_slice(np.random.default_rng(7), SMALL)
    again = simulate_slice(np.random.default_rng(7), SMALL)
    for name in ("hu", "hu_true", "mask", "tissue", "field_of_view"):
        np.testing.assert_array_equal(getattr(one, name), getattr(again, name))
    assert (one.photons_per_ray, one.kernel, one.level) == (again.photons_per_ray, again.kernel, again.level)

    rng = np.random.default_rng(3)
    batch = simulate_slices(rng, SMALL, 2, head=sample_head(rng))
    rng = np.random.default_rng(3)
    head = sample_head(rng)
    singles = [simulate_slice(rng, SMALL, head=head) for _ in range(2)]
    for b, s in zip(batch, singles, strict=True):
        np.testing.assert_array_equal(b.hu_true, s.hu_true)
        np.testing.assert_allclose(b.hu, s.hu, atol=0.01)


def test_brain_noise_after_acquisition_is_diagnostic():
    slices = simulate_slices(np.random.default_rng(2), PhantomConfig(), 4, bleed_types=["none"] * 4)
    noise = []
    for simulated in slices:
        white = binary_erosion(simulated.tissue == Tissue.WHITE, iterations=3)  # away from edges
        noise.append(simulated.hu[white].std())
        assert simulated.kernel in PhantomConfig().kernels
        assert simulated.hu[~simulated.field_of_view].max() == -1000
    assert 3 <= np.mean(noise) <= 8  # HU


@pytest.mark.parametrize(
    "kwargs",
    [{"size": 16}, {"bleed_fraction": 1.5}, {"bleed_types": ("chronic subdural",)}, {"kernels": ("bone",)}],
)
def test_bad_config_raises(kwargs):
    with pytest.raises(ValueError):
        PhantomConfig(**kwargs)
