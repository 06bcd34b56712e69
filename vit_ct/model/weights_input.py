"""How named weights see their input: one answer for every command and for Python, as timm's ``pretrained_cfg`` is
for a timm tag. The weights are a vit-ct checkpoint (``--ckpt_path``, or ``--model.weights`` when it is one) or weights
shipped with vit-ct (``--model.pretrained vit-ct/<name>``, whose card stands for the checkpoint); the answer is their
:class:`~vit_ct.data.transforms.contract.InputContract` (input size, windows, read options) and the hyper-parameters
of the network they fill. A timm tag or a plain state dict has no answer (None): it is adapted to the data instead.

``fit``, ``validate``, ``test``, ``predict`` (:mod:`vit_ct.run.checkpoint_input`), the review and
``ViTClassifier(weights=..., pretrained=...)`` all ask :func:`weights_input`, so that one question never gets two
answers by path.
"""

from __future__ import annotations

import functools
import os
import re
import zipfile
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn  # the same rank Lightning sets

from vit_ct.data.transforms.contract import DEFAULT_IMG_SIZE, DEFAULT_WINDOWS, InputContract, slices_read
from vit_ct.model import shipped

# values of --ckpt_path that Lightning resolves itself (not files)
SPECIAL_CKPT_PATHS = ("best", "last", "hpc", "registry")


class WeightsInput(NamedTuple):
    """How named weights see their input.

    Attributes:
        path: The weights as the user named them (a file, or ``vit-ct/<name>``).
        kind: ``ckpt_path`` (the command's checkpoint: the network and its weights are the checkpoint's) or
            ``weights`` (start weights: ``--model.weights`` / ``--model.pretrained``).
        contract: What the weights expect.
        architecture: The hyper-parameters of the network they fill (a checkpoint's ``hyper_parameters``; a shipped
            card's ``architecture``).
    """

    path: str
    kind: Literal["ckpt_path", "weights"]
    contract: InputContract
    architecture: dict[str, Any]

    @property
    def source(self) -> str:
        """How messages name them: ``shipped weights`` or ``checkpoint``."""
        return "shipped weights" if shipped.is_shipped(self.path) else "checkpoint"


def is_checkpoint_file(ckpt_path: Any) -> bool:
    """Whether a ``--ckpt_path`` value names a file (not ``best`` / ``last`` / ... nor a URL, which Lightning
    resolves)."""
    text = str(ckpt_path or "")
    return bool(text) and text.split(":")[0] not in SPECIAL_CKPT_PATHS and "://" not in text


def weights_input(
    *, ckpt_path: str | os.PathLike | None = None, weights: str | None = None, pretrained: str | None = None
) -> WeightsInput | None:
    """How the weights a command or a model names see their input: ``ckpt_path`` first (the weights a command
    evaluates or resumes), else ``weights`` when it is a vit-ct checkpoint, else shipped ``pretrained`` weights; None
    for a timm tag, a plain state dict or no weights.

    Raises:
        ValueError: ``ckpt_path`` is not a readable vit-ct checkpoint, or ``pretrained`` names shipped weights that do
            not exist (each naming the file or tag).
    """
    if is_checkpoint_file(ckpt_path):
        checkpoint = read_lightning_checkpoint(ckpt_path)
        return WeightsInput(str(ckpt_path), "ckpt_path", InputContract.from_checkpoint(checkpoint),
                            dict(checkpoint.get("hyper_parameters") or {}))  # fmt: skip
    if shipped.is_shipped(pretrained):
        card = shipped.card(pretrained)
        return WeightsInput(pretrained, "weights", InputContract.from_dict(card["input"]), dict(card["architecture"]))
    if weights:
        try:
            checkpoint = read_checkpoint(weights)
        except ValueError:  # not a vit-ct checkpoint: read as a state dict, or named as wrong where it is loaded
            return None
        hparams = checkpoint.get("hyper_parameters") or {}
        if "arch" in hparams:
            return WeightsInput(str(weights), "weights", InputContract.from_checkpoint(checkpoint), dict(hparams))
    return None


