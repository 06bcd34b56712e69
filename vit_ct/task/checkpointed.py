"""A LightningModule whose checkpoints say how it sees its input: the input contract written into every checkpoint
(:class:`~vit_ct.data.transforms.contract.InputContract`), and checkpoints restored as their network was built, read
without running code."""

from __future__ import annotations

from pathlib import Path

import lightning as L

from vit_ct.data.transforms.contract import CHECKPOINT_KEY, InputContract
from vit_ct.model.hparams import unstored_hparams
from vit_ct.model.weights_input import read_checkpoint


class SeesAsCheckpointed(L.LightningModule):
    """The base of vit-ct's model: ``input_contract`` (set by the subclass) goes into every checkpoint it saves."""

    input_contract: InputContract

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, map_location=None, hparams_file=None, strict=None, **kwargs):
        """Restore a vit-ct checkpoint as its network was built, also where it does not store a hyper-parameter
        (:func:`~vit_ct.model.hparams.unstored_hparams`); the file is read with ``weights_only=True``, so it cannot
        run code."""
        if kwargs.pop("weights_only", True) is not True:
            raise ValueError(f"vit-ct loads checkpoints with weights_only=True only (not {checkpoint_path})")
        if isinstance(checkpoint_path, (str, Path)) and Path(checkpoint_path).is_file() and hparams_file is None:
            kwargs = {**unstored_hparams(read_checkpoint(checkpoint_path)), **kwargs}  # (tensors memory-mapped)
        kwargs.update(map_location=map_location, hparams_file=hparams_file, strict=strict, weights_only=True)
        return super().load_from_checkpoint(checkpoint_path, **kwargs)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Records how the weights see their input: as the trainer's data module prepares slices now, else as the
        checkpoint or start weights the model came from did."""
        try:
            datamodule = self.trainer.datamodule
        except RuntimeError:  # saved through a strategy alone, without a trainer
            datamodule = None
        if hasattr(datamodule, "input_contract"):
            self.input_contract = datamodule.input_contract(self.hparams.patch_size)
        checkpoint[CHECKPOINT_KEY] = self.input_contract.to_dict()
