"""The CPU suite on a GPU machine: its processes stay on the CPU, asking for CUDA initialises
none, and rank processes are spawned (not forked) wherever CUDA is visible
(tests/helpers/devices.py, tests/helpers/ranks.py `rank_context`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from mcore_dpo.parallel import platform as plat
from tests.helpers import devices
from tests.helpers import ranks


def test_the_cpu_suite_keeps_its_processes_on_the_cpu_and_a_gpu_test_gets_the_gpu():
    assert os.environ[devices.FORCE_CPU] == "1"  # this test, and whatever it starts
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
    assert devices.forces_cpu(gpu_test=False, user_forced=False)
    assert not devices.forces_cpu(gpu_test=True, user_forced=False)
    assert devices.forces_cpu(gpu_test=True, user_forced=True)  # scripts/gpu_checks.sh --cpu


def test_a_process_on_the_forced_cpu_never_asks_cuda(monkeypatch):
    def asked(*_):
        raise AssertionError("CUDA was asked")

    monkeypatch.setattr(torch.cuda, "is_available", asked)
    monkeypatch.setattr(torch.cuda, "device_count", asked)
    assert plat.detect(local_rank=3) == plat.Platform(device=torch.device("cpu"), backend="gloo")
    monkeypatch.delenv(devices.FORCE_CPU)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert plat.detect(local_rank=3) == plat.Platform(device=torch.device("cuda", 1), backend="nccl")


def _report_rank(rank: int, out_dir: str) -> None:
    Path(out_dir, f"rank{rank}.txt").write_text(
        f"{os.environ.get(devices.FORCE_CPU)} {'megatron.core' in sys.modules}")


def test_ranks_are_spawned_where_cuda_is_visible(tmp_path, monkeypatch):
    """With CUDA visible (patched here), the spawners' processes are fresh interpreters: nothing
    preloaded (a forkserver child would have megatron-core imported), the caller's environment
    passed on. On this machine they fork from the preloading server."""
    assert ranks.rank_context().get_start_method() == "forkserver"
    assert ranks.rank_context("fork").get_start_method() == "fork"
    monkeypatch.setattr(ranks, "cuda_visible", lambda: True)
    assert ranks.rank_context().get_start_method() == "spawn"
    assert ranks.rank_context("fork").get_start_method() == "spawn"
    ranks.spawn_processes(_report_rank, nprocs=2, args=(str(tmp_path),))
    assert [Path(tmp_path, f"rank{r}.txt").read_text() for r in range(2)] == ["1 False"] * 2
