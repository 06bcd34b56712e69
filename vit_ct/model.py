"""``ViTClassifier``: a timm Vision Transformer (arXiv:2010.11929) for CT slices, as a LightningModule.

16x16 patches, learnable position embeddings, a class token, pre-norm blocks; an optional patch head learns
"is there blood in this patch" from the lesion masks, which teaches a ViT trained from scratch where to look.
"""

from __future__ import annotations

import math
import warnings
from typing import Literal

import lightning as L
import timm
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from timm.optim import param_groups_layer_decay, param_groups_weight_decay
from torch import nn
from torch.utils.checkpoint import checkpoint

from vit_ct.compat import add_position_embeddings
from vit_ct.data.contract import CHECKPOINT_KEY as INPUT_CONTRACT
from vit_ct.data.contract import InputContract
from vit_ct.explain.attention import record_attention, running_tokens
from vit_ct.explain.localisation import (
    MAP_SOURCES,
    LocalisationMetrics,
    localisation_maps,
    model_grid_spacing_mm,
)
from vit_ct.explain.maps import Explained, explain_forward
from vit_ct.explain.rollout import class_token_rollout
from vit_ct.explain.sink import SinkMetrics, sink_per_slice
from vit_ct.metrics import classification_metrics
from vit_ct.stem import ConvStemPatchEmbed
from vit_ct.weights import check_pretrained_tag, load_state, load_weights, pretrained_state_dict


