"""Exact tensor memory by category (mcore_dpo/pipeline/account.py) and the memory model of a
plan (mcore_dpo/pipeline/memory.py), against each other on real ranks.

One launch per pipeline size runs every reference mode for two steps (the first interleaved
step computes this batch's reference and carries out, the second carries in):
- pp 2 at benchmarks/memory.py's setting (hidden 1024, 32 tokens, 4 microbatches): also the
  reference's exact overhead over policy-only, against its parameter bytes;
- pp 4 with a small model and 6 microbatches;
- pp 2 with the small model under each activation recompute (--recompute none, selective, full
  with groups of 1 and 2 layers), interleaved: the plan model against the peaks again, and what
  a layer keeps under recompute against memory_estimate's recompute terms; in the same launch,
  shared-prompt rows (--prefix-sharing, one row of P + C + R + 1 positions per pair, their
  [rows, 1, W, W] mask), without recompute and with full: the plan model against the peaks.
Tensor bytes are deterministic: every comparison is exact, in bytes.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ["OMP_NUM_THREADS"] = "1"

from benchmarks import common, memory
from mcore_dpo.pipeline.account import CATEGORIES, storage_bytes
from mcore_dpo.pipeline.memory import StageMemory, plan_memory
from mcore_dpo.pipeline.plan import REF_MODES
from mcore_dpo.pipeline.schedule import build_plan
from tests.helpers.ranks import run_benchmark

MODES = ("interleaved", "sequential", "precomputed", "none")
assert set(MODES) == set(REF_MODES)
PP4_SHAPE = common.LlamaShape(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
                              vocab_size=256)


RECOMPUTE_SETTINGS = ({}, {"recompute": "selective"}, {"recompute": "full"}, {"recompute": "full", "recompute_num_layers": 2})
RECOMPUTE_SEQ_LEN = 32
SHARED_SETTINGS = ({"prefix_sharing": True}, {"prefix_sharing": True, "recompute": "full"})


@pytest.fixture(scope="module")
def recompute_runs(tmp_path_factory) -> list[list[dict]]:
    work = tmp_path_factory.mktemp("memory_account_recompute")
    model = common.write_random_llama(work / "small_model", shape=PP4_SHAPE)
    return run_benchmark(memory.launch, model_dir=model, pp=2, modes=("interleaved",), num_microbatches=4,
                         seq_len=RECOMPUTE_SEQ_LEN, num_steps=2, out_dir=work / "pp2",
                         settings=RECOMPUTE_SETTINGS + SHARED_SETTINGS)


def _unshared(runs: list[list[dict]]) -> list[list[dict]]:
    return [[r for r in per_rank if not r["prefix_sharing"]] for per_rank in runs]


def _shared(runs: list[list[dict]]) -> list[list[dict]]:
    return [[r for r in per_rank if r["prefix_sharing"]] for per_rank in runs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, list[list[dict]]]:
    work = tmp_path_factory.mktemp("memory_account")
    pp2_model = common.write_random_llama(work / "bench_model", shape=memory.SHAPE)
    pp4_model = common.write_random_llama(work / "small_model", shape=PP4_SHAPE)
    return {
        2: run_benchmark(memory.launch, model_dir=pp2_model, pp=2, modes=MODES,
                         num_microbatches=memory.NUM_MICROBATCHES, seq_len=memory.SEQ_LEN, num_steps=2,
                         other_modes_steps=1, out_dir=work / "pp2"),
        4: run_benchmark(memory.launch, model_dir=pp4_model, pp=4, modes=MODES, num_microbatches=6, seq_len=16,
                         num_steps=2, other_modes_steps=1, out_dir=work / "pp4"),
    }


# ----------------------------------------------------------------------------- no processes


def test_storage_bytes_counts_each_storage_once():
    base = torch.zeros(10, 4)
    assert storage_bytes([base, base[2:], base.t(), {"x": (base[0],)}]) == 160
    seen: set[int] = set()
    assert storage_bytes([base], seen=seen) == 160
    assert storage_bytes([base, torch.zeros(3)], seen=seen) == 12


@pytest.mark.parametrize("pp,m", [(1, 3), (2, 4), (4, 8), (8, 32)])
def test_one_f_one_b_stash_is_min_of_stages_left_and_microbatches(pp, m):
    for mode in ("none", "precomputed"):
        peaks = plan_memory(build_plan(num_stages=pp, num_microbatches=m, ref_mode=mode))
        assert peaks == tuple(StageMemory(min(pp - s, m), 0, 0) for s in range(pp))


def test_reference_modes_keep_the_policy_stash_and_bound_what_is_in_flight():
    for pp, m in [(2, 4), (4, 8), (4, 16), (8, 16)]:
        base = plan_memory(build_plan(num_stages=pp, num_microbatches=m, ref_mode="none"))
        for kwargs in (dict(ref_mode="sequential"), dict(ref_mode="interleaved", ref_current=True, carry_out=True),
                       dict(ref_mode="interleaved", carry_in=True, carry_out=True)):
            plan = build_plan(num_stages=pp, num_microbatches=m, **kwargs)
            for s, (have, policy_only) in enumerate(zip(plan_memory(plan), base)):
                assert have.policy_stash == policy_only.policy_stash
                assert have.reference_in_flight <= 2 * 3 + 1  # MAX_REF_ACTS_IN_FLIGHT on each side, + one being sent
                if plan.carry_out or plan.carry_in:
                    assert have.carried == (s < pp - 1) * 1  # stage s keeps exactly one for stage s+1


# ----------------------------------------------------------------------------- real ranks


def _model_of(step: dict, *, pp: int) -> tuple[StageMemory, ...]:
    plan = step["plan"]
    ref_batches = plan["ref_batches"]
    kwargs = {}
    if plan["ref_mode"] == "interleaved":
        kwargs = dict(ref_current=0 in ref_batches, ref_next=1 in ref_batches, carry_in=plan["carry_in"],
                      carry_out=plan["carry_out"])
    return plan_memory(build_plan(num_stages=pp, num_microbatches=plan["num_microbatches"], ref_mode=plan["ref_mode"],
                                  **kwargs))


def _check_plan_model(results: list[list[dict]], *, pp: int) -> set:
    """Every step of every result against the plan model; the (mode, carry in, carry out) seen."""
    seen_flags = set()
    for rank, per_mode in enumerate(results):
        for result in per_mode:
            act = result["stage_activation_bytes"]
            for index, step in enumerate(result["steps"]):
                model = _model_of(step, pp=pp)[result["pp_rank"]]
                stash = step["stash_bytes_per_microbatch"]
                assert len(set(stash)) == 1 and stash[0] > 0, stash  # one unit per microbatch
                measured = step["memory"]
                where = f"pp {pp} rank {rank} {result['ref_mode']} recompute {result['recompute']} step {index + 1}"
                assert measured["policy_stash_peak_bytes"] == model.policy_stash * stash[0], where
                assert measured["reference_in_flight_peak_bytes"] == model.reference_in_flight * act, where
                assert measured["carried_peak_bytes"] == model.carried * act, where
                seen_flags.add((result["ref_mode"], step["plan"]["carry_in"], step["plan"]["carry_out"]))
    return seen_flags


@pytest.mark.parametrize("pp", [2, 4])
def test_plan_model_equals_measured_activation_peaks(runs, pp):
    seen_flags = _check_plan_model(runs[pp], pp=pp)
    # every mode ran; interleaved both as a first (carry out) and a carrying (in and out) step
    assert {mode for mode, *_ in seen_flags} == set(MODES)
    assert ("interleaved", False, True) in seen_flags and ("interleaved", True, True) in seen_flags


@pytest.mark.parametrize("pp", [2, 4])
def test_run_long_categories_are_the_tensors_themselves(runs, pp):
    for per_mode in runs[pp]:
        for result in per_mode:
            numel = result["policy_numel"]
            for step in result["steps"]:
                mem = step["memory"]
                # fp32 weights and main-grad buffer; megatron-core may pad a storage by a few elements
                padding = mem["policy_params_peak_bytes"] - 4 * numel - result["policy_buffer_bytes"]
                assert 0 <= padding < 1024, padding
                assert 0 <= mem["grads_peak_bytes"] - 4 * numel < 1024
                assert mem["optimizer_state_peak_bytes"] == 8 * numel  # fp32 masters are the weights; m, v
                assert mem["reference_params_peak_bytes"] == (result["ref_param_bytes"]
                                                              if result["ref_mode"] in ("interleaved", "sequential")
                                                              else 0)
                assert mem["total_peak_bytes"] >= sum(mem[f"{c}_peak_bytes"] for c in CATEGORIES[:4])


def test_metrics_log_each_category_as_its_max_over_ranks(runs):
    for mode_index, mode in enumerate(MODES):
        per_rank = [per_mode[mode_index] for per_mode in runs[4]]
        for step_index in range(len(per_rank[0]["steps"])):
            logged = [r["steps"][step_index]["metrics"] for r in per_rank if r["steps"][step_index]["metrics"]]
            assert len(logged) == 1, mode
            for name in CATEGORIES:
                key = f"{name}_peak_bytes"
                assert logged[0][f"memory/{key}"] == max(r["steps"][step_index]["memory"][key] for r in per_rank)


def test_colocated_reference_costs_at_most_1_1_times_its_bytes(runs):
    # benchmarks/memory.py's setting, exact tensor bytes: (peak with the reference - policy-only)
    # / reference parameter bytes, per rank.
    for rank, ratio in memory.reference_overhead(runs[2]).items():
        # Below 1 by a hair is possible: the activation side peaks at another op in each mode.
        assert 0.99 <= ratio <= memory.GOAL_RATIO, (rank, ratio)


def test_config_model_reduces_to_one_microbatch_at_pp1_and_sees_the_stage_split():
    from mcore_dpo.tools.memory_estimate import LayerShape, activation_bytes, boundary_bytes, plan_activation_bytes

    shape = LayerShape(hidden=256, heads=8, kv_heads=2, head_dim=32, ffn=512, vocab=1024)
    kw = dict(seq_len=128, rows=2, tp=2, sequence_parallel=True, attention="flash", dtype_bytes=2)
    one = activation_bytes(shape, layers=8, **kw)
    for mode in ("interleaved", "none"):
        assert plan_activation_bytes(shape, layers=8, pp=1, num_microbatches=8, ref_mode=mode, **kw) == one
    # pp 4: the first stage holds 4 microbatches of 2 layers (8 layers' worth), one reference
    # activation in flight and one carried, and no head; 1F1B alone holds no reference activation.
    with_ref = plan_activation_bytes(shape, layers=8, pp=4, num_microbatches=8, ref_mode="interleaved", **kw)
    policy_only = plan_activation_bytes(shape, layers=8, pp=4, num_microbatches=8, ref_mode="none", **kw)
    boundary = boundary_bytes(shape, seq_len=128, rows=2, tp=2, sequence_parallel=True, dtype_bytes=2)
    assert with_ref - policy_only == 2 * boundary


def test_plan_model_equals_measured_activation_peaks_under_recompute(recompute_runs):
    _check_plan_model(_unshared(recompute_runs), pp=2)
    for per_setting in _unshared(recompute_runs):
        assert [(r["recompute"], r["recompute_num_layers"]) for r in per_setting] == [
            (s.get("recompute", "none"), s.get("recompute_num_layers")) for s in RECOMPUTE_SETTINGS]


def _stash_unit(result: dict) -> int:
    return result["steps"][0]["stash_bytes_per_microbatch"][0]


def test_recompute_keeps_what_the_estimate_says(recompute_runs):
    """Exact bytes per microbatch on each stage (2 layers each), against memory_estimate:
    - full: each group of N layers keeps only its input, one stage-boundary activation
      (layer_activation_bytes is 1/N of one per layer); the first stage keeps the token ids
      beside it, the last its head, which recompute does not change, so what the layers keep
      without recompute (the stash minus the same rest) is the same on both stages;
    - selective: each layer keeps the no-recompute stash minus the core attention's s x s
      probabilities and the copies it makes, as the estimate's terms differ, except for the
      attention mask type megatron-core's checkpoint saves as a one-element int32 tensor.
    And the measured stash falls: full < selective < none on every stage."""
    from mcore_dpo.tools.memory_estimate import LayerShape, layer_activation_bytes

    shape = LayerShape(hidden=PP4_SHAPE.hidden_size, heads=PP4_SHAPE.num_heads, kv_heads=PP4_SHAPE.num_kv_heads,
                       head_dim=PP4_SHAPE.hidden_size // PP4_SHAPE.num_heads, ffn=PP4_SHAPE.intermediate_size,
                       vocab=PP4_SHAPE.vocab_size)
    layers = PP4_SHAPE.num_layers // 2
    layers_stash = {}
    for per_setting in _unshared(recompute_runs):
        by = {(r["recompute"], r["recompute_num_layers"]): r for r in per_setting}
        none, selective, full, full2 = (by[k] for k in (("none", None), ("selective", None), ("full", None), ("full", 2)))
        stage = none["pp_rank"]
        act = none["stage_activation_bytes"]
        rows = act // (RECOMPUTE_SEQ_LEN * PP4_SHAPE.hidden_size * 4)
        kw = dict(seq_len=RECOMPUTE_SEQ_LEN, rows=rows, tp=1, sequence_parallel=False, attention="local", dtype_bytes=4)
        for result, group in ((full, 1), (full2, 2)):
            kept = layers * layer_activation_bytes(shape, **kw, recompute="full", recompute_num_layers=group)
            assert kept == layers // group * act
            rest = _stash_unit(result) - kept
            if stage == 0:
                assert rest == rows * RECOMPUTE_SEQ_LEN * 8, (group, rest)  # the int64 token ids
            else:
                assert rest == _stash_unit(full) - layers * act  # the head, whatever the group size
        layers_stash[stage] = _stash_unit(none) - _stash_unit(full) + layers * act  # what the layers keep without recompute
        per_layer = layer_activation_bytes(shape, **kw) - layer_activation_bytes(shape, **kw, recompute="selective")
        assert _stash_unit(none) - _stash_unit(selective) == layers * (per_layer - 4), stage
        peaks = [r["steps"][0]["memory"]["policy_stash_peak_bytes"] for r in (full, selective, none)]
        assert peaks == sorted(set(peaks)), peaks
    assert layers_stash[0] == layers_stash[1] > 2 * layers * act, layers_stash


def test_plan_model_equals_measured_activation_peaks_with_shared_prompts(recompute_runs):
    """--prefix-sharing: each microbatch one row [p_1..p_{P-1} | p_P c_1..c_C | p_P r_1..r_R] of
    P + C + R + 1 positions (rounded up to 8) instead of two rows of P + max(C, R), with its own
    [rows, 1, W, W] boolean mask (no category: the mask stays out of the stash, as the padded
    rows' causal mask does). The plan model holds exactly, in the shared rows' units: the stash
    per microbatch, and the [W, rows, h] stage activation the reference sends and carries, both
    as a first (carry out) and as a carrying (in and out) interleaved step, without recompute and
    under full recompute."""
    from mcore_dpo.data.prefix_sharing import shared_seq_len

    shared = _shared(recompute_runs)
    seen_flags = _check_plan_model(shared, pp=2)
    assert ("interleaved", False, True) in seen_flags and ("interleaved", True, True) in seen_flags
    pairs = common.make_pairs(1, prompt_len=RECOMPUTE_SEQ_LEN // 4, completion_len=RECOMPUTE_SEQ_LEN - RECOMPUTE_SEQ_LEN // 4,
                              vocab_size=PP4_SHAPE.vocab_size, seed=3)  # memory.launch's lengths
    prompt, completion = len(pairs[0].prompt_ids), len(pairs[0].chosen_ids)
    width = -(-(prompt + 2 * completion + 1) // 8) * 8
    assert width == shared_seq_len(pairs, multiple=8) == 64
    for per_rank, unshared in zip(shared, _unshared(recompute_runs)):
        assert [(r["recompute"], r["recompute_num_layers"]) for r in per_rank] == [
            (s.get("recompute", "none"), s.get("recompute_num_layers")) for s in SHARED_SETTINGS]
        for result in per_rank:
            assert (result["rows"], result["seq_len"]) == (1, width)  # one pair per row (micro_batch_size 1)
            assert result["stage_activation_bytes"] == width * PP4_SHAPE.hidden_size * 4
        assert (unshared[0]["rows"], unshared[0]["seq_len"]) == (2, RECOMPUTE_SEQ_LEN)  # chosen and rejected rows
        # The shared row's attention saves more per microbatch than the two unshared rows (this
        # short prompt saves 7 of 64 positions, while one row of 64 holds twice the W x W scores
        # of two rows of 32); full recompute keeps far less than none.
        none, full = (_stash_unit(r) for r in per_rank)
        assert full < none and none > _stash_unit(unshared[0])


def test_device_figures_are_gpu_only():
    from mcore_dpo.pipeline.account import device_figures

    assert device_figures(torch.device("cpu")) == {}


@pytest.mark.gpu
def test_device_figures_read_the_cuda_allocator():
    from mcore_dpo.pipeline.account import device_figures, reset_device_peaks

    device = torch.device("cuda", 0)
    reset_device_peaks(device)
    block = torch.empty(2**24, dtype=torch.uint8, device=device)
    figures = device_figures(device)
    assert figures["cuda_allocated_peak_bytes"] >= block.numel()
    assert figures["cuda_reserved_peak_bytes"] >= figures["cuda_allocated_peak_bytes"]


def test_model_table_command(capsys):
    rows = {(r["pp"], r["m"]): r for r in memory.main(["--model-table"])["model_table"]}
    assert set(rows) == {(p, m) for p in memory.TABLE_STAGES for m in memory.TABLE_MICROBATCHES}
    carrying = rows[(4, 8)]["interleaved, carrying"]
    assert (carrying["in_flight"], carrying["carried"]) == (3, 1)
    assert 0 < rows[(4, 8)]["sequential"]["overhead"] < carrying["overhead"] < 0.01
    assert "| 4 | 8 | 4 |" in capsys.readouterr().out
