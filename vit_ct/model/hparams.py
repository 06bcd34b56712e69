"""The model's hyper-parameters: which of them shape the network, checked before anything is built, and put back as
they were for checkpoints that do not store one."""

from __future__ import annotations

import math
from typing import Any

# The hyper-parameters that shape the network, its input and outputs aside: what a network started from weights (a
# vit-ct checkpoint's, shipped ones) takes from them, so that they fit.
NETWORK = ("arch", "patch_size", "stem", "embed_dim", "depth", "num_heads", "reg_tokens", "mask_air")
# With the input it is built for, its outputs and the sequence head over the scan: everything that builds the
# network, recorded in a shipped model's card so that its weights load into the right one.
ARCHITECTURE = (*NETWORK, "img_size", "in_chans", "num_classes", "sequence")

# Hyper-parameters that did not exist when older checkpoints were written, with the value those were trained with
# (vit-ct's defaults have changed since).
BEFORE_THEY_EXISTED = {"mask_air": False, "attention_loss_weight": 0.0}


def predated_hparams(saved: dict[str, Any]) -> dict[str, Any]:
    """The hyper-parameters a checkpoint's ``saved`` ones lack because they did not exist then, with the value it
    was trained with: e.g. a checkpoint from before ``mask_air`` was trained with every patch as a key."""
    return {name: value for name, value in BEFORE_THEY_EXISTED.items() if name not in saved}


def unstored_hparams(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The hyper-parameters a checkpoint does not store, with the value its network was built with: the options it
    predates (:func:`predated_hparams`), and the input size and channels, which ``vit-ct fit`` did not store before the
    hyper-parameters held every argument (they are links from the data): its input contract says them. Every other
    argument has been stored since the first release, so a default changed since never reaches an older checkpoint."""
    from vit_ct.data.transforms.contract import InputContract

    saved = checkpoint.get("hyper_parameters") or {}
    missing = predated_hparams(saved)
    if "img_size" not in saved or "in_chans" not in saved:
        contract = InputContract.from_checkpoint(checkpoint)
        input_ = {"img_size": contract.img_size, "in_chans": contract.in_chans}
        missing.update({name: value for name, value in input_.items() if name not in saved})
    return missing


def check_hparams(hparams: dict[str, Any]) -> None:
    """Bad model arguments (``ViTClassifier``'s, ``num_classes`` resolved), named with what was expected, before
    anything is built.

    Raises:
        ValueError: naming the argument and what it must be.
    """
    num_classes, multilabel, class_names = hparams["num_classes"], hparams["multilabel"], hparams["class_names"]
    img_size, patch_size, arch, lr = hparams["img_size"], hparams["patch_size"], hparams["arch"], hparams["lr"]
    class_weights, label_weights = hparams["class_weights"], hparams["label_weights"]
    if num_classes < 1 or (num_classes < 2 and not multilabel):
        raise ValueError(f"num_classes must be >= 2 (or >= 1 with multilabel), got {num_classes}")
    if img_size % patch_size:
        raise ValueError(f"img_size ({img_size}) must be a multiple of patch_size ({patch_size})")
    if class_names is not None and len(class_names) != num_classes:
        raise ValueError(
            f"class_names has {len(class_names)} names (multi-label: from data.label_columns) for"
            f" num_classes={num_classes}; set --model.labels.num_classes {len(class_names)}, or leave it unset"
        )
    if class_weights is not None and len(class_weights) != num_classes:
        raise ValueError(f"class_weights has {len(class_weights)} values for num_classes={num_classes}")
    if label_weights is not None and (not multilabel or len(label_weights) != num_classes):
        raise ValueError(
            f"label_weights ({len(label_weights)} values) need multi-label data with as many labels; got"
            f" multilabel={multilabel}, num_classes={num_classes}"
        )
    import timm  # here: `python -m vit_ct.model.shipped list` reads this module's lists without torch

    if not timm.is_model(arch) or not arch.startswith(("vit_", "deit")):
        raise ValueError(f"arch {arch!r} is not a timm Vision Transformer (e.g. vit_tiny_patch16_224)")
    if not (math.isfinite(lr) and lr > 0):  # lr 0 would train nothing without a word; a negative one ascends
        raise ValueError(f"model.optimisation.lr must be a finite number > 0 (e.g. 5e-4), got {lr}")
