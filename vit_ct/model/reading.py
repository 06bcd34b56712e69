"""How the model's maps are read: the logits and attention rollout of a batch from one forward pass, or over
shifted grids (``map_shifts``, :mod:`vit_ct.explain.shifted`) for a map finer than the patches."""

from __future__ import annotations

import torch
from torch import nn

from vit_ct.explain.maps import Explained, explain_forward
from vit_ct.explain.shifted import air_level, shifted_explained


class MapReader(nn.Module):
    """Mixin of the model (which has ``hparams``, ``input_contract`` and a forward pass): its maps, read over
    ``map_shifts`` shifted grids per axis (1: one pass)."""

    map_shifts: int = 1

    def _explained(self, forward, image_shape) -> Explained:
        h = self.hparams
        return explain_forward(self, forward, image_shape, head_fusion=h.rollout_head_fusion,
                               discard_ratio=h.rollout_discard_ratio)  # fmt: skip

    def explain(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and attention rollout ``(B, grid_h, grid_w)`` of a batch from one forward pass (:meth:`explained`)."""
        explained = self.explained(image)
        return explained.output, explained.rollout

    def explained(self, image: torch.Tensor, first: Explained | None = None) -> Explained:
        """Logits, attention rollout and the class token's attention rows per block, from one forward pass without
        gradients (``map_shifts**2`` passes where ``map_shifts`` > 1, :func:`shifted_explained`; ``first``: the
        unshifted one, already run). Heads are fused inside the hook and only the class token's row is propagated, so
        large slices fit (:func:`vit_ct.explain.maps.explain_forward`, with this model's rollout settings)."""
        fill = air_level(self.input_contract.windows, image.shape[1])
        with torch.no_grad():
            return shifted_explained(lambda x: self._explained(lambda: self(x), x.shape), image, first=first,
                                     patch_size=self.hparams.patch_size, shifts=self.map_shifts, fill=fill)  # fmt: skip
