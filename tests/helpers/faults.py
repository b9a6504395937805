"""Environment for a run with an injected fault: MCORE_DPO_FAULT (see
tests/fault_hooks/sitecustomize.py) and that directory first on PYTHONPATH, so that the
driver and every Ray worker process load the fault hooks at start-up."""

from __future__ import annotations

import os
from pathlib import Path

FAULT_HOOKS_DIR = Path(__file__).resolve().parents[1] / "fault_hooks"


def with_fault(env: dict, fault: str | None) -> dict:
    env = dict(env)
    env.pop("MCORE_DPO_FAULT", None)
    if fault:
        env["MCORE_DPO_FAULT"] = fault
        env = _with_hooks_dir(env)
    return env


def with_io_fault(env: dict, spec: str) -> dict:
    """Environment for a run whose writes to paths matching a regular expression fail with an
    errno (MCORE_DPO_IO_FAULT, "ENOSPC:/\\.hf\\.tmp-"; tests/fault_hooks/sitecustomize.py), in the driver and
    in every Ray worker process."""
    return _with_hooks_dir(dict(env, MCORE_DPO_IO_FAULT=spec))


def with_grouped_standin(env: dict) -> dict:
    """Environment for a CPU run whose MoE experts are fault_hooks/grouped_standin.py's stand-in
    for megatron-core's grouped GEMM experts."""
    return _with_hooks_dir(dict(env, MCORE_DPO_GROUPED_STANDIN="1"))


def _with_hooks_dir(env: dict) -> dict:
    return dict(env, PYTHONPATH=os.pathsep.join(p for p in (str(FAULT_HOOKS_DIR), env.get("PYTHONPATH")) if p))


def fault_env(fault: str) -> dict:
    """The variables an in-process run (tests/helpers/ray_runs.py) gives its workers for `fault`:
    the fault, and the hooks directory ahead of this process's PYTHONPATH."""
    return _hook_vars(with_fault({}, fault))


def grouped_standin_env() -> dict:
    """The same for the grouped experts' stand-in."""
    return _hook_vars(with_grouped_standin({}))


def _hook_vars(env: dict) -> dict:
    path = os.pathsep.join(p for p in (str(FAULT_HOOKS_DIR), os.environ.get("PYTHONPATH")) if p)
    return {**env, "PYTHONPATH": path}
