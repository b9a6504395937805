import os

import pytest

# One torch thread per process: the suite spawns many ranks on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    # MCORE_DPO_GPU_CHECKS_ON_CPU=1: the dry run of scripts/gpu_checks.sh --cpu runs them on the CPU.
    if _has_cuda() or os.environ.get("MCORE_DPO_GPU_CHECKS_ON_CPU") == "1":
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
