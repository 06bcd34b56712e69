"""A command's data follows the weights it names: every subcommand with ``--ckpt_path``, ``--model.weights`` holding a
vit-ct checkpoint or ``--model.pretrained vit-ct/<name>`` prepares slices as the weights were trained on
(:class:`~vit_ct.data.transforms.contract.InputContract`, answered by
:func:`vit_ct.model.weights_input.weights_input`, as for Python), and the network is the weights'. A config that says
otherwise is overruled in one line each, never a crash and never a silent resize to another model.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from jsonargparse import Namespace

from vit_ct.data.transforms.contract import describe_window, reading
from vit_ct.data.transforms.windows import parse_windows
from vit_ct.model.hparams import NETWORK
from vit_ct.model.weights_input import WeightsInput, weights_input


def weights_to_follow(config: Namespace) -> WeightsInput | None:
    """How the weights one subcommand's ``config`` names see their input (``--ckpt_path`` first, then
    ``--model.weights`` / ``--model.pretrained``); None when it names none that knows (a timm tag or state dict is
    adapted to the data instead)."""
    model = config.get("model") or Namespace()
    return weights_input(
        ckpt_path=config.get("ckpt_path"), weights=model.get("weights"), pretrained=model.get("pretrained")
    )


def follow_checkpoint(config: Namespace, *, command_line: Sequence[str] = ()) -> list[str]:
    """Set the data (and, for start weights, the network) of one subcommand's ``config`` to what the weights it names
    were trained with; returns one line per value changed, saying what was used and why.

    With start weights (``--model.weights``, ``--model.pretrained``), an input size or window list typed on the
    command line (``--data.init_args.img_size 256``) is kept: the weights are then adapted to it (position embeddings
    interpolated, the stem's first convolution adapted to other channels), and the line says so. A config file's value
    gives way to the weights'.

    Raises:
        ValueError: the checkpoint predates recorded inputs and the configured windows do not match its channels.
    """
    found = weights_to_follow(config)
    data = (config.get("data") or Namespace()).get("init_args")
    if found is None or data is None:
        return []
    path, kind, contract, hparams = found
    source = found.source
    lines = []
    model = config.get("model")
    if kind == "ckpt_path" and model is not None:  # start weights of a config (finetune.yaml's shipped ones) give way
        for name in ("pretrained", "weights"):
            if model.get(name):
                lines.append(f"weights follow the checkpoint: model.{name}: None (the checkpoint {path} holds the"
                             f" weights; the config said {model.get(name)!r})")  # fmt: skip
                model[name] = None
    if kind == "weights":
        for name in NETWORK:  # start weights: the network is built as theirs was
            value = hparams.get(name, False if name == "mask_air" else None)  # before mask_air: every patch a key
            said = config.model.network.get(name)
            if said == value:
                continue
            config.model.network[name] = value
            if name == "stem" and said is None:  # stem None: the weights' own, nothing to overrule
                continue
            own = _architecture_own(hparams.get("arch"), name) if value is None and said is not None else None
            if own is not None and own == said:
                continue  # None is the architecture's own value, which the config gave: nothing changes
            shown = f"{own}, {hparams.get('arch')}'s own" if own is not None else repr(value)
            lines.append(f"network follows the {source}: model.network.{name}: {shown} (the network of the weights"
                         f" {path}; the config said {said!r})")  # fmt: skip
    lines += _follow_context(data, found, config.model.network.get("neighbour_start") or "zeros", command_line)
    for name, value in contract.data_arguments().items():
        if name == "context_mm" or name not in data or _same(name, data[name], value):
            continue
        if kind == "weights" and name in ("img_size", "windows") and _typed(command_line, name):
            lines.append(
                f"input as typed: data.{name}: {_show(name, data[name])} as typed on the command line; the weights"
                f" {path} were trained with {_show(name, value)} and are adapted to it"
            )
            continue
        lines.append(
            f"input follows the {source}: data.{name}: {_show(name, value)} (as {path} was trained; the config said"
            f" {_show(name, data[name])})"
        )
        data[name] = value
    if contract.windows is None and len(parse_windows(data["windows"])) != contract.in_chans:
        raise ValueError(
            f"{path} takes {contract.in_chans} input window(s) but data.windows gives"
            f" {_show('windows', data['windows'])}; the checkpoint predates recorded inputs: pass the windows it was"
            " trained with, e.g. --data.init_args.windows [brain,subdural]"
        )
    if "img_size" in data:
        config.model.network.img_size = data["img_size"]  # the link data -> model, applied again after the change
    return lines


def _follow_context(
    data: Namespace, found: WeightsInput, neighbour_start: str = "zeros", command_line: Sequence[str] = ()
) -> list[str]:
    """The context of a command's data: a checkpoint's own (it reads slices as it was trained); with start weights
    that read neighbours, theirs where a config leaves it at None; else the data's as configured (a fine-tune may add
    neighbours to weights of single slices, or, typed on the command line, read a context start's slices alone),
    said in one line where it differs from theirs."""
    if "context_mm" not in data:
        return []  # a data module without neighbours (e.g. the pretraining cohort's)
    given, theirs = data["context_mm"], found.contract.context_mm
    if given == theirs:
        return []
    if found.kind == "ckpt_path" or (given is None and not _typed(command_line, "context_mm")):
        data["context_mm"] = theirs
        return [f"input follows the {found.source}: data.context_mm: {theirs!r} (as {found.path} was trained; the"
                f" config said {given!r})"]  # fmt: skip
    if theirs is None:
        kept = ("their kernels on the slice's own channels, zeros on the neighbours'" if neighbour_start == "zeros"
                else "their kernels spread over the slice and its neighbours, a third on each (neighbour_start:"
                " inflated)")  # fmt: skip
    elif given is None:
        kept = "their kernels on the slice's own channels; those on the neighbours' are dropped"
    else:
        kept = f"their kernels as trained, on neighbours {given:g} mm away"
    return [f"input as configured: data.context_mm: {given!r}, {reading(given)}; the weights {found.path} read"
            f" {reading(theirs)}: the model starts with {kept}"]  # fmt: skip


@functools.cache
def _architecture_values(arch: str) -> dict[str, int]:
    """``embed_dim``, ``depth`` and ``num_heads`` of a timm architecture as timm builds it (on the meta device: no
    memory, no weights): what None means for them in a checkpoint's hyper-parameters."""
    import timm
    import torch

    with torch.device("meta"):
        network = timm.create_model(arch, pretrained=False)
    return {"embed_dim": network.embed_dim, "depth": len(network.blocks), "num_heads": network.blocks[0].attn.num_heads}


def _architecture_own(arch: str | None, name: str) -> int | None:
    """The architecture's own value of ``name`` (None when unknown: not one of its sizes, or not a timm ViT)."""
    try:
        return _architecture_values(arch).get(name) if arch else None
    except Exception:  # an architecture timm cannot build here: the line says None, as the checkpoint does
        return None


def _same(name: str, configured: Any, recorded: Any) -> bool:
    if name == "windows":
        return [tuple(w) for w in parse_windows(configured)] == [tuple(w) for w in recorded]
    if name == "modalities":
        return (configured is None) == (recorded is None) and (
            configured is None or tuple(configured) == tuple(recorded)
        )
    return configured == recorded


def _show(name: str, value: Any) -> str:
    if name == "windows":
        return "[" + ", ".join(describe_window(w) for w in parse_windows(value)) + "]"
    if name == "img_size":
        return f"{value} x {value}"
    return repr(value)


def _typed(command_line: Sequence[str], name: str) -> bool:
    """Whether ``--data.<name>`` or ``--data.init_args.<name>`` was typed on the command line."""
    flags = (f"--data.{name}", f"--data.init_args.{name}")
    return any(arg in flags or arg.startswith(tuple(f"{flag}=" for flag in flags)) for arg in command_line)