class ViTClassifier(L.LightningModule):
    """Slice classifier: P(lesion) for two classes, class probabilities, or per-label probabilities.

    Args:
        arch: timm ViT architecture the network starts from; the arguments below override its defaults.
        img_size: Side of the square model input in pixels (a multiple of ``patch_size``).
        patch_size: Side of a patch in pixels.
        stem: ``patch``: timm's linear patch embedding; ``conv``: a convolutional stem with the same token grid,
            which trains much better from scratch on small data (arXiv:2106.14881).
        in_chans: Input channels (one per HU window; linked to the data in the CLI). The defaults (192 x 192, two
            channels) are the demo model's: the brain and subdural windows of the data module's defaults.
        num_classes: Classes (label 0 = no lesion) or, with ``multilabel``, labels. None: one per name in
            ``class_names`` for multi-label (the CLI links both from ``data.label_columns``), else 2.
        class_names: Names of the classes or labels, for prediction columns (``prob_<name>``).
        multilabel: Independent sigmoid outputs and binary cross-entropy (e.g. RSNA's subtype labels).
        embed_dim: Token width; None keeps the architecture's.
        depth: Transformer blocks; None keeps the architecture's.
        num_heads: Attention heads; None keeps the architecture's.
        reg_tokens: Register tokens beside the class token (arXiv:2309.16588).
        mask_air: Patches that hold nothing (every pixel at the floor of every window: air, padding, outside the
            scan circle) are not attention keys: no token attends to them, so the class token cannot park its
            attention in the air and the rollout is zero there by construction, not by erasing the map afterwards.
            As nothing they compute could reach another token, they skip the blocks (keep their embedding): the
            blocks run only the tokens that are keys somewhere in the batch, about 1.3-1.4x faster at the same
            logits; recorded attention is still on the full sequence (identity rows, zero columns for air).
            Decided from the model's input alone, so training, validation, predict and review mask alike.
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
        rollout_head_fusion: How attention rollout fuses the heads of a block (``mean``, ``max``, ``min``).
        rollout_discard_ratio: Share of the lowest attention weights rollout discards per block.
        localisation_tolerance_mm: Pointing-game tolerance of the validation and test localisation metrics, in mm
            on each slice's own pixel spacing (read from the file; slices without one are assumed to span 230 mm).
        grad_checkpointing: Recompute block activations in the backward pass (less memory, ~30% slower); not while
            the attention loss is on (``attention_loss_weight`` > 0), whose attention must stay in the graph.
        weights: Initial weights: a vit-ct checkpoint or a timm state-dict file. Channels, position grid and
            differently sized heads are adapted. Only the network is loaded, not the trainer state.
        pretrained: A timm pretrained tag (e.g. ``vit_small_patch16_224.augreg_in21k_ft_in1k``,
            ``vit_base_patch16_224.mae``): the network takes the tag's architecture (``arch``, ``embed_dim``,
            ``depth`` and ``num_heads`` are then not used) and its weights, loaded by timm through the Hugging Face
            hub and its local cache (``HF_HUB_OFFLINE=1`` once cached), adapted as for ``weights``. Use it with
            ``stem: patch``: a conv stem has no pretrained weights and starts afresh.
        optimizer: Replaces the default AdamW; receives the parameter groups.
        scheduler: Replaces the default per-step warm-up + cosine schedule.
    """

    def __init__(
        self,
        *,
        arch: str = "vit_tiny_patch16_224",
        img_size: int = 192,
        patch_size: int = 16,
        stem: Literal["patch", "conv"] = "conv",
        in_chans: int = 2,
        num_classes: int | None = None,
        class_names: list[str] | None = None,
        multilabel: bool = False,
        embed_dim: int | None = None,
        depth: int | None = 6,
        num_heads: int | None = None,
        reg_tokens: int = 0,
        mask_air: bool = True,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.1,
        patch_loss_weight: float = 1.0,
        attention_loss_weight: float = 1.0,
        attention_target: Literal["rollout", "class_token"] = "rollout",
        class_weights: list[float] | None = None,
        label_smoothing: float = 0.0,
        label_weights: list[float] | None = None,
        lr: float = 5e-4,
        weight_decay: float = 0.05,
        warmup_epochs: float = 1.0,
        layer_decay: float | None = None,
        rollout_head_fusion: Literal["mean", "max", "min"] = "mean",
        rollout_discard_ratio: float = 0.0,
        localisation_tolerance_mm: float = 5.0,
        grad_checkpointing: bool = False,
        weights: str | None = None,
        pretrained: str | None = None,
        optimizer: OptimizerCallable | None = None,
        scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__()
        if num_classes is None:  # multi-label: one output per named label
            num_classes = len(class_names) if multilabel and class_names else 2
        _check_arguments(
            num_classes, multilabel, img_size, patch_size, class_names, class_weights, label_weights, arch, lr
        )
        # `weights` is a start point, not part of the model: a checkpoint must load without that file.
        self.save_hyperparameters(ignore=["optimizer", "scheduler", "weights", "pretrained"])
        self.hparams.num_classes = num_classes  # resolved (the CLI hands its own config to save_hyperparameters)
        if pretrained:  # the tag's architecture, recorded so that a checkpoint rebuilds it without the hub
            check_pretrained_tag(pretrained)
            self.hparams.pop("pretrained", None)
            self.hparams.update(arch=pretrained.split(".")[0], embed_dim=None, depth=None, num_heads=None)
        self.task = "multilabel" if multilabel else ("binary" if num_classes == 2 else "multiclass")
        # How the weights see their input; windows and read options become known from the data it is trained on or
        # from the checkpoint it is loaded from (see on_save_checkpoint / on_load_checkpoint).
        self.input_contract = InputContract(img_size, patch_size, in_chans)
        self.configure_network()
        self.configure_losses()
        self.configure_metrics()
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        if weights and pretrained:
            raise ValueError("give --model.weights or --model.pretrained, not both")
        if weights:
            load_weights(self, weights, vit=self.vit)
        if pretrained:
            load_state(self, pretrained_state_dict(pretrained), vit=self.vit, source=f"--model.pretrained {pretrained}")

    def configure_network(self) -> None:
        """The timm ViT (conv stem or timm's patch embedding) and the patch head of the mask-supervised loss."""
        h = self.hparams
        overrides = {"embed_dim": h.embed_dim, "depth": h.depth, "num_heads": h.num_heads}
        self.vit = timm.create_model(
            h.arch,
            pretrained=False,
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
        self.patch_head = nn.Linear(self.vit.embed_dim, 1) if h.patch_loss_weight > 0 else None
        if h.grad_checkpointing:
            self.vit.set_grad_checkpointing(True)

    def configure_losses(self) -> None:
        """Per-class (multi-label: per-label positive) loss weights, as a buffer that follows the model's device."""
        weights = self.hparams.class_weights
        self.register_buffer("class_weights", torch.tensor(weights, dtype=torch.float32) if weights else None)

    def configure_metrics(self) -> None:
        """Classification metrics per stage, and rollout against the lesion masks beside two floors it must beat:
        the image itself and the head mask."""
        h = self.hparams
        self.metrics = nn.ModuleDict(
            {
                stage: classification_metrics(
                    self.task,
                    h.num_classes,
                    f"{stage}/",
                    class_names=h.get("class_names"),
                    label_weights=h.get("label_weights"),
                )
                for stage in ("val", "test")
            }
        )
        self.sink = nn.ModuleDict({stage: SinkMetrics(len(self.vit.blocks)) for stage in ("val", "test")})
        spacing = model_grid_spacing_mm(h.img_size)  # for slices whose files give no pixel spacing
        self.localisation = nn.ModuleDict(
            {
                stage: nn.ModuleDict(
                    {
                        source: LocalisationMetrics(tolerance_mm=h.localisation_tolerance_mm, pixel_spacing_mm=spacing)
                        for source in MAP_SOURCES
                    }
                )
                for stage in ("val", "test")
            }
        )

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, map_location=None, hparams_file=None, strict=None, **kwargs):
        """Restore a vit-ct checkpoint; the file is read with ``weights_only=True``, so it cannot run code."""
        if kwargs.pop("weights_only", True) is not True:
            raise ValueError(f"vit-ct loads checkpoints with weights_only=True only (not {checkpoint_path})")
        return super().load_from_checkpoint(
            checkpoint_path,
            map_location=map_location,
            hparams_file=hparams_file,
            strict=strict,
            weights_only=True,
            **kwargs,
        )

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Records how the weights see their input (:class:`~vit_ct.data.contract.InputContract`): as the trainer's
        data module prepares slices now, else as the checkpoint the model came from did."""
        try:
            datamodule = self.trainer.datamodule
        except RuntimeError:  # saved through a strategy alone, without a trainer
            datamodule = None
        if hasattr(datamodule, "input_contract"):
            self.input_contract = datamodule.input_contract(self.hparams.patch_size)
        checkpoint[INPUT_CONTRACT] = self.input_contract.to_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """A checkpoint decides how its weights see the input: its input contract (input size, windows, read
        options), and ``mask_air``: one saved before that option existed was trained with every patch as a key,
        and is run that way, whatever the current default or a config says."""
        self.input_contract = InputContract.from_checkpoint(checkpoint)
        self.hparams.mask_air = bool(checkpoint.get("hyper_parameters", {}).get("mask_air", False))

    @property
    def class_names(self) -> list[str]:
        """Names of the outputs: ``class_names`` or ``0``, ``1``, ..."""
        return list(self.hparams.class_names or [str(i) for i in range(self.hparams.num_classes)])

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, num_classes)`` for windowed slices ``(B, in_chans, img_size, img_size)``."""
        return self.vit.forward_head(self.forward_features(image))

    def forward_features(self, image: torch.Tensor, *, checkpoint_blocks: bool = True) -> torch.Tensor:
        """Tokens ``(B, T, D)`` after the final norm: timm's ``forward_features``, with air patches masked as
        attention keys when ``mask_air`` (see :func:`attention_keys`). ``checkpoint_blocks=False`` runs every block
        plainly even with gradient checkpointing on (attention recorded in the graph would be recorded again when a
        checkpointed block is recomputed in the backward pass)."""
        vit = self.vit
        tokens = vit.norm_pre(vit.patch_drop(add_position_embeddings(vit, vit.patch_embed(image))))  # (B, T, D)
        if not self.hparams.get("mask_air", False):
            return vit.norm(self._run_blocks(tokens, None, checkpoint_blocks))
        keys = attention_keys(image, self.hparams.patch_size, vit.num_prefix_tokens)[:, 0, 0]  # (B, T)
        # Air patches are keys of no token, so nothing they compute reaches another token: they skip the blocks.
        # The blocks run the tokens that are keys somewhere in the batch (each slice's air among them masked).
        index = (~keys).long().argsort(dim=1, stable=True)[:, : int(keys.sum(dim=1).max())]  # keys first, in order
        x = tokens.gather(1, index[..., None].expand(-1, -1, tokens.shape[-1]))
        with running_tokens(vit, index, tokens.shape[1]):  # recorded attention stays on the full sequence
            x = self._run_blocks(x, keys.gather(1, index)[:, None, None, :], checkpoint_blocks)
        return vit.norm(tokens.scatter(1, index[..., None].expand_as(x), x))

    def _run_blocks(self, x: torch.Tensor, keys: torch.Tensor | None, checkpoint_blocks: bool) -> torch.Tensor:
        # timm's own loop skips gradient checkpointing when given a mask: the blocks are run here instead
        vit = self.vit
        for block in vit.blocks:
            if vit.grad_checkpointing and torch.is_grad_enabled() and checkpoint_blocks:
                x = checkpoint(block, x, attn_mask=keys, use_reentrant=False)
            else:
                x = block(x, attn_mask=keys)
        return x

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """P(lesion) ``(B,)`` for binary, else ``(B, num_classes)``; float32 whatever the autocast dtype."""
        logits = logits.float()
        if self.task == "multilabel":
            return logits.sigmoid()
        probs = logits.softmax(-1)
        return probs[:, 1] if self.task == "binary" else probs

    def _losses(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        image, label = batch["image"], batch["label"]
        if self.hparams.get("attention_loss_weight", 0.0) > 0:
            with record_attention(self, head_fusion="mean", keep_graph=True) as attentions:
                tokens = self.forward_features(image, checkpoint_blocks=False)  # (B, T, D)
        else:
            attentions, tokens = None, self.forward_features(image)
        logits = self.vit.forward_head(tokens).float()  # losses and metrics in float32, also under AMP
        if self.task == "multilabel":
            loss = F.binary_cross_entropy_with_logits(logits, label.float(), pos_weight=self.class_weights)
        else:
            loss = F.cross_entropy(
                logits, label, weight=self.class_weights, label_smoothing=self.hparams.label_smoothing
            )
        parts = {"cls_loss": loss.detach()}
        if self.patch_head is not None:
            patch_loss = self._patch_loss(tokens, batch)
            if patch_loss is not None:
                parts["patch_loss"] = patch_loss.detach()
                loss = loss + self.hparams.patch_loss_weight * patch_loss
        if attentions:
            attention_loss = self._attention_loss(attentions, batch)
            if attention_loss is not None:
                parts["attention_loss"] = attention_loss.detach()
                loss = loss + self.hparams.attention_loss_weight * attention_loss
        return loss, logits, parts

    def _attention_loss(self, attentions: list[torch.Tensor], batch: dict) -> torch.Tensor | None:
        """Cross-entropy of the lesion's share of each patch against where the class token's attention goes: its
        attention rollout over the patches (``attention_target="rollout"``, renormalised over the patches) or its
        attention row in every block (``"class_token"``, averaged over blocks); over the slices whose lesion mask is
        known and not empty."""
        scored = batch["has_mask"] & batch["mask"].flatten(1).any(dim=1)
        if not scored.any():
            return None
        target = F.avg_pool2d(batch["mask"][scored].float(), self.hparams.patch_size).flatten(1)  # (b, N)
        target = target / target.sum(dim=1, keepdim=True)
        prefix = self.num_prefix
        attentions = [attention[scored].float() for attention in attentions]  # (b, 1, T, T), rows sum to 1

        def cross_entropy(share: torch.Tensor) -> torch.Tensor:
            return -(target * share.clamp_min(1e-6).log()).sum(dim=1).mean()

        if self.hparams.get("attention_target", "rollout") == "rollout":
            grid = self.vit.patch_embed.grid_size
            rollout = class_token_rollout(attentions, num_prefix_tokens=prefix, grid_size=grid).flatten(1)  # (b, N)
            return cross_entropy(rollout / rollout.sum(dim=1, keepdim=True).clamp_min(1e-12))
        return torch.stack([cross_entropy(attention[:, 0, 0, prefix:]) for attention in attentions]).mean()

    def _patch_loss(self, tokens: torch.Tensor, batch: dict) -> torch.Tensor | None:
        """BCE of each patch token against "this patch holds lesion pixels", on slices whose mask is known."""
        label = batch["label"]
        lesion_free = (label.sum(-1) == 0) if self.task == "multilabel" else (label == 0)
        known = batch["has_mask"] | lesion_free  # a slice without lesion has an empty mask by definition
        if not known.any():
            return None
        patch = self.hparams.patch_size
        target = (F.max_pool2d(batch["mask"].float(), patch) > 0.5).flatten(1).float()  # (B, N)
        patch_logits = self.patch_head(tokens[:, self.vit.num_prefix_tokens :]).squeeze(-1).float()  # (B, N)
        logits, target = patch_logits[known], target[known]
        losses = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
        # Lesion patches are ~1% of all: weigh both kinds equally, or "never blood" is the easy minimum.
        lesion = target > 0.5
        if lesion.all() or not lesion.any():
            return losses.mean()
        return 0.5 * (losses[lesion].mean() + losses[~lesion].mean())

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, _, parts = self._losses(batch)
        size = batch["image"].shape[0]
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=True, batch_size=size)
        for name, value in parts.items():
            self.log(f"train/{name}", value, on_step=False, on_epoch=True, batch_size=size)
        return loss

    def _evaluate(self, batch: dict, stage: str) -> dict[str, torch.Tensor] | None:
        keep = batch.get("valid")  # False on samples a distributed sampler repeated to even out the ranks
        if keep is not None and not keep.all():
            batch = {k: v[keep] if torch.is_tensor(v) and v.shape[:1] == keep.shape else v for k, v in batch.items()}
        label = batch["label"]
        if not len(label):  # a batch of DDP padding only (possible when a split has fewer slices than ranks)
            return None
        # one forward pass for the losses, the metrics and the explanation
        explained = self._explained(lambda: self._losses(batch), batch["image"].shape)
        loss, logits, _ = explained.output
        probs = self.probabilities(logits)
        self.metrics[stage].update(probs, label)
        self.log(f"{stage}/loss", loss, prog_bar=stage == "val", sync_dist=True, batch_size=len(label))
        self.log_dict(self.metrics[stage], prog_bar=stage == "val")
        self._localise(batch, explained, stage)
        # the slices' probabilities and rows go to callbacks (per-scan AUROC, vit_ct.scan_metrics)
        return {"loss": loss, "prob": probs.detach(), "index": batch["index"]}

    def _explained(self, forward, image_shape) -> Explained:
        return explain_forward(
            self,
            forward,
            image_shape,
            head_fusion=self.hparams.rollout_head_fusion,
            discard_ratio=self.hparams.rollout_discard_ratio,
        )

    def _localise(self, batch: dict, explained: Explained, stage: str) -> None:
        """The attention sink on every slice; rollout and its floors against the lesion on slices with a known,
        non-empty mask."""
        mask, head = batch["mask"][:, 0], batch["head"][:, 0]
        scored = batch["has_mask"] & mask.flatten(1).any(dim=1)
        maps = localisation_maps(None, batch, rollout=explained.rollout)
        self.sink[stage].update(
            explained.rollout,
            maps["rollout"],
            explained.class_attention,
            head,
            mask,
            scored,
            num_prefix_tokens=self.num_prefix,
            patch_size=self.hparams.patch_size,
        )
        spacing = batch.get("pixel_spacing_mm")  # model grid, when the batch has it
        for source, source_maps in maps.items():  # each metric scores only the slices with a lesion inside the head
            self.localisation[stage][source].update(
                source_maps, mask, head, known=batch["has_mask"], pixel_spacing_mm=spacing
            )

    def _log_localisation(self, stage: str) -> None:
        """Logs ``{stage}/{source}_{score}`` for the epoch, unless no slice was scored (e.g. data without masks)."""
        for source, metrics in self.localisation[stage].items():
            with warnings.catch_warnings():
                # every rank joins the sync, also one that scored nothing: its "compute before update" is noise
                warnings.filterwarnings("ignore", message="The ``compute`` method", category=UserWarning)
                values = metrics.compute()  # the same on every rank
            metrics.reset()
            if values["slices"] > 0:
                self.log_dict({f"{stage}/{source}_{name}": value.float() for name, value in values.items()})
        values = self.sink[stage].compute()
        self.sink[stage].reset()
        if values["slices"] > 0:
            values = {name: value for name, value in values.items() if name not in ("slices", "lesion_slices")}
            self.log_dict({f"{stage}/{name}": value.float() for name, value in values.items() if not value.isnan()})

    def on_validation_epoch_end(self) -> None:
        self._log_localisation("val")

    def on_test_epoch_end(self) -> None:
        self._log_localisation("test")

    def validation_step(self, batch: dict, batch_idx: int) -> dict[str, torch.Tensor] | None:
        return self._evaluate(batch, "val")

    def test_step(self, batch: dict, batch_idx: int) -> dict[str, torch.Tensor] | None:
        return self._evaluate(batch, "test")

    def explain(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and attention rollout ``(B, grid_h, grid_w)`` of a batch from one forward pass (:meth:`explained`)."""
        explained = self.explained(image)
        return explained.output, explained.rollout

    def explained(self, image: torch.Tensor) -> Explained:
        """Logits, attention rollout and the class token's attention rows per block, from one forward pass without
        gradients. Heads are fused inside the hook and only the class token's row is propagated, so large slices fit
        (:func:`vit_ct.explain.maps.explain_forward`, with this model's rollout settings)."""
        with torch.no_grad():
            return self._explained(lambda: self(image), image.shape)

    def predict_step(self, batch: dict, batch_idx: int) -> dict[str, torch.Tensor]:
        explained = self.explained(batch["image"])
        out = {"prob": self.probabilities(explained.output), "rollout": explained.rollout, "index": batch["index"]}
        if "head" in batch:  # the attention sink, per slice
            out.update(sink_per_slice(explained.rollout, explained.class_attention, batch["head"], self.num_prefix))
        return out

    @property
    def num_prefix(self) -> int:
        """Class and register tokens in front of the patch tokens."""
        return int(self.vit.num_prefix_tokens)

    def configure_optimizers(self):
        groups = self._param_groups()
        if self.optimizer_factory is not None:
            optimizer = self.optimizer_factory(groups)
        else:
            optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr)
        if self.scheduler_factory is not None:
            return {"optimizer": optimizer, "lr_scheduler": self.scheduler_factory(optimizer)}
        return {
            "optimizer": optimizer,
            "lr_scheduler": warmup_cosine_schedule(optimizer, self.trainer, self.hparams.warmup_epochs),
        }

    def _param_groups(self) -> list[dict]:
        """timm's groups: no decay on 1-D tensors and ``no_weight_decay()``; optional layer-wise LR decay."""
        wd, lr = self.hparams.weight_decay, self.hparams.lr
        skip = self.vit.no_weight_decay()
        if self.hparams.layer_decay is not None:
            groups = param_groups_layer_decay(
                self.vit, weight_decay=wd, no_weight_decay_list=skip, layer_decay=self.hparams.layer_decay
            )
            for group in groups:  # torch optimizers ignore timm's `lr_scale`: bake it into the rate
                group["lr"] = lr * group.pop("lr_scale", 1.0)
        else:
            groups = param_groups_weight_decay(self.vit, weight_decay=wd, no_weight_decay_list=skip)
        if self.patch_head is not None:
            groups.append({"params": list(self.patch_head.parameters()), "weight_decay": 0.0})
        return groups


def every_token_features(model: ViTClassifier, image: torch.Tensor) -> torch.Tensor:
    """``model.forward_features`` as timm computes it, every token through every block: air patches (where the model
    masks them) are masked as keys instead of skipping the blocks. The same class token and logits; the block outputs
    lie on the full patch grid (what Grad-CAM reads), and it is the reference the skipping is tested and timed against.
    """
    vit, hparams = model.vit, model.hparams
    keys = attention_keys(image, hparams.patch_size, vit.num_prefix_tokens) if hparams.get("mask_air") else None
    return vit.forward_features(image, attn_mask=keys)


# Windowed input at or below this is "nothing here": every window maps air (-1000 HU) to exactly 0.
EMPTY_LEVEL = 1e-3


def attention_keys(image: torch.Tensor, patch_size: int, num_prefix_tokens: int) -> torch.Tensor:
    """Which tokens may be attended to: every prefix token, and every patch with at least one pixel above the floor
    of some window (``EMPTY_LEVEL``). Patches at the floor of every window hold only air: HU below all windows.

    Args:
        image: ``(B, C, H, W)`` windowed input in [0, 1], ``H`` and ``W`` multiples of ``patch_size``.
        patch_size: side of a patch in pixels.
        num_prefix_tokens: class and register tokens in front of the patch tokens (always keys).

    Returns:
        ``(B, 1, 1, T)`` bool, True where a key may be attended to; broadcasts over heads and queries as timm's
        (and ``scaled_dot_product_attention``'s) boolean ``attn_mask``.
    """
    content = F.max_pool2d(image.detach().amax(dim=1, keepdim=True).float(), patch_size) > EMPTY_LEVEL
    patches = content.flatten(1)  # (B, N)
    prefix = patches.new_ones(patches.shape[0], num_prefix_tokens)
    return torch.cat([prefix, patches], dim=1)[:, None, None, :]


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


def _check_arguments(
    num_classes, multilabel, img_size, patch_size, class_names, class_weights, label_weights, arch, lr
) -> None:
    """Bad model arguments, named with what was expected, before anything is built."""
    if num_classes < 1 or (num_classes < 2 and not multilabel):
        raise ValueError(f"num_classes must be >= 2 (or >= 1 with multilabel), got {num_classes}")
    if img_size % patch_size:
        raise ValueError(f"img_size ({img_size}) must be a multiple of patch_size ({patch_size})")
    if class_names is not None and len(class_names) != num_classes:
        raise ValueError(
            f"class_names has {len(class_names)} names (multi-label: from data.label_columns) for"
            f" num_classes={num_classes}; set --model.num_classes {len(class_names)}, or leave it unset"
        )
    if class_weights is not None and len(class_weights) != num_classes:
        raise ValueError(f"class_weights has {len(class_weights)} values for num_classes={num_classes}")
    if label_weights is not None and (not multilabel or len(label_weights) != num_classes):
        raise ValueError(
            f"label_weights ({len(label_weights)} values) need multi-label data with as many labels; got"
            f" multilabel={multilabel}, num_classes={num_classes}"
        )
    if not timm.is_model(arch) or not arch.startswith(("vit_", "deit")):
        raise ValueError(f"arch {arch!r} is not a timm Vision Transformer (e.g. vit_tiny_patch16_224)")
    if not (math.isfinite(lr) and lr > 0):  # lr 0 would train nothing without a word; a negative one ascends
        raise ValueError(f"model.lr must be a finite number > 0 (e.g. 5e-4), got {lr}")
