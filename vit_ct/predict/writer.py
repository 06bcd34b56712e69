"""``vit-ct predict`` outputs: ``predictions.csv``, one rollout map (``.npy``, source grid) and one overlay PNG
per slice, as the contract in the README describes. A run's outputs never mix with another's: they are written into
a fresh hidden folder beside ``OUT`` and replace ``OUT`` only once complete.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from lightning.pytorch.callbacks import BasePredictionWriter

from vit_ct.data.io.head_check import head_check
from vit_ct.data.io.reader import load_ct_slice, load_mask
from vit_ct.data.manifests.manifest import manifest_frame
from vit_ct.data.transforms.grid import to_source_grid
from vit_ct.data.transforms.windows import DISPLAY_WINDOW
from vit_ct.explain.overlay import add_caption, render_overlay, save_png
from vit_ct.files import (
    atomic_write,
    check_replaceable,
    record_output,
    remove_leftovers,
    replace_folder,
    safe_name,
    staging_folder,
)
from vit_ct.metrics.lesion_probability import scan_column
from vit_ct.metrics.schema import PREDICTIONS, RUN_JSON, RunRecord
from vit_ct.metrics.temperature import read_temperature, scale
from vit_ct.task.inference import Inference
from vit_ct.task.scan_reading import joined, on_cpu, read_in_scan

PREDICT = "predict"  # the command whose outputs this writer writes, as its output record names it


def _slug(text: str) -> str:
    """A readable file stem from a slice's path (the row index before it keeps the stems unique)."""
    name = Path(str(text)).name
    for suffix in (".gz", ".nii", ".dcm", ".npy"):
        name = name.removesuffix(suffix)
    return safe_name(name, unique=False, fallback="slice")[:80]


OVERLAY_MIN_WIDTH = 256  # px: a narrower slice is enlarged by a whole factor so that its caption can be read


def overlay_caption(record: dict) -> list[str]:
    """The lines under a slice's overlay PNG, so that a picture passed on alone still names its case: the scan and
    the file (and frame), the model's probabilities with the label where known, and why the slice looks outside the
    model's domain where it does."""
    where = Path(str(record[PREDICTIONS.image])).name
    if PREDICTIONS.slice in record:
        where += f" [{record[PREDICTIONS.slice]}]"
    if PREDICTIONS.scan in record:
        where = f"{record[PREDICTIONS.scan]} / {where}"
    if PREDICTIONS.prob in record:
        said = f"P(lesion) {record[PREDICTIONS.prob]:.3f}"
        if PREDICTIONS.label in record:
            said += f", label {record[PREDICTIONS.label]}"
    else:  # one prob_<class> per output: the highest first
        probs = {k.removeprefix("prob_"): v for k, v in record.items() if k.startswith("prob_") and "tta" not in k}
        said = ", ".join(f"P({k}) {v:.2f}" for k, v in sorted(probs.items(), key=lambda kv: -kv[1])[:3])
    lines = [_fit(where), _fit(said)]
    if record.get(PREDICTIONS.outside_domain):
        lines.append(_fit(f"not a head CT? {record[PREDICTIONS.outside_domain]}"))
    return lines


def _fit(text: str, width: int = 44) -> str:
    """``text`` cut to ``width`` characters, the cut shown: the end of a long name is the part that tells cases
    apart, so the start goes."""
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def save_npy(array: np.ndarray, path: Path) -> None:
    """Write a ``.npy`` atomically."""
    with atomic_write(path) as tmp, open(tmp, "wb") as f:
        np.save(f, array)


def run_record(trainer, pl_module, calibration: dict | None = None) -> RunRecord:
    """What ``OUT/run.json`` records: the checkpoint, how it saw its input, and where the slices' paths in
    ``predictions.csv`` are relative to (the manifest's folder), so that a review opens ``OUT`` without the model."""
    data = trainer.datamodule
    manifest = getattr(data, "manifest", None)
    return RunRecord(
        checkpoint=str(Path(trainer.ckpt_path).resolve()) if trainer.ckpt_path else None,
        manifest=str(Path(manifest).resolve()) if manifest else None,
        images_relative_to=str(Path(manifest).resolve().parent) if manifest else None,
        scans=getattr(data, "scans", None),
        input=pl_module.input_contract.to_dict() if pl_module.input_contract is not None else None,
        task=pl_module.task,
        class_names=list(pl_module.class_names),
        calibration=calibration,
    )


