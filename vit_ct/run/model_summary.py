"""The model summary at the start of a fit: Lightning's rich table, without the FLOPs it did not count."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count
from rich import get_console
from rich.table import Table


class ModelSummaryTable(RichModelSummary):
    """Lightning's :class:`~lightning.pytorch.callbacks.RichModelSummary`, except that FLOPs it did not count are not
    shown. Lightning counts FLOPs only by running the model's ``example_input_array``, which a vit-ct model has not
    (its input size comes from the data), and would print 0 in every row and ``Total FLOPs: 0``. A model that sets
    one gets Lightning's table as it is."""

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        if total_flops:
            RichModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                       total_training_modes, total_flops, **summarize_kwargs)  # fmt: skip
            return
        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:  # Lightning's first column is the row number, named " "
            table.add_column(name, justify="right" if name in ("Params", "Params per Device") else "left",
                             style="dim" if not name.strip() else None)  # fmt: skip
        for row in zip(*(values for _, values in columns), strict=True):
            table.add_row(*row)
        console = get_console()
        console.print(table)
        count = lambda n: get_human_readable_count(int(n)).strip()
        console.print(
            f"{count(total_parameters)} parameters ({count(trainable_parameters)} trainable), {model_size:.1f} MB;"
            f" modules in train mode {total_training_modes['train']}, in eval mode {total_training_modes['eval']}",
            highlight=False,
            soft_wrap=True,
        )
