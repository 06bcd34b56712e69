"""The scanner-randomised cohort: where each bleed kind lies (sulci, ventricles, a fluid level), mass effect, partial
volume of thick slices, look-alikes, heads true to size at any pixel spacing, the scanner draws and their noise."""

import math

import numpy as np
import pytest
from scipy.ndimage import binary_erosion

from vit_ct.sim.anatomy import Geometry, HeadFrame, Tissue, draw_anatomy, sample_head
from vit_ct.sim.bleed import BLEED_TYPES, Bleed, draw_bleed, midline_shift, paint_bleed
from vit_ct.sim.cohort import CohortConfig, draw_thick_slice, simulate_cohort_patient
from vit_ct.sim.lookalike import draw_lookalikes, paint_lookalikes
from vit_ct.sim.projector import FILTER_NAMES, Kernel
from vit_ct.sim.protocol import ScannerConfig, sample_motion, sample_protocol

LESIONS = {"hu_range": (40.0, 90.0), "low_contrast_fraction": 0.25, "small_fraction": 0.5}
THIN = ScannerConfig(slice_thicknesses_mm=(0.625,), slice_thickness_weights=(1.0,))  # one level: pure tissue HU


def _slice(seed: int, level: float, *, rotation: float = 0.1, fissures: bool = True, shift=None):
    head = sample_head(np.random.default_rng(seed))
    head = type(head)(**{**head.__dict__, "rotation": rotation})
    g = Geometry(HeadFrame(256, 0.9, head, 1.0), head, level)
    return head, g, draw_anatomy(np.random.default_rng(seed + 100), head, g, level, fissures=fissures,
                                 midline_shift=shift)  # fmt: skip


@pytest.mark.parametrize("level", [0.05, 0.2, 0.5])
def test_subarachnoid_blood_fills_sulci_and_cisterns_only(level):
    rng = np.random.default_rng(1)
    for seed in range(3):
        head, g, anatomy = _slice(seed, level)
        csf = anatomy.tissue == Tissue.CSF
        spaces = (anatomy.sulci | anatomy.cisterns) & csf
        # the anatomy's subarachnoid spaces: CSF inside the brain's outline, sulci within their depth of its surface
        assert (g.depth_inner[spaces] >= 0).all() and g.depth_brain[anatomy.sulci & csf].max() <= 20 + 1
        for _ in range(3):
            painted = anatomy._replace(tissue=anatomy.tissue.copy(), hu=anatomy.hu.copy())
            mask = paint_bleed(draw_bleed(rng, g, "subarachnoid", painted, **LESIONS), g, painted)
            assert mask.any() and not (mask & ~spaces).any()
            assert (painted.tissue[mask] == Tissue.BLEED).all() and (painted.hu[mask] >= 40).all()


def test_intraventricular_blood_lies_in_the_ventricles_and_layers_flat_in_the_scanners_frame():
    rng = np.random.default_rng(2)
    kinds = set()
    for seed in range(6):
        head, g, anatomy = _slice(seed, 0.15, rotation=0.35)  # a rotated head: the level stays horizontal
        ventricles = anatomy.ventricles & (anatomy.tissue == Tissue.CSF)
        assert np.abs(g.x[ventricles]).max() < 40 and g.depth_brain[ventricles].min() > 15  # deep, near the midline
        bleed = draw_bleed(rng, g, "intraventricular", anatomy, **LESIONS)
        mask = paint_bleed(bleed, g, anatomy)
        kinds.add(bleed.layered)
        assert mask.any() and not (mask & ~ventricles).any()
        if bleed.layered:  # dependent: every ventricle pixel below the level is blood, none above it
            rows = np.nonzero(mask)[0]
            below = ventricles & (np.arange(256)[:, None] >= rows.min())
            assert np.array_equal(mask, below)
    assert kinds == {True, False}
    _, g, above = _slice(0, 0.9)  # no ventricles at the vertex: the blood goes to the sulci instead
    assert draw_bleed(rng, g, "intraventricular", above, **LESIONS).kind == "subarachnoid"


def test_a_large_bleed_pushes_the_midline_away_and_squeezes_the_ventricle_beside_it():
    bleed = Bleed("intraparenchymal", 70.0, (30.0, 5.0), 22.0)  # 22 mm radius, right of the midline
    shift = midline_shift(bleed, 1.0)
    assert shift[0] == pytest.approx(-0.45 * 12) and shift[1] == 5.0  # mm, leftwards
    assert midline_shift(Bleed("intraparenchymal", 70.0, (30.0, 5.0), 6.0), 1.0) is None  # small: none
    _, g, still = _slice(3, 0.1, fissures=False)
    _, _, pushed = _slice(3, 0.1, fissures=False, shift=shift)

    def falx_x(anatomy):
        falx = (anatomy.tissue == Tissue.FALX) & (np.abs(g.y - 5) < 20)
        return g.x[falx].mean()

    assert falx_x(pushed) - falx_x(still) == pytest.approx(shift[0], abs=1.0)
    right = g.x > 0
    assert (pushed.ventricles & right).sum() < 0.8 * (still.ventricles & right).sum()


