"""Lightning's ``Trainer`` with two additions: ``precision="auto"``, the fastest precision the hardware has, and a
SIGTERM handler that cannot deadlock DDP ranks (:mod:`vit_ct.run.signal_connector`)."""

from __future__ import annotations

from typing import Literal

import lightning as L
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.utilities import rank_zero_info

from vit_ct.run.compat import PrecisionInput
from vit_ct.run.hardware import AUTO, accelerator_name, resolve_precision
from vit_ct.run.signal_connector import SignalConnector


class Trainer(L.Trainer):
    """``lightning.Trainer`` whose ``precision`` defaults to ``"auto"``; every other argument is Lightning's own.

    Args:
        accelerator: Lightning's: ``cpu``, ``gpu``, ``auto``, ... or an ``Accelerator`` object.
        precision: ``auto``: bf16 autocast on a CPU with native bf16 (AVX512-BF16, AMX) or a GPU with native bf16,
            fp16 autocast on an older GPU, fp32 on any other CPU (where bf16 is emulated and many times slower).
            Or any of Lightning's values (``32-true``, ``bf16-mixed``, ``16-mixed``, ...), used as given.
    """

    def __init__(
        self,
        *,
        accelerator: str | Accelerator = AUTO,
        precision: PrecisionInput | Literal["auto"] | None = AUTO,
        **kwargs,
    ) -> None:
        precision, reason = resolve_precision(precision, accelerator_name(accelerator))
        if reason is not None:
            rank_zero_info(f"precision: {precision} (auto: {reason})")
        super().__init__(accelerator=accelerator, precision=precision, **kwargs)
        self._signal_connector = SignalConnector(self)  # SIGTERM under DDP without a collective in the handler
