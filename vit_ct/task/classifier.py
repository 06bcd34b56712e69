"""``ViTClassifier``: a timm Vision Transformer (arXiv:2010.11929) for CT slices, as a LightningModule.

16x16 patches, learnable position embeddings, a class token, pre-norm blocks (the network:
:mod:`vit_ct.model.network`); an optional patch head learns "is there blood in this patch" from the lesion masks,
which teaches a ViT trained from scratch where to look. The losses are :mod:`vit_ct.task.losses`, the optimiser's
groups and schedule :mod:`vit_ct.task.optim`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from functools import partial
from typing import Any, Literal

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn

from vit_ct.data.transforms.contract import InputContract
from vit_ct.explain.attention import record_attention
from vit_ct.explain.map_reading import ONE_PASS, MapReading
from vit_ct.explain.maps import Explained
from vit_ct.metrics.classification import classification_metrics
from vit_ct.metrics.map_scores import MapMetrics
from vit_ct.model.architecture import Network
from vit_ct.model.hparams import check_hparams, predated_hparams, unstored_hparams
from vit_ct.model.network import AirSkippingViT
from vit_ct.model.sequence import SEQUENCES, head_inputs
from vit_ct.model.stem import ConvStemPatchEmbed, NeighbourKernels, split_neighbour_kernels
from vit_ct.model.weights import choose_stem, load_start, read_start, start_architecture
from vit_ct.model.weights_input import model_input, read_lightning_checkpoint, weights_input
from vit_ct.task.anchor import StartAnchor
from vit_ct.task.checkpointed import SeesAsCheckpointed
from vit_ct.task.inference import Inference, infer
from vit_ct.task.losses import Losses, PatchLosses, classification_loss
from vit_ct.task.optim import param_groups, warmup_cosine_schedule
from vit_ct.task.reading import explained_pass, read_maps, reading_of
from vit_ct.task.scan_bags import ScanBags
from vit_ct.task.scan_reading import EmbeddingMemory, EvaluatedRows, log_in_scan, training_in_scan
from vit_ct.task.settings import GuidingLosses, Labels, Maps, Optimisation, flat_hparams, group_of, grouped

STAGES = ("val", "test")
OWN_ARGUMENTS = ("weights", "pretrained", "optimizer", "scheduler")  # the model's arguments that are no group


class ViTClassifier(SeesAsCheckpointed):
    """Slice classifier: P(lesion) for two classes, class probabilities, or per-label probabilities.

    The defaults are a plain ViT as timm builds ``network.arch``, with the classification loss alone; the recipes live
    in ``configs/``. The settings come by concern, each a value documented in :mod:`vit_ct.task.settings`; the
    hyper-parameters (``model.hparams``, and every checkpoint) hold their fields flat, as they always have.
    :meth:`from_hparams` builds the model from those flat names.

    Args:
        network: The network (:class:`vit_ct.model.architecture.Network`): architecture, input, stem, regularisation.
        labels: What it predicts (:class:`vit_ct.task.settings.Labels`): classes or labels, their names and weights.
        losses: The losses beside classification (:class:`vit_ct.task.settings.GuidingLosses`), all off by default.
        optimisation: The default optimiser and schedule (:class:`vit_ct.task.settings.Optimisation`).
        maps: How validation and test read the maps (:class:`vit_ct.task.settings.Maps`).
        weights: Initial weights: a vit-ct checkpoint (the network takes its architecture and, where
            ``network.img_size`` and ``network.in_chans`` are None, its input, as with ``pretrained``) or a timm
            state-dict file. Channels, position grid and differently sized heads are adapted. Only the network is
            loaded, not the trainer state.
        pretrained: A timm pretrained tag (e.g. ``vit_small_patch16_224.augreg_in21k_ft_in1k``) or weights shipped
            with vit-ct (``vit-ct/headct-tiny-256``): the network takes the weights' architecture (an ``arch``,
            ``patch_size``, ``stem``, ``embed_dim``, ``depth`` or ``num_heads`` given otherwise gives way, with a
            warning naming it) and their weights (a timm tag's loaded by timm through the Hugging Face hub and its
            local cache, shipped ones from the package), adapted as for ``weights``.
        optimizer: Replaces the default AdamW; receives the parameter groups.
        scheduler: Replaces the default per-step warm-up + cosine schedule.
    """

    def __init__(
        self,
        *,
        network: Network = Network(),
        labels: Labels = Labels(),
        losses: GuidingLosses = GuidingLosses(),
        optimisation: Optimisation = Optimisation(),
        maps: Maps = Maps(),
        weights: str | None = None,
        pretrained: str | None = None,
        optimizer: OptimizerCallable | None = None,
        scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__()
        if weights and pretrained:
            raise ValueError("give --model.weights or --model.pretrained, not both")
        arguments = flat_hparams(network=network, labels=labels, losses=losses, optimisation=optimisation, maps=maps)
        num_classes = labels.num_classes
        if num_classes is None:  # multi-label: one output per named label
            num_classes = len(labels.class_names) if labels.multilabel and labels.class_names else 2
        # How the model sees: the start weights' input where they know it and the arguments leave it (None) or agree
        seen = weights_input(weights=weights, pretrained=pretrained)
        # the network the start weights fill, taken below so that they fit (a tag's, or a vit-ct checkpoint's)
        own = start_architecture(pretrained, seen.architecture if seen is not None else None)
        patch_size = own.get("patch_size") or network.patch_size
        contract = model_input(seen, img_size=network.img_size, in_chans=network.in_chans, patch_size=patch_size,
                               context_mm=network.context_mm)  # fmt: skip
        # resolved: the input, the outputs and the weights' architecture, recorded so that a checkpoint rebuilds
        # the network without the hub or the weights file (the start weights are a start point, not part of it)
        arguments.update(num_classes=num_classes, img_size=contract.img_size, in_chans=contract.in_chans,
                         context_mm=contract.context_mm)  # fmt: skip
        check_hparams({**arguments, "patch_size": patch_size})
        start = read_start(weights, pretrained)  # the start weights, or None
        self.save_hyperparameters({**arguments, **own, "stem": choose_stem(own.get("stem", network.stem), start)})
        self.task: Literal["binary", "multiclass", "multilabel"] = (
            "multilabel" if labels.multilabel else ("binary" if num_classes == 2 else "multiclass")
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
            defaults = flat_hparams()
            given = {name: value for name, value in arguments.items() if value != defaults[name]}
            slices = (seen.contract.slices if seen is not None else 1, contract.slices)
            load_start(self, start, given, own_architecture=bool(own), slices=slices,
                       neighbours=network.neighbour_start)  # fmt: skip
        anchored = losses.anchor_loss_weight > 0 and start is not None
        self.anchor = StartAnchor(self.vit if anchored else None)  # the start network, frozen, on each build

    @classmethod
    def from_hparams(cls, hparams: Mapping[str, Any] | None = None, /, **more: Any) -> ViTClassifier:
        """The model from flat hyper-parameter names, as ``model.hparams`` and checkpoints hold them
        (``from_hparams(depth=6, lr=1e-4, pretrained="vit-ct/headct-tiny-256")``), the start weights, optimiser and
        scheduler by their own names; ``more`` overrides ``hparams``.

        Raises:
            TypeError: a name that is neither a settings field nor one of those arguments.
        """
        flat = {**(hparams or {}), **more}
        unknown = sorted(name for name in flat if group_of(name) is None and name not in OWN_ARGUMENTS)
        if unknown:
            raise TypeError(f"ViTClassifier.from_hparams: unknown hyper-parameter(s) {', '.join(unknown)}")
        return cls(**grouped(flat), **{name: flat[name] for name in OWN_ARGUMENTS if name in flat})

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, map_location=None, hparams_file=None, strict=None, **kwargs):
        """Restore a vit-ct checkpoint as its network was built: its flat hyper-parameters read into the settings,
        also where it does not store one (:func:`~vit_ct.model.hparams.unstored_hparams`); the file is read with
        ``weights_only=True``, so it cannot run code. ``kwargs`` are flat names that override the stored ones."""
        if kwargs.pop("weights_only", True) is not True:
            raise ValueError(f"vit-ct loads checkpoints with weights_only=True only (not {checkpoint_path})")
        if hparams_file is not None:
            raise ValueError(f"vit-ct checkpoints hold their hyper-parameters; give no hparams_file ({hparams_file})")
        checkpoint = read_lightning_checkpoint(checkpoint_path)  # (tensors memory-mapped; named in its errors)
        flat = {**(checkpoint.get("hyper_parameters") or {}), **unstored_hparams(checkpoint), **kwargs}
        arguments = {**grouped(flat), "_instantiator": None}  # the settings, built here, not by the CLI's parser
        return super().load_from_checkpoint(checkpoint_path, map_location=map_location, strict=strict,
                                            weights_only=True, **arguments)  # fmt: skip

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
        contract = self.input_contract
        if contract.slices > 1:  # the neighbours' kernels apart, for the optimiser: they learn at their own rate
            split_neighbour_kernels(self.vit.patch_embed, per_slice=contract.in_chans // contract.slices)
        needs_head = h.patch_loss_weight > 0 or h.mil_loss_weight > 0 or h.evidence_attention
        self.patch_head = nn.Linear(self.vit.embed_dim, 1) if needs_head else None
        # each slice read in its scan too: a sequence over the slices' embeddings (vit_ct.model.sequence)
        self.sequence = SEQUENCES[h.sequence](self.vit.embed_dim, h.num_classes) if h.get("sequence") else None
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
        self.embedding_memory = EmbeddingMemory()  # the training slices' latest embeddings, for their scans' sequences
        self.evaluated = {stage: EvaluatedRows() for stage in STAGES}  # each stage's slices, read in scan at its end
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
        if self.sequence is not None:  # the same figures, of each slice read in its scan
            self.in_scan_metrics = nn.ModuleDict(
                {stage: classification_metrics(self.task, h.num_classes, f"{stage}/", class_names=h.class_names,
                                               label_weights=h.label_weights) for stage in STAGES}
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

    def explain(self, image: torch.Tensor, reading: MapReading = ONE_PASS) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and attention rollout ``(B, grid_h, grid_w)`` of a batch, from one forward pass unless ``reading``
        asks for more (:meth:`explained`)."""
        explained = self.explained(image, reading=reading)
        return explained.output, explained.rollout

    def explained(
        self, image: torch.Tensor, first: Explained | None = None, reading: MapReading = ONE_PASS
    ) -> Explained:
        """Logits, attention rollout and the class token's attention rows per block, read as ``reading`` says
        (:func:`vit_ct.task.reading.read_maps`; ``first``: the one-pass reading, already run)."""
        return read_maps(self, image, first=first, reading=reading)

    def _apply(self, fn, recurse: bool = True):
        """Moves and casts (``.to``, ``.double``, ...) reach the fine-tuning anchor too, which is no submodule."""
        self.anchor.apply(fn)
        return super()._apply(fn, recurse)

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
        held = self.anchor.attention(image) if anchored else None  # the start network's attention
        if self.patch_losses.attention_weight > 0 or held is not None:
            with record_attention(self, head_fusion="mean", keep_graph=True) as attentions:
                tokens = self.vit.forward_features(image, checkpoint_blocks=False)  # (B, T, D)
        else:
            attentions, tokens = None, self.vit.forward_features(image)
        embeddings = self.vit.forward_head(tokens, pre_logits=True)
        logits = self.vit.head(embeddings).float()
        cls = classification_loss(
            logits, label, self.task, class_weights=self.class_weights, label_smoothing=self.label_smoothing
        )
        patch_logits = None if self.patch_head is None else self.patch_head(tokens[:, self.num_prefix :]).squeeze(-1)
        terms = [("cls_loss", 1.0, cls), *self.patch_losses(batch, patch_logits, attentions, held)]
        ddp = self.training and self._trainer is not None and self._trainer.world_size > 1
        read = logits  # what the scan's bag pools: the slices alone, or in their scan
        if self.sequence is not None and self.training and "volume" in batch:  # (evaluation: whole scans, at the end)
            read = training_in_scan(self.sequence, self.embedding_memory, batch, embeddings, logits,
                                    gather=ddp and self.all_gather)  # fmt: skip
            in_scan = classification_loss(read, label, self.task, class_weights=self.class_weights,
                                          label_smoothing=self.label_smoothing)  # fmt: skip
            terms.append(("in_scan_loss", 1.0, in_scan))
        if "scan_label" in batch:  # scan labels: the scan is the bag (vit_ct.task.scan_bags)
            terms += self.scan_bags(batch, read, patch_logits, remember=self.training, gather=ddp and self.all_gather)
        loss, parts = logits.sum() * 0.0, {}  # in the graph even where a batch scores nothing
        for name, weight, part in terms:
            if part is not None:
                parts[name] = part.detach()
                loss = loss + weight * part
        return Losses(loss, logits, parts)

    def on_fit_start(self) -> None:
        self.anchor.check(self.patch_losses.anchor_weight)
        self.scan_bags.memory.reset()  # rows of another fit's training split are not this one's
        self.embedding_memory.reset()

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

    def on_validation_epoch_start(self) -> None:
        self.evaluated["val"].reset()

    def on_test_epoch_start(self) -> None:
        self.evaluated["test"].reset()

    def on_validation_epoch_end(self) -> None:
        self.log_dict({f"val/{name}": value for name, value in self.map_metrics["val"].compute_and_reset().items()})
        log_in_scan(self, "val")

    def on_test_epoch_end(self) -> None:
        self.log_dict({f"test/{name}": value for name, value in self.map_metrics["test"].compute_and_reset().items()})
        log_in_scan(self, "test")

    def _evaluate(self, batch: dict, stage: str) -> dict[str, torch.Tensor] | None:
        keep = batch.get("valid")  # False on samples a distributed sampler repeated to even out the ranks
        if keep is not None and not keep.all():
            batch = {k: v[keep] if torch.is_tensor(v) and v.shape[:1] == keep.shape else v for k, v in batch.items()}
        label = batch["label"]
        if not len(label):  # a batch of DDP padding only (possible when a split has fewer slices than ranks)
            return None
        image = batch["image"]  # one pass for the losses, the metrics and the map (and the command's shifted grids)
        with head_inputs(self.vit.head) as embeddings:
            first = explained_pass(self, lambda: self.losses(batch), image.shape)
        explained = self.explained(image, first=first, reading=reading_of(self._trainer))
        loss, logits, _ = explained.output
        probs = self.probabilities(logits)
        if self.sequence is not None and "volume" in batch:  # read in their scans at the epoch's end
            self.evaluated[stage].add(batch, embeddings[0], logits)
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
        """The optimiser's parameter groups (:func:`vit_ct.task.optim.param_groups`), the patch head's included, and
        with context the neighbours' kernels at the peak rate (new to weights that read single slices, they would
        barely move at the stem's layer-decayed rate)."""
        h = self.hparams
        first = self.vit.patch_embed.proj
        first = first[0] if isinstance(first, nn.Sequential) else first
        fresh = [first.neighbours] if isinstance(first, NeighbourKernels) else []
        heads = nn.ModuleList([head for head in (self.patch_head, self.sequence) if head is not None])
        return param_groups(self.vit, lr=h.lr, weight_decay=h.weight_decay, layer_decay=h.layer_decay,
                            extra=heads if len(heads) else None, peak_rate=fresh)  # fmt: skip