def test_a_thick_slice_is_the_mean_of_thin_slices_over_its_slab():
    config = CohortConfig(bleed_fraction=0.0, lookalike_probability=0.0, metal_fraction=0.0)
    head = sample_head(np.random.default_rng(0))
    frame = HeadFrame(256, 0.9, head, 1.0)
    level = 0.85  # near the vertex, where the skull cuts the slab obliquely
    thick, *_ = draw_thick_slice(np.random.default_rng(5), config, head, frame, level, 5.0)
    heights = np.array([-5 / 3, 0, 5 / 3])  # mm: three levels 2 mm or less apart
    thins = [
        draw_thick_slice(np.random.default_rng(5), config, head, frame, level + dz / 100, 0.625)[0] for dz in heights
    ]
    np.testing.assert_allclose(thick, np.mean(thins, axis=0), atol=1e-3)
    skull_band = (thins[0] != thins[2]) & (np.maximum(thins[0], thins[2]) > 500)
    assert skull_band.sum() > 100  # the slab's levels differ at the skull: partial-volume bone
    assert (np.abs(thick[skull_band] - thins[1][skull_band]) > 50).mean() > 0.5


def test_every_bleed_kind_from_2_mm_to_large_with_exact_masks_and_acute_hu():
    config = CohortConfig(bleed_fraction=1.0, small_fraction=0.4, scanner=THIN)
    slices = [s for index in range(6) for s in simulate_cohort_patient(0, index, 10, config, acquire=False)]
    assert {s.bleed_type for s in slices} == set(BLEED_TYPES[1:])
    diameters = []
    for s in slices:
        assert s.label == int(s.mask.any()) == int(s.bleed_type != "none")
        if s.label:
            assert (s.tissue[s.mask] == Tissue.BLEED).all()
            assert s.hu_true[s.mask].min() >= 40 and s.hu_true[s.mask].max() <= 90  # HU of acute blood
        if s.bleed_type == "intraparenchymal":
            diameters.append(2 * math.sqrt(s.mask.sum() / math.pi) * s.pixel_spacing_mm)  # mm
    assert min(diameters) <= 3.5 and max(diameters) >= 25


def test_lookalikes_calcify_in_their_places_and_skull_base_bone_fills_part_of_the_slice():
    rng = np.random.default_rng(4)
    found = [spot for _ in range(4) for spot in draw_lookalikes(rng, 1.0, 1.0, 0.05, extended=True)]
    kinds = {spot.kind for spot in found}
    assert {"pineal", "choroid plexus", "falx", "basal ganglia", "skull base"} <= kinds
    assert {spot.kind for spot in draw_lookalikes(rng, 1.0, 1.0, 0.5, extended=True)} == {"falx"}
    _, g, anatomy = _slice(7, 0.05)
    paint_lookalikes(found, g, anatomy)
    calcified = anatomy.hu[anatomy.tissue == Tissue.CALCIFICATION]
    assert calcified.size and calcified.min() >= 100 and calcified.max() <= 400
    bone = anatomy.tissue == Tissue.PARTIAL_BONE
    assert bone.any() and anatomy.hu[bone].min() >= 100 and anatomy.hu[bone].max() <= 600  # part bone, part brain
    assert g.depth_inner[bone].max() <= 8 and g.depth_inner[bone].min() >= -1  # reaching in from the inner table


def test_a_head_is_true_to_size_and_inside_the_field_of_view_at_any_pixel_spacing():
    widths = []
    for spacing in (0.9, 1.0):
        scanner = ScannerConfig(pixel_spacing_mm_range=(spacing, spacing))
        (simulated,) = simulate_cohort_patient(0, 3, 1, CohortConfig(head_scale_range=(0.85, 0.85), scanner=scanner),
                                               acquire=False)  # fmt: skip
        head = simulated.tissue != Tissue.AIR
        assert simulated.pixel_spacing_mm == spacing and not (head & ~simulated.field_of_view).any()
        columns = np.flatnonzero(head.any(0))
        widths.append((columns[-1] - columns[0] + 1) * spacing)  # mm
    assert widths[0] == pytest.approx(widths[1], abs=2.0)
    again = simulate_cohort_patient(0, 3, 1, CohortConfig(head_scale_range=(0.85, 0.85)), acquire=False)[0]
    big = simulate_cohort_patient(0, 3, 1, CohortConfig(head_scale_range=(1.08, 1.08)), acquire=False)[0]
    assert big.pixel_spacing_mm >= again.pixel_spacing_mm  # a larger head needs a larger field of view


