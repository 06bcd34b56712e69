"""vit-ct: Vision Transformers for CT slices, with attention-rollout maps over the lesion."""

from vit_ct.attention import record_attention
from vit_ct.datamodule import CTBatch, CTSliceDataModule, CTSliceDataset, SyntheticCTDataModule
from vit_ct.model import ViTClassifier
from vit_ct.reader import load_ct_slice, load_mask
from vit_ct.rollout import attention_rollout, gradient_rollout, last_block_attention
from vit_ct.windows import WINDOW_PRESETS, stack_windows, window_hu

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
