"""``vit-ct report --wandb RUN``: a report's figures (``wandb.Image``), its figures table (``wandb.Table``) and its
headline values (the run's summary, ``report/slice/auroc``...) logged into the W&B run of a ``vit-ct fit`` run folder,
resumed by the run's id: no second run, nothing written into the run folder (its checkpoints stay as they were)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from vit_ct.report.report_files import FIGURES, REPORT_JSON

SECTIONS = ("slice", "scan", "calibration", "maps")  # the sections of report.json whose entries are figures
TABLE_COLUMNS = ["model", "section", "figure", "value", "ci95_low", "ci95_high", "n"]


@dataclass(frozen=True)
class FitRun:
    """The W&B run of a ``vit-ct fit`` run folder, ``<save_dir>/<project>/<run id>/`` (``runs/latest`` links there).

    Attributes:
        folder: The run folder, links resolved.
        run_id: The W&B run's id (the folder's name).
        project: The W&B project (the folder above it).
        entity: The W&B entity the run's ``config.yaml`` names, else None (the user's default).
        save_dir: Where the run's ``wandb/`` folder lies (the folder above the project's).
    """

    folder: Path
    run_id: str
    project: str
    entity: str | None
    save_dir: Path


def fit_run(path: str | os.PathLike) -> FitRun:
    """The W&B run of the run folder ``path``; ValueError naming it when it is none (no ``summary.json``, or a run
    logged without W&B)."""
    folder = Path(path)
    expected = "expected a run folder of `vit-ct fit`, e.g. runs/latest or runs/<project>/<run id>"
    summary_file = folder / "summary.json"
    if not summary_file.is_file():
        raise ValueError(f"--wandb {path}: no summary.json there; {expected}")
    try:
        summary = json.loads(summary_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"--wandb {path}: {summary_file} is not JSON ({err}); {expected}") from None
    folder = folder.resolve()
    wandb_dir = summary.get("wandb_dir") if isinstance(summary, dict) else None
    if not wandb_dir or not Path(wandb_dir).name.endswith(f"-{folder.name}"):  # W&B's folders end with the run id
        raise ValueError(f"--wandb {path}: its run was not logged to W&B (summary.json's wandb_dir is"
                         f" {wandb_dir!r}, not a W&B folder of run {folder.name}); {expected}")  # fmt: skip
    return FitRun(folder, folder.name, folder.parent.name, _entity(folder / "config.yaml"), folder.parent.parent)


def _entity(config_file: Path) -> str | None:
    """``entity`` of the ``WandbLogger`` in the run's saved config (``trainer.logger``: one logger or a list)."""
    if not config_file.is_file():
        return None
    loggers = ((yaml.safe_load(config_file.read_text()) or {}).get("trainer") or {}).get("logger")
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        if isinstance(logger, dict) and str(logger.get("class_path", "")).endswith("WandbLogger"):
            return (logger.get("init_args") or {}).get("entity")
    return None


def figure_rows(record: dict) -> list[list]:
    """One row per figure (``{"value", "ci95", "n"}``) of every model in ``report.json``, in :data:`TABLE_COLUMNS`;
    a map figure's section is ``maps/<map>`` (``maps/rollout``)."""
    models = {record["model"]: record, **record.get("compare", {})}
    rows = []
    for name, sections in models.items():
        for section in SECTIONS:
            for place, figures in _figure_groups(section, sections.get(section) or {}):
                for figure, entry in figures.items():
                    if isinstance(entry, dict) and {"value", "ci95", "n"} <= set(entry):
                        low, high = entry["ci95"] or (None, None)
                        rows.append([name, place, figure, entry["value"], low, high, entry["n"]])
    return rows


def _figure_groups(section: str, entries: dict):
    """(``section``, its figures), or for ``maps`` one group per map (``maps/rollout``: its figures)."""
    if section != "maps":
        return [(section, entries)]
    return [(f"maps/{source}", figures) for source, figures in entries.items() if isinstance(figures, dict)]


def summary_values(record: dict) -> dict[str, float]:
    """The first model's figures as ``report/<section>/<figure>`` (``report/slice/auroc``,
    ``report/maps/rollout/pointing``): their values, None where undefined."""
    return {f"report/{section}/{figure}": value
            for model, section, figure, value, *_ in figure_rows(record) if model == record["model"]}  # fmt: skip


def log_report(report_dir: str | os.PathLike, run: FitRun) -> Path:
    """Log the report in ``report_dir`` (``report.json``, ``figures/*.png``) into ``run``, resumed by its id (offline
    unless the user configured W&B): ``report/<figure>`` images (``report/roc``...), the ``report/figures`` table
    and the summary values of :func:`summary_values`. Returns the W&B folder this session wrote."""
    report_dir = Path(report_dir)
    record = json.loads((report_dir / REPORT_JSON).read_text())
    import wandb

    # here, not at the top: it imports Lightning, which a report without --wandb never needs
    from vit_ct.run.wandb_runs import quiet_wandb_unless_configured, use_wandb_offline_unless_configured

    use_wandb_offline_unless_configured()
    quiet_wandb_unless_configured()
    # resume="allow": online, the run continues (and is made with this id if it was never synced); offline, W&B
    # writes a new folder with the run's id, which `wandb sync` uploads into the same run after the fit's.
    # reinit="create_new": a run still active in this process (a notebook's) is neither returned nor finished.
    with wandb.init(id=run.run_id, project=run.project, entity=run.entity, dir=str(run.save_dir), resume="allow",
                    reinit="create_new") as session:  # fmt: skip
        images = {f"report/{png.stem}": wandb.Image(str(png)) for png in sorted((report_dir / FIGURES).glob("*.png"))}
        session.log({**images, "report/figures": wandb.Table(columns=TABLE_COLUMNS, data=figure_rows(record))})
        session.summary.update(summary_values(record))
        return Path(session.dir).parent
