"""Every private name of Lightning, jsonargparse, W&B, timm and torch that vit-ct reaches, in one place: what each is
for, and the releases it was checked on. A release that drops or renames one fails ``tests/test_compat.py`` (also run
by ``make floors`` at the lowest declared versions) instead of a user's run.
"""

from __future__ import annotations

import re
from typing import Any

import lightning.pytorch
import torch
from jsonargparse import ArgumentParser
from lightning.fabric.plugins.precision import precision as precision_module
from lightning.pytorch.callbacks import ModelCheckpoint, RichModelSummary
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.loops import _FitLoop
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from timm.models import VisionTransformer

# Checked on the declared floors (pyproject.toml, `make floors`) and on the newest releases of the day.
CHECKED_ON = {
    "lightning": ("2.6.0", "2.6.6"),
    "jsonargparse": ("4.51.0", "4.53.0"),  # the error-message format summarise_parser_error reads: 4.51 and newer
    "wandb": ("0.23.1", "0.31.0"),
    "timm": ("1.0.31",),
    "torch": ("2.5.0", "2.14.1"),
}

# (owner, name, why vit-ct needs it); `owner` is a class or module, or a callable giving an instance to look at.
PRIVATE_NAMES: list[tuple[Any, str, str]] = [
    (LightningCLI, "_parse_ckpt_path", "overridden: a bad --ckpt_path is named before torch.load fails without it"),
    (LightningCLI, "_get", "the trainer's config as instantiated, to see whether the user chose a CheckpointIO"),
    (LightningCLI, "_prepare_subcommand_parser", "overridden: each subcommand's own options (--output_dir: predict)"),
    (lambda: RichModelSummary(), "_max_depth", "the depth of the summary that ModelSummaryTable replaces"),
    (ModelCheckpoint, "_save_monitor_checkpoint", "overridden: a NaN val/auroc never makes a best checkpoint"),
    (ModelCheckpoint, "_save_last_checkpoint", "last.ckpt refreshed at every validation, not only with a new best"),
    (ModelCheckpoint, "_save_checkpoint", "overridden: last.ckpt a hard link to the file of the same state"),
    (lambda: ModelCheckpoint(), "_last_global_step_saved", "kept as Lightning keeps it when last.ckpt is a link"),
    (lambda: ModelCheckpoint(), "_last_checkpoint_saved", "kept as Lightning keeps it when last.ckpt is a link"),
    (ModelCheckpoint, "_monitor_candidates", "the metrics last.ckpt's name and monitor read"),
    (ModelCheckpoint, "_should_skip_saving_checkpoint", "no second last.ckpt at a step Lightning just saved"),
    (ModelCheckpoint, "_should_save_on_train_epoch_end", "which hook saves for this trainer"),
    (_FitLoop, "_load_combined_loader_states", "a resumed loader's state applied before its first batch"),
    (_SignalConnector, "_sigterm_notifier_fn", "overridden: Lightning's SIGTERM handler runs a DDP collective"),
    (lambda: lightning.pytorch.Trainer(logger=False), "_signal_connector", "replaced by vit-ct's SignalConnector"),
    (ArgumentParser, "_subcommands_action", "predict's own defaults, to tell the default logger from a chosen one"),
    (lambda: WandbLogger(project="vit-ct", offline=True), "_wandb_init", "wandb.init's arguments: drop `anonymous`"),
    (VisionTransformer, "_pos_embed", "inherited by the air-skipping network, whose forward_features is timm's own"),
    (precision_module, "_PRECISION_INPUT", "the Trainer's precision type, extended by 'auto'"),
    (torch.cpu, "_is_avx512_bf16_supported", "native bf16 on x86 (AVX512-BF16), for precision auto"),
    (torch.cpu, "_is_amx_tile_supported", "native bf16 on x86 (AMX), for precision auto"),
    (torch.ops.mkldnn, "_is_mkldnn_bf16_supported", "native bf16 on Arm, for precision auto"),
]


def missing_private_names() -> list[str]:
    """``owner.name`` of every entry of :data:`PRIVATE_NAMES` that the installed libraries lack."""
    missing = []
    for owner, name, _ in PRIVATE_NAMES:
        target = owner() if callable(owner) and not isinstance(owner, type) else owner  # a factory of an instance
        if not hasattr(target, name):
            missing.append(f"{getattr(owner, '__name__', type(target).__name__)}.{name}")
    return missing


def subcommand_defaults(parser: ArgumentParser, subcommand: str):
    """The defaults of a subcommand's own parser (jsonargparse keeps them in its subcommands action)."""
    return parser._subcommands_action._name_parser_map[subcommand].get_defaults()


def model_summary_depth(callback: RichModelSummary) -> int:
    """How deep a Lightning model summary callback lists modules."""
    return callback._max_depth


def wandb_init_arguments(logger: WandbLogger) -> dict[str, Any]:
    """The keyword arguments Lightning's ``WandbLogger`` will pass to ``wandb.init`` (a live dict: edits count)."""
    return logger._wandb_init


def load_pending_loader_states(fit_loop: _FitLoop) -> None:
    """Apply a resumed training loader's saved state now, if Lightning has not yet (see ``ResumeState``)."""
    if getattr(fit_loop, "_combined_loader_states_to_load", None):
        fit_loop._load_combined_loader_states()


def save_last_checkpoint(callback: ModelCheckpoint, trainer) -> None:
    """Write ``last.ckpt`` now, unless Lightning has just saved at this step."""
    if not callback._should_skip_saving_checkpoint(trainer):
        callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def saves_on_train_epoch_end(callback: ModelCheckpoint, trainer) -> bool:
    """Whether the callback saves at the training epoch's end (else at the validation's end) for this trainer."""
    return callback._should_save_on_train_epoch_end(trainer)


PrecisionInput = precision_module._PRECISION_INPUT  # the values Lightning's Trainer takes for `precision`


def cpu_bf16_instructions() -> tuple[bool, bool]:
    """``(AVX512-BF16, AMX tiles)`` as torch's CPU capability checks report them."""
    return bool(torch.cpu._is_avx512_bf16_supported()), bool(torch.cpu._is_amx_tile_supported())


def mkldnn_bf16_supported() -> bool:
    """oneDNN's bf16 check (on Arm: the bf16 extension; on x86 it also says yes where bf16 is only emulated)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def missing_required(message: str) -> list[str]:
    """The keys jsonargparse's message names as required and not given (``predict.output_dir``), if it is that
    message (its format: :data:`CHECKED_ON`)."""
    found = re.search(r"the following arguments are required: (.*)", message)
    return [key.strip() for key in found.group(1).split(",")] if found else []


def summarise_parser_error(message: str) -> str:
    """One line from jsonargparse's message for a bad value: the option's key path, the value given and what was
    expected (``data.predict_split: got 'tset'; expected a Literal['train', 'val', 'test']``). The message nests one
    ``Parser key "..."`` block per level; the text format is jsonargparse's (checked on :data:`CHECKED_ON`)."""
    keys = re.findall(r'Parser key "([^"]+)"', message)
    given = re.search(r"Given value: (.*)", message)
    expected = re.search(r"- Expected an? (?:typing\.)?(.*)", message)
    if not keys:
        return message.strip().splitlines()[-1] if message.strip() else message
    text = ".".join(keys)
    if given:
        text += f": got {given.group(1).strip()!r}"
    if expected:
        text += f"; expected {expected.group(1).strip()}"
    return text
