"""CT acquisition physics against scikit-image's Radon transform (both projector methods) and known noise behaviour,
and each optional effect of the scan (kernels, rings, calibration, cupping, motion) against its reference."""

import numpy as np
import pytest
import torch
from skimage.data import shepp_logan_phantom
from skimage.transform import iradon, radon, resize

from vit_ct.sim.projector import (
    FILTER_NAMES,
    METHODS,
    Kernel,
    default_angles,
    filtered_back_projection,
    forward_project,
    fourier_filter,
)
from vit_ct.sim.scanner import gaussian_blur, moved_frames, simulate_acquisition

N = 65  # odd: skimage's rotation centre (N // 2) is then the geometric centre, so samples line up exactly
THETA_DEG = np.arange(0, 180, 2.0)


def _inside(n: int) -> np.ndarray:
    offsets = np.arange(n) - n // 2
    return offsets[:, None] ** 2 + offsets[None, :] ** 2 <= (n // 2) ** 2


@pytest.fixture(scope="module")
def shepp_logan() -> np.ndarray:
    image = resize(shepp_logan_phantom(), (N, N), anti_aliasing=True)
    image[~_inside(N)] = 0
    return image


@pytest.mark.parametrize("method", METHODS)
def test_forward_project_matches_skimage_radon_on_a_disk(method):
    offsets = np.arange(N) - N // 2
    disk = ((offsets[:, None] - 6) ** 2 + (offsets[None, :] + 4) ** 2 <= 15**2).astype(float)  # off-centre
    reference = radon(disk, THETA_DEG, circle=True).T  # (A, n_det)
    angles = torch.tensor(np.deg2rad(THETA_DEG))
    ours = forward_project(torch.tensor(disk)[None], angles, method=method)[0].numpy()
    assert ours.shape == reference.shape
    np.testing.assert_allclose(ours, reference, atol=1e-3 * reference.max())
    assert ours.max() == pytest.approx(31, abs=0.5)  # the digital disk is 2 * 15 + 1 pixels across


def test_forward_project_scales_with_pixel_spacing():
    mu = torch.rand(2, 33, 33)
    angles = default_angles(16)
    np.testing.assert_allclose(
        forward_project(mu, angles, pixel_spacing_mm=0.5), 0.5 * forward_project(mu, angles), rtol=1e-5
    )


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("filter_name", FILTER_NAMES)
def test_filtered_back_projection_matches_skimage_iradon(shepp_logan, filter_name, method):
    sinogram = radon(shepp_logan, THETA_DEG, circle=True)
    reference = iradon(sinogram, THETA_DEG, filter_name=filter_name, circle=True)
    ours = filtered_back_projection(
        torch.tensor(sinogram.T)[None], torch.tensor(np.deg2rad(THETA_DEG)), filter_name=filter_name, method=method
    )[0].numpy()
    np.testing.assert_allclose(ours[_inside(N)], reference[_inside(N)], atol=1e-4)


def test_noiseless_round_trip_reconstructs_shepp_logan(shepp_logan):
    angles = torch.tensor(np.deg2rad(THETA_DEG))
    sinogram = forward_project(torch.tensor(shepp_logan)[None], angles)
    ours = filtered_back_projection(sinogram, angles)[0].numpy()
    reference = iradon(radon(shepp_logan, THETA_DEG, circle=True), THETA_DEG, circle=True)
    inside = _inside(N)
    rmse = np.sqrt(np.mean((ours - shepp_logan)[inside] ** 2))
    reference_rmse = np.sqrt(np.mean((reference - shepp_logan)[inside] ** 2))
    assert rmse < 0.08  # the phantom spans 0 to 1
    assert rmse <= 1.01 * reference_rmse


def test_batched_kernels_match_single():
    sinogram = torch.rand(2, 20, 33)
    angles = default_angles(20)
    both = filtered_back_projection(sinogram, angles, filter_name=["ramp", "hann"])
    torch.testing.assert_close(both[1], filtered_back_projection(sinogram[1:], angles, filter_name="hann")[0])


def test_unknown_filter_raises():
    with pytest.raises(ValueError, match="filter_name"):
        filtered_back_projection(torch.zeros(1, 8, 17), default_angles(8), filter_name="sharp")


def _water_disk(size=256, spacing=0.9, radius_mm=90.0) -> np.ndarray:
    offsets = (np.arange(size) - (size - 1) / 2) * spacing
    hu = np.full((size, size), -1000.0, np.float32)
    hu[offsets[:, None] ** 2 + offsets[None, :] ** 2 <= radius_mm**2] = 0
    return hu


def test_noise_in_water_grows_as_dose_falls_and_is_diagnostic_at_default_dose():
    hu = _water_disk()
    doses = [1.5e5, 1.5e6, 1.5e7]  # photons per ray: low, default, high
    scans = simulate_acquisition(
        np.stack([hu] * 3), generator=torch.Generator().manual_seed(0), photons_per_ray=torch.tensor(doses)
    )
    offsets = (np.arange(256) - 127.5) * 0.9
    centre = offsets[:, None] ** 2 + offsets[None, :] ** 2 <= 50**2  # mm, well inside the disk
    noise = [float(scan[centre].std()) for scan in scans.hu.numpy()]
    assert noise[0] > noise[1] > noise[2]
    assert 3 <= noise[1] <= 8  # HU, typical brain noise at diagnostic dose
    assert noise[0] / noise[1] == pytest.approx(np.sqrt(10), rel=0.25)  # Poisson: std ~ 1 / sqrt(dose)
    assert abs(float(scans.hu[1][centre].mean())) < 2  # water stays at 0 HU


def test_field_of_view_and_per_element_generators():
    hu = _water_disk(size=64, spacing=3.6)
    first = simulate_acquisition(np.stack([hu, hu]), generator=[torch.Generator().manual_seed(s) for s in (1, 2)])
    alone = simulate_acquisition(hu, generator=torch.Generator().manual_seed(2), pixel_spacing_mm=0.9)
    assert first.hu.shape == (2, 64, 64) and alone.hu.shape == (64, 64)
    torch.testing.assert_close(first.hu[1], alone.hu, atol=1e-3, rtol=0)  # element 2 ignores element 1
    offsets = np.arange(64) - 31.5  # pixels from the geometric centre
    np.testing.assert_array_equal(first.field_of_view[0].numpy(), offsets[:, None] ** 2 + offsets[None] ** 2 <= 32**2)
    assert (first.hu[~first.field_of_view] == -1000).all()


def test_matrix_method_equals_sampled_on_a_batch_of_moving_frames():
    frames = torch.rand(3, 4, 33, 33)  # 3 images, 4 poses each
    angles = default_angles(16)
    sampled = forward_project(frames, angles, pixel_spacing_mm=0.7)
    torch.testing.assert_close(forward_project(frames, angles, pixel_spacing_mm=0.7, method="matrix"), sampled)
    # views 4k..4k+3 see frame k only
    torch.testing.assert_close(sampled[:, 4:8], forward_project(frames[:, 1], angles, pixel_spacing_mm=0.7)[:, 4:8])
    sinogram = torch.rand(3, 16, 33)
    torch.testing.assert_close(
        filtered_back_projection(sinogram, angles, filter_name=Kernel(0.7, 0.3), method="matrix"),
        filtered_back_projection(sinogram, angles, filter_name=Kernel(0.7, 0.3)),
    )
    with pytest.raises(ValueError, match="method"):
        forward_project(frames[:, 0], angles, method="fast")


def test_kernel_halves_the_ramp_at_its_half_response_frequency():
    ramp = fourier_filter(64, "ramp").numpy()
    smooth = fourier_filter(64, Kernel(half_response=0.5)).numpy()
    quarter = 16  # bin 16 of 64 is 0.25 cycles per sample: half of Nyquist
    assert smooth[quarter] / ramp[quarter] == pytest.approx(0.5)
    assert smooth[0] == ramp[0]
    boosted = fourier_filter(64, Kernel(half_response=0.5, edge_boost=1.0)).numpy()
    assert boosted[quarter] / smooth[quarter] == pytest.approx(1.25)  # 1 + 1.0 * 0.5^2
    np.testing.assert_allclose(smooth[1:], smooth[1:][::-1], rtol=1e-12)  # even: a real filter
    assert Kernel(0.62, 0.3).name == "G0.62B0.30" and len(Kernel(5, 10).name) <= 16
    with pytest.raises(ValueError, match="half_response"):
        Kernel(0.0)


def test_kernel_sharpness_raises_noise_and_edge_response_monotonically():
    hu = _water_disk(size=128, spacing=1.8, radius_mm=90)
    kernels = [Kernel(0.4), Kernel(0.6), Kernel(0.8), Kernel(1.0), Kernel(1.0, 0.5)]
    batch = np.stack([hu] * len(kernels))
    noisy = simulate_acquisition(batch, generator=[torch.Generator().manual_seed(0)] * len(kernels), kernel=kernels,
                                 pixel_spacing_mm=1.8, method="matrix").hu.numpy()  # fmt: skip
    clean = simulate_acquisition(batch, photons_per_ray=1e12, kernel=kernels, pixel_spacing_mm=1.8).hu.numpy()
    offsets = (np.arange(128) - 63.5) * 1.8
    centre = offsets[:, None] ** 2 + offsets[None, :] ** 2 <= 50**2
    noise = [scan[centre].std() for scan in noisy - clean]
    edge = [np.abs(np.diff(scan[64, :])).max() for scan in clean]  # steepest step across the rim, HU per pixel
    assert all(a < b for a, b in zip(noise, noise[1:], strict=False)), noise
    assert all(a < b for a, b in zip(edge, edge[1:], strict=False)), edge


def _rings(size: int, bins: list[int], error: float) -> torch.Tensor:
    gains = torch.ones(size)
    for b in bins:
        gains[b] = gains[size - 1 - b] = 1 + error
    return gains


def test_ring_artefact_is_radially_symmetric_at_the_bad_bins_radius():
    hu = _water_disk(size=128, spacing=1.8, radius_mm=100)
    clean = simulate_acquisition(hu, photons_per_ray=1e12, pixel_spacing_mm=1.8, method="matrix").hu.numpy()
    offsets = np.arange(128) - 63.5
    radius = np.hypot(offsets[:, None], offsets[None, :])
    shells = np.round(2 * radius).astype(int)  # half-pixel shells
    inside = radius < 60

    def ring(gains):
        scan = simulate_acquisition(hu, photons_per_ray=1e12, pixel_spacing_mm=1.8, detector_gains=gains,
                                    method="matrix")  # fmt: skip
        difference = scan.hu.numpy() - clean
        profile = np.bincount(shells.ravel(), difference.ravel()) / np.maximum(np.bincount(shells.ravel()), 1)
        asymmetry = ((difference - profile[shells])[inside] ** 2).sum() / (difference[inside] ** 2).sum()
        return profile, asymmetry

    profile, asymmetry = ring(_rings(128, [40], 0.01))  # bin 40 and its mirror 87: 23.5 pixels from the centre
    assert asymmetry < 0.1  # share of the artefact's energy that is not radially symmetric
    assert abs(np.argmax(np.abs(profile[:120])) / 2 - (63.5 - 40)) <= 0.5  # at the bin's distance, pixels
    assert np.abs(profile).max() > 5  # HU: visible in a brain window
    half = torch.ones(128)
    half[40] = 1.01  # without its mirror, 180 degrees of views draw half a ring
    assert ring(half)[1] > 0.3


def test_hu_offset_shifts_water_and_gain_scales_hu():
    hu = _water_disk(size=64, spacing=3.6)
    scan = {"generator": torch.Generator(), "photons_per_ray": 1e12, "pixel_spacing_mm": 3.6}
    base = simulate_acquisition(hu, **scan)
    scan["generator"].manual_seed(0)
    shifted = simulate_acquisition(hu, **scan, hu_offset=7.0, hu_gain=1.02)
    scan["generator"].manual_seed(0)
    base = simulate_acquisition(hu, **scan)
    inside = base.field_of_view
    torch.testing.assert_close(shifted.hu[inside], base.hu[inside] * 1.02 + 7.0)
    offsets = (np.arange(64) - 31.5) * 3.6
    water = torch.from_numpy(offsets[:, None] ** 2 + offsets[None, :] ** 2 < 50**2)  # mm, away from the rim
    assert abs(float(base.hu[water].mean())) < 1.0
    assert abs(float(shifted.hu[water].mean()) - 7.0) < 1.0  # water reads the offset
    assert (shifted.hu[~inside] == -1000).all()


@pytest.mark.parametrize("cupping", [0.002, -0.002])
def test_cupping_darkens_the_centre_and_over_correction_brightens_it(cupping):
    hu = _water_disk(size=128, spacing=1.8, radius_mm=100)
    base = simulate_acquisition(hu, photons_per_ray=1e12, pixel_spacing_mm=1.8).hu.numpy()
    cupped = simulate_acquisition(hu, photons_per_ray=1e12, pixel_spacing_mm=1.8, cupping=cupping).hu.numpy()
    offsets = (np.arange(128) - 63.5) * 1.8
    radius = np.hypot(offsets[:, None], offsets[None, :])
    change = cupped - base
    centre, rim = change[radius < 20].mean(), change[(radius > 75) & (radius < 90)].mean()
    assert np.sign(rim - centre) == np.sign(cupping) and abs(rim - centre) > 2  # HU


def test_motion_frames_are_the_object_moved_and_still_patients_scan_unchanged():
    mu = torch.rand(2, 32, 32)
    poses = torch.zeros(2, 4, 3)
    poses[1, 2:, 0] = 2 * 1.5  # element 1 shifts 2 pixels right during the last half of the views
    frames = moved_frames(mu, poses, pixel_spacing_mm=1.5)
    assert torch.equal(frames[0], mu[0].expand(4, 32, 32))  # still: repeated exactly
    torch.testing.assert_close(frames[1, 2, :, 2:], mu[1, :, :-2])  # moved by whole pixels: exact samples
    assert frames[1, 2, :, :2].abs().max() < 1e-5  # air came in from the edge
    hu = _water_disk(size=64, spacing=3.6)
    still = simulate_acquisition(hu, generator=torch.Generator().manual_seed(0), pixel_spacing_mm=3.6)
    zero = simulate_acquisition(hu, generator=torch.Generator().manual_seed(0), pixel_spacing_mm=3.6,
                                motion=torch.zeros(1, 8, 3))  # fmt: skip
    torch.testing.assert_close(zero.hu, still.hu)


def test_blur_by_shifts_equals_conv2d():
    image = torch.rand(3, 40, 40)
    torch.testing.assert_close(gaussian_blur(image, 0.9, by_shifts=True), gaussian_blur(image, 0.9))
