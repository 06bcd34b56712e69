"""Import paths of earlier releases that saved configs may name (``class_path: vit_ct.simulator.SimulatorDataModule``,
``--trainer.callbacks+=vit_ct.progress.EpochLines``): registered as aliases, so that a run's ``config.yaml`` or a
command written before the package was split into folders still loads."""

from __future__ import annotations

import sys
import types

from vit_ct.data.datamodule import CTSliceDataModule
from vit_ct.model.stem import ConvStemPatchEmbed
from vit_ct.run.checkpoint import AtomicCheckpointIO, BestAndLastCheckpoint, ResumeState
from vit_ct.run.progress import EpochLines
from vit_ct.run.runs import BadFilesReport
from vit_ct.run.scan_auroc import ScanAUROC
from vit_ct.run.wandb_media import RolloutOverlayCallback
from vit_ct.sim.simulator import SimulatorDataModule
from vit_ct.sim.synthetic import SyntheticCTDataModule

# old module -> the classes a config could name in it (data modules, callbacks, checkpoint plugins, embed layers)
ALIASES = {
    "vit_ct.datamodule": {"CTSliceDataModule": CTSliceDataModule, "SyntheticCTDataModule": SyntheticCTDataModule},
    "vit_ct.simulator": {"SimulatorDataModule": SimulatorDataModule},
    # before the top of the package was split into model/, metrics/, predict/ and run/
    "vit_ct.callbacks": {"RolloutOverlayCallback": RolloutOverlayCallback, "BadFilesReport": BadFilesReport},
    "vit_ct.progress": {"EpochLines": EpochLines},
    "vit_ct.scan_metrics": {"ScanAUROC": ScanAUROC},
    "vit_ct.checkpoint": {
        "AtomicCheckpointIO": AtomicCheckpointIO,
        "BestAndLastCheckpoint": BestAndLastCheckpoint,
        "ResumeState": ResumeState,
    },
    "vit_ct.stem": {"ConvStemPatchEmbed": ConvStemPatchEmbed},
}


def register_aliases() -> None:
    for name, classes in ALIASES.items():
        if name not in sys.modules:
            module = types.ModuleType(name, f"Alias of an earlier release's module: {', '.join(classes)}.")
            module.__dict__.update(classes)
            sys.modules[name] = module
