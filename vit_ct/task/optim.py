"""Optimiser parameter groups (timm's: no weight decay on norms, biases and embeddings; optional layer-wise LR decay)
and the default per-step schedule: linear warm-up, then cosine to 0."""

from __future__ import annotations

import math
from collections.abc import Sequence

import lightning as L
import torch
from timm.models import VisionTransformer
from timm.optim import param_groups_layer_decay, param_groups_weight_decay
from torch import nn


def param_groups(
    vit: VisionTransformer,
    *,
    lr: float,
    weight_decay: float,
    layer_decay: float | None = None,
    extra: nn.Module | None = None,
    peak_rate: Sequence[nn.Parameter] = (),
) -> list[dict]:
    """timm's groups of the network: no decay on 1-D tensors and ``no_weight_decay()``; with ``layer_decay`` (e.g.
    0.75) each block's rate scaled by ``layer_decay ** depth_from_the_top``. ``extra`` (a head beside the network)
    joins without decay; ``peak_rate`` (tensors of the network the start weights did not train) leave their layer's
    group for one at ``lr``, with weight decay."""
    skip = vit.no_weight_decay()
    if layer_decay is not None:
        groups = param_groups_layer_decay(vit, weight_decay=weight_decay, no_weight_decay_list=skip,
                                          layer_decay=layer_decay)  # fmt: skip
        for group in groups:  # torch optimizers ignore timm's `lr_scale`: bake it into the rate
            group["lr"] = lr * group.pop("lr_scale", 1.0)
    else:
        groups = param_groups_weight_decay(vit, weight_decay=weight_decay, no_weight_decay_list=skip)
    if peak_rate:
        apart = {id(p) for p in peak_rate}
        for group in groups:
            group["params"] = [p for p in group["params"] if id(p) not in apart]
        groups = [group for group in groups if group["params"]]
        groups.append({"params": list(peak_rate), "lr": lr, "weight_decay": weight_decay})
    if extra is not None:
        groups.append({"params": list(extra.parameters()), "weight_decay": 0.0})
    return groups


def warmup_cosine_schedule(optimizer: torch.optim.Optimizer, trainer: L.Trainer, warmup_epochs: float) -> dict:
    """Lightning's ``lr_scheduler`` entry: :func:`warmup_cosine` per step over the trainer's whole run."""
    total = max(int(trainer.estimated_stepping_batches), 1)
    epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else 1
    warmup = min(int(warmup_epochs * total / epochs), total - 1)
    return {"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(warmup, total)), "interval": "step"}


def warmup_cosine(warmup_steps: int, total_steps: int):
    """LR multiplier per step: linear from ~0 to 1 over ``warmup_steps``, then cosine to 0 at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return factor
