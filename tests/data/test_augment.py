"""Training augmentation on whole batches: the geometry against torch's own flips and rotations, masks that follow
the image exactly, noise that leaves clipped pixels clipped, the contrast formula by hand, seeded draws, and the data
module applying it to training batches only, as plain tensors."""

import math

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import quiet_trainer

from vit_ct.data.loading.datamodule import CTSliceDataModule
from vit_ct.data.transforms.augment import BatchAugmentation, adjust_contrast, affine_grid, warp, windowed_noise

OFF = {"flip_prob": 0.0, "affine_prob": 0.0, "noise_prob": 0.0, "contrast_prob": 0.0}


def batch_of(image: torch.Tensor) -> dict:
    mask = (image[:, :1] > 0.6).float()
    return {"image": image, "mask": mask, "head": (image[:, :1] > 0).float(), "label": torch.zeros(len(image))}


def head_slices(B: int = 4, S: int = 32, seed: int = 0) -> torch.Tensor:
    """(B, 2, S, S) windowed slices: an off-centre 'head' of random tissue, air (0) around it."""
    image = torch.zeros(B, 2, S, S)
    g = torch.Generator().manual_seed(seed)
    image[:, :, S // 4 :, S // 4 : S - S // 8] = torch.rand(B, 2, S - S // 4, S - S // 4 - S // 8, generator=g)
    return image


def test_nothing_drawn_is_the_identity():
    batch = batch_of(head_slices())
    out = BatchAugmentation(**OFF)(batch, torch.Generator().manual_seed(0))
    for key in ("image", "mask", "head"):
        torch.testing.assert_close(out[key], batch[key], atol=1e-5, rtol=0)
    assert out["label"] is batch["label"]


def test_flip_is_torchs_left_right_flip():
    batch = batch_of(head_slices())
    out = BatchAugmentation(**{**OFF, "flip_prob": 1.0})(batch, torch.Generator().manual_seed(0))
    for key in ("image", "mask", "head"):
        torch.testing.assert_close(out[key], batch[key].flip(-1), atol=1e-5, rtol=0)


def test_quarter_turn_is_torchs_rot90():
    image = head_slices(2)
    n = len(image)
    theta = BatchAugmentation.affine(
        flip=torch.zeros(n, dtype=torch.bool), moved=torch.ones(n, dtype=torch.bool),
        angle=torch.full((n,), math.pi / 2), zoom=torch.ones(n), shift=torch.zeros(n, 2),
    )  # fmt: skip
    out = warp({"image": image}, theta)["image"]
    torch.testing.assert_close(out, image.rot90(1, dims=(-2, -1)), atol=1e-5, rtol=0)


def test_shift_moves_by_the_fraction_of_the_side():
    image = head_slices(1)
    theta = BatchAugmentation.affine(
        flip=torch.zeros(1, dtype=torch.bool), moved=torch.ones(1, dtype=torch.bool),
        angle=torch.zeros(1), zoom=torch.ones(1), shift=torch.tensor([[0.25, 0.0]]),
    )  # fmt: skip
    out = warp({"image": image}, theta)["image"]
    torch.testing.assert_close(out[..., 8:], image[..., :-8], atol=1e-5, rtol=0)  # 0.25 of 32 columns: 8
    assert (out[..., :8] == 0).all()  # air comes in where the slice left


def test_grid_is_torchs_affine_grid():
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(5, 2, 3, generator=g)
    expected = F.affine_grid(theta, [5, 1, 24, 24], align_corners=False)
    torch.testing.assert_close(affine_grid(theta, 24), expected, atol=1e-6, rtol=1e-5)


def test_masks_follow_the_image_and_stay_binary():
    image = torch.zeros(16, 2, 32, 32)
    image[:, :, 10:22, 12:20] = 1.0  # a lesion, and channel 0 of the image is its mask
    batch = batch_of(image)
    batch["mask"] = image[:, :1].clone()
    out = BatchAugmentation(noise_prob=0.0, contrast_prob=0.0)(batch, torch.Generator().manual_seed(1))
    assert not torch.equal(out["mask"], batch["mask"])
    assert set(out["mask"].unique().tolist()) <= {0.0, 1.0} and set(out["head"].unique().tolist()) <= {0.0, 1.0}
    bilinear = out["image"][:, :1] > 0.5  # where the image's lesion went
    nearest = out["mask"] > 0.5
    iou = (bilinear & nearest).flatten(1).sum(1) / (bilinear | nearest).flatten(1).sum(1)
    assert iou.min() > 0.8, iou  # edges may differ by a pixel: bilinear vs nearest-neighbour


def test_noise_leaves_clipped_pixels_clipped():
    image = torch.zeros(2, 2, 8, 8)
    image[:, :, 2:6, 2:6] = 0.5
    image[:, :, 3, 3] = 1.0  # bone, above the window
    out = windowed_noise(image, torch.randn(image.shape, generator=torch.Generator().manual_seed(0)) * 0.1)
    assert (out[image == 0] == 0).all() and (out[image == 1] == 1).all()  # air and bone as the window clips them
    shown = (image > 0) & (image < 1)
    assert (out[shown] != 0.5).all() and out.min() >= 0 and out.max() <= 1


def test_augmentation_keeps_air_air():
    image = head_slices(64)
    out = BatchAugmentation()(batch_of(image), torch.Generator().manual_seed(0))["image"]
    assert (out[..., :2, :] == 0).all()  # rows that no rotation, scaling or shift of the head reaches stay air


def test_contrast_is_gamma_over_the_slices_range_by_hand():
    image = torch.rand(3, 2, 8, 8, generator=torch.Generator().manual_seed(0)) * 0.5 + 0.2
    gamma = torch.tensor([0.8, 1.0, 1.25])
    out = adjust_contrast(image, gamma)
    for b in range(3):
        x = image[b].double().numpy()
        low, span = x.min(), x.max() - x.min()
        expected = ((x - low) / (span + 1e-7)) ** gamma[b].item() * span + low
        np.testing.assert_allclose(out[b].numpy(), expected, atol=1e-5)


def test_each_part_is_drawn_per_slice_at_its_probability():
    n = 2000
    image = head_slices(n, S=16)
    batch = batch_of(image)
    generator = torch.Generator().manual_seed(0)
    flipped = BatchAugmentation(**{**OFF, "flip_prob": 0.5})(batch, generator)["image"]
    is_flipped = (flipped - image.flip(-1)).flatten(1).abs().amax(1) < 1e-5
    noisy = BatchAugmentation(**{**OFF, "noise_prob": 0.3})(batch, generator)["image"]
    has_noise = (noisy - image).flatten(1).abs().amax(1) > 1e-4  # beyond the resampling's rounding
    # 3.5 standard deviations of a binomial proportion over 2000 slices: ~0.039 (p = 0.5), ~0.036 (p = 0.3)
    assert abs(is_flipped.float().mean().item() - 0.5) < 0.04
    assert abs(has_noise.float().mean().item() - 0.3) < 0.04


def test_same_seed_same_draws():
    batch = batch_of(head_slices(8))
    a = BatchAugmentation()(batch, torch.Generator().manual_seed(3))["image"]
    b = BatchAugmentation()(batch, torch.Generator().manual_seed(3))["image"]
    c = BatchAugmentation()(batch, torch.Generator().manual_seed(4))["image"]
    assert torch.equal(a, b) and not torch.equal(a, c)


class _Recorder(L.LightningModule):
    """Keeps the batches the Trainer hands to each step (a real Trainer, data module and loaders)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: dict[str, list[dict]] = {"train": [], "val": []}

    def training_step(self, batch, batch_idx):
        self.seen["train"].append(batch)
        return (self.weight * batch["image"].mean()) ** 2 + self.weight**2

    def validation_step(self, batch, batch_idx):
        self.seen["val"].append(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("augment", [True, False])
def test_data_module_augments_training_batches_only_as_plain_tensors(synthetic_set, augment):
    data = CTSliceDataModule(str(synthetic_set), img_size=32, batch_size=4, num_workers=0, augment=augment)
    model = _Recorder()
    trainer = quiet_trainer(max_steps=2, limit_val_batches=1, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=data)
    for split, batches in model.seen.items():
        dataset = data.datasets[split]
        for batch in batches:
            assert type(batch["image"]) is torch.Tensor  # not a MetaTensor: no per-op dispatch in the model
            stored = torch.stack([dataset.load(int(i))["image"] for i in batch["index"]])
            changed = not torch.equal(batch["image"], stored)
            assert changed == (augment and split == "train"), split
