"""A LightningModule whose checkpoints say how it sees its input: the input contract written into every checkpoint
(:class:`~vit_ct.data.transforms.contract.InputContract`)."""

from __future__ import annotations

import lightning as L

from vit_ct.data.transforms.contract import CHECKPOINT_KEY, InputContract


class SeesAsCheckpointed(L.LightningModule):
    """The base of vit-ct's model: ``input_contract`` (set by the subclass) goes into every checkpoint it saves."""

    input_contract: InputContract

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
