"""GPU checks (marked `gpu`; skipped on machines without CUDA): the same parity as
test_parity.py with the ranks on a GPU (NCCL), against the single-process HF reference on the
CPU, with megatron-core's distributed optimizer and with the CPU-path AdamW.

fp32 on a GPU (TF32 off) reorders sums inside cuBLAS kernels: tolerance 1e-4 relative.
"""

from __future__ import annotations

import pytest
import torch

from parity import write_models
from test_parity import FAMILIES, _check_job, _jobs_for

pytestmark = pytest.mark.gpu
GPU_RTOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_models")
    return {family: write_models(family, root) for family in FAMILIES}


@pytest.mark.parametrize("distributed_optimizer", [True, False], ids=["megatron-optimizer", "adamw"])
def test_parity_on_gpu(models, tmp_path, distributed_optimizer):
    from parity import run_ranks

    torch.backends.cuda.matmul.allow_tf32 = False
    layout = (1, 1, 1)
    jobs = _jobs_for(layout, models, all_losses=False)
    for job in jobs:
        job["config"]["distributed_optimizer"] = distributed_optimizer
    run_ranks(world_size=1, jobs=jobs, out_dir=tmp_path)
    for j, job in enumerate(jobs):
        _check_job(tmp_path, j, job, layout, rtol=GPU_RTOL)
