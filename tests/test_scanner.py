"""CT acquisition physics against scikit-image's Radon transform and known noise behaviour."""

import numpy as np
import pytest
import torch
from skimage.data import shepp_logan_phantom
from skimage.transform import iradon, radon, resize

from vit_ct.sim.projector import FILTER_NAMES, default_angles, filtered_back_projection, forward_project
from vit_ct.sim.scanner import simulate_acquisition

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


def test_forward_project_matches_skimage_radon_on_a_disk():
    offsets = np.arange(N) - N // 2
    disk = ((offsets[:, None] - 6) ** 2 + (offsets[None, :] + 4) ** 2 <= 15**2).astype(float)  # off-centre
    reference = radon(disk, THETA_DEG, circle=True).T  # (A, n_det)
    ours = forward_project(torch.tensor(disk)[None], torch.tensor(np.deg2rad(THETA_DEG)))[0].numpy()
    assert ours.shape == reference.shape
    np.testing.assert_allclose(ours, reference, atol=1e-3 * reference.max())
    assert ours.max() == pytest.approx(31, abs=0.5)  # the digital disk is 2 * 15 + 1 pixels across


def test_forward_project_scales_with_pixel_spacing():
    mu = torch.rand(2, 33, 33)
    angles = default_angles(16)
    np.testing.assert_allclose(
        forward_project(mu, angles, pixel_spacing_mm=0.5), 0.5 * forward_project(mu, angles), rtol=1e-5
    )


@pytest.mark.parametrize("filter_name", FILTER_NAMES)
def test_filtered_back_projection_matches_skimage_iradon(shepp_logan, filter_name):
    sinogram = radon(shepp_logan, THETA_DEG, circle=True)
    reference = iradon(sinogram, THETA_DEG, filter_name=filter_name, circle=True)
    ours = filtered_back_projection(
        torch.tensor(sinogram.T)[None], torch.tensor(np.deg2rad(THETA_DEG)), filter_name=filter_name
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