def test_protocol_draws_lie_in_their_ranges():
    config = ScannerConfig()
    rng = np.random.default_rng(0)
    protocols = [sample_protocol(rng, config, size=256) for _ in range(200)]
    spacing = np.array([p.pixel_spacing_mm for p in protocols])
    assert spacing.min() >= 0.7 and spacing.max() <= 1.0
    assert {p.slice_thickness_mm for p in protocols} == set(config.slice_thicknesses_mm)
    assert {p.kernel for p in protocols if isinstance(p.kernel, str)} == set(FILTER_NAMES)
    kernels = [p.kernel for p in protocols if isinstance(p.kernel, Kernel)]
    assert 0.5 < len(kernels) / len(protocols) < 0.9
    assert all(0.4 <= k.half_response <= 1.0 and 0 <= k.edge_boost <= 0.6 for k in kernels)
    for p in protocols:  # dose per bin scales with the bin's width and the square root of the thickness
        scale = p.pixel_spacing_mm / 0.9 * math.sqrt(p.slice_thickness_mm / 5)
        assert 1.0e6 <= p.photons_per_ray / scale <= 1.5e7
        np.testing.assert_array_equal(p.detector_gains, p.detector_gains[::-1])  # rings close: mirrored bins
        assert np.abs(p.detector_gains - 1).max() <= 0.01
        assert -5 <= p.hu_offset <= 5 and 0.98 <= p.hu_gain <= 1.02 and 0 <= p.beam_hardening <= 0.12
    assert 0.1 < np.mean([(p.detector_gains != 1).any() for p in protocols]) < 0.4
    raised = sample_protocol(rng, config, size=256, min_spacing_mm=1.05)
    assert raised.pixel_spacing_mm == 1.05  # the head must fit: the field of view grows beyond the range


def test_motion_starts_at_rest_and_stays_within_its_range():
    rng = np.random.default_rng(0)
    poses = [sample_motion(rng, ScannerConfig(motion_fraction=0.5)) for _ in range(100)]
    moving = [p for p in poses if p.any()]
    assert 30 < len(moving) < 70
    for p in moving:
        assert p.shape == (8, 3) and not p[0].any()
        assert np.hypot(p[:, 0], p[:, 1]).max() <= 3.0 + 1e-9 and np.abs(p[:, 2]).max() <= math.radians(3)


@pytest.mark.medium
def test_brain_noise_of_a_standard_protocol_is_diagnostic():
    scanner = ScannerConfig(
        pixel_spacing_mm_range=(0.9, 0.9), slice_thicknesses_mm=(5.0,), slice_thickness_weights=(1.0,),
        photons_per_ray_range=(1.5e6, 1.5e6), window_kernel_fraction=0.0, half_response_range=(0.6, 0.6),
        edge_boost_range=(0.0, 0.0), ring_fraction=0.0, motion_fraction=0.0,
    )  # fmt: skip
    config = CohortConfig(bleed_fraction=0.0, metal_fraction=0.0, head_scale_range=(0.85, 0.85), scanner=scanner)
    slices = simulate_cohort_patient(0, 1, 3, config)
    noise = [(s.hu - s.hu_true)[binary_erosion(s.tissue == Tissue.WHITE, iterations=3)].std() for s in slices]
    assert 3 <= np.mean(noise) <= 8  # HU
    assert slices[0].kernel == "G0.60B0.00" and slices[0].settings["ring_bins"] == 0


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: ScannerConfig(pixel_spacing_mm_range=(1.0, 0.5)), "pixel_spacing_mm_range"),
        (lambda: ScannerConfig(slice_thickness_weights=(1.0,)), "slice_thicknesses_mm"),
        (lambda: ScannerConfig(half_response_range=(0.0, 1.0)), "half_response"),
        (lambda: ScannerConfig(ring_fraction=1.5), "ring_fraction"),
        (lambda: CohortConfig(bleed_types=("chronic",)), "bleed_types"),
        (lambda: CohortConfig(head_scale_range=(0.2, 1.0)), "head_scale_range"),
        (lambda: CohortConfig(small_radius_mm=(0.1, 1.0)), "small_radius_mm"),
    ],
)
def test_bad_config_names_the_argument(make, name):
    with pytest.raises(ValueError, match=name):
        make()
