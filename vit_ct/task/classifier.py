"""``ViTClassifier``: a timm Vision Transformer (arXiv:2010.11929) for CT slices, as a LightningModule.

16x16 patches, learnable position embeddings, a class token, pre-norm blocks (the network:
:mod:`vit_ct.model.network`); an optional patch head learns "is there blood in this patch" from the lesion masks,
which teaches a ViT trained from scratch where to look. The losses are :mod:`vit_ct.task.losses`, the optimiser's
groups and schedule :mod:`vit_ct.task.optim`.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Literal

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn

from vit_ct.data.transforms.contract import InputContract
from vit_ct.explain.attention import record_attention
from vit_ct.metrics.classification import classification_metrics
from vit_ct.metrics.map_scores import MapMetrics
from vit_ct.model.hparams import check_hparams, predated_hparams
from vit_ct.model.network import AirSkippingViT
from vit_ct.model.stem import ConvStemPatchEmbed
from vit_ct.model.weights import choose_stem, load_start, read_start, start_architecture
from vit_ct.model.weights_input import model_input, weights_input
from vit_ct.task.anchor import StartAnchor
from vit_ct.task.checkpointed import SeesAsCheckpointed
from vit_ct.task.inference import Inference, infer
from vit_ct.task.losses import Losses, PatchLosses, classification_loss
from vit_ct.task.optim import param_groups, warmup_cosine_schedule
from vit_ct.task.reading import MapReader, reading_of
from vit_ct.task.scan_bags import ScanBags

STAGES = ("val", "test")


class ViTClassifier(StartAnchor, MapReader, SeesAsCheckpointed):
    """Slice classifier: P(lesion) for two classes, class probabilities, or per-label probabilities.

    The defaults are a plain ViT as timm builds ``arch``, with the classification loss alone; the recipes live in
    ``configs/``. The arguments come by concern: the network, the losses, optimisation, the maps, the start weights.

    Args:
        arch: timm ViT architecture the network starts from; the arguments below override its defaults.
        img_size: Side of the square model input in pixels (a multiple of ``patch_size``; linked to the data in the
            CLI). None: the start weights' own (``weights`` holding a vit-ct checkpoint, shipped ``pretrained``
            weights), else the data modules' default, 192. A value other than the weights' resamples their position
            embeddings, said in one warning.
        patch_size: Side of a patch in pixels.
        in_chans: Input channels, one per HU window (linked to the data's windows in the CLI). None: the start
            weights' own, else 2, the data modules' default windows (brain, subdural).
        stem: ``patch``: timm's linear patch embedding; ``conv``: a convolutional stem with the same token grid,
            which trains much better from scratch on small data (arXiv:2106.14881). None: the stem the start weights
            (``weights``, ``pretrained``) hold, so that they load whole; ``conv`` without start weights.
        num_classes: Classes (label 0 = no lesion) or, with ``multilabel``, labels. None: one per name in
            ``class_names`` for multi-label (the CLI links both from ``data.label_columns``), else 2.
        class_names: Names of the classes or labels, for prediction columns (``prob_<name>``).
        multilabel: Independent sigmoid outputs and binary cross-entropy (e.g. RSNA's subtype labels).
        embed_dim: Token width; None keeps the architecture's.
        depth: Transformer blocks; None keeps the architecture's.
        num_heads: Attention heads; None keeps the architecture's.
        reg_tokens: Register tokens beside the class token (arXiv:2309.16588).
        mask_air: Patches that hold nothing (every pixel at the floor of every window: air, padding, outside the
            scan circle) are not attention keys, so the class token cannot park its attention in the air: the rollout
            is zero there by construction, not by erasing the map afterwards; and they skip the blocks, 1.3-1.4x
            faster at the same logits (:class:`vit_ct.model.network.AirSkippingViT`). Decided from the input alone.
        drop_rate: Dropout before the classifier.
        attn_drop_rate: Dropout on the attention weights, after the softmax.
        drop_path_rate: Stochastic depth, rising linearly to this rate in the last block.
        patch_loss_weight: Weight of the patch-level loss (each token predicts whether its patch holds lesion
            pixels, from the masks); 0 switches the patch head off.
        attention_loss_weight: Weight of the attention loss: on slices with a known lesion mask, the cross-entropy of
            the lesion's share of each patch against where the class token's attention flows (heads averaged), so
            that the token that decides reads the lesion. 0 switches it off; slices without masks are unaffected.
        attention_target: What the attention loss reads: ``rollout`` (the attention rollout over the patches, the
            map vit-ct shows) or ``class_token`` (the class token's attention row in each block).
        mil_loss_weight: Weight of the multiple-instance loss: the patch head's logits, pooled by log-sum-exp over the
            patches that hold something, against the slice's label, so that the patch evidence learns from slice
            labels alone (data without masks); 0 switches it off.
        mil_sharpness: ``r`` of that pooling, ``log(mean(exp(r z))) / r``: from the patches' mean (near 0) to their
            maximum (large).
        evidence_attention: On positive slices without a lesion mask, train the rollout toward the patch head's own
            evidence (the softmax of its logits, detached), as the masks train it where they exist.
        anchor_loss_weight: Weight of the anchor loss, for fine-tuning: the KL divergence of this model's rollout
            from that of the start weights (``weights`` or ``pretrained``, a frozen copy run on the same batch), on
            every slice with something in it, so that fine-tuning keeps what the start weights' maps could show
            (the model is held, its maps are never edited). Needs start weights; 0 switches it off.
        class_weights: Per-class loss weights (e.g. ``[1.0, 3.0]`` against class imbalance); per-label positive
            weights when ``multilabel``.
        label_smoothing: Label smoothing of the cross-entropy.
        label_weights: Multi-label: per-label weights of the ``weighted_log_loss`` metric (RSNA 2019:
            ``[1, 1, 1, 1, 1, 2]``, ``any`` last); None: the metric is not computed.
        lr: Peak learning rate of the default AdamW.
        weight_decay: Weight decay of the default AdamW; never applied to norms, biases, position embeddings or
            prefix tokens.
        warmup_epochs: Linear warm-up length of the default cosine schedule, in epochs (fractions allowed).
        layer_decay: Layer-wise learning-rate decay (e.g. 0.75) for fine-tuning; None: the same rate everywhere.
        grad_checkpointing: Recompute block activations in the backward pass (less memory, more compute); not while
            the attention loss is on (``attention_loss_weight`` > 0), whose attention must stay in the graph.
        optimizer: Replaces the default AdamW; receives the parameter groups.
        scheduler: Replaces the default per-step warm-up + cosine schedule.
        rollout_head_fusion: How attention rollout fuses the heads of a block (``mean``, ``max``, ``min``).
        rollout_discard_ratio: Share of the lowest attention weights rollout discards per block.
        localisation_tolerance_mm: Pointing-game tolerance of the validation and test localisation metrics, in mm
            on each slice's own pixel spacing (from the file, else the manifest's ``pixel_spacing_mm``); in pixels of
            the source slice for a slice without one, said in one warning.
        weights: Initial weights: a vit-ct checkpoint (the network takes its architecture and, where ``img_size``
            and ``in_chans`` are None, its input, as with ``pretrained``) or a timm state-dict file. Channels,
            position grid and differently sized heads are adapted. Only the network is loaded, not the trainer state.
        pretrained: A timm pretrained tag (e.g. ``vit_small_patch16_224.augreg_in21k_ft_in1k``) or weights shipped
            with vit-ct (``vit-ct/headct-tiny-256``): the network takes the weights' architecture (an ``arch``,
            ``patch_size``, ``stem``, ``embed_dim``, ``depth`` or ``num_heads`` given otherwise gives way, with a
            warning naming it) and their weights (a timm tag's loaded by timm through the Hugging Face hub and its
            local cache, shipped ones from the package), adapted as for ``weights``.
    """

    def __init__(
        self,
        *,
        # the network
        arch: str = "vit_tiny_patch16_224",
        img_size: int | None = None,
        patch_size: int = 16,
        in_chans: int | None = None,
        stem: Literal["patch", "conv"] | None = None,
        num_classes: int | None = None,
        class_names: list[str] | None = None,
        multilabel: bool = False,
        embed_dim: int | None = None,
        depth: int | None = None,
        num_heads: int | None = None,
        reg_tokens: int = 0,
        mask_air: bool = True,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        # the losses beside classification
        patch_loss_weight: float = 0.0,
        attention_loss_weight: float = 0.0,
        attention_target: Literal["rollout", "class_token"] = "rollout",
        mil_loss_weight: float = 0.0,
        mil_sharpness: float = 5.0,
        evidence_attention: bool = False,
        anchor_loss_weight: float = 0.0,
        class_weights: list[float] | None = None,
        label_smoothing: float = 0.0,
        label_weights: list[float] | None = None,
        # optimisation
        lr: float = 5e-4,
        weight_decay: float = 0.05,
        warmup_epochs: float = 1.0,
        layer_decay: float | None = None,
        grad_checkpointing: bool = False,
        optimizer: OptimizerCallable | None = None,
        scheduler: LRSchedulerCallable | None = None,
        # the maps
        rollout_head_fusion: Literal["mean", "max", "min"] = "mean",
        rollout_discard_ratio: float = 0.0,
        localisation_tolerance_mm: float = 5.0,
        # the start weights
        weights: str | None = None,
        pretrained: str | None = None,
    ) -> None:
        arguments = {name: value for name, value in locals().items() if name not in ("self", "__class__")}
        super().__init__()
        if weights and pretrained:
            raise ValueError("give --model.weights or --model.pretrained, not both")
        if num_classes is None:  # multi-label: one output per named label
            num_classes = len(class_names) if multilabel and class_names else 2
        # How the model sees: the start weights' input where they know it and the arguments leave it (None) or agree
        seen = weights_input(weights=weights, pretrained=pretrained)
        # the network the start weights fill, taken below so that they fit (a tag's, or a vit-ct checkpoint's)
        own = start_architecture(pretrained, seen.architecture if seen is not None else None)
        patch_size = own.get("patch_size") or patch_size
        contract = model_input(seen, img_size=img_size, in_chans=in_chans, patch_size=patch_size)
        arguments.update(img_size=contract.img_size, in_chans=contract.in_chans)
        check_hparams({**arguments, "num_classes": num_classes})
        # `weights` is a start point, not part of the model: a checkpoint must load without that file.
        ignore = ("optimizer", "scheduler", "weights", "pretrained")
        self.save_hyperparameters(ignore=list(ignore))
        # The CLI hands save_hyperparameters its own config, which lacks the link targets it did not set: the
        # hyper-parameters are made every argument the model is built with, so that nothing reads a fallback.
        self.hparams.update({k: v for k, v in arguments.items() if k not in self.hparams and k not in ignore})
        self.hparams.update(num_classes=num_classes, img_size=contract.img_size, in_chans=contract.in_chans)  # resolved
        start = read_start(weights, pretrained)  # the start weights, or None
        # the weights' architecture, recorded so that a checkpoint rebuilds it without the hub or the weights file
        self.hparams.update(own)
        self.hparams.stem = choose_stem(self.hparams.stem, start)  # resolved
        self.task: Literal["binary", "multiclass", "multilabel"] = (
            "multilabel" if multilabel else ("binary" if num_classes == 2 else "multiclass")
        )
        # How the weights see their input; where the start weights leave windows and read options unknown, they
        # become known from the data it is trained on or the checkpoint it is loaded from (on_save_checkpoint /
        # on_load_checkpoint).
        self.input_contract = contract
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.configure_models()
        self.configure_losses()
        self.configure_metrics()
        if start is not None:
            load_start(self, start, arguments, own_architecture=bool(own))
        self.hold_to_start(self.vit if anchor_loss_weight > 0 and start else None)  # from the start weights, each build

    def configure_models(self) -> None:
        """The network (timm's ViT, conv stem or timm's patch embedding, air patches skipping the blocks) and the
        patch head of the mask-supervised loss."""
        h = self.hparams
        overrides = {"embed_dim": h.embed_dim, "depth": h.depth, "num_heads": h.num_heads}
        self.vit = AirSkippingViT.create(
            h.arch,
            mask_air=h.mask_air,
            img_size=h.img_size,
            patch_size=h.patch_size,
            in_chans=h.in_chans,
            num_classes=h.num_classes,
            reg_tokens=h.reg_tokens,
            drop_rate=h.drop_rate,
            attn_drop_rate=h.attn_drop_rate,
            drop_path_rate=h.drop_path_rate,
            **({"embed_layer": ConvStemPatchEmbed} if h.stem == "conv" else {}),
            **{k: v for k, v in overrides.items() if v is not None},
        )
        needs_head = h.patch_loss_weight > 0 or h.mil_loss_weight > 0 or h.evidence_attention
        self.patch_head = nn.Linear(self.vit.embed_dim, 1) if needs_head else None
        if h.grad_checkpointing:
            self.vit.set_grad_checkpointing(True)

    def configure_losses(self) -> None:
        """The losses beside the classification loss, as one object with their weights resolved once (a checkpoint
        from before a loss existed migrates them in :meth:`on_load_checkpoint`), and the per-class (multi-label:
        per-label positive) weights, as a buffer that follows the model's device."""
        h = self.hparams
        self.patch_losses = PatchLosses(
            patch_size=h.patch_size, num_prefix_tokens=self.num_prefix, grid_size=self.vit.patch_embed.grid_size,
            patch_weight=h.patch_loss_weight, mil_weight=h.mil_loss_weight, mil_sharpness=h.mil_sharpness,
            attention_weight=h.attention_loss_weight, attention_target=h.attention_target,
            evidence_attention=h.evidence_attention, anchor_weight=h.anchor_loss_weight,
        )  # fmt: skip
        self.scan_bags = ScanBags(self.task, h.patch_size, self.num_prefix, sharpness=h.mil_sharpness,
                                  mil_weight=h.mil_loss_weight if self.patch_head is not None else 0.0)  # fmt: skip
        self.label_smoothing = float(h.label_smoothing)
        weights = h.class_weights
        self.register_buffer("class_weights", torch.tensor(weights, dtype=torch.float32) if weights else None)

    def configure_metrics(self) -> None:
        """Classification metrics per stage, and the maps' metrics (:class:`vit_ct.metrics.map_scores.MapMetrics`): the
        attention sink, and rollout against the lesion masks beside two floors it must beat, the image and the head."""
        h = self.hparams
        self.metrics = nn.ModuleDict(
            {
                stage: classification_metrics(
                    self.task, h.num_classes, f"{stage}/", class_names=h.class_names, label_weights=h.label_weights
                )
                for stage in STAGES
            }
        )
        self.map_metrics = nn.ModuleDict(
            {stage: MapMetrics(len(self.vit.blocks), tolerance_mm=h.localisation_tolerance_mm, stage=stage)
             for stage in STAGES}
        )  # fmt: skip

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """A checkpoint decides how its weights see the input and how they were trained: its input contract (input
        size, windows, read options), and the options it predates run as they did then (:func:`predated_hparams`:
        e.g. one saved before ``mask_air`` existed was trained with every patch as a key, and is run that way,
        whatever the current default or a config says)."""
        self.input_contract = InputContract.from_checkpoint(checkpoint)
        self.hparams.update(predated_hparams(checkpoint.get("hyper_parameters", {})))
        self.vit.mask_air = bool(self.hparams.mask_air)
        self.patch_losses = replace(self.patch_losses, attention_weight=float(self.hparams.attention_loss_weight))

    @property
    def class_names(self) -> list[str]:
        """Names of the outputs: ``class_names`` or ``0``, ``1``, ..."""
        return list(self.hparams.class_names or [str(i) for i in range(self.hparams.num_classes)])

    @property
    def num_prefix(self) -> int:
        """Class and register tokens in front of the patch tokens."""
        return int(self.vit.num_prefix_tokens)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, num_classes)`` for windowed slices ``(B, in_chans, img_size, img_size)``."""
        return self.vit(image)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """P(lesion) ``(B,)`` for binary, else ``(B, num_classes)``; float32 whatever the autocast dtype."""
        logits = logits.float()
        if self.task == "multilabel":
            return logits.sigmoid()
        probs = logits.softmax(-1)
        return probs[:, 1] if self.task == "binary" else probs

    def losses(self, batch: dict) -> Losses:
        """The batch's loss: classification, plus the patch, multiple-instance and attention losses where the batch
        holds what they score (lesion masks, labels), each weighted; in float32, also under AMP."""
        image, label = batch["image"], batch["label"]
        anchored = self.training and self.patch_losses.anchor_weight > 0  # a training loss: not in val/test's
        held = self.anchor_attention(image) if anchored else None  # the start network's attention
        if self.patch_losses.attention_weight > 0 or held is not None:
            with record_attention(self, head_fusion="mean", keep_graph=True) as attentions:
                tokens = self.vit.forward_features(image, checkpoint_blocks=False)  # (B, T, D)
        else:
            attentions, tokens = None, self.vit.forward_features(image)
        logits = self.vit.forward_head(tokens).float()
        cls = classification_loss(
            logits, label, self.task, class_weights=self.class_weights, label_smoothing=self.label_smoothing
        )
        patch_logits = None if self.patch_head is None else self.patch_head(tokens[:, self.num_prefix :]).squeeze(-1)
        terms = [("cls_loss", 1.0, cls), *self.patch_losses(batch, patch_logits, attentions, held)]
        if "scan_label" in batch:  # scan labels: the scan is the bag (vit_ct.task.scan_bags)
            ddp = self.training and self._trainer is not None and self._trainer.world_size > 1
            terms += self.scan_bags(batch, logits, patch_logits, remember=self.training, gather=ddp and self.all_gather)
        loss, parts = logits.sum() * 0.0, {}  # in the graph even where a batch scores nothing
        for name, weight, part in terms:
            if part is not None:
                parts[name] = part.detach()
                loss = loss + weight * part
        return Losses(loss, logits, parts)

    def on_fit_start(self) -> None:
        self.check_anchor(self.patch_losses.anchor_weight)
        self.scan_bags.memory.reset()  # rows of another fit's training split are not this one's

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, _, parts = self.losses(batch)
        size = batch["image"].shape[0]
        self.log("train/loss", loss, on_step=True, on_epoch=True, batch_size=size)  # not prog_bar: see LoggedLossBar
        parts = {f"train/{name}": value for name, value in parts.items()}
        self.log_dict(parts, on_step=False, on_epoch=True, batch_size=size)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> dict[str, torch.Tensor] | None:
        return self._evaluate(batch, "val")

    def test_step(self, batch: dict, batch_idx: int) -> dict[str, torch.Tensor] | None:
        return self._evaluate(batch, "test")

    def on_validation_epoch_end(self) -> None:
        self.log_dict({f"val/{name}": value for name, value in self.map_metrics["val"].compute_and_reset().items()})

    def on_test_epoch_end(self) -> None:
        self.log_dict({f"test/{name}": value for name, value in self.map_metrics["test"].compute_and_reset().items()})

    def _evaluate(self, batch: dict, stage: str) -> dict[str, torch.Tensor] | None:
        keep = batch.get("valid")  # False on samples a distributed sampler repeated to even out the ranks
        if keep is not None and not keep.all():
            batch = {k: v[keep] if torch.is_tensor(v) and v.shape[:1] == keep.shape else v for k, v in batch.items()}
        label = batch["label"]
        if not len(label):  # a batch of DDP padding only (possible when a split has fewer slices than ranks)
            return None
        image = batch["image"]  # one pass for the losses, the metrics and the map (and the command's shifted grids)
        first = self._explained(lambda: self.losses(batch), image.shape)
        explained = self.explained(image, first=first, reading=reading_of(self._trainer))
        loss, logits, _ = explained.output
        probs = self.probabilities(logits)
        self.metrics[stage].update(probs, label)  # labels -1 (a slice of a scan with a lesion) left out
        self.log(f"{stage}/loss", loss, prog_bar=stage == "val", sync_dist=True, batch_size=len(label))
        self.log_dict(self.metrics[stage], prog_bar=stage == "val")
        self.map_metrics[stage].update(
            batch, explained, num_prefix_tokens=self.num_prefix, patch_size=self.hparams.patch_size
        )
        # the slices' probabilities and rows go to callbacks (per-scan AUROC, vit_ct.run.scan_auroc)
        return {"loss": loss, "prob": probs.detach(), "index": batch["index"]}

    def predict_step(self, batch: dict, batch_idx: int) -> Inference:
        """Probabilities, rollout, attention sink and localisation scores of each slice (:func:`infer`)."""
        return infer(self, batch, reading_of(self._trainer))

    def configure_optimizers(self):
        """AdamW with a per-step warm-up + cosine schedule, unless ``optimizer`` / ``scheduler`` replace them."""
        optimizer = (self.optimizer_factory or partial(torch.optim.AdamW, lr=self.hparams.lr))(self.param_groups())
        if self.scheduler_factory is not None:
            return {"optimizer": optimizer, "lr_scheduler": self.scheduler_factory(optimizer)}
        schedule = warmup_cosine_schedule(optimizer, self.trainer, self.hparams.warmup_epochs)
        return {"optimizer": optimizer, "lr_scheduler": schedule}

    def param_groups(self) -> list[dict]:
        """The optimiser's parameter groups (:func:`vit_ct.task.optim.param_groups`), the patch head's included."""
        h = self.hparams
        return param_groups(self.vit, lr=h.lr, weight_decay=h.weight_decay, layer_decay=h.layer_decay,
                            extra=self.patch_head)  # fmt: skip
