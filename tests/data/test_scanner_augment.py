"""Another scanner's kernel, dose and HU calibration as augmentation in HU: each part against a hand-computed or
MONAI reference, drawn per slice, reproducible, and reaching the model's batches windowed after it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import quiet_trainer
from monai.transforms import GaussianSmooth
from test_augment import _Recorder

from vit_ct import CTSliceDataModule
from vit_ct.data.transforms.model_input import apply_windows
from vit_ct.data.transforms.scanner_augment import KERNEL_SIGMAS, ScannerAugmentation

OFF = {"kernel_prob": 0.0, "noise_prob": 0.0, "calibration_prob": 0.0}


def _hu(n: int = 8, size: int = 32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    hu = torch.full((n, 1, size, size), -1000.0)
    hu[..., 6:26, 6:26] = 35 + 10 * torch.randn(n, 1, 20, 20, generator=gen)  # a "head" of brain
    hu[..., 12:16, 12:16] = 70.0  # a bleed
    return hu


def _draw(augmentation: ScannerAugmentation, hu: torch.Tensor, seed: int = 0) -> torch.Tensor:
    return augmentation(hu, torch.Generator().manual_seed(seed))


def test_nothing_drawn_is_the_identity():
    hu = _hu()
    assert torch.equal(_draw(ScannerAugmentation(**OFF), hu), hu)


def test_smoother_kernels_are_monais_gaussian_smooth_per_slice():
    hu = _hu()
    out = _draw(ScannerAugmentation(**{**OFF, "kernel_prob": 1.0, "sharpen": 0.0}), hu)  # sharper: amount 0
    smoothed = {s: torch.stack([torch.as_tensor(GaussianSmooth(sigma=s)(x)) for x in hu]) for s in KERNEL_SIGMAS}
    kinds = []
    for i in range(len(hu)):
        if torch.equal(out[i], hu[i]):
            kinds.append("unsharp by 0")
            continue
        match = [s for s in KERNEL_SIGMAS if torch.allclose(out[i], smoothed[s][i], atol=1e-3)]
        assert len(match) == 1, i
        kinds.append(match[0])
    assert "unsharp by 0" in kinds and len(set(kinds)) > 2  # both directions and several widths among 8 slices


def test_sharper_kernels_are_the_unsharp_mask():
    hu = _hu()
    out = _draw(ScannerAugmentation(**{**OFF, "kernel_prob": 1.0}), hu)
    for i in range(len(hu)):
        for s in KERNEL_SIGMAS:
            blurred = torch.as_tensor(GaussianSmooth(sigma=s)(hu[i]))
            detail = (hu[i] - blurred).flatten()
            amount = float(((out[i] - hu[i]).flatten() @ detail) / (detail @ detail))
            if 0 < amount <= 1 and torch.allclose(out[i], hu[i] + amount * (hu[i] - blurred), atol=1e-2):
                break
        else:
            assert any(torch.allclose(out[i], torch.as_tensor(GaussianSmooth(sigma=s)(hu[i])), atol=1e-3)
                       for s in KERNEL_SIGMAS), i  # fmt: skip


def test_calibration_is_a_gain_and_an_offset_in_range():
    hu = _hu()
    out = _draw(ScannerAugmentation(**{**OFF, "calibration_prob": 1.0}), hu)
    for x, y in zip(hu.flatten(1).numpy(), out.flatten(1).numpy(), strict=True):
        gain, offset = np.polyfit(x, y, 1)
        np.testing.assert_allclose(y, gain * x + offset, atol=1e-2)
        assert 0.97 <= gain <= 1.03 and -6 <= offset <= 6


def test_noise_is_zero_mean_gaussian_up_to_its_largest_deviation():
    hu = _hu(n=64)
    residual = (_draw(ScannerAugmentation(**{**OFF, "noise_prob": 1.0}), hu) - hu).flatten(1)
    assert residual.mean().abs() < 0.2
    assert residual.std(dim=1).max() <= 12.0 * 1.05 and residual.std(dim=1).min() < 4  # uniform in [0, 12] HU


def test_same_seed_same_draws_and_each_slice_its_own():
    hu = _hu()
    augmentation = ScannerAugmentation()
    assert torch.equal(_draw(augmentation, hu, 3), _draw(augmentation, hu, 3))
    changed = (_draw(augmentation, hu, 3) != hu).flatten(1).any(dim=1)
    assert 0 < int(changed.sum()) < len(hu)  # each part at 0.3 per slice: some slices drawn, others not


@pytest.mark.parametrize("cache", [True, "disk"])
def test_data_module_augments_training_batches_in_hu_before_the_windows(synthetic_set, cache, tmp_path):
    data = CTSliceDataModule(str(synthetic_set), img_size=32, batch_size=4, num_workers=0, augment=False,
                             scanner_augment=True, cache=cache, cache_dir=str(tmp_path))  # fmt: skip
    model = _Recorder()
    trainer = quiet_trainer(max_steps=3, limit_val_batches=1, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=data)
    changed = []
    for split, batches in model.seen.items():
        dataset = data.datasets[split]
        for batch in batches:
            assert type(batch["image"]) is torch.Tensor and "hu" not in batch
            items = [dataset.load(int(i)) for i in batch["index"]]  # training items from files: still in HU
            stored = torch.stack([(apply_windows(x, data.windows) if "hu" in x else x)["image"] for x in items])
            if split == "train":
                changed.append(not torch.equal(batch["image"], stored))
            else:
                assert torch.equal(batch["image"], stored), split
    assert any(changed)


def test_augmentation_benchmark_times_every_contender():

    from benchmarks import augmentation

    report = augmentation.main(["--batch", "2", "--size", "32", "--repeats", "1"])
    rows = [line for line in report.splitlines() if line.startswith("| ") and "ms per batch" not in line]
    names = [r.split(" | ")[0][2:] for r in rows]
    assert any(n.startswith("kornia") for n in names) and any(n.startswith("MONAI random intensity") for n in names)
    assert len(rows) == 6 and all(float(r.split(" | ")[1]) > 0 for r in rows)
