"""Shared set-ups of the suite.

Session fixtures, built once per pytest run:
    ray_cluster    the local Ray cluster every in-process run joins (tests/helpers/ray_runs.py)
    parity_models  the dense parity models: family -> (policy dir, reference dir)
    moe_models     the MoE parity models: "qwen3_moe" / "mixtral" -> (policy dir, reference dir)
    qwen3_models   Qwen3 dense, tied (True) and untied (False) -> (policy dir, reference dir)
    hf_llama       the converter's Llama with GQA, untied (8 heads in 4 groups, 4 layers, vocab 100)
MCORE_DPO_CACHE points at one directory of the session, so the embedded default model is built
once per run and never in the user's cache.
"""

from __future__ import annotations

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


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    """MCORE_DPO_CACHE for the whole run (module docstring)."""
    previous = os.environ.get("MCORE_DPO_CACHE")
    os.environ["MCORE_DPO_CACHE"] = str(tmp_path_factory.mktemp("mcore_dpo_cache"))
    yield
    if previous is None:
        os.environ.pop("MCORE_DPO_CACHE", None)
    else:
        os.environ["MCORE_DPO_CACHE"] = previous


@pytest.fixture(scope="session")
def ray_cluster():
    from tests.helpers.ray_runs import start_cluster

    cluster = start_cluster()
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="session")
def parity_models(tmp_path_factory):
    from tests.helpers.models import write_models
    from tests.helpers.parity import FAMILIES

    root = tmp_path_factory.mktemp("parity_models")
    return {family: write_models(family, root) for family in FAMILIES}


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory):
    from tests.helpers.models import MOE_FACTORIES, save_hf

    root = tmp_path_factory.mktemp("moe_models")
    return {name: (save_hf(make(seed=1), root / f"{name}_policy"), save_hf(make(seed=2), root / f"{name}_ref"))
            for name, make in MOE_FACTORIES.items()}


@pytest.fixture(scope="session")
def qwen3_models(tmp_path_factory):
    from tests.helpers.models import qwen3, save_hf

    root = tmp_path_factory.mktemp("qwen3_models")
    return {tied: (save_hf(qwen3(tied=tied, seed=1), root / f"policy_{tied}"),
                   save_hf(qwen3(tied=tied, seed=2), root / f"ref_{tied}"))
            for tied in (True, False)}


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory):
    from tests.helpers.models import llama_gqa_untied, save_hf

    return save_hf(llama_gqa_untied(), tmp_path_factory.mktemp("hf_llama") / "llama")
