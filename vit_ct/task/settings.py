"""The model's settings by concern, each documented once: what it predicts (:class:`Labels`), the losses beside
classification (:class:`GuidingLosses`), the optimiser (:class:`Optimisation`) and the maps' validation
(:class:`Maps`), beside the network (:class:`vit_ct.model.architecture.Network`).

On the command line and in configs they are groups of ``--model``: ``--model.network.depth 6``,
``--model.losses.mil_loss_weight 1``, ``--model.optimisation.lr 1e-4``. Checkpoints store the fields flat, under the
names they have had since the first release (:func:`flat_hparams`), and are read back into the groups
(:func:`grouped`), so checkpoints from before the groups and after them are one format.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from vit_ct.model.architecture import Network


@dataclass(frozen=True)
class Labels:
    """What the model predicts, and how its classification loss weighs it.

    Args:
        num_classes: Classes (label 0 = no lesion) or, with ``multilabel``, labels. None: one per name in
            ``class_names`` for multi-label (the CLI links both from ``data.label_columns``), else 2.
        class_names: Names of the classes or labels, for prediction columns (``prob_<name>``).
        multilabel: Independent sigmoid outputs and binary cross-entropy (e.g. RSNA's subtype labels).
        class_weights: Per-class loss weights (e.g. ``[1.0, 3.0]`` against class imbalance); per-label positive
            weights when ``multilabel``.
        label_smoothing: Label smoothing of the cross-entropy.
        label_weights: Multi-label: per-label weights of the ``weighted_log_loss`` metric (RSNA 2019:
            ``[1, 1, 1, 1, 1, 2]``, ``any`` last); None: the metric is not computed.
    """

    num_classes: int | None = None
    class_names: list[str] | None = None
    multilabel: bool = False
    class_weights: list[float] | None = None
    label_smoothing: float = 0.0
    label_weights: list[float] | None = None


@dataclass(frozen=True)
class GuidingLosses:
    """The losses beside classification, which teach the model where to look; each off at weight 0 (the default).

    Args:
        patch_loss_weight: Weight of the patch-level loss (each token predicts whether its patch holds lesion
            pixels, from the masks); 0 switches the patch head off.
        attention_loss_weight: Weight of the attention loss: on slices with a known lesion mask, the cross-entropy of
            the lesion's share of each patch against where the class token's attention flows (heads averaged), so
            that the token that decides reads the lesion. Slices without masks are unaffected.
        attention_target: What the attention loss reads: ``rollout`` (the attention rollout over the patches, the
            map vit-ct shows) or ``class_token`` (the class token's attention row in each block).
        mil_loss_weight: Weight of the multiple-instance loss: the patch head's logits, pooled by log-sum-exp over the
            patches that hold something, against the slice's label, so that the patch evidence learns from slice
            labels alone (data without masks).
        mil_sharpness: ``r`` of that pooling, ``log(mean(exp(r z))) / r``: from the patches' mean (near 0) to their
            maximum (large).
        evidence_attention: On positive slices without a lesion mask, train the rollout toward the patch head's own
            evidence (the softmax of its logits, detached), as the masks train it where they exist.
        anchor_loss_weight: Weight of the anchor loss, for fine-tuning: the KL divergence of this model's rollout
            from that of the start weights (``weights`` or ``pretrained``, a frozen copy run on the same batch), on
            every slice with something in it, so that fine-tuning keeps what the start weights' maps could show
            (the model is held, its maps are never edited). Needs start weights.
    """

    patch_loss_weight: float = 0.0
    attention_loss_weight: float = 0.0
    attention_target: Literal["rollout", "class_token"] = "rollout"
    mil_loss_weight: float = 0.0
    mil_sharpness: float = 5.0
    evidence_attention: bool = False
    anchor_loss_weight: float = 0.0


@dataclass(frozen=True)
class Optimisation:
    """The default optimiser (AdamW) and schedule (per-step linear warm-up, then cosine), and what a step costs.

    Args:
        lr: Peak learning rate.
        weight_decay: Weight decay; never applied to norms, biases, position embeddings or prefix tokens.
        warmup_epochs: Length of the linear warm-up, in epochs (fractions allowed).
        layer_decay: Layer-wise learning-rate decay (e.g. 0.75) for fine-tuning; None: the same rate everywhere.
        grad_checkpointing: Recompute block activations in the backward pass (less memory, more compute); not while
            the attention loss is on (``attention_loss_weight`` > 0), whose attention must stay in the graph.
    """

    lr: float = 5e-4
    weight_decay: float = 0.05
    warmup_epochs: float = 1.0
    layer_decay: float | None = None
    grad_checkpointing: bool = False


@dataclass(frozen=True)
class Maps:
    """How validation and test read the model's maps; stored with the model, since its checkpoints were chosen by
    them (how finely a command reads them is its own: :class:`vit_ct.explain.map_reading.MapReading`).

    Args:
        rollout_head_fusion: How attention rollout fuses the heads of a block (``mean``, ``max``, ``min``).
        rollout_discard_ratio: Share of the lowest attention weights rollout discards per block.
        localisation_tolerance_mm: Pointing-game tolerance of the validation and test localisation metrics, in mm
            on each slice's own pixel spacing (from the file, else the manifest's ``pixel_spacing_mm``); in pixels of
            the source slice for a slice without one, said in one warning.
    """

    rollout_head_fusion: Literal["mean", "max", "min"] = "mean"
    rollout_discard_ratio: float = 0.0
    localisation_tolerance_mm: float = 5.0


# The model's argument that holds each group, and the group's type.
GROUPS: dict[str, type] = {
    "network": Network,
    "labels": Labels,
    "losses": GuidingLosses,
    "optimisation": Optimisation,
    "maps": Maps,
}


def flat_hparams(**groups: Any) -> dict[str, Any]:
    """The groups' fields under one flat set of names, as checkpoints store them (a group not given: its defaults)."""
    flat: dict[str, Any] = {}
    for name, kind in GROUPS.items():
        flat.update(asdict(groups.get(name) or kind()))
    return flat


def nested(hparams: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Flat hyper-parameters by group, as a config holds them (``{"optimisation": {"lr": 1e-4}}``): only the fields
    ``hparams`` has, and only groups with one; names no group has are left out (e.g. Lightning's ``_instantiator``)."""
    by_group = {name: {f.name: hparams[f.name] for f in fields(kind) if f.name in hparams}
                for name, kind in GROUPS.items()}  # fmt: skip
    return {name: values for name, values in by_group.items() if values}


def grouped(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """Flat hyper-parameters (a checkpoint's, or keyword arguments by their field names) as the model's settings,
    one value per group, the fields ``hparams`` lacks at their defaults."""
    given = nested(hparams)
    return {name: kind(**given.get(name, {})) for name, kind in GROUPS.items()}


def group_of(field: str) -> str | None:
    """The group a flat name belongs to (``lr`` -> ``optimisation``); None for a name that is no group's field."""
    return next((name for name, kind in GROUPS.items() if field in {f.name for f in fields(kind)}), None)


def flat_config(model: Mapping[str, Any]) -> dict[str, Any]:
    """A config's ``model`` section (its groups, and the arguments that are none, like ``pretrained``) under flat
    names, as :meth:`vit_ct.task.classifier.ViTClassifier.from_hparams` takes them."""
    flat: dict[str, Any] = {}
    for key, value in model.items():
        flat.update(value if key in GROUPS and isinstance(value, Mapping) else {key: value})
    return flat
