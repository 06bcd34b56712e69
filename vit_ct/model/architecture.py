"""The network as a setting: one value that says which timm Vision Transformer is built, for which input, and how
it regularises; the model's ``network`` argument (``--model.network.*`` on the command line)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Network:
    """The network: timm's ``arch``, with the fields below overriding its defaults.

    Args:
        arch: timm ViT architecture the network starts from.
        img_size: Side of the square model input in pixels (a multiple of ``patch_size``; linked to the data in the
            CLI). None: the start weights' own (``weights`` holding a vit-ct checkpoint, shipped ``pretrained``
            weights), else the data modules' default, 192. A value other than the weights' resamples their position
            embeddings, said in one warning.
        patch_size: Side of a patch in pixels.
        in_chans: Input channels, one per HU window of each slice read (linked to the data in the CLI). None: the
            start weights' own, else 2, the data modules' default windows (brain, subdural), times 3 with context.
        context_mm: The network reads each slice with its neighbours this far below and above (linked to
            ``data.context_mm`` in the CLI): the slice's own windows, then the slice below's, then the one above's.
            Start weights that read single slices read the slice itself: their first convolution's kernels on its
            channels, the neighbours' as ``neighbour_start`` says (and the other way round, a context start's
            own-slice kernels). None: each slice alone, or the start weights' own context.
        neighbour_start: How the first convolution of a network with context starts on the neighbours' channels
            when its start weights read single slices: ``zeros`` (the network starts as the weights read the slice
            alone, and learns the neighbours), or ``inflated`` (the slice's kernels spread over the slice and its
            neighbours, each a third, as I3D inflates 2-D kernels: a scan that does not change along its axis is read
            as the weights read its slice, and every slice read uses the neighbours from the first step).
        sequence: ``gru``: read each slice in its scan as well as alone: a bidirectional GRU over the class-token
            embeddings of a scan's slices in position order adds a correction, zero at the start, to each slice's
            logits (:mod:`vit_ct.model.sequence`); ``transformer``: the same with a two-block transformer encoder
            over the scan's slices; trained beside the slice classifier, which still reads a slice
            alone and whose maps the rollout reads. Validation and test log each figure in scan too
            (``val/auroc_in_scan``, ``val/scan_auroc_in_scan``). None: each slice alone.
        stem: ``patch``: timm's linear patch embedding; ``conv``: a convolutional stem with the same token grid,
            which trains much better from scratch on small data (arXiv:2106.14881). None: the stem the start weights
            (``weights``, ``pretrained``) hold, so that they load whole; ``conv`` without start weights.
        embed_dim: Token width; None keeps the architecture's.
        depth: Transformer blocks; None keeps the architecture's.
        num_heads: Attention heads; None keeps the architecture's.
        reg_tokens: Register tokens beside the class token (arXiv:2309.16588).
        mask_air: Patches that hold nothing (every pixel at the floor of every window: air, padding, outside the
            scan circle) are not attention keys, so the class token cannot park its attention in the air: the rollout
            is zero there by construction, not by erasing the map afterwards; and they skip the blocks, at the same
            logits (:class:`vit_ct.model.network.AirSkippingViT`). Decided from the input alone.
        drop_rate: Dropout before the classifier.
        attn_drop_rate: Dropout on the attention weights, after the softmax.
        drop_path_rate: Stochastic depth, rising linearly to this rate in the last block.
    """

    arch: str = "vit_tiny_patch16_224"
    img_size: int | None = None
    patch_size: int = 16
    in_chans: int | None = None
    context_mm: float | None = None
    neighbour_start: Literal["zeros", "inflated"] = "zeros"
    sequence: Literal["gru", "transformer"] | None = None
    stem: Literal["patch", "conv"] | None = None
    embed_dim: int | None = None
    depth: int | None = None
    num_heads: int | None = None
    reg_tokens: int = 0
    mask_air: bool = True
    drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.0
