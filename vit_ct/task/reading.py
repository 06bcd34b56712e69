"""How the model's maps are read: the logits and attention rollout of a batch from one forward pass, or over
shifted grids (:mod:`vit_ct.explain.shifted`) for a map finer than the patches, and down to the pixel
(:mod:`vit_ct.explain.pixels`) by the gradient x input through the stem, as a command's
:class:`~vit_ct.explain.map_reading.MapReading` says; the trainer carries that reading (:class:`ReadMaps`), never the
model."""

from __future__ import annotations

from dataclasses import replace

import torch
from lightning.pytorch import Callback

from vit_ct.explain.map_reading import ONE_PASS, MapReading
from vit_ct.explain.maps import Explained, explain_forward
from vit_ct.explain.pixels import input_relevance, lesion_log_odds, spread_over_pixels
from vit_ct.explain.shifted import air_level, shifted_explained


class ReadMaps(Callback):
    """How the trainer's command reads the maps (``--map_shifts``, ``--map_pixels``): the steps that read maps
    (validation, test, predict) take it from here; a trainer without one reads one pass."""

    def __init__(self, reading: MapReading) -> None:
        self.reading = reading


def reading_of(trainer) -> MapReading:
    """The map reading of ``trainer``'s :class:`ReadMaps` callback; one pass where there is none (or no trainer)."""
    for callback in getattr(trainer, "callbacks", None) or ():
        if isinstance(callback, ReadMaps):
            return callback.reading
    return ONE_PASS


def explained_pass(model, forward, image_shape) -> Explained:
    """One recorded pass of ``forward`` through ``model`` (a :class:`~vit_ct.task.classifier.ViTClassifier`), its
    rollout read with the model's head fusion and discard ratio."""
    h = model.hparams
    return explain_forward(model, forward, image_shape, head_fusion=h.rollout_head_fusion,
                           discard_ratio=h.rollout_discard_ratio)  # fmt: skip


def _read(model, image: torch.Tensor, fill: torch.Tensor, pixels: bool) -> Explained:
    """One recorded pass; with ``pixels`` also the gradient x input of the lesion log-odds (gradients switched on
    locally, also under ``torch.inference_mode``; the parameters' ``.grad`` stay untouched)."""
    if not pixels:
        return explained_pass(model, lambda: model(image), image.shape)
    with torch.inference_mode(False), torch.enable_grad():
        x = image.clone().requires_grad_(True)  # an inference tensor cannot enter autograd, its clone can
        explained = explained_pass(model, lambda: model(x), x.shape)
        score = lesion_log_odds(explained.output, model.task, model.hparams.class_names)
        (gradient,) = torch.autograd.grad(score.sum(), x)  # slices are independent: each its own gradient
    output = explained.output.detach()
    return replace(explained, output=output, relevance=input_relevance(gradient, x.detach(), fill))


def read_maps(model, image: torch.Tensor, first: Explained | None = None, reading: MapReading = ONE_PASS) -> Explained:
    """Logits, attention rollout and the class token's attention rows per block of ``model`` (a
    :class:`~vit_ct.task.classifier.ViTClassifier`) on a batch, from one forward pass without gradients
    (``reading.shifts**2`` passes where it is > 1, :func:`shifted_explained`; ``first``: the unshifted one, already
    run). Heads are fused inside the hook and only the class token's row is propagated, so large slices fit
    (:func:`vit_ct.explain.maps.explain_forward`, with the model's rollout settings). With ``reading.pixels``, each
    pass also takes the input's gradient and ``rollout`` is ``(B, S, S)``
    (:func:`vit_ct.explain.pixels.spread_over_pixels`)."""
    fill = air_level(model.input_contract.windows, image.shape[1])
    output = None
    if reading.pixels and first is not None and first.relevance is None:
        output, first = first.output, None  # a pass without the gradient (the losses'): its output, read again
    patch_size, shifts = model.hparams.patch_size, reading.shifts
    with torch.no_grad():
        explained = shifted_explained(lambda x: _read(model, x, fill, reading.pixels), image, first=first,
                                      patch_size=patch_size, shifts=shifts, fill=fill)  # fmt: skip
    if reading.pixels:
        explained = replace(explained, rollout=spread_over_pixels(explained.rollout, explained.relevance))
    return explained if output is None else replace(explained, output=output)
