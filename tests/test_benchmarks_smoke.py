"""Smoke tests of benchmarks/: every script runs end to end at its smallest size and its
figures are consistent. The real benchmark sizes stay out of the suite (docs/BENCHMARKS.md).
benchmarks/gpu_step.py's tiny run is part of scripts/gpu_checks.sh's CPU wiring run
(tests/test_gpu_checks_script.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors import safe_open

from benchmarks import (checkpoint_memory, common, conversion, dp_scaling, gpu_step, memory,
                        optimizer_memory, ref_cost, vpp, vs_trl)
from tests.helpers.cli import REPO, run_python
from tests.helpers.ranks import run_benchmark
from tests.helpers.tiers import launches


@launches("cli", "ray")
def _run_training_script(args: list[str], **kwargs):
    """A benchmark script that runs `python -m mcore_dpo.train` (with its own local Ray cluster)
    in a subprocess of its own."""
    return run_python(args, **kwargs)


def _weights(model_dir: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as handle:
        return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}


def test_ref_cost_simulated_and_measured(tmp_path):
    result = run_benchmark(ref_cost.main, ["--tiny", "--steps", "1", "--out", str(tmp_path / "r.json"),
                            "--work-dir", str(tmp_path / "w"), "--plot", str(tmp_path / "sim.png"),
                            "--timeline", str(tmp_path / "timeline.png")])
    rows = {(r["pp"], r["m"]): r for r in result["simulated"]}
    p4m8 = rows[(4, 8)]
    assert p4m8["ratio_sim_interleaved"] <= 1.07  # the simulated goal
    assert math.isclose(p4m8["ratio_closed_separate_pass"], 4 / 3) and math.isclose(p4m8["ratio_closed_concatenated"], 4 / 3)
    for r in rows.values():
        assert math.isclose(r["sim_none"], r["closed_1f1b"])  # the simulator reproduces the 1F1B closed form
        assert r["sim_interleaved"] <= r["sim_sequential"] <= r["closed_separate_pass"] + 1e-9
        assert r["sim_interleaved"] <= r["sim_interleaved_first_step"]
        assert r["sim_interleaved"] <= r["sim_interleaved_no_carry"]  # carrying never costs time
    modes = result["measured"]["modes"]
    assert set(modes) == set(ref_cost.MODES)
    assert all(m["step_time_s"]["n"] == 1 and m["step_time_s"]["median"] > 0 for m in modes.values())
    assert modes["precomputed"]["precompute_s"]["median"] > 0
    assert (tmp_path / "sim.png").stat().st_size > 0
    assert json.loads((tmp_path / "r.json").read_text())["measured"]["modes"]["none"]["ratio_vs_none"] == 1.0
    # The op timelines: every stage ran each microbatch's forward and backward once, and the
    # reference forwards its mode calls for, one op at a time. Interleaved (a measured step
    # carries in and out): stage s runs this batch's last s and the next batch's others.
    m = result["measured"]["num_microbatches"]
    for mode, entry in modes.items():
        assert set(entry["timeline"]) == {"0", "1"}
        for stage, trace in entry["timeline"].items():
            kinds = [kind for kind, *_ in trace]
            assert kinds.count("fwd") == kinds.count("bwd") == m and kinds.count("optimizer") == 1
            refs = sorted((batch, mb) for kind, mb, batch, *_ in trace if kind == "ref_fwd")
            carried = range(m - int(stage), m)
            expected = {"interleaved": [(0, mb) for mb in carried] + [(1, mb) for mb in range(m) if mb not in carried],
                        "sequential": [(0, mb) for mb in range(m)], "precomputed": [], "none": []}[mode]
            assert refs == sorted(expected), (mode, stage)
            times = [t for *_, start, end in trace for t in (start, end)]
            assert times == sorted(times) and times[0] >= 0
        assert set(entry["op_median_ms"]) == {"0", "1"} and 0 <= min(entry["recv_wait_share"].values()) < 1
    bound = result["measured"]["any_schedule_faster_than_sequential_at_most"]
    assert result["measured"]["interleaved_faster_than_sequential"] <= bound < 1
    assert set(result["measured"]["simulated_with_measured_costs"]["ratio_vs_none"]) == {
        "none", "sequential", "interleaved", "interleaved_no_carry"}
    assert (tmp_path / "timeline.png").stat().st_size > 0


def test_vpp_measures_step_times_against_vpp1(tmp_path):
    """--measure at its smoke size: pp 2, 2 microbatches, --vpp 1 and 2, none and interleaved
    (one launch, one measured step each), beside the simulated ratio of the same plan."""
    out = tmp_path / "m.json"
    result = run_benchmark(vpp.main, ["--measure", "--tiny", "--stages", "2", "--microbatches", "2", "--chunks", "1",
                                      "2", "--costs", "unit", "--out", str(tmp_path / "s.json"), "--measured-out",
                                      str(out), "--work-dir", str(tmp_path / "w")])
    measured = result["measured"]
    assert json.loads(out.read_text()) == json.loads(json.dumps(measured))
    cells = {(c["mode"], c["vpp"]): c for c in measured["cells"]}
    assert set(cells) == {(mode, v) for mode in ("none", "interleaved") for v in (1, 2)}
    for (mode, v), c in cells.items():
        assert c["step_time_s"]["n"] == 1 and c["step_time_s"]["median"] > 0
        assert 0 < c["busiest_stage_compute_s"]["median"] < c["step_time_s"]["median"]
        assert c["busiest_rank_cpu_s"]["median"] > 0
        assert 0 <= c["bubble_fraction"]["median"] < 1
        assert c["bubble_theory_policy_only"] == pytest.approx(1 / (2 * v + 1))  # (p-1)/(v*m + p-1)
        assert c["vs_vpp1"] == pytest.approx(c["round_vs_vpp1"]["median"])  # one round
    for mode in ("none", "interleaved"):
        assert cells[(mode, 1)]["vs_vpp1"] == cells[(mode, 1)]["simulated_vs_vpp1_unit"] == 1.0
        assert cells[(mode, 1)]["min_vs_vpp1"] == cells[(mode, 1)]["cpu_vs_vpp1"] == 1.0
        assert cells[(mode, 2)]["ops_per_stage"] > cells[(mode, 1)]["ops_per_stage"]  # ops per chunk
    assert cells[("none", 2)]["simulated_vs_vpp1_unit"] == pytest.approx(7.5 / 9)  # 1F1B's closed form, v = 2
    assert cells[("none", 2)]["simulated_bubble_unit"] == pytest.approx(cells[("none", 2)]["bubble_theory_policy_only"])
    assert len(measured["launches"]) == 1 and measured["launches"][0]["seconds"] > 0


def test_memory_reports_reference_bytes_per_rank(tmp_path):
    result = run_benchmark(memory.main, ["--tiny", "--repeats", "1", "--out", str(tmp_path / "m.json"), "--work-dir",
                                         str(tmp_path)])
    total_ref = sum(row["ref_param_bytes"] for row in result["ranks"].values())
    fp32_bytes = 4 * sum(math.prod(s) for s in _weights(tmp_path / "model").values())
    assert total_ref == fp32_bytes  # pp 2 splits the reference, nothing duplicated (untied)
    for row in result["ranks"].values():
        assert 0 < row["ref_param_bytes"] < fp32_bytes
        for mode in ("interleaved", "none"):
            assert row[mode]["peak_rss_bytes"]["median"] >= row[mode]["baseline_rss_bytes"]["median"] > 0
        assert "interleaved_minus_none_over_ref_bytes" in row


def test_optimizer_memory_halves_the_state_per_rank_at_dp2(tmp_path):
    result = run_benchmark(optimizer_memory.main, ["--tiny", "--repeats", "1", "--dtype", "bfloat16", "--share-launch",
                                    "--out", str(tmp_path / "o.json"), "--work-dir", str(tmp_path)])
    assert result["share_launch"] is True
    numel = sum(math.prod(s) for s in _weights(tmp_path / "model").values())
    configs = result["configs"]
    one = configs["dp1_sharded"]["0"]["optimizer_state_bytes"]["median"]
    # bf16 parameters: fp32 master + two fp32 moments (fp32 norms need no master copy), untied
    assert 8 * numel < one <= 12 * numel
    assert sum(row["optimizer_state_bytes"]["median"] for row in configs["dp2_sharded"].values()) == one
    for row in configs["dp2_sharded"].values():
        assert abs(row["state_over_dp1"] - 0.5) < 0.05
    for row in configs["dp2_replicated"].values():
        assert row["state_over_dp1"] == 1.0


def test_checkpoint_memory_measures_a_save_that_sends_experts(tmp_path):
    """tp 2 x ep 2 (world 2): the ep group is the tp group, so two of the four files of each kind
    are written from experts the other rank sends; every rank's figures are recorded."""
    result = run_benchmark(checkpoint_memory.main, ["--tiny", "--repeats", "1", "--steps", "1", "--layouts", "2x1x2",
                                     "--out", str(tmp_path / "c.json"), "--work-dir", str(tmp_path)])
    written = tmp_path / "2x1x2_0" / "checkpoint"
    for kind in ("model", "optim/exp_avg", "optim/exp_avg_sq"):
        assert sorted(p.name for p in (written / kind).glob("tp*")) == [
            "tp0_pp0_ep0", "tp0_pp0_ep1", "tp1_pp0_ep0", "tp1_pp0_ep1"], kind
    ranks = result["layouts"]["2x1x2"]
    assert sorted(row["coordinates"] for row in ranks.values()) == [[0, 0, 0], [1, 0, 0]]  # (tp, pp, dp)
    with safe_open(str(tmp_path / "model" / "model.safetensors"), "pt") as handle:
        experts = sum(4 * math.prod(handle.get_slice(n).get_shape()) for n in handle.keys() if ".experts." in n)
    assert sum(row["own_expert_bytes"] for row in ranks.values()) == experts  # each rank half the experts, whole
    for row in ranks.values():
        assert 0 < row["largest_tensor_bytes"] < row["own_kind_bytes"] < result["model_kind_bytes"]
        extra, peak, before = (row[k]["median"]
                               for k in ("save_extra_bytes", "save_peak_rss_bytes", "rss_before_save_bytes"))
        assert extra == peak - before and before > 0
        assert row["extra_over_own_kind"] == extra / row["own_kind_bytes"]