def check_output_dir(output_dir: Path, *, overwrite: bool, inputs: Iterable[str | Path] = ()) -> None:
    """Refuse an ``OUT`` that is a file, lies under a file or in a folder this process cannot write to (its outputs
    are staged beside it), or is not empty unless it holds an earlier predict output and ``overwrite``
    (:func:`vit_ct.files.check_replaceable`): never one holding a file predict did not write, the working directory
    or one of the run's ``inputs``."""
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"--output_dir {output_dir} is a file; expected a folder (absent or empty)")
    parent = next(p for p in output_dir.parents if p.exists())  # the nearest folder that exists
    if not parent.is_dir():
        raise ValueError(f"--output_dir {output_dir} lies under {parent}, which is a file; expected a folder path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--output_dir {output_dir}: cannot write in {parent} (permission denied); choose a folder"
                         " you can write to")  # fmt: skip
    check_replaceable(output_dir, PREDICT, overwrite=overwrite, inputs=(Path.cwd(), *inputs), how="--overwrite true")


def unmeasured_distances(table: pd.DataFrame) -> list[str]:
    """The HD95 columns of a unit no slice was measured in: ``*_hd95_px`` (slices without a pixel spacing, in pixels
    of the source slice) unless some slice had no spacing, and then ``*_hd95_mm`` where every value is empty."""
    pixels = [c for c in table.columns if c.endswith("_hd95_px")]
    if table[pixels].isna().all().all():
        return pixels
    return [c for c in table.columns if c.endswith("_hd95_mm") and table[c].isna().all()]


def prediction_row(
    prediction: Inference,
    i: int,
    row: pd.Series,
    pl_module,
    *,
    files: dict[str, str],
    scan_key: str | None,
    outside_domain: str | None = None,
) -> dict:
    """Slice ``i`` of a batch as a row of ``predictions.csv`` (:class:`vit_ct.metrics.schema.PredictionColumns`, in
    its order), from the model's :class:`~vit_ct.task.inference.Inference`, the slice's manifest ``row`` (with the
    dataset's ``image_ref``) and the ``files`` written for it (``rollout``, ``overlay``); with ``index``, the slice's
    row in the dataset. ``scan_key``: the manifest's column naming the slice's scan, if any. ``outside_domain``: why
    the slice does not look like a head CT ("" where it does; None: not checked)."""
    record = {PREDICTIONS.index: int(prediction.index[i]), PREDICTIONS.image: row["image_ref"]}
    record.update(prediction.probabilities(i, pl_module.class_names))
    labels = pl_module.hparams.class_names if pl_module.task == "multilabel" else None
    if labels:
        known = {name: row[name] for name in labels if name in row and not pd.isna(row[name])}
        record.update(zip(PREDICTIONS.labels(list(known)), map(int, known.values()), strict=True))
    elif "label" in row and not pd.isna(row["label"]):
        record[PREDICTIONS.label] = int(row["label"])
    record.update(files)
    if scan_key is not None:  # where the slice belongs, for a review of OUT without the model
        record[PREDICTIONS.scan] = row[scan_key]
    if manifest_frame(row) is not None:
        record[PREDICTIONS.slice] = manifest_frame(row)
    if isinstance(row.get("mask"), str):
        record[PREDICTIONS.mask] = row.get("mask_ref", row["mask"])
    if outside_domain is not None:
        record[PREDICTIONS.outside_domain] = outside_domain
    record.update(prediction.sink_columns(i))
    record.update(prediction.score_columns(i))
    return record


