"""vit-ct: Vision Transformers for CT slices, with attention-rollout maps over the lesion."""

from vit_ct.data.datamodule import CTBatch, CTSliceDataModule, CTSliceDataset
from vit_ct.data.reader import load_ct_slice, load_mask
from vit_ct.data.windows import WINDOW_PRESETS, stack_windows, window_hu
from vit_ct.explain.attention import record_attention
from vit_ct.explain.rollout import attention_rollout, gradient_rollout, last_block_attention
from vit_ct.model import ViTClassifier
from vit_ct.run.aliases import register_aliases
from vit_ct.sim.synthetic import SyntheticCTDataModule

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

register_aliases()