def test_dp_scaling_runs_both_sizes(tmp_path):
    result = run_benchmark(dp_scaling.main, ["--tiny", "--steps", "1", "--out", str(tmp_path / "d.json"), "--work-dir",
                                             str(tmp_path)])
    assert set(result["dp"]) == {"1", "2"}
    assert result["dp"]["1"]["speedup_vs_dp1"] == 1.0
    assert result["dp"]["2"]["tokens_per_s"]["median"] > 0


def test_conversion_round_trip_is_exact(tmp_path):
    result = run_benchmark(conversion.main, ["--tiny", "--repeats", "1", "--out", str(tmp_path / "c.json"),
                              "--work-dir", str(tmp_path / "conv")])
    assert result["round_trip_bit_exact"] is True
    assert result["checkpoint_bytes"] == common.directory_bytes(tmp_path / "conv" / "hf")
    assert all(v > 0 and math.isfinite(v) for v in result["ratios"].values())


def test_conversion_refuses_a_work_dir_inside_the_repository():
    with pytest.raises(SystemExit, match="inside the repository"):
        conversion.main(["--tiny", "--work-dir", str(common.REPO_ROOT / "bench_tmp")])


def test_gpu_step_flop_count_matches_the_checkpoint(tmp_path):
    shape = gpu_step.TINY
    model_dir = common.write_random_llama(tmp_path / "m", shape=shape)
    matrices = sum(math.prod(s) for s in _weights(model_dir).values() if len(s) == 2)
    assert gpu_step.matmul_params(shape) == matrices  # tied: the embedding is counted once, as the output layer
    flops = gpu_step.step_flops(shape=shape, tokens=100, seq_len=10)
    assert flops["dense"] == 8 * matrices * 100 and flops["with_attention"] > flops["dense"]