class PredictionWriter(BasePredictionWriter):
    """Writes each predicted slice's rollout map and overlay, then ``predictions.csv`` once all ranks are done.

    Everything goes into a fresh hidden folder beside ``OUT`` (``.<OUT>.<pid>-<token>.partial``, ``output_dir``
    while the run lasts), which replaces ``OUT`` when complete: a reader sees the old outputs or the new ones, never a
    mix, and a failed run leaves ``OUT`` as it was (and removes its partial folder; a killed one's is removed by the
    next predict beside it).

    Args:
        output_dir: Folder of the outputs: absent or empty, unless ``overwrite``.
        overwrite: Replace an ``OUT`` holding an earlier predict output: none of its files survive. A folder holding
            any file predict did not write is refused all the same.
        inputs: Files the run reads (checkpoint, manifest); ``overwrite`` refuses an ``OUT`` that holds one.
        window: (centre, width) HU of the overlay's grey image.
        calibration: A ``calibration.json`` of ``vit-ct report``: ``prob_calibrated`` beside ``prob`` (binary runs).
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        overwrite: bool = False,
        inputs: Iterable[str | Path] = (),
        window: tuple[float, float] = DISPLAY_WINDOW,
        calibration: str | Path | None = None,
    ) -> None:
        super().__init__(write_interval="batch")
        self.destination = Path(output_dir).resolve()  # a link to a folder: its target is replaced, the link kept
        self.overwrite = overwrite
        # the calibration file is an input too: an --overwrite of the folder holding it is refused
        self.inputs = [Path(p) for p in (*inputs, *([calibration] if calibration is not None else []))]
        # read before any slice: a file without a temperature is refused at once
        self.calibration = None
        if calibration is not None:
            self.calibration = {"file": str(Path(calibration).resolve()), "temperature": read_temperature(calibration)}
        remove_leftovers(self.destination.parent)  # a killed run's partial folder, also when this run is refused
        check_output_dir(self.destination, overwrite=overwrite, inputs=self.inputs)
        self.output_dir = self.destination
        self.window = window
        self.rows: list[dict] = []
        self.in_scan: list[dict] = []  # with a sequence head: what reading the slices in their scans needs

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.calibration is not None and pl_module.task != "binary":
            raise ValueError(f"--calibration {self.calibration['file']}: a temperature of P(lesion) applies to binary"
                             f" runs (one prob column); this model is {pl_module.task}")  # fmt: skip
        check_output_dir(self.destination, overwrite=self.overwrite, inputs=self.inputs)  # again: OUT may have changed
        # rank 0's pid and token on every rank: one partial folder per run, which no other run's files can be in
        token = trainer.strategy.broadcast(f"{os.getpid()}-{secrets.token_hex(4)}")
        self.output_dir = staging_folder(self.destination, token)
        for sub in ("maps", "overlays"):
            (self.output_dir / sub).mkdir(parents=True, exist_ok=True)
        self.rows, self.in_scan = [], []
        report = getattr(trainer.datamodule, "report_bad_rows", None)  # rows on_bad_file="skip" left out
        if report is not None and trainer.is_global_zero:
            report(self.output_dir, shown_as=self.destination)

    def on_predict_start(self, trainer, pl_module) -> None:
        if self.overwrite:  # the slices themselves must not lie in the folder that is about to be replaced
            table = trainer.predict_dataloaders.dataset.table
            files = [p for column in ("image", "mask") if column in table for p in table[column] if isinstance(p, str)]
            check_output_dir(self.destination, overwrite=True, inputs=files)

    def write_on_batch_end(
        self, trainer, pl_module, prediction: Inference, batch_indices, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        dataset = trainer.predict_dataloaders.dataset
        table = dataset.table
        scan_key = scan_column(table)
        for i, index in enumerate(prediction.index.tolist()):
            row = table.iloc[index]
            rows, cols = batch["source_shape"][i].tolist()
            heat = to_source_grid(prediction.rollout[i].float().cpu(), rows, cols).clamp_min(0).numpy()
            # the scan in the name too: every series of an archive has its IM0005
            scan = f"{safe_name(row[scan_key], unique=False)[:40]}_" if scan_key is not None else ""
            stem = f"{index:06d}_{scan}{_slug(row['image_ref'])}"
            map_path, overlay_path = Path("maps") / f"{stem}.npy", Path("overlays") / f"{stem}.png"
            save_npy(heat.astype(np.float32), self.output_dir / map_path)
            hu = load_ct_slice(row["image"], frame=manifest_frame(row), **dataset.read_options)
            outside = head_check(row["image"], hu)
            mask = load_mask(row["mask"], frame=manifest_frame(row)) if isinstance(row.get("mask"), str) else None
            files = {PREDICTIONS.rollout: map_path.as_posix(), PREDICTIONS.overlay: overlay_path.as_posix()}
            record = prediction_row(prediction, i, row, pl_module, files=files, scan_key=scan_key,
                                    outside_domain=outside)  # fmt: skip
            picture = render_overlay(hu, heat, mask, window=self.window)
            save_png(add_caption(picture, overlay_caption(record), min_width=OVERLAY_MIN_WIDTH),
                     self.output_dir / overlay_path)  # fmt: skip
            self.rows.append(record)
        if prediction.in_scan is not None:
            self.in_scan.append(on_cpu({**prediction.in_scan, "index": prediction.index}))

    def on_predict_epoch_end(self, trainer, pl_module) -> None:
        partial = self.output_dir / f".predictions.rank{trainer.global_rank}.csv"
        pd.DataFrame(self.rows).to_csv(partial, index=False)
        if self.in_scan:
            torch.save(self.in_scan, self.output_dir / f".in_scan.rank{trainer.global_rank}.pt")
        trainer.strategy.barrier()  # every rank calls it: no collective inside rank-0-only code
        if trainer.is_global_zero:
            # one file per rank of this run: the partial folder is this run's own
            parts = [self.output_dir / f".predictions.rank{rank}.csv" for rank in range(trainer.world_size)]
            frames = [pd.read_csv(p) for p in parts if p.stat().st_size > 1]
            # A distributed sampler repeats a few slices to even out the ranks: keep each slice once.
            table = pd.concat(frames).drop_duplicates(PREDICTIONS.index).sort_values(PREDICTIONS.index)
            table = read_in_scans(table, pl_module, [self.output_dir / f".in_scan.rank{r}.pt" for r in
                                                     range(trainer.world_size)])  # fmt: skip
            table = table.drop(columns=PREDICTIONS.index)
            table = table.drop(columns=unmeasured_distances(table))
            if self.calibration is not None:  # beside prob, which the metrics and the review read as the model gave it
                calibrated = scale(table[PREDICTIONS.prob].to_numpy(), self.calibration["temperature"])
                table.insert(table.columns.get_loc(PREDICTIONS.prob) + 1, PREDICTIONS.prob_calibrated, calibrated)
            with atomic_write(self.output_dir / PREDICTIONS.file) as tmp:
                table.to_csv(tmp, index=False)
            say_outside_domain(table)
            with atomic_write(self.output_dir / RUN_JSON) as tmp:  # where the slices are: the review reads them
                tmp.write_text(json.dumps(run_record(trainer, pl_module, self.calibration), indent=2) + "\n")
            for p in parts:
                p.unlink()
        trainer.strategy.barrier()

    def on_predict_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            record_output(self.output_dir, PREDICT)  # what a later --overwrite may replace: these files, no other
            replace_folder(self.output_dir, self.destination)
            print(summary_line(self.destination))
        trainer.strategy.barrier()
        self.output_dir = self.destination

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if trainer.is_global_zero and self.output_dir != self.destination:
            shutil.rmtree(self.output_dir, ignore_errors=True)  # OUT itself was never touched


def summary_line(out: Path) -> str:
    """What a predict run wrote, in one line: slices, scans, DICOM objects and the files listing what was left out."""
    slices = len(pd.read_csv(out / PREDICTIONS.file, usecols=[PREDICTIONS.image]))
    parts = [f"{slices} slice{'s' * (slices != 1)} ({PREDICTIONS.file}, maps/, overlays/)"]
    if (out / "scans.csv").is_file():
        scans = len(pd.read_csv(out / "scans.csv", usecols=[0]))
        volumes = ", scans/" if (out / "scans").is_dir() else ""
        parts.append(f"{scans} scan{'s' * (scans != 1)} (scans.csv{volumes})")
    objects = sum(1 for _ in (out / "dicom").rglob("*.dcm")) if (out / "dicom").is_dir() else 0
    if objects:
        parts.append(f"{objects} DICOM object{'s' * (objects != 1)} (dicom/)")
    left_out = [name for name in ("skipped.csv", "bad_files.csv") if (out / name).is_file()]
    if left_out:
        parts.append(f"what was left out, with the reasons: {', '.join(left_out)}")
    return f"vit-ct predict wrote {out}: " + "; ".join(parts)


def read_in_scans(table: pd.DataFrame, pl_module, parts: list[Path]) -> pd.DataFrame:
    """``table`` (with its ``index``) with each slice's probability in its whole scan after ``prob``
    (:attr:`~vit_ct.metrics.schema.PredictionColumns.prob_in_scan`), where the model has a sequence head and the ranks
    wrote what it reads (``parts``, removed here); as it was otherwise."""
    found = [p for p in parts if p.is_file()]
    batches = [batch for p in found for batch in torch.load(p, weights_only=True)]
    for p in found:
        p.unlink()
    if not batches or getattr(pl_module, "sequence", None) is None:
        return table
    rows = joined(batches)  # a DDP padding repeat counts once
    probs = pl_module.probabilities(read_in_scan(pl_module.sequence, rows)).cpu()
    probs = probs.reshape(len(rows["index"]), -1).numpy()
    columns = PREDICTIONS.probs(pl_module.task, pl_module.class_names, in_scan=True)
    read = pd.DataFrame(probs, columns=columns, index=rows["index"].numpy())
    table = table.copy()
    before = [*PREDICTIONS.probs(pl_module.task, pl_module.class_names),
              *PREDICTIONS.probs(pl_module.task, pl_module.class_names, tta=True)]  # fmt: skip
    at = max(table.columns.get_loc(c) for c in before if c in table.columns) + 1
    for offset, column in enumerate(columns):
        table.insert(at + offset, column, table[PREDICTIONS.index].map(read[column]).to_numpy())
    return table


def say_outside_domain(table: pd.DataFrame) -> None:
    """One line where some slices do not look like an axial head CT: their probabilities are the model's all the
    same, read on what it was not trained on."""
    flagged = table[table[PREDICTIONS.outside_domain].fillna("").astype(str) != ""]
    if len(flagged):
        first = flagged.iloc[0]
        print(f"{len(flagged)} of {len(table)} slices do not look like an axial head CT, which the model was trained"
              f" on: their P(lesion) means little (each reason in {PREDICTIONS.file}'s {PREDICTIONS.outside_domain}"
              f" column); e.g. {first[PREDICTIONS.image]}: {first[PREDICTIONS.outside_domain]}")  # fmt: skip
