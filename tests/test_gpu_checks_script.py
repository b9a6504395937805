"""scripts/gpu_checks.sh works apart from the CUDA-only parts: its CPU wiring run (`--cpu
--wiring`) finds every pytest check it names among the collected tests of tests/test_gpu.py
(their code paths run elsewhere in this suite: parity at world size 1 with the sharded optimizer
in tests/test_parity.py, the replicated optimizer against it in tests/test_sharded_optimizer.py,
exact resume in tests/test_resume.py, bf16 export in tests/test_train_cli.py), runs the others
at their smallest sizes and prints the summary table; Transformer Engine, which needs CUDA, is
reported as SKIP. Also: the step benchmark counts 8N flops per token."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.helpers.cli import command_env, run

CHECKS = ("parity-sharded-opt", "packed-thd", "te-vs-local", "bf16-resume", "gpu-step", "parity-unfused",
          "te-grouped-gemm", "parity-adamw", "convert-verify")  # the order they run in: the most important first


def _table(text: str) -> dict[str, tuple[str, str]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0] in CHECKS:
            rows[cells[0]] = (cells[1], cells[3])
    return rows


LISTED = {"parity-sharded-opt": "tests/test_gpu.py::test_parity_on_gpu[sharded-optimizer]",
          "parity-adamw": "tests/test_gpu.py::test_parity_on_gpu[adamw]",
          "parity-unfused": "tests/test_gpu.py::test_parity_on_gpu[unfused]",
          "bf16-resume": "tests/test_gpu.py::test_bf16_checkpoint_and_exact_resume_through_cli[deterministic]",
          "te-grouped-gemm": "tests/test_gpu.py::test_grouped_gemm_experts_match_sequential_experts",
          "packed-thd": "tests/test_packing_gpu.py::test_packed_row_gives_each_sequence_its_own_logits"}


def test_gpu_checks_wiring_on_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MCORE_DPO_FAULT",)}
    env.update(OUT=str(tmp_path / "out"), PYTHON=sys.executable)
    proc = run(["bash", "scripts/gpu_checks.sh", "--cpu", "--wiring"], env=env, timeout=1200)
    rows = _table(proc.stdout)
    assert set(rows) == set(CHECKS), proc.stdout + proc.stderr[-2000:]
    for name, (status, detail) in rows.items():
        expected = "COLLECTED" if name in LISTED else "SKIP" if name == "te-vs-local" else "PASS"
        log = (tmp_path / "out" / f"{name}.log").read_text()[-3000:]
        assert status == expected, f"{name}: {status} ({detail})\n{log}"
    for name, test in LISTED.items():  # the row names the test a GPU run executes
        assert rows[name][1] == test, rows[name]
    assert [line.split("|")[1].strip() for line in proc.stdout.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip() in CHECKS] == list(CHECKS)
    assert proc.returncode == 0, proc.stdout
    assert "Transformer Engine needs CUDA" in rows["te-vs-local"][1]
    assert "MFU(8N)" in rows["gpu-step"][1]
    step = json.loads((tmp_path / "out" / "gpu_step.json").read_text())
    assert step["layer_spec"] == "local" and step["tokens_per_step"] == 2 * 2 * 32  # --tiny: 2 pairs x 2 sequences x 32 tokens
    assert step["step_time_s"]["median"] > 0
    assert (tmp_path / "out" / "summary.md").read_text().strip() == proc.stdout.strip()


def test_gpu_checks_limits_add_up_to_the_deadline_by_construction(tmp_path):
    """The rows' limits are the plan; the deadline is their sum, so no row is left without time
    by a slow one before it, and a smaller DEADLINE_S is refused before anything runs."""
    plan = run(["bash", "scripts/gpu_checks.sh", "--plan"], timeout=60)
    assert plan.returncode == 0, plan.stderr
    rows = [line.split("|") for line in plan.stdout.split()]
    limits = {name: int(limit) for name, limit in rows[:-1]}
    assert tuple(limits) == CHECKS and rows[-1] == ["total", str(sum(limits.values()))]
    assert sum(limits.values()) <= 470  # what one device call leaves for the checks (15 min in all, with start-up)
    env = command_env(OUT=str(tmp_path / "out"), PYTHON=sys.executable, DEADLINE_S=str(sum(limits.values()) - 1))
    proc = run(["bash", "scripts/gpu_checks.sh"], env=env, timeout=60)
    assert proc.returncode == 2 and "is below the checks' limits" in proc.stderr and proc.stdout == "", proc.stderr


@pytest.mark.parametrize("argv, message", [(["--cpu", "--bogus"], "unknown argument '--bogus'"),
                                           (["--wiring"], "--wiring is a CPU dry run")])
def test_gpu_checks_refuses_bad_arguments_before_running_anything(tmp_path, argv, message):
    proc = run(["bash", "scripts/gpu_checks.sh", *argv], env=command_env(OUT=str(tmp_path / "out"), PYTHON=sys.executable),
               timeout=60)
    assert proc.returncode == 2 and message in proc.stderr and proc.stdout == "", (proc.returncode, proc.stderr)
    assert not (tmp_path / "out").exists()


def test_step_benchmark_counts_8n_flops_per_token():
    from benchmarks.gpu_step import ONE_B, matmul_params, step_flops

    n = matmul_params(ONE_B)
    assert 1.2e9 < n < 1.3e9  # the Llama-3.2-1B shape, output layer included
    flops = step_flops(shape=ONE_B, tokens=1000, seq_len=1024)
    assert flops["dense"] == 8 * n * 1000  # policy 6N (forward + backward) + reference 2N (forward)
    assert flops["with_attention"] > flops["dense"]
