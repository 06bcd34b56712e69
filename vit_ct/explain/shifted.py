"""Maps finer than the patch grid, read from the model itself: shifted-grid rollout.

The patches are fixed at ``patch_size`` pixels, so one pass gives one value per patch. Run the same model on the slice
shifted by fractions of a patch (``shifts`` steps of ``patch_size / shifts`` pixels in y and in x: ``shifts**2``
passes), with air filling what the shift uncovers (the input is padded with air already), roll out each pass, bring
each pass's patch map to the pixels it covered, shift it back and average the passes: every cell of ``patch_size /
shifts`` pixels then has its own value, the mean of the ``shifts**2`` patches that held it. The result is a map on a
grid ``shifts`` times finer, aligned to the slice's pixels, upsampled bilinearly as every rollout is. Each value is
still the model's own attention, never a map edited after the fact. The passes' outputs give test-time augmentation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from vit_ct.data.transforms.windows import AIR_HU, window_hu
from vit_ct.explain.maps import Explained

# How finely the commands that show maps to a person (`vit-ct predict`, `vit-ct test`, the review) read them unless
# told otherwise (benchmarks/finer_maps.py: 2 x 2 gains most of what finer grids give on held-out CT; 4 x 4 adds a
# slice or two for four times the passes). Training's validation reads one pass (map_shifts 1): a fit does not pay.
READ_SHIFTS = 2


def grid_offsets(patch_size: int, shifts: int) -> list[tuple[int, int]]:
    """The ``(dy, dx)`` shifts in pixels of the ``shifts**2`` passes, the unshifted pass first: every pair of
    ``0, patch_size / shifts, ...`` up to ``patch_size`` excluded."""
    if shifts < 1 or patch_size % shifts:
        raise ValueError(f"map_shifts must be >= 1 and divide the patch size {patch_size}, got {shifts}")
    steps = [k * patch_size // shifts for k in range(shifts)]
    return [(dy, dx) for dy in steps for dx in steps]


def air_level(windows: Sequence[tuple[float, float]] | None, channels: int) -> torch.Tensor:
    """``(channels,)``: air (-1000 HU) through each window, what the model grid's padding holds (the windows repeat
    for each slice a model with context reads); 0 where the windows are unknown (every preset maps air to 0)."""
    if windows is None:
        return torch.zeros(channels)
    levels = torch.stack([window_hu(torch.tensor(AIR_HU), center, width) for center, width in windows]).float()
    return levels.repeat(channels // len(windows))


def shift_image(image: torch.Tensor, dy: int, dx: int, fill: torch.Tensor) -> torch.Tensor:
    """``(B, C, H, W)`` with its content moved ``dy`` pixels down and ``dx`` right (``>= 0``); the rows and columns it
    uncovers take ``fill`` ``(C,)``, what falls off the far edge is dropped."""
    H, W = image.shape[-2:]
    out = fill.to(image.device, image.dtype)[:, None, None].expand(image.shape).clone()
    out[..., dy:, dx:] = image[..., : H - dy, : W - dx]
    return out


def combine_shifted(maps: Sequence[torch.Tensor], patch_size: int, shifts: int) -> torch.Tensor:
    """Patch maps of the passes of :func:`grid_offsets` -> one map on the grid of ``patch_size / shifts``-pixel cells
    of the unshifted slice.

    Each pass's ``(B, grid_h, grid_w)`` map gives each patch's value to the ``shifts`` x ``shifts`` cells the patch
    covered (nearest: a patch has one value), is shifted back by its offset, and the passes are averaged cell by cell
    over those that saw the cell (a shift drops the far edge's cells, which the unshifted pass always sees).

    Args:
        maps: one ``(B, grid_h, grid_w)`` map per pass, in the order of ``grid_offsets(patch_size, shifts)``.
        patch_size: side of a patch in pixels.
        shifts: steps per axis.

    Returns:
        ``(B, grid_h * shifts, grid_w * shifts)`` float32; with ``shifts`` 1, the one map.
    """
    offsets = grid_offsets(patch_size, shifts)
    if len(maps) != len(offsets):
        raise ValueError(f"{len(maps)} maps for the {len(offsets)} passes of map_shifts {shifts}")
    cell = patch_size // shifts
    B, grid_h, grid_w = maps[0].shape
    G = (grid_h * shifts, grid_w * shifts)
    total = maps[0].new_zeros((B, *G), dtype=torch.float32)
    count = maps[0].new_zeros(G, dtype=torch.float32)
    for patch_map, (dy, dx) in zip(maps, offsets, strict=True):
        cells = patch_map.float().repeat_interleave(shifts, dim=-2).repeat_interleave(shifts, dim=-1)
        cy, cx = dy // cell, dx // cell  # cell i of the slice was cell i + cy of this pass
        total[:, : G[0] - cy, : G[1] - cx] += cells[:, cy:, cx:]
        count[: G[0] - cy, : G[1] - cx] += 1
    return total / count


def shift_back_mean(maps: Sequence[torch.Tensor], offsets: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Pixel maps ``(B, S, S)`` of passes over the slice shifted by ``offsets`` -> one map of the unshifted slice:
    each shifted back and averaged pixel by pixel over the passes that saw the pixel."""
    B, H, W = maps[0].shape
    total, count = maps[0].new_zeros((B, H, W), dtype=torch.float32), maps[0].new_zeros((H, W), dtype=torch.float32)
    for pixel_map, (dy, dx) in zip(maps, offsets, strict=True):
        total[:, : H - dy, : W - dx] += pixel_map[:, dy:, dx:].float()
        count[: H - dy, : W - dx] += 1
    return total / count


def shifted_explained(
    explain: Callable[[torch.Tensor], Explained],
    image: torch.Tensor,
    *,
    patch_size: int,
    shifts: int,
    fill: torch.Tensor,
    first: Explained | None = None,
) -> Explained:
    """A batch explained on the grid ``shifts`` times finer than the patches (see the module's text).

    Args:
        explain: one recorded pass, image -> :class:`Explained` (e.g. through
            :func:`~vit_ct.explain.maps.explain_forward`), in eval mode.
        image: ``(B, C, S, S)`` model input, ``S`` a multiple of ``patch_size``.
        patch_size: side of a patch in pixels.
        shifts: steps per axis, dividing ``patch_size``; 1 is the plain pass.
        fill: ``(C,)`` the input's air level per channel (:func:`air_level`).
        first: the unshifted pass, when the caller already ran it (e.g. with the losses).

    Returns:
        The unshifted pass's :class:`Explained` with ``rollout`` on the finer grid, ``shifted_outputs`` the other
        passes' outputs and ``relevance`` (where the passes give one) averaged by :func:`shift_back_mean`; the
        unshifted pass itself when ``shifts`` is 1.
    """
    offsets = grid_offsets(patch_size, shifts)
    first = explain(image) if first is None else first
    if shifts == 1:
        return first
    outputs, maps, relevance = [], [first.rollout], [first.relevance]
    for dy, dx in offsets[1:]:
        explained = explain(shift_image(image, dy, dx, fill))
        outputs.append(explained.output)
        maps.append(explained.rollout)
        relevance.append(explained.relevance)
    relevance = None if first.relevance is None else shift_back_mean(relevance, offsets)
    return replace(first, rollout=combine_shifted(maps, patch_size, shifts), shifted_outputs=tuple(outputs),
                   relevance=relevance)  # fmt: skip
