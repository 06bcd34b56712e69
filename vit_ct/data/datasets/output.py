"""What a dataset converter writes: the manifest CSV, a folder of binary mask volumes beside it and side tables, all
or nothing.

Mask volumes are written into a hidden staging folder; only when the whole conversion has succeeded does it take the
place of ``<stem>_masks/``, then the side tables and the manifest are written atomically, the manifest last. A crash
or bad input leaves the previous output as it was (the staging folder is removed by the next writer in the folder).
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Sequence
from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd

from vit_ct.data.manifests.manifest import check_replaceable_manifest
from vit_ct.files import atomic_write, check_replaceable, record_output, remove_leftovers

MANIFEST = "manifest"  # the command, as a mask folder's output record names it
# Column order of every converter's manifest; columns not listed follow in the converter's order.
LEADING_COLUMNS = (
    "image", "slice", "label", "epidural", "intraparenchymal", "intraventricular", "subarachnoid", "subdural", "any",
    "scan_label", "scan_epidural", "scan_intraparenchymal", "scan_intraventricular", "scan_subarachnoid",
    "scan_subdural", "mask", "patient_id", "scan", "scan_slice", "position_mm", "study_uid", "series_uid",
)  # fmt: skip


class DatasetOutput:
    """The files of one converted dataset: ``OUT.csv``, ``OUT_masks/<scan>.nii.gz`` and ``OUT.<table>.csv``.

    Use as a context manager; :meth:`commit` publishes everything, leaving the block without it discards the masks.

    Args:
        manifest: the manifest CSV to write.
        overwrite: replace an existing manifest, mask folder and side tables; refused otherwise.
        tables: names of the side tables the converter may add (``OUT.<name>.csv``), checked up front.
    """

    def __init__(self, manifest: str | os.PathLike, *, overwrite: bool = False, tables: Sequence[str] = ()):
        self.manifest = Path(os.path.abspath(Path(manifest).expanduser()))
        if self.manifest.suffix.lower() != ".csv":
            raise ValueError(f"output {self.manifest}: expected a manifest file name ending in .csv")
        self.folder = self.manifest.parent
        self.stem = self.manifest.name[: -len(".csv")]
        self.masks_dir = self.folder / f"{self.stem}_masks"
        self._tables = {name: self.folder / f"{self.stem}.{name}.csv" for name in tables}
        self._pending: dict[str, pd.DataFrame] = {}
        self._staging = self.folder / f".{self.stem}_masks.{os.getpid()}.tmp"
        self.overwrite = overwrite

    def __enter__(self) -> DatasetOutput:
        taken = [p for p in (self.manifest, self.masks_dir, *self._tables.values()) if p.exists()]
        if taken and not self.overwrite:
            raise ValueError(
                f"{', '.join(map(str, taken))} already exist(s); choose another output, or overwrite=True"
                " (--overwrite) to replace the manifest and its mask folder"
            )
        if self.manifest.is_dir():
            raise ValueError(f"output {self.manifest} is a folder; expected a manifest file name ending in .csv")
        check_replaceable_manifest(self.manifest)
        # the mask folder of an earlier conversion (its record), never a folder of the user's that has the name
        check_replaceable(self.masks_dir, MANIFEST, overwrite=True, option="mask folder")
        self.folder.mkdir(parents=True, exist_ok=True)
        remove_leftovers(self.folder)  # staging folders of converters that were killed
        return self

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self._staging, ignore_errors=True)  # after commit it is gone already

    def reference(self, path: str | os.PathLike) -> str:
        """How the manifest names ``path``: relative to the manifest's folder when it lies below it, else absolute."""
        path = Path(os.path.abspath(path))
        return path.relative_to(self.folder).as_posix() if path.is_relative_to(self.folder) else path.as_posix()

    def write_mask(self, scan_id: str, lesion: np.ndarray, affine: np.ndarray) -> str:
        """Stage a binary mask volume (uint8, 1 = lesion) on a CT's grid and return how the manifest names it.

        Args:
            scan_id: file name stem (unique per manifest).
            lesion: (rows, columns, slices) bool, voxel for voxel the CT volume's.
            affine: the CT's (4, 4) voxel-to-RAS affine, so that `load_mask` reorients it as `load_ct_slice` does.
        """
        self._staging.mkdir(exist_ok=True)
        name = f"{scan_id}.nii.gz"
        nib.save(nib.Nifti1Image(lesion.astype(np.uint8), affine), self._staging / name)
        return f"{self.masks_dir.name}/{name}"

    def add_table(self, name: str, table: pd.DataFrame) -> None:
        """A side table written beside the manifest on commit as ``<stem>.<name>.csv``."""
        if name not in self._tables:
            raise AssertionError(f"side table {name!r} not declared")  # a converter's own mistake, not the user's
        self._pending[name] = table

    def commit(self, table: pd.DataFrame) -> list[Path]:
        """Publish the staged masks, the side tables and ``table`` as the manifest; returns the paths written."""
        table = table[[c for c in LEADING_COLUMNS if c in table.columns] + [c for c in table.columns
                                                                            if c not in LEADING_COLUMNS]]  # fmt: skip
        old = None
        if self.masks_dir.exists():  # overwrite was asked for (checked on entry)
            old = self.folder / f".{self.masks_dir.name}.{os.getpid()}-{secrets.token_hex(4)}.old"
            os.replace(self.masks_dir, old)
        written = []
        if self._staging.exists():
            record_output(self._staging, MANIFEST)
            os.replace(self._staging, self.masks_dir)
            written.append(self.masks_dir)
        for name, path in self._tables.items():
            if name in self._pending:
                with atomic_write(path) as tmp:
                    self._pending[name].to_csv(tmp, index=False)
                written.append(path)
            elif path.exists():
                path.unlink()  # a side table of the output this one replaces
        with atomic_write(self.manifest) as tmp:
            table.to_csv(tmp, index=False)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return [self.manifest, *written]