def test_trl_side_sees_exactly_the_engine_tokens(tmp_path):
    from transformers import AutoTokenizer

    vs_trl.write_tokenizer(tmp_path, vocab_size=64)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    for pair in common.make_pairs(3, prompt_len=5, completion_len=4, vocab_size=64, seed=0):
        prompt = " ".join(vs_trl._word(i) for i in pair.prompt_ids)
        chosen = " " + " ".join(vs_trl._word(i) for i in pair.chosen_ids)
        assert tokenizer(prompt)["input_ids"] == list(pair.prompt_ids)
        assert tokenizer(prompt + chosen)["input_ids"] == list(pair.prompt_ids + pair.chosen_ids)
        assert chosen.endswith(tokenizer.eos_token)  # TRL then adds no second EOS


def test_packing_decompose_counts_and_splits_the_step(tmp_path):
    # Its own process: the script builds a one-rank worker (a process group) for itself.
    out = tmp_path / "d.json"
    run_python([str(REPO / "benchmarks" / "packing_decompose.py"), "--tiny", "--reps", "1", "--steps", "1", "--out",
                str(out), "--work-dir", str(tmp_path / "w")], check=True, timeout=600)
    result = json.loads(out.read_text())
    padded, packed = (result["exact"]["layouts"][k]["steps"][0] for k in ("padded", "packed"))
    assert padded["real"] == packed["real"]  # the same pairs, two layouts
    assert packed["positions"] == sum(packed["widths"]) and all(w % 8 == 0 for w in packed["widths"])
    assert max(packed["widths"]) <= result["max_tokens_per_microbatch"]
    assert packed["positions"] - packed["real"] < 8 * packed["microbatches"] < padded["positions"] - padded["real"]
    # THD's attention counts each sequence's triangle only, whatever the layout.
    assert padded["flops_attention_thd"] == packed["flops_attention_thd"] < packed["flops_attention_cpu"]
    widest = result["exact"]["layouts"]["packed"]["widest_microbatch"]
    assert 0 < widest["stash_wxw_bytes"] < widest["stash_bytes"] <= widest["peak_live_bytes"]
    for layout in ("padded", "packed"):
        assert math.isclose(sum(result["timed"]["class_share"][layout].values()), 1.0)
        assert result["timed"]["step_compute_cpu_s"][layout]["median"] > 0


