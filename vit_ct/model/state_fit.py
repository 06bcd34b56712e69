"""Whether a ViT state dict fits a network: which stem it holds, what architecture its tensors show, and the first
tensor that does not fit, named in one line (instead of timm's reshaping error or a page of size mismatches)."""

from __future__ import annotations

import math
import re
from typing import Literal

import torch
from timm.models import VisionTransformer

# Keys of the heads: re-initialised when their shape differs from the target's, or where the weights have none (the
# network's classifier; beside it, the patch head and the sequence over a scan's slices, vit_ct.model.sequence).
HEAD_PREFIXES = ("head.", "patch_head.", "sequence.")


def stem_keys(state: dict) -> list[str]:
    """The keys of a state dict's patch embedding (its stem)."""
    return [k for k in state if k.startswith("patch_embed.") and "num_batches_tracked" not in k]


def stem_of(state: dict[str, torch.Tensor]) -> Literal["patch", "conv"] | None:
    """The stem a ViT state dict holds: ``patch`` (timm's linear patch embedding, one convolution ``patch_embed.proj``),
    ``conv`` (:class:`~vit_ct.model.stem.ConvStemPatchEmbed`, a sequence ``patch_embed.proj.0`` ...), or None (no
    patch embedding in it)."""
    if "patch_embed.proj.weight" in state:
        return "patch"
    return "conv" if "patch_embed.proj.0.weight" in state else None


def architecture(state: dict[str, torch.Tensor]) -> dict[str, int]:
    """What a ViT state dict's tensors say of its network, where they say it: ``embed_dim`` (the width of its tokens),
    ``depth`` (its blocks) and ``patch_size`` (the kernel of a linear patch embedding; 2 ** the stride-2 3x3
    convolutions of a conv stem)."""
    found = {}
    for key in ("cls_token", "pos_embed", "norm.weight", "blocks.0.norm1.weight"):
        if key in state and state[key].ndim >= 1:
            found["embed_dim"] = int(state[key].shape[-1])
            break
    blocks = {int(m[1]) for k in state if (m := re.match(r"blocks\.(\d+)\.", k))}
    if blocks:
        found["depth"] = max(blocks) + 1
    if stem_of(state) == "patch" and state["patch_embed.proj.weight"].ndim == 4:
        found["patch_size"] = int(state["patch_embed.proj.weight"].shape[-1])
    elif stem_of(state) == "conv":
        # each stride-2 convolution halves the grid; the 1x1 convolution that ends the stem does not stride
        convs = [v for k, v in state.items() if re.fullmatch(r"patch_embed\.proj\.\d+\.weight", k) and v.ndim == 4]
        found["patch_size"] = 2 ** sum(v.shape[-1] != 1 for v in convs)
    return found


def _described(found: dict[str, int]) -> str:
    return ", ".join(f"{name} {value}" for name, value in found.items()) or "no ViT tensors"


def _adaptable(key: str, given: torch.Tensor, target: dict[str, torch.Tensor], prefix: int) -> bool:
    """Whether :func:`adapt_state_dict` fits a tensor of another shape than ``target[key]``: a classifier head, a
    position embedding of the model's width on a square grid (after ``prefix`` tokens), the input channels of the
    first convolution."""
    wanted = target[key]
    if key.startswith(HEAD_PREFIXES):
        return True
    if given.ndim != wanted.ndim:
        return False
    if key == "pos_embed":
        patches = given.shape[1] - prefix
        return given.shape[::2] == wanted.shape[::2] and patches > 0 and math.isqrt(patches) ** 2 == patches
    first_conv = next((k for k, v in target.items() if k.startswith("patch_embed.") and v.ndim == 4), None)
    return key == first_conv and given.shape[0] == wanted.shape[0] and given.shape[2:] == wanted.shape[2:]


def first_misfit(state: dict[str, torch.Tensor], model: VisionTransformer) -> str | None:
    """The first tensor of ``state`` (in ``model``'s order) that does not fit it and cannot be adapted to it
    (:func:`_adaptable`), with both shapes; else one that only either holds (a stem of another kind starts afresh, so
    it is not one); None when every tensor fits."""
    target = model.state_dict()
    prefix = 0 if getattr(model, "no_embed_class", False) else model.num_prefix_tokens
    stems = stem_of(state) == stem_of(target)

    def counted(key: str) -> bool:  # a head is re-initialised, a stem of another kind (or none) starts afresh
        return not key.startswith(HEAD_PREFIXES) and (stems or not key.startswith("patch_embed."))

    for key, wanted in target.items():
        given = state.get(key)
        if given is not None and given.shape != wanted.shape and not _adaptable(key, given, target, prefix):
            return f"{key}: {tuple(given.shape)} in the file, {tuple(wanted.shape)} in the model"
    for key, wanted in target.items():
        if key not in state and counted(key):
            return f"{key}: absent from the file, {tuple(wanted.shape)} in the model"
    for key, given in state.items():
        if key not in target and counted(key):
            return f"{key}: {tuple(given.shape)} in the file, absent from the model"
    return None


def misfit_error(state: dict[str, torch.Tensor], model: VisionTransformer, source: str) -> ValueError | None:
    """One line naming ``source``, the first tensor that does not fit ``model`` (:func:`first_misfit`) with both
    shapes, and the architecture the file's tensors show against the model's (:func:`architecture`); None when every
    tensor fits. Without it a user read timm's reshaping error or a page of size mismatches, no file named."""
    misfit = first_misfit(state, model)
    if misfit is None:
        return None
    target = model.state_dict()
    theirs, ours = architecture(state), architecture(target)
    if stem_of(state) != stem_of(target):  # a stem of another kind starts afresh: its patch size is the model's
        theirs.pop("patch_size", None)
        ours.pop("patch_size", None)
    if theirs != ours:
        return ValueError(
            f"{source} holds another architecture ({_described(theirs)}) than the model ({_described(ours)}): first"
            f" tensor that does not fit: {misfit}; build the model as the file's (--model.network.embed_dim,"
            " --model.network.depth, --model.network.patch_size, and its --model.network.num_heads) or give weights of"
            " the model's architecture"
        )
    return ValueError(
        f"{source}: tensor {misfit}, though the file's other tensors show the model's architecture"
        f" ({_described(ours)}); expected a ViT state dict whose tensors have the model's shapes"
    )
