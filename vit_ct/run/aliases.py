"""Import paths of earlier releases that saved configs may name (``class_path: vit_ct.simulator.SimulatorDataModule``,
``--trainer.callbacks+=vit_ct.progress.EpochLines``): registered as aliases, so that a run's ``config.yaml``, a
command or code written before a module moved still loads. A module that is gone becomes an alias module; a name that
left a module which is still there (``vit_ct.progress``) is found through that module's ``__getattr__`` (PEP 562);
either way with a :class:`DeprecationWarning` naming its new place. docs/moved.md lists them all (a test reads it)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings

# old module -> {name a config or a user's code could name in it: the module it lives in now} (data modules,
# callbacks, checkpoint plugins, embed layers, metrics, the public names of `vit_ct` and the functions the docs name)
ALIASES = {
    "vit_ct.datamodule": {
        "CTSliceDataModule": "vit_ct.data.loading.datamodule",
        "SyntheticCTDataModule": "vit_ct.sim.synthetic",
    },
    "vit_ct.simulator": {"SimulatorDataModule": "vit_ct.sim.simulator"},
    # before the top of the package was split into model/, metrics/, predict/ and run/
    "vit_ct.callbacks": {"RolloutOverlayCallback": "vit_ct.run.wandb_media", "BadFilesReport": "vit_ct.run.runs"},
    "vit_ct.scan_metrics": {"ScanAUROC": "vit_ct.run.scan_auroc"},
    "vit_ct.checkpoint": {
        "AtomicCheckpointIO": "vit_ct.run.checkpoint",
        "BestAndLastCheckpoint": "vit_ct.run.checkpoint",
        "ResumeState": "vit_ct.run.checkpoint",
    },
    "vit_ct.stem": {"ConvStemPatchEmbed": "vit_ct.model.stem"},
    # before data/ was split into rooms (io, transforms, cache, manifests, loading) and the metric classes left explain/
    "vit_ct.data.datamodule": {
        "CTSliceDataModule": "vit_ct.data.loading.datamodule",
        "CTSliceDataset": "vit_ct.data.loading.datamodule",
        "CTBatch": "vit_ct.data.loading.datamodule",
    },
    "vit_ct.data.slice_dataset": {
        "CTSliceDataset": "vit_ct.data.loading.slice_dataset",
        "CTBatch": "vit_ct.data.loading.slice_dataset",
    },
    "vit_ct.data.slice_module": {"SliceDataModule": "vit_ct.data.loading.slice_module"},
    "vit_ct.data.reader": {"load_ct_slice": "vit_ct.data.io.reader", "load_mask": "vit_ct.data.io.reader"},
    "vit_ct.data.windows": {
        "WINDOW_PRESETS": "vit_ct.data.transforms.windows",
        "stack_windows": "vit_ct.data.transforms.windows",
        "window_hu": "vit_ct.data.transforms.windows",
    },
    "vit_ct.data.model_input": {"grid_hu": "vit_ct.data.transforms.model_input"},
    "vit_ct.data.augment": {"BatchAugmentation": "vit_ct.data.transforms.augment"},
    "vit_ct.data.scanner_augment": {"ScannerAugmentation": "vit_ct.data.transforms.scanner_augment"},
    "vit_ct.data.rsna": {
        "build_rsna_manifest": "vit_ct.data.datasets.rsna_manifest",
        "read_rsna_labels": "vit_ct.data.datasets.rsna_manifest",
    },
    "vit_ct.explain.localisation": {"LocalisationMetrics": "vit_ct.metrics.localisation"},
    "vit_ct.explain.sink": {"SinkMetrics": "vit_ct.metrics.sink"},
    "vit_ct.metrics.maps": {"MapMetrics": "vit_ct.metrics.map_scores"},
    "vit_ct.predict.scans": {"ScanResultsWriter": "vit_ct.predict.scan_writer"},
    "vit_ct.run.progress": {"EpochLines": "vit_ct.run.epoch_progress"},
}
# module that is still there -> {class that left it: the module it lives in now}
MOVED = {"vit_ct.progress": {"EpochLines": "vit_ct.run.epoch_progress"}}


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes an alias module when something (a saved config) first imports it; each of its names is imported from its
    new module when first read, with a warning: not at ``import vit_ct``, which stays free of torch and Lightning.
    Last on ``sys.meta_path``, so that a real module of the same name, should one come back, wins."""

    def find_spec(self, fullname, path, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in ALIASES else None

    def create_module(self, spec):
        return None  # the default module

    def exec_module(self, module) -> None:
        names = ALIASES[module.__name__]
        module.__doc__ = f"Alias of an earlier release's module: {', '.join(names)}."
        module.__getattr__ = _moved_names(module.__name__, names)
        module.__dir__ = lambda: sorted(names)


def _moved_names(module_name: str, moved: dict[str, str] | None = None):
    """The ``__getattr__`` of a module some of whose names moved (or of an alias module): each imported from its new
    module, with a warning."""
    moved = MOVED[module_name] if moved is None else moved

    def __getattr__(name: str):
        if name not in moved:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        warnings.warn(
            f"{module_name}.{name} moved to {moved[name]}.{name}: import it from there (or name that class_path)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(moved[name]), name)

    return __getattr__


class _MovedNamesLoader(importlib.abc.Loader):
    """The module's own loader, then its moved names: installed when the module is first imported, so that ``import
    vit_ct`` imports nothing more (``vit_ct.progress`` imports rich)."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def __getattr__(self, name: str):  # get_source, get_code, is_package, ...: the module's own loader answers
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        module.__getattr__ = _moved_names(module.__name__)


class _MovedNamesFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` for the modules of :data:`MOVED` only: finds them where Python would and wraps their
    loader in :class:`_MovedNamesLoader`."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in MOVED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _MovedNamesLoader(spec.loader)
        return spec


def register_aliases() -> None:
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.append(_AliasFinder())
    if not any(isinstance(finder, _MovedNamesFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedNamesFinder())
    for name in MOVED:  # already imported (before the finder was there): its names are added now
        module = sys.modules.get(name)
        if module is not None and not hasattr(module, "__getattr__"):
            module.__getattr__ = _moved_names(name)
