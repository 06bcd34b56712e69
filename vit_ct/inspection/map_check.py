"""The model-randomisation check of a map on a checkpoint's slices (Adebayo et al. 2018): the slices to read and the
check itself, shared by ``python -m vit_ct.review.sanity_command`` and ``vit-ct report``'s map section."""

from __future__ import annotations

import torch

from vit_ct.data.manifests.labels import lesion_label
from vit_ct.explain.sanity import MapFunction, RandomisationCheck, model_randomisation, rollout_map
from vit_ct.task import ViTClassifier


def sanity_slices(model: ViTClassifier, datamodule, n: int) -> dict[str, torch.Tensor]:
    """The first ``n`` slices of the datamodule's split in manifest order, on the model's device: ``image``, ``head``
    and ``label`` (lesion 0/1, -1 unknown)."""
    datamodule.setup("predict")
    parts = {"image": [], "head": [], "label": []}
    taken = 0
    for batch in datamodule.predict_dataloader():
        take = min(n - taken, batch["image"].shape[0])
        parts["image"].append(batch["image"][:take])
        parts["head"].append(batch["head"][:take])
        parts["label"].append(lesion_label(batch["label"][:take]))
        taken += take
        if taken == n:
            break
    if taken == 0:
        raise ValueError(f"manifest {datamodule.manifest} has no slice in split {datamodule.predict_split!r}")
    return {key: torch.cat(value).to(model.device) for key, value in parts.items()}


def check_map(
    model: ViTClassifier,
    slices: dict[str, torch.Tensor],
    map_fn: MapFunction = rollout_map,
    *,
    method: str = "attention rollout",
    seed: int = 0,
    batch_size: int = 16,
) -> RandomisationCheck:
    """The check of ``map_fn`` (default: ``model``'s attention rollout) on ``slices`` (:func:`sanity_slices`),
    compared inside the head; the figure shows the first two lesion slices (else the first two)."""
    lesions = (slices["label"] > 0).nonzero()[:, 0].tolist()
    examples = (lesions or list(range(len(slices["label"]))))[:2]
    check = model_randomisation(model, slices["image"], map_fn, region=slices["head"], seed=seed,
                                batch_size=batch_size, examples=examples, method=method)  # fmt: skip
    check.notes.append("maps compared inside the head: outside it vit-ct's ViT attends nowhere, trained or not")
    return check
