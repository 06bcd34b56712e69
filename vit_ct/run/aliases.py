"""Import paths of earlier releases that saved configs may name (``class_path: vit_ct.simulator.SimulatorDataModule``,
``--trainer.callbacks+=vit_ct.progress.EpochLines``): registered as aliases, so that a run's ``config.yaml`` or a
command written before the package was split into folders still loads."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

# old module -> {class a config could name in it: the module it lives in now} (data modules, callbacks, checkpoint
# plugins, embed layers)
ALIASES = {
    "vit_ct.datamodule": {
        "CTSliceDataModule": "vit_ct.data.datamodule",
        "SyntheticCTDataModule": "vit_ct.sim.synthetic",
    },
    "vit_ct.simulator": {"SimulatorDataModule": "vit_ct.sim.simulator"},
    # before the top of the package was split into model/, metrics/, predict/ and run/
    "vit_ct.callbacks": {"RolloutOverlayCallback": "vit_ct.run.wandb_media", "BadFilesReport": "vit_ct.run.runs"},
    "vit_ct.progress": {"EpochLines": "vit_ct.run.progress"},
    "vit_ct.scan_metrics": {"ScanAUROC": "vit_ct.run.scan_auroc"},
    "vit_ct.checkpoint": {
        "AtomicCheckpointIO": "vit_ct.run.checkpoint",
        "BestAndLastCheckpoint": "vit_ct.run.checkpoint",
        "ResumeState": "vit_ct.run.checkpoint",
    },
    "vit_ct.stem": {"ConvStemPatchEmbed": "vit_ct.model.stem"},
}


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes an alias module when something (a saved config) first imports it, and imports its classes' modules
    then: not at ``import vit_ct``, which stays free of torch and Lightning. Last on ``sys.meta_path``, so that a real
    module of the same name (``vit_ct/progress.py``) wins."""

    def find_spec(self, fullname, path, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in ALIASES else None

    def create_module(self, spec):
        return None  # the default module

    def exec_module(self, module) -> None:
        classes = ALIASES[module.__name__]
        module.__doc__ = f"Alias of an earlier release's module: {', '.join(classes)}."
        for name, home in classes.items():
            setattr(module, name, getattr(importlib.import_module(home), name))


def register_aliases() -> None:
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.append(_AliasFinder())
