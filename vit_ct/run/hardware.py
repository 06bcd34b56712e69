"""What the machine can do, decided in one place: the CPUs this process may use and the fastest precision it has.

``precision: auto`` (the default of every config) resolves here: on CPU, bf16 autocast only where bf16 is native
(AVX512-BF16 or AMX on x86, the bf16 extension on Arm) and fp32 elsewhere, where emulated bf16 is many times slower;
on a GPU, bf16 autocast where the GPU computes bf16 natively (Ampere and newer), else fp16 autocast with loss scaling.
"""

from __future__ import annotations

import math
import os
import platform
from pathlib import Path

import torch

from vit_ct.run.compat import cpu_bf16_instructions, mkldnn_bf16_supported

AUTO = "auto"


def cpu_has_native_bf16() -> bool:
    """True where the CPU computes bf16 in hardware, so that bf16 autocast is faster than fp32, not slower.

    x86: AVX512-BF16 or AMX tiles (``torch.ops.mkldnn._is_mkldnn_bf16_supported`` alone also says yes on AVX-512
    CPUs that only emulate bf16). Other CPUs (Arm): oneDNN's own check, which there means the bf16 extension.
    """
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        return any(cpu_bf16_instructions())
    return mkldnn_bf16_supported()


def gpu_has_native_bf16() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)


def auto_precision(accelerator: str = AUTO) -> tuple[str, str]:
    """The fastest precision for ``accelerator`` (a Lightning accelerator name) on this machine, and why.

    Returns:
        ``(precision, reason)``, e.g. ``("32-true", "CPU without native bf16")``.
    """
    name = str(accelerator).lower()
    if name in ("gpu", "cuda") or (name == AUTO and torch.cuda.is_available()):
        name_of_gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "GPU"
        if gpu_has_native_bf16():
            return "bf16-mixed", f"{name_of_gpu} computes bf16 natively"
        return "16-mixed", f"{name_of_gpu} without native bf16"
    if name in ("cpu", AUTO):
        if cpu_has_native_bf16():
            return "bf16-mixed", "CPU with native bf16"
        return "32-true", "CPU without native bf16 (bf16 would be emulated, many times slower)"
    return "32-true", f"accelerator {accelerator!r}"


def accelerator_name(accelerator) -> str:
    """``"cpu"``, ``"cuda"``, ... for an accelerator given by name or as a Lightning ``Accelerator`` object."""
    if isinstance(accelerator, str):
        return accelerator.lower()
    return type(accelerator).__name__.lower().removesuffix("accelerator")


def resolve_precision(precision, accelerator: str = AUTO) -> tuple[object, str | None]:
    """``precision`` unchanged unless it is ``"auto"`` or None, which become :func:`auto_precision`'s choice.

    Returns:
        ``(precision, reason)``; ``reason`` is None when the user named the precision.
    """
    if precision is None or precision == AUTO:
        return auto_precision(accelerator)
    return precision, None


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota (containers, CI runners), not
    the host's core count that ``os.cpu_count()`` reports."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        count = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        count = min(count, max(1, math.floor(quota)))  # a fractional quota would throttle the last thread
    return max(1, count)


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs' worth of time the cgroup may use (cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``), None if unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), e.g. ``AMD EPYC 9R14``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine() -> str:
    """One line naming what a figure was measured on: CPU model, usable CPUs, native bf16, and the GPU if any."""
    text = f"{cpu_model()}, {usable_cpus()} CPUs usable, native bf16: {'yes' if cpu_has_native_bf16() else 'no'}"
    if torch.cuda.is_available():
        text += f"; GPU {torch.cuda.get_device_name()}"
    return text
