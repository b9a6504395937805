"""Which device a test's processes compute on: the CPU suite on the CPU, even on a GPU machine,
and the GPU tests (marked `gpu`) on the GPU.

`platform.detect` puts every rank on a GPU whenever CUDA is visible, so on a GPU machine the
multi-rank CPU tests would put all their ranks on cuda:0 (which NCCL refuses). conftest.py
therefore sets MCORE_DPO_FORCE_CPU=1 for the whole pytest run (session fixtures such as the Ray
cluster inherit it) and removes it while a `gpu` test runs, unless the user set it: then
everything runs on the CPU (`scripts/gpu_checks.sh --cpu`). conftest.py also makes torch ask
NVML whether CUDA is there (PYTORCH_NVML_BASED_CUDA_CHECK=1), so that asking does not
initialise CUDA in the pytest process, and the rank spawners spawn instead of fork where CUDA
is visible (tests/helpers/ranks.py `rank_context`).
"""

from __future__ import annotations

import os

FORCE_CPU = "MCORE_DPO_FORCE_CPU"
# Read when conftest.py first imports this module, before it sets the variable itself.
USER_FORCED_CPU = os.environ.get(FORCE_CPU) == "1"


def forces_cpu(*, gpu_test: bool, user_forced: bool = USER_FORCED_CPU) -> bool:
    """Whether a test's processes stay on the CPU: every test but a `gpu` one, and every test
    when the user asked for the CPU."""
    return user_forced or not gpu_test