def test_data_scale_measures_the_store_and_the_train_command(tmp_path):
    """--tiny: 200 pairs, the store's measurements (a cold build, a warm open) and one cold run of
    the train command (time to step 1, total time, the driver's peak RSS) and its plot. A warm
    run of the train command differs only by not deleting the cache first; tests/test_store_runs.py
    runs the train command on a store it built before."""
    out, plot = tmp_path / "d.json", tmp_path / "d.png"
    args = [str(REPO / "benchmarks" / "data_scale.py"), "--tiny", "--e2e-modes", "cold", "--work-dir",
            str(tmp_path / "w"), "--out", str(out), "--plot", str(plot)]
    _run_training_script(args, check=True, timeout=900)
    result = json.loads(out.read_text())
    figures = result["sizes"]["200"]
    assert figures["cold_1"]["built"] and not figures["warm"]["built"] and figures["load_pairs"]["pairs"] == 200
    assert result["e2e"]["repeats"] == 1 and result["e2e"]["plot"] == str(plot)
    assert set(figures["e2e"]) == {"cold"} and result["e2e"]["modes"] == ["cold"]
    entry = figures["e2e"]["cold"]
    assert len(entry["runs"]) == 1
    run = entry["runs"][0]
    assert run["step_reached"] == 1
    assert 0 < run["step1_s"] <= run["total_s"] and run["driver_peak_rss"] > 0
    assert (entry["step1_s"], entry["total_s"], entry["driver_peak_rss"]) == (
        run["step1_s"], run["total_s"], run["driver_peak_rss"])  # the median of one run
    assert "--max-steps" in run["command"] and "--no-export-hf" in run["command"]
    assert plot.stat().st_size > 0
