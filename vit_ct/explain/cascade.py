"""Cascading randomisation of a timm ViT (Adebayo et al. 2018, arXiv:1810.03292): its parts from the top (head) down
to the input (patch and position embeddings), each re-initialised by timm's own initialisation, seeded."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from timm.models import named_apply
from timm.models.vision_transformer import get_init_weights_vit
from torch import nn

from vit_ct.explain.attention import _vision_transformer

# after the blocks: the final norms, attention pooling and the classifier
_TOP = ("norm", "fc_norm", "attn_pool", "head")
# the input side, re-initialised last: the token embeddings, then what sits on them before the blocks
_EMBEDDINGS = ("cls_token", "reg_token", "pos_embed")


@dataclass(frozen=True)
class CascadeStep:
    """One step of the cascade: re-initialise ``modules`` and ``tensors`` (names in the network), on top of every step
    before it."""

    name: str  # "head", "block 5", ..., "patch embedding", "position embedding"
    modules: tuple[str, ...]
    tensors: tuple[str, ...] = ()

    def parameters(self, network: nn.Module) -> list[str]:
        """The names of the parameters this step re-initialises."""
        names = [f"{m}.{p}" for m in self.modules for p, _ in network.get_submodule(m).named_parameters()]
        return names + list(self.tensors)


def _prefix(network: nn.Module, vit: nn.Module) -> str:
    return next(name for name, module in network.named_modules() if module is vit)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _has_parameters(module: nn.Module | None) -> bool:
    return isinstance(module, nn.Module) and any(True for _ in module.parameters())


def cascade_steps(network: nn.Module) -> list[CascadeStep]:
    """The steps of the cascade of the timm ViT in ``network``, top down: ``head`` (the classifier, the norms after the
    blocks, and any module of ``network`` outside the ViT, e.g. vit-ct's patch head), each block from the last to the
    first, ``patch embedding`` (timm's linear patch projection or vit-ct's conv stem), ``position embedding`` (position
    embeddings, class and register tokens, the norm before the blocks). Any parameter of the ViT none of these holds
    (a timm variant's extra) joins the last step, so that the last step leaves no trained weight.

    Args:
        network: a timm ``VisionTransformer`` or a module holding one (e.g. a :class:`vit_ct.ViTClassifier`).
    """
    vit = _vision_transformer(network)
    prefix = _prefix(network, vit)
    outside = [  # modules of a network that holds the ViT, beside it (none when the network is the ViT)
        name
        for name, module in network.named_children()
        if vit is not network and _has_parameters(module) and not any(m is vit for m in module.modules())
    ]
    top = [_join(prefix, n) for n in _TOP if _has_parameters(getattr(vit, n, None))]
    steps = [CascadeStep("head", tuple(top + outside))]
    steps += [CascadeStep(f"block {i}", (_join(prefix, f"blocks.{i}"),)) for i in reversed(range(len(vit.blocks)))]
    steps.append(CascadeStep("patch embedding", (_join(prefix, "patch_embed"),)))
    tensors = [_join(prefix, n) for n in _EMBEDDINGS if isinstance(getattr(vit, n, None), nn.Parameter)]
    pre = [_join(prefix, "norm_pre")] if _has_parameters(vit.norm_pre) else []
    planned = {p for step in steps for p in step.parameters(network)} | set(tensors)
    planned |= {p for m in pre for p in CascadeStep("", (m,)).parameters(network)}
    rest = [n for n, _ in network.named_parameters() if n not in planned]
    steps.append(CascadeStep("position embedding", tuple(pre), tuple(tensors + rest)))
    return steps


def _block_index(vit: nn.Module, module: nn.Module) -> int | None:
    return next((i for i, block in enumerate(vit.blocks) if block is module), None)


@torch.no_grad()
def reinitialise(network: nn.Module, step: CascadeStep, *, seed: int) -> None:
    """Re-initialises the parts of ``step`` in ``network`` in place, as timm initialises a new ViT: its
    ``init_weights`` scheme per module (truncated normal linear layers, reset norms and convolutions, running
    statistics of batch norms reset), position embeddings truncated normal (std 0.02), class and register tokens
    normal (std 1e-6), timm's ``fix_init`` rescaling of a block when the ViT was built with it. Seeded: the same seed
    gives the same weights on the same device; the caller's random state is left as it was.

    Args:
        network: the network holding the timm ViT (a copy: its weights are overwritten).
        step: one of :func:`cascade_steps` of ``network``.
        seed: seed of this step's draws.
    """
    vit = _vision_transformer(network)
    mode = getattr(vit, "weight_init_mode", "") or ""
    head_bias = -math.log(vit.num_classes) if "nlhb" in mode and vit.num_classes > 0 else 0.0
    init = get_init_weights_vit(mode, head_bias)
    cuda = sorted({p.device.index or 0 for p in network.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        for name in step.modules:
            module = network.get_submodule(name)
            # the name inside the ViT, as timm's init reads it (the jax scheme tells the head by its name)
            named_apply(init, module, name=name.rsplit(".", 1)[-1], include_root=True)
            index = _block_index(vit, module)
            if index is not None and getattr(vit, "fix_init", False):
                module.attn.proj.weight.div_(math.sqrt(2.0 * (index + 1)))
                module.mlp.fc2.weight.div_(math.sqrt(2.0 * (index + 1)))
        for name in step.tensors:
            tensor = network.get_parameter(name)
            if name.rsplit(".", 1)[-1] in ("cls_token", "reg_token"):
                nn.init.normal_(tensor, std=1e-6)
            else:  # position embeddings, and any extra of a timm variant
                nn.init.trunc_normal_(tensor, std=0.02)


def cascade(network: nn.Module, *, seed: int = 0) -> Iterator[tuple[str, nn.Module]]:
    """``("trained", copy)``, then ``(step name, copy)`` after each step of :func:`cascade_steps`: one copy of
    ``network`` in eval mode, re-initialised further at each step (so read it before the next). ``network`` itself is
    never changed. Step ``k`` (from 1) draws with seed ``seed + k``."""
    steps = cascade_steps(network)
    randomised = _copy(network)
    yield "trained", randomised
    for k, step in enumerate(steps, start=1):
        reinitialise(randomised, step, seed=seed + k)
        yield step.name, randomised


def _copy(network: nn.Module) -> nn.Module:
    """A deep copy in eval mode (a LightningModule's trainer reference left behind)."""
    trainer = getattr(network, "_trainer", None)
    if trainer is not None:
        network._trainer = None
    try:
        copied = copy.deepcopy(network)
    finally:
        if trainer is not None:
            network._trainer = trainer
    return copied.eval()
