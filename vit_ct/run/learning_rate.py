"""The learning rate a fit logs: one series per schedule, where Lightning's monitor logs one per parameter group."""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback


class PeakLearningRate(Callback):
    """Logs ``lr``, the highest learning rate of the optimiser's parameter groups, at the start of each training
    epoch; a group on a schedule of its own adds ``lr-pg<i>`` (a second optimiser: ``lr-<j>``, ``lr-<j>-pg<i>``).

    vit-ct's groups share one schedule (:func:`vit_ct.task.optim.warmup_cosine_schedule` scales every group by the
    same factor): with layer-wise decay their rates differ only by a fixed scale each, ``layer_decay`` to the power of
    the block's distance from the head, and with weight decay not at all, so one curve says everything. Lightning's
    ``LearningRateMonitor`` logs one series per group (17 ``lr-AdamW/pgN`` for ViT-Ti with layer decay). Groups share
    a schedule when their rates stand in the same ratio to the rate they started at (``initial_lr``, which torch's
    schedulers record). Without a logger it does nothing.
    """

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if not trainer.loggers:
            return
        rates: dict[str, float] = {}
        for j, optimizer in enumerate(trainer.optimizers):
            prefix = "lr" if len(trainer.optimizers) == 1 else f"lr-{j}"
            rates.update(_rates_by_schedule(optimizer.param_groups, prefix))
        for logger in trainer.loggers:
            logger.log_metrics(rates, step=trainer.global_step)


def _rates_by_schedule(groups: list[dict], prefix: str) -> dict[str, float]:
    """``{prefix: peak rate}`` of the schedule the highest rate follows, plus ``{prefix-pg<i>: peak}`` for each other
    schedule (``i``: its first group)."""
    schedules: dict[float, tuple[int, float]] = {}  # rate / initial rate -> (first group, peak rate)
    for i, group in enumerate(groups):
        factor = round(group["lr"] / group["initial_lr"], 9) if group.get("initial_lr") else 1.0
        first, peak = schedules.get(factor, (i, 0.0))
        schedules[factor] = (first, max(peak, group["lr"]))
    top = max(schedules.values(), key=lambda found: found[1])
    return {prefix if found == top else f"{prefix}-pg{found[0]}": found[1] for found in schedules.values()}