def model_input(
    seen: WeightsInput | None,
    *,
    img_size: int | None,
    in_chans: int | None,
    patch_size: int,
    context_mm: float | None = None,
) -> InputContract:
    """How a model built with ``img_size``, ``in_chans`` and ``context_mm`` from weights that see as ``seen`` sees its
    input: the weights' own contract where the arguments leave a value to them (None) or agree with it; else the
    arguments', said in one warning (their position embeddings resampled, their first convolution adapted, their
    windows no longer known unless only the context changed). Without weights that know their input, a None takes the
    data module's default (192 x 192, 2 windows, each slice alone).
    """
    if seen is None:
        channels = len(DEFAULT_WINDOWS) * slices_read(context_mm) if in_chans is None else in_chans
        return InputContract(DEFAULT_IMG_SIZE if img_size is None else img_size, patch_size, channels,
                             context_mm=context_mm)  # fmt: skip
    theirs = seen.contract
    context = theirs.context_mm if context_mm is None and in_chans is None else context_mm
    slices = slices_read(context)
    size = theirs.img_size if img_size is None else img_size
    per_slice = theirs.in_chans // theirs.slices
    channels = per_slice * slices if in_chans is None else in_chans
    if (size, channels, context) == (theirs.img_size, theirs.in_chans, theirs.context_mm):
        return theirs
    # only the context changed (and maybe the size): the same windows read for more or fewer slices stay known
    same_windows = context != theirs.context_mm and channels == per_slice * slices
    changed = []
    if size != theirs.img_size:
        changed.append(f"their position embeddings are resampled from {theirs.img_size} x {theirs.img_size}")
    if same_windows:
        read = "single slices" if context is None else f"slices with neighbours {context:g} mm below and above"
        changed.append(f"they read {read}, their first convolution on the slice's own channels as trained")
    elif channels != theirs.in_chans:
        changed.append(f"their first convolution is adapted from {theirs.in_chans} channels, their windows unknown")
    rank_zero_warn(
        f"{seen.path} was trained on {theirs.describe()}; built for {channels} channel(s) at {size} x {size},"
        f" {' and '.join(changed)} (img_size={theirs.img_size}, in_chans={theirs.in_chans} use them as trained)"
    )
    if same_windows:
        return InputContract(size, patch_size, channels, theirs.windows, theirs.read_options, context)
    return InputContract(size, patch_size, channels, context_mm=context)


def unreadable_reason(err: Exception) -> str:
    """Why ``torch.load(weights_only=True)`` refused a file, in one line: for a pickle holding Python objects, which
    ones (unpickling them is how a file runs code) and that vit-ct loads tensors and plain values only; torch's own
    text, whose advice is to load it with ``weights_only=False``, is never passed on."""
    text = str(err)
    # torch names the object it refused as "Unsupported global: GLOBAL x.y" or "unsupported GLOBAL x.y whose module"
    refused = re.search(r"[Uu]nsupported (?:global: )?GLOBAL ([\w.]+)", text)
    if refused or "weights_only" in text or "Weights only load failed" in text:
        objects = f" (e.g. {refused[1]})" if refused else ""
        return (
            f"it holds Python objects{objects} that only unpickling would make, which can run code; vit-ct loads"
            " tensors and plain values only (a checkpoint of `vit-ct fit`, a state dict, .safetensors)"
        )
    return text.splitlines()[0] if text else type(err).__name__


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """A Lightning checkpoint's contents, tensors memory-mapped (only the small pickle is read) and no code executed.
    The last file read is kept while it is unchanged on disk, so that a command asking about it several times (its
    input, its W&B run, whether it is readable) opens it once.

    Raises:
        ValueError: naming the file: missing, not a ``torch.save`` archive (truncated, or another kind of file),
            unreadable, or not a checkpoint (no ``state_dict``: a plain or timm state dict goes to ``--model.weights``).
    """
    path = Path(path)
    expected = "expected a .ckpt written by `vit-ct fit`"
    if path.is_dir():
        found = sorted(path.rglob("*.ckpt"), key=lambda p: (p.name != "last.ckpt", len(p.parts)))
        hint = f" (it holds {found[0].relative_to(path)}: pass that file)" if found else ""
        raise ValueError(f"checkpoint {path} is a folder; {expected}{hint}")
    if not path.is_file():
        raise ValueError(f"checkpoint {path} does not exist; {expected}")
    stat = path.stat()
    checkpoint = _read_checkpoint(path.resolve(), stat.st_mtime_ns, stat.st_size, str(path))
    # the caller's own dicts (a caller may edit them), the tensors shared
    return {key: dict(value) if isinstance(value, dict) else value for key, value in checkpoint.items()}


def read_lightning_checkpoint(path: str | Path) -> dict[str, Any]:
    """:func:`read_checkpoint` of a file that Lightning restores a run or a model from (``--ckpt_path``,
    ``load_from_checkpoint``), which must have been written by Lightning.

    Raises:
        ValueError: as :func:`read_checkpoint`; or a ``state_dict`` in a file Lightning did not write (it lacks what
            Lightning restores, starting with the version it migrates from), naming the file.
    """
    checkpoint = read_checkpoint(path)
    if "pytorch-lightning_version" not in checkpoint:
        raise ValueError(
            f"checkpoint {path} holds a `state_dict` but was not written by Lightning (no"
            " `pytorch-lightning_version`): expected a .ckpt written by `vit-ct fit` (a model's state dict goes to"
            " --model.weights)"
        )
    return checkpoint


@functools.lru_cache(maxsize=1)
def _read_checkpoint(path: Path, mtime_ns: int, size: int, shown: str) -> dict[str, Any]:
    """:func:`read_checkpoint` of one version of a file (the cache key is its path, time and size)."""
    expected = "expected a .ckpt written by `vit-ct fit`"
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; a truncated copy loses its central directory
        raise ValueError(
            f"checkpoint {shown} is not a torch.save archive (truncated, or another kind of file); {expected}"
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # torch raises several types for corrupt or unsafe files
        raise ValueError(f"cannot read checkpoint {shown}: {unreadable_reason(err)}") from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ValueError(
            f"checkpoint {shown} holds no `state_dict`: {expected} (a plain or timm state dict of the network goes to"
            " --model.weights)"
        )
    return checkpoint
