"""Precision and threads follow the machine: bf16 only where it is native, threads within affinity and quota."""

from __future__ import annotations

import os

import pytest
import torch
import yaml
from npy_manifest import manifest_args, write_npy_manifest

from vit_ct.cli import main
from vit_ct.run import hardware
from vit_ct.run.trainer import Trainer


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "onednn", "native"),
    [
        (True, False, True, True),  # AMD Zen 4, Intel Cooper Lake
        (False, True, True, True),  # Intel Sapphire Rapids and newer (AMX)
        (False, False, True, False),  # AVX-512 without BF16 (Skylake-SP): oneDNN says yes, but emulates
        (False, False, False, False),  # AVX2 only
    ],
)
def test_native_bf16_on_x86_means_avx512_bf16_or_amx(monkeypatch, avx512_bf16, amx, onednn, native):
    monkeypatch.setattr(hardware.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn)
    assert hardware.cpu_has_native_bf16() is native
    assert hardware.auto_precision("cpu")[0] == ("bf16-mixed" if native else "32-true")


@pytest.mark.parametrize(("bf16", "expected"), [(True, "bf16-mixed"), (False, "16-mixed")])
def test_auto_precision_on_a_gpu(monkeypatch, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Test GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
    for accelerator in ("auto", "gpu", "cuda"):
        assert hardware.auto_precision(accelerator)[0] == expected
    assert hardware.auto_precision("cpu")[0] in ("bf16-mixed", "32-true")  # an explicit CPU run stays on the CPU


def test_named_precision_wins_over_auto(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    assert hardware.resolve_precision("bf16-mixed", "cpu") == ("bf16-mixed", None)
    assert hardware.resolve_precision(None, "cpu")[0] == hardware.resolve_precision("auto", "cpu")[0] == "32-true"
    assert Trainer(accelerator="cpu", logger=False).precision == "32-true"
    assert Trainer(accelerator="cpu", logger=False, precision="bf16-mixed").precision == "bf16-mixed"


@pytest.mark.slow
@pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "no-native-bf16"])
def test_demo_recipe_takes_the_machines_precision_and_records_it(tmp_path, monkeypatch, native):
    """The demo config says ``precision: auto``; a CPU without native bf16 trains in fp32, and the run's saved config
    names the precision used. bf16 is exercised on every machine: the shapes are tiny."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native)
    manifest = write_npy_manifest(tmp_path / "data", train=4, val=2)
    args = manifest_args(manifest)
    i = args.index("--trainer.precision")
    del args[i : i + 2]  # the config's own `auto`
    cli = main(["fit", *args, "--trainer.max_epochs", "1", "--trainer.logger", "false"])
    expected = "bf16-mixed" if native else "32-true"
    assert cli.trainer.precision == expected and cli.trainer.global_step == 2
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["trainer"]["precision"] == expected


def test_cgroup_quota_v2_and_v1(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert hardware.cgroup_cpu_quota(v2) == 1.5
    (v2 / "cpu.max").write_text("max 100000\n")
    assert hardware.cgroup_cpu_quota(v2) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert hardware.cgroup_cpu_quota(v1) == 3.0
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert hardware.cgroup_cpu_quota(v1) is None
    assert hardware.cgroup_cpu_quota(tmp_path / "none") is None


def test_usable_cpus_is_the_affinity_capped_by_the_quota(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    monkeypatch.setattr(hardware, "cgroup_cpu_quota", lambda: None)
    assert hardware.usable_cpus() == 8
    monkeypatch.setattr(hardware, "cgroup_cpu_quota", lambda: 2.5)
    assert hardware.usable_cpus() == 2
    monkeypatch.setattr(hardware, "cgroup_cpu_quota", lambda: 0.5)
    assert hardware.usable_cpus() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    monkeypatch.setattr(hardware, "cgroup_cpu_quota", lambda: 4.0)
    assert hardware.usable_cpus() == 1
