"""Initialise a timm ViT from a local weights file: a vit-ct checkpoint or a timm state dict (no hub, no pickle code).

Channels, position-embedding grid and classifier head are adapted to the target model with timm's own helpers.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any, Literal, NamedTuple

import timm
import torch
from lightning_utilities.core.rank_zero import rank_zero_warn  # the same rank Lightning sets
from timm.layers import resample_abs_pos_embed
from timm.models import VisionTransformer, adapt_input_conv

from vit_ct.model import shipped
from vit_ct.model.hparams import NETWORK
from vit_ct.model.state_fit import HEAD_PREFIXES, misfit_error, stem_keys, stem_of
from vit_ct.model.weights_input import read_checkpoint, unreadable_reason

STEM_NAMES = {"patch": "timm's linear patch embedding", "conv": "a convolutional stem"}


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a weights file, loaded without executing code from it (``weights_only``).

    Accepts a vit-ct / Lightning checkpoint (its ``state_dict``, network keys under ``vit.``), a plain
    timm ``state_dict`` saved with ``torch.save``, a dict holding one under ``state_dict``/``model``, or
    ``.safetensors``.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"weights file {path} does not exist")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            obj = load_file(str(path))
        elif zipfile.is_zipfile(path):  # torch.save's archive; a vit-ct checkpoint is the one the command already read
            obj = _checkpoint_or_archive(path)
        else:
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for corrupt or unsafe files
        raise ValueError(f"cannot read weights file {path}: {unreadable_reason(err)}") from None
    for key in ("state_dict", "model", "state_dict_ema"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"weights file {path} holds no state dict of tensors")
    if any(k.startswith("vit.") for k in obj):  # a vit-ct checkpoint: the network lives under `vit.`
        obj = {k[4:] if k.startswith("vit.") else k: v for k, v in obj.items()}
    return obj


def _checkpoint_or_archive(path: Path) -> dict:
    """A vit-ct checkpoint from :func:`read_checkpoint`'s copy (each command reads it once: its input contract, its
    run, its weights), any other ``torch.save`` archive memory-mapped."""
    try:
        return read_checkpoint(path)
    except ValueError:  # no `state_dict`: a plain state dict, or a dict holding one under another key
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


class StartWeights(NamedTuple):
    """The weights a network starts from: their tensors, how messages name them, and the pretrained tag (or None)."""

    state: dict[str, torch.Tensor]
    source: str
    tag: str | None


def read_start(weights: str | Path | None, pretrained: str | None) -> StartWeights | None:
    """The start weights of ``ViTClassifier(weights=..., pretrained=...)``; None without any."""
    if weights:
        return StartWeights(read_state_dict(weights), f"weights file {weights}", None)
    if pretrained:
        return StartWeights(pretrained_state_dict(pretrained), f"--model.pretrained {pretrained}", pretrained)
    return None


def load_start(
    model: torch.nn.Module,
    start: StartWeights,
    given: dict[str, Any],
    *,
    own_architecture: bool,
    slices: tuple[int, int] = (1, 1),
    neighbours: Literal["zeros", "inflated"] = "zeros",
) -> list[str]:
    """Load the start weights into ``model`` (its timm network ``model.vit``) as :func:`load_state` does; first, where
    the network took the weights' ``own_architecture`` (:func:`start_architecture`), warn about the architecture
    settings ``given`` (the model's, where not their defaults) that it overruled. Returns the keys left at their
    fresh initialisation."""
    if own_architecture:
        named = f"--model.pretrained {start.tag}" if start.tag is not None else start.source
        warn_overruled_architecture(named, given, built_architecture(model.vit, model.hparams))
    return load_state(model, start.state, vit=model.vit, source=start.source, slices=slices, neighbours=neighbours)


def choose_stem(stem: Literal["patch", "conv"] | None, start: StartWeights | None) -> Literal["patch", "conv"]:
    """The stem to build: the one asked for; else the one the start weights hold (saying so when it is timm's linear
    patch embedding, which a default conv stem would have left behind), else the conv stem."""
    if stem is not None:
        return stem
    held = stem_of(start.state) if start is not None else None
    if held == "patch":
        rank_zero_warn(
            f"{start.source} holds {STEM_NAMES['patch']}: the network is built with stem 'patch' so that it loads"
            " (--model.network.stem conv starts a convolutional stem from scratch instead)"
        )
    return held or "conv"


def adapt_state_dict(
    state: dict[str, torch.Tensor],
    model: VisionTransformer,
    *,
    slices: tuple[int, int] = (1, 1),
    neighbours: Literal["zeros", "inflated"] = "zeros",
) -> dict[str, torch.Tensor]:
    """Reshape a ViT state dict to ``model``: input channels (of a linear patch embedding or a conv stem),
    position-embedding grid, head size. ``slices``: the slices the weights and the model read for one (1, or 3 with
    context), ``neighbours`` how new neighbours start (:func:`read_as_centre`)."""
    target = model.state_dict()
    state = dict(state)
    if any(k.startswith("patch_embed.") for k in state) and set(stem_keys(state)) != set(stem_keys(target)):
        # A linear patch embedding and a conv stem share nothing: the stem starts afresh, the rest loads.
        state = {k: v for k, v in state.items() if not k.startswith("patch_embed.")}
    # The convolution that sees the image: timm's linear patch embedding (patch_embed.proj.weight) or the first conv
    # of the conv stem (patch_embed.proj.0.weight); module order puts it first among the 4-D patch_embed tensors.
    conv = next((k for k, v in target.items() if k.startswith("patch_embed.") and v.ndim == 4), None)
    per_slice = _per_slice(state[conv], slices[0]) if conv in state else None
    if conv in state and state[conv].shape[1] != target[conv].shape[1]:
        if slices[0] != slices[1] and per_slice is not None and per_slice == _per_slice(target[conv], slices[1]):
            # the same windows read for another number of slices: the slice's own kernels carry over
            state[conv] = read_as_centre(state[conv], per_slice, target[conv].shape[1], neighbours=neighbours)
        else:  # timm's rule, from any number of channels: -> 1 sums the kernels; -> N repeats them, scaled
            state[conv] = adapt_input_conv(target[conv].shape[1], state[conv], base_chans=state[conv].shape[1])
    if "pos_embed" in state and "pos_embed" in target and state["pos_embed"].shape != target["pos_embed"].shape:
        prefix = 0 if getattr(model, "no_embed_class", False) else model.num_prefix_tokens
        state["pos_embed"] = resample_abs_pos_embed(
            state["pos_embed"], new_size=model.patch_embed.grid_size, num_prefix_tokens=prefix
        )
    for key in list(state):
        if key.startswith("head.") and (key not in target or state[key].shape != target[key].shape):
            del state[key]
    return state


def load_weights(model: torch.nn.Module, path: str | Path, *, vit: VisionTransformer) -> list[str]:
    """Copy the weights in ``path`` into ``model`` (whose timm network is ``vit``); returns re-initialised keys.

    Raises:
        ValueError: The file is unreadable or its tensors do not fit the architecture (other than the
            adaptable channels, position grid and heads).
    """
    return load_state(model, read_state_dict(path), vit=vit, source=f"weights file {path}")


def check_pretrained_tag(tag: str) -> None:
    """Raises a ValueError unless ``tag`` names weights shipped with vit-ct (``vit-ct/<name>``) or pretrained weights
    timm knows, of a Vision Transformer."""
    if shipped.is_shipped(tag):
        shipped.card(tag)  # names the shipped weights there are when there is no such one
        return
    if not timm.list_pretrained(tag) or not tag.startswith(("vit_", "deit")):
        raise ValueError(
            f"--model.pretrained {tag}: not a timm pretrained tag of a ViT; list them with "
            "timm.list_pretrained('vit_*'), e.g. vit_small_patch16_224.augreg_in21k_ft_in1k"
        )


def pretrained_architecture(tag: str) -> dict:
    """The hyper-parameters of the network a pretrained tag fills: a shipped model's card's, or a timm tag's
    architecture (its own width, depth and heads)."""
    check_pretrained_tag(tag)
    if shipped.is_shipped(tag):
        return {name: value for name, value in shipped.architecture(tag).items() if name in NETWORK}
    return {"arch": tag.split(".")[0], "embed_dim": None, "depth": None, "num_heads": None}


def start_architecture(pretrained: str | None, checkpoint_hparams: dict[str, Any] | None) -> dict[str, Any]:
    """The hyper-parameters of the network that start weights fill, which the model takes so that they fit: a
    pretrained tag's (:func:`pretrained_architecture`), or those a vit-ct checkpoint given as weights was built with
    (``checkpoint_hparams``; one from before ``mask_air`` had every patch as a key); ``{}`` for a plain state dict."""
    if pretrained:
        return pretrained_architecture(pretrained)
    if checkpoint_hparams is None:
        return {}
    return {name: checkpoint_hparams.get(name, False if name == "mask_air" else None) for name in NETWORK}


def built_architecture(vit: VisionTransformer, hparams: dict) -> dict[str, Any]:
    """The architecture of a built network, by the names of ``ViTClassifier``'s arguments."""
    return {
        "arch": hparams["arch"],
        "patch_size": vit.patch_embed.patch_size[0],
        "stem": hparams["stem"],
        "embed_dim": vit.embed_dim,
        "depth": len(vit.blocks),
        "num_heads": vit.blocks[0].attn.num_heads,
        "reg_tokens": vit.num_reg_tokens,
        "mask_air": hparams["mask_air"],
    }


def warn_overruled_architecture(named: str, given: dict[str, Any], built: dict[str, Any]) -> None:
    """One warning naming the architecture arguments ``given`` (those passed other than at their default; None: the
    architecture's own) that the weights ``named`` overruled: the network is built as the weights' architecture,
    which is the only one they fit."""
    overruled = [
        f"{name} {built[name]} ({name}={value!r} was given)"
        for name, value in given.items()
        if name in built and value is not None and value != built[name]
    ]
    if overruled:
        rank_zero_warn(
            f"{named} has its own architecture, which the network takes so that the weights fit: {'; '.join(overruled)}"
        )


def pretrained_state_dict(tag: str) -> dict[str, torch.Tensor]:
    """The weights of a pretrained tag: weights shipped with vit-ct (``vit-ct/headct-tiny-256``), read offline from
    the package, or a timm tag (``vit_small_patch16_224.augreg_in21k_ft_in1k``) through timm's own loading, the
    Hugging Face hub and its local cache (offline with ``HF_HUB_OFFLINE=1`` once cached).

    Raises:
        ValueError: an unknown tag, or weights neither cached nor downloadable.
    """
    check_pretrained_tag(tag)
    if shipped.is_shipped(tag):
        return read_state_dict(shipped.weights_file(tag))
    try:
        return timm.create_model(tag, pretrained=True).state_dict()
    except Exception as err:  # huggingface_hub and timm raise many types for a missing or unreachable file
        from huggingface_hub.constants import HF_HUB_CACHE

        raise ValueError(
            f"--model.pretrained {tag}: its weights could not be loaded ({type(err).__name__}: {err}). Without internet"
            f" they must be in the Hugging Face cache ({HF_HUB_CACHE}): load the tag once with internet, or give a"
            " weights file with --model.weights"
        ) from None


def _per_slice(kernel: torch.Tensor, slices: int) -> int | None:
    """Input channels of a first convolution per slice read, None where they do not divide."""
    channels = kernel.shape[1]
    return channels // slices if channels % slices == 0 else None


def read_as_centre(
    kernel: torch.Tensor, per_slice: int, channels: int, *, neighbours: Literal["zeros", "inflated"] = "zeros"
) -> torch.Tensor:
    """A first convolution's kernels ``(out, C_in, k, k)`` for ``channels`` inputs that hold the same ``per_slice``
    windows for another number of slices, the slice's own channels first (:mod:`vit_ct.data.transforms.contract`).
    To more slices: ``zeros``: the slice's own kernels as they are, zeros for the neighbours the weights never saw,
    so that the network starts as the weights read the slice; ``inflated``: the slice's own kernels divided among
    every slice read (I3D's inflation along the scan axis), so that a scan constant along its axis is read as the
    weights read its slice. To fewer slices: the slice's own kernels, the neighbours' dropped."""
    out = kernel.new_zeros((kernel.shape[0], channels, *kernel.shape[2:]))
    own = kernel[:, :per_slice]
    if neighbours == "inflated" and channels > kernel.shape[1]:
        slices = channels // per_slice
        return (own / slices).repeat(1, slices, 1, 1)
    out[:, :per_slice] = own
    return out


def load_state(
    model: torch.nn.Module,
    state: dict[str, torch.Tensor],
    *,
    vit: VisionTransformer,
    source: str,
    slices: tuple[int, int] = (1, 1),
    neighbours: Literal["zeros", "inflated"] = "zeros",
) -> list[str]:
    """Copy a ViT state dict into ``model`` (whose timm network is ``vit``), adapted to it (:func:`adapt_state_dict`);
    returns the keys left at their fresh initialisation, and names them in one warning. ``source`` names the weights
    in errors and in the warning."""
    given = state
    error = misfit_error(state, vit, source)  # before adapting: timm's helpers fail on tensors of another network
    if error is not None:
        raise error
    state = adapt_state_dict(state, vit, slices=slices, neighbours=neighbours)
    # Heads that live beside the timm network (e.g. the patch head) keep their own prefix.
    target = model.state_dict()
    vit_prefix = next(name for name, module in model.named_modules() if module is vit)
    vit_prefix = f"{vit_prefix}." if vit_prefix else ""
    remapped = {}
    for key, value in state.items():
        name = key if key.startswith(HEAD_PREFIXES[1:]) else vit_prefix + key
        if name in target and target[name].shape == value.shape:
            remapped[name] = value
        elif not key.startswith(HEAD_PREFIXES):
            shape = tuple(target[name].shape) if name in target else "absent"
            raise ValueError(
                f"{source}: tensor {key} {tuple(value.shape)} does not fit the model ({shape}); "
                "is it a different architecture (embed_dim, depth, patch_size)?"
            )
    missing = [k for k in target if k not in remapped]
    fresh = (*HEAD_PREFIXES, "patch_embed.") if not any(k.startswith("patch_embed.") for k in state) else HEAD_PREFIXES
    not_heads = [k for k in missing if not k.removeprefix(vit_prefix).startswith(fresh)]
    if not_heads:
        raise ValueError(f"{source} lacks {len(not_heads)} tensors of the model, e.g. {not_heads[:3]}")
    model.load_state_dict(remapped, strict=False)
    if missing:
        rank_zero_warn(_fresh_start(source, missing, given, target, vit_prefix))
    unread = [key for key in state if key.startswith("sequence.") and key not in remapped]
    if unread:  # weights trained to read each slice in its scan, into a model without that head (or another kind)
        rank_zero_warn(f"{source}: the weights' sequence head over the scan ({len(unread)} tensors) is not used: this"
                       " model has none of its kind (--model.network.sequence as the weights' card names it reads"
                       " each slice in its scan as they were trained)")  # fmt: skip
    return missing


def _fresh_start(
    source: str, missing: list[str], given: dict[str, torch.Tensor], target: dict[str, torch.Tensor], vit_prefix: str
) -> str:
    """One line naming the parts of the model the weights did not fill, and why, e.g. a head for another number of
    classes, or a stem of another kind."""
    parts: dict[str, list[str]] = {}
    for key in missing:
        name = key.removeprefix(vit_prefix)
        parts.setdefault(name.split(".")[0], []).append(name)
    said = []
    for part, keys in parts.items():
        if part == "head" and "head.weight" in given:
            outputs = tuple(target[f"{vit_prefix}head.weight"].shape)[0]
            said.append(f"the classifier head ({outputs} outputs here, {given['head.weight'].shape[0]} in the weights)")
        elif part == "patch_embed":
            held = stem_of(given)
            built = "patch" if f"{vit_prefix}patch_embed.proj.weight" in target else "conv"
            why = f"the weights hold {STEM_NAMES[held]}" if held else "not in the weights"
            said.append(f"the stem ({STEM_NAMES[built]}; {why})")
        elif part in ("head", "patch_head", "sequence"):
            kind = {"head": "the classifier head", "patch_head": "the patch head", "sequence": "the sequence head"}
            said.append(f"{kind[part]} (not in the weights)")
        else:
            shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
            said.append(f"{shown} (not in the weights)")
    return f"{source}: {len(missing)} tensors start from a fresh initialisation: {'; '.join(said)}"
