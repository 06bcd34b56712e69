"""Import paths of earlier releases that saved configs may name (``class_path: vit_ct.simulator.SimulatorDataModule``):
registered as aliases, so that a run's ``config.yaml`` written before the package was split into folders still loads."""

from __future__ import annotations

import sys
import types

from vit_ct.data.datamodule import CTSliceDataModule
from vit_ct.sim.simulator import SimulatorDataModule
from vit_ct.sim.synthetic import SyntheticCTDataModule

# old module -> the classes a config could name in it
ALIASES = {
    "vit_ct.datamodule": {"CTSliceDataModule": CTSliceDataModule, "SyntheticCTDataModule": SyntheticCTDataModule},
    "vit_ct.simulator": {"SimulatorDataModule": SimulatorDataModule},
}


def register_aliases() -> None:
    for name, classes in ALIASES.items():
        if name not in sys.modules:
            module = types.ModuleType(name, f"Alias of an earlier release's module: {', '.join(classes)}.")
            module.__dict__.update(classes)
            sys.modules[name] = module
