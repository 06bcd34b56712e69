"""vit-ct: Vision Transformers for CT slices, with attention-rollout maps over the lesion.

The public names below are imported on first use (PEP 562): ``import vit_ct`` costs no torch, Lightning or timm, so
that ``vit-ct --help`` answers at once, while ``from vit_ct import ViTClassifier`` and ``class_path:
vit_ct.ViTClassifier`` in a saved config work as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the module that defines it
_PUBLIC = {
    "CTBatch": "vit_ct.data.loading.datamodule",
    "CTSliceDataModule": "vit_ct.data.loading.datamodule",
    "CTSliceDataset": "vit_ct.data.loading.datamodule",
    "load_ct_slice": "vit_ct.data.io.reader",
    "load_mask": "vit_ct.data.io.reader",
    "WINDOW_PRESETS": "vit_ct.data.transforms.windows",
    "stack_windows": "vit_ct.data.transforms.windows",
    "window_hu": "vit_ct.data.transforms.windows",
    "record_attention": "vit_ct.explain.attention",
    "attention_rollout": "vit_ct.explain.rollout",
    "gradient_rollout": "vit_ct.explain.rollout",
    "last_block_attention": "vit_ct.explain.rollout",
    "ViTClassifier": "vit_ct.task.classifier",
    "SyntheticCTDataModule": "vit_ct.sim.synthetic",
}

if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from vit_ct.data.io.reader import load_ct_slice, load_mask
    from vit_ct.data.loading.datamodule import CTBatch, CTSliceDataModule, CTSliceDataset
    from vit_ct.data.transforms.windows import WINDOW_PRESETS, stack_windows, window_hu
    from vit_ct.explain.attention import record_attention
    from vit_ct.explain.rollout import attention_rollout, gradient_rollout, last_block_attention
    from vit_ct.sim.synthetic import SyntheticCTDataModule
    from vit_ct.task.classifier import ViTClassifier

__all__ = [
    "WINDOW_PRESETS",
    "CTBatch",
    "CTSliceDataModule",
    "CTSliceDataset",
    "SyntheticCTDataModule",
    "ViTClassifier",
    "attention_rollout",
    "gradient_rollout",
    "last_block_attention",
    "load_ct_slice",
    "load_mask",
    "record_attention",
    "stack_windows",
    "window_hu",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
