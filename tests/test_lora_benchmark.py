"""Smoke test of benchmarks/lora_memory.py at its smallest size: it runs both modes end to end
and the state it reports follows from what LoRA keeps (the real size is in docs/BENCHMARKS.md)."""

from __future__ import annotations

from benchmarks import lora_memory
from tests.helpers.ranks import run_benchmark


def test_lora_memory_runs_both_modes(tmp_path):
    result = run_benchmark(lora_memory.main, ["--tiny", "--repeats", "1", "--steps", "1", "--out", str(tmp_path / "l.json"),
                                              "--work-dir", str(tmp_path)])
    assert set(result["ranks"]) == {"0", "1"}
    for row in result["ranks"].values():
        full, lora = (row[m]["optimizer_state_bytes"]["median"] for m in ("full", "lora"))
        assert 0 < lora < full  # moments of the adapters only
        assert row["lora"]["peak_above_baseline_bytes"]["median"] > 0 and row["peak_ratio"] > 0
    assert result["step_time_ratio"] > 0
