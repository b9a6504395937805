"""Virtual pipeline stages (--vpp) as plans: megatron-core's interleaved 1F1B, built, checked
and timed without processes (pipeline/interleaved.py), and which layers each chunk holds.

The sweep over every plan the issue names (p <= 8, v <= 4, m <= 32, every reference mode) takes
long on the shared 2-core machine; pytest runs a sample, the whole sweep runs as
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python tests/test_vpp_plan.py
"""

import dataclasses
import hashlib
import json
import sys
import time
from collections import Counter
from functools import lru_cache
from pathlib import Path

import pytest

from checkpoint_convert.families.base import ConversionError
from checkpoint_convert.mapping import chunk_layers
from mcore_dpo.pipeline.check import simulate, validate_plan, validate_stages
from mcore_dpo.pipeline.interleaved import (
    chunk_costs,
    interleaved_1f1b,
    max_in_flight,
    schedule_table,
)
from mcore_dpo.pipeline.memory import plan_memory
from mcore_dpo.pipeline.plan import Costs, Op, OpKind, PlanError, carried, format_plan, kept, virtual_neighbour
from mcore_dpo.pipeline.schedule import build_plan

# (ref_mode, ref_current, ref_next[, carry_in, carry_out]) of the steps a run builds with chunks
VPP_CASES = (
    ("none", False, True),
    ("precomputed", False, True),
    ("sequential", False, True),
    ("interleaved", False, True),  # a steady step: the next batch's reference in the bubbles
    ("interleaved", True, True),  # the first step: this batch's too
    ("interleaved", True, False),  # the last step: this batch's only
    ("interleaved", True, True, False, True),  # the first step of a carrying run: carries out
    ("interleaved", False, True, True, True),  # a steady carrying step
    ("interleaved", False, False, True, False),  # the last step of a carrying run: carries in only
)
STEADY, STEADY_CARRYING = VPP_CASES[3], VPP_CASES[7]


@lru_cache(maxsize=None)
def vpp_plan(p: int, m: int, v: int, case: tuple = VPP_CASES[0]):
    mode, current, next_, carry_in, carry_out = (*case, False, False)[:5]
    return build_plan(num_stages=p, num_microbatches=m, num_chunks=v, ref_mode=mode, ref_current=current,
                      ref_next=next_, carry_in=carry_in, carry_out=carry_out)


def allowed_counts(p: int, max_m: int = 32) -> range:
    """The microbatch counts megatron-core's interleaved schedule takes at pp p (multiples of p)."""
    return range(p, max_m + 1, p)


# ----------------------------------------------------------------------------- v = 1 is today's plan

# sha256 over the plans below, written by the builder at b159708 (before ops had a chunk).
V1_GOLDEN = "3ce3d60ca74918b22ffad77d7dfd9b082e141b6591337f7154ded15de799cbcc"
V1_CASES = [("none", False, True, False, False), ("precomputed", False, True, False, False),
            ("sequential", False, True, False, False), ("interleaved", False, True, False, False),
            ("interleaved", True, True, False, False), ("interleaved", True, False, False, False),
            ("interleaved", False, True, True, True), ("interleaved", True, True, False, True)]


def _words(op: Op) -> tuple:
    return (op.kind.value, op.microbatch, op.batch, tuple(_words(part) for part in op.parts))


def test_one_chunk_plans_are_unchanged_byte_for_byte():
    digest = hashlib.sha256()
    for p in range(1, 6):
        for m in range(1, 9):
            for mode, current, next_, carry_in, carry_out in V1_CASES:
                kwargs = dict(num_stages=p, num_microbatches=m, ref_mode=mode, ref_current=current, ref_next=next_,
                              carry_in=carry_in, carry_out=carry_out)
                plan = build_plan(**kwargs)
                assert build_plan(**kwargs, num_chunks=1) == plan and plan.num_chunks == 1
                assert all(part.chunk == 0 for ops in plan.stages for op in ops for part in (op, *op.parts))
                digest.update(repr((plan.num_stages, plan.num_microbatches, plan.ref_mode, plan.ref_batches,
                                    plan.carry_in, plan.carry_out,
                                    tuple(tuple(map(_words, ops)) for ops in plan.stages))).encode())
    assert digest.hexdigest() == V1_GOLDEN


# ----------------------------------------------------------------------------- the schedule


def test_order_is_megatron_cores():
    """Forward and backward order per stage as megatron-core 0.16 computes it (its schedule table
    and warm-up count, the backward chunk reversed)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table

    class Group:
        def __init__(self, size: int, rank: int):
            self._size, self._rank = size, rank

        def size(self) -> int:
            return self._size

        def rank(self) -> int:
            return self._rank

    class Communicator:
        def __init__(self, p: int, s: int, v: int):
            self.pp_group, self.virtual_pipeline_model_parallel_size = Group(p, s), v

    for p, v, m in [(2, 2, 4), (2, 3, 6), (3, 2, 9), (4, 2, 8), (4, 4, 12), (8, 2, 16)]:
        table = get_schedule_table(m, v, p)
        assert schedule_table(num_stages=p, num_microbatches=m, num_chunks=v) == table
        for s in range(p):
            total, _, warmup, _ = get_pp_rank_microbatches(m, v, p, p2p_communicator=Communicator(p, s, v))
            fwd = [Op(OpKind.FWD, mb, chunk=c) for mb, c in table]
            bwd = [Op(OpKind.BWD, mb, chunk=v - 1 - c) for mb, c in table]
            expected = fwd[:warmup] + [op for k in range(total - warmup) for op in (fwd[warmup + k], bwd[k])]
            expected += bwd[total - warmup:]
            assert interleaved_1f1b(stage=s, num_stages=p, num_microbatches=m, num_chunks=v) == expected


def test_wrap_around_link_carries_chunks_across_the_ring():
    plan = vpp_plan(4, 8, 2, ("interleaved", False, True))
    flat = [[part for op in ops for part in (op.parts or (op,))] for ops in plan.stages]
    # The last stage's chunk 0 sends down the ring to stage 0's chunk 1; grads come back.
    assert Op(OpKind.SEND_ACT, 3, chunk=0) in flat[3] and Op(OpKind.RECV_ACT, 3, chunk=1) in flat[0]
    assert Op(OpKind.SEND_GRAD, 3, chunk=1) in flat[0] and Op(OpKind.RECV_GRAD, 3, chunk=0) in flat[3]
    assert Op(OpKind.SEND_REF_ACT, 5, 1, chunk=0) in flat[3] and Op(OpKind.RECV_REF_ACT, 5, 1, chunk=1) in flat[0]
    # The ends of the model: no input into stage 0's chunk 0, no output of the last stage's last chunk.
    assert not any(op.kind is OpKind.RECV_ACT and op.chunk == 0 for op in flat[0])
    assert not any(op.kind is OpKind.SEND_ACT and op.chunk == 1 for op in flat[3])
    assert "ra3.1" in format_plan(plan).splitlines()[0]


@pytest.mark.parametrize("p", [2, 3, 4])
def test_sampled_plans_valid_and_complete(p):
    for v in (2, 3):
        for m in (p, 2 * p):
            for case in VPP_CASES:
                plan = vpp_plan(p, m, v, case)
                validate_plan(plan)
                assert plan.num_chunks == v and (plan.carry_in, plan.carry_out) == (*case, False, False)[3:5]
                for s, ops in enumerate(plan.stages):
                    compute = Counter((op.kind, op.chunk) for op in ops if op.kind in (OpKind.FWD, OpKind.BWD))
                    assert compute == {(kind, c): m for kind in (OpKind.FWD, OpKind.BWD) for c in range(v)}
                    # Carrying moves min(s, m) forwards of the last chunk from one step to the next.
                    moved = (plan.carry_in - plan.carry_out) * s
                    assert len([op for op in ops if op.kind is OpKind.REF_FWD]) == m * v * len(plan.ref_batches) + moved


def test_refusals_are_one_line():
    cases = [
        (dict(num_stages=4, num_microbatches=6, num_chunks=2, ref_mode="none"), "multiple of pp"),
        (dict(num_stages=1, num_microbatches=4, num_chunks=2, ref_mode="none"), "pp >= 2"),
    ]
    for kwargs, fragment in cases:
        with pytest.raises(PlanError) as info:
            build_plan(**kwargs)
        assert fragment in str(info.value) and "--vpp 2" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ValueError, match="num_chunks"):
        build_plan(num_stages=2, num_microbatches=4, num_chunks=0, ref_mode="none")


def test_validator_knows_chunks():
    plan = vpp_plan(2, 4, 2, ("interleaved", False, True))
    # As a one-chunk plan, its chunk-1 ops are extra.
    with pytest.raises(PlanError, match="model chunk 1, but num_chunks=1"):
        validate_plan(dataclasses.replace(plan, num_chunks=1))
    # The last stage's last chunk has no stage downstream.
    with pytest.raises(PlanError, match="no peer"):
        validate_stages((plan.stages[0], plan.stages[1] + (Op(OpKind.SEND_ACT, 0, chunk=1),)))
    # A wrap-around receive after the forward that needs it.
    ops = list(plan.stages[0])
    recv = ops.pop(ops.index(Op(OpKind.RECV_ACT, 0, chunk=1)))
    ops.insert(ops.index(Op(OpKind.FWD, 0, chunk=1)) + 1, recv)
    with pytest.raises(PlanError, match="forward needs its input") as info:
        validate_plan(dataclasses.replace(plan, stages=(tuple(ops), plan.stages[1])))
    assert "chunk=1" in str(info.value)


# ----------------------------------------------------------------------------- carrying


def test_carrying_rule_with_chunks():
    """plan.carried / plan.kept with model chunks: the one-chunk rule on the last chunk (the last lap
    of the ring), nothing on the others; sets that grow along the virtual pipeline by at most the one
    activation the stage upstream keeps; stage s carries s chunk forwards, its warm-up idle time."""
    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 32):
            assert [list(carried(s, num_stages=p, num_microbatches=m)) for s in range(p)] == \
                [list(range(m - min(s, m), m)) for s in range(p)]  # one chunk: as before
            for v in (2, 3, 4):
                rule = dict(num_stages=p, num_microbatches=m, num_chunks=v)
                for s in range(p):
                    sets = [set(carried(s, chunk=c, **rule)) for c in range(v)]
                    assert sets == [set()] * (v - 1) + [set(carried(s, num_stages=p, num_microbatches=m))]
                    assert sum(map(len, sets)) == s
                    for c in range(v):
                        down = virtual_neighbour(s, c, step=1, num_stages=p, num_chunks=v)
                        mine, keeps = set(carried(s, chunk=c, **rule)), set(kept(s, chunk=c, **rule))
                        if down is None:
                            assert keeps == set()
                            continue
                        theirs = set(carried(down[0], chunk=down[1], **rule))
                        assert mine <= theirs and theirs - mine == keeps and len(keeps) <= 1
                        assert keeps == ({m - s - 1} if c == v - 1 and s < p - 1 else set())


def test_carried_forwards_open_the_next_step():
    """A steady carrying plan: stage s starts with its s carried reference forwards of the last chunk
    (before its first policy forward), keeps what the next step's stage s+1 carries in, and what
    one step keeps is what the next one sends first."""
    for p, m, v in [(2, 4, 2), (4, 8, 2), (4, 8, 4)]:
        plan = vpp_plan(p, m, v, STEADY_CARRYING)
        for s, ops in enumerate(plan.stages):
            flat = [part for op in ops for part in (op.parts or (op,))]
            first_fwd = flat.index(Op(OpKind.FWD, 0))
            opening = [op for op in flat[:first_fwd] if op.kind is OpKind.REF_FWD]
            assert opening == [Op(OpKind.REF_FWD, mb, 0, chunk=v - 1) for mb in range(m - s, m)]
            kept_out = [(op.chunk, op.microbatch) for op in flat if op.kind is OpKind.KEEP_REF_ACT]
            sent_in = [(op.chunk, op.microbatch) for op in flat if op.kind is OpKind.SEND_KEPT_REF_ACT]
            assert kept_out == sent_in == ([(v - 1, m - s - 1)] if s < p - 1 else [])
            assert flat[0].kind is OpKind.SEND_KEPT_REF_ACT or s == p - 1
        # The memory model (and so the memory estimate): one carried activation on every stage but the last.
        assert [stage.carried for stage in plan_memory(plan)] == [1] * (p - 1) + [0]


# ----------------------------------------------------------------------------- time


@pytest.mark.parametrize("costs", [Costs(), Costs(fwd=1.0, bwd=1.0), Costs(fwd=0.7, bwd=2.3)])
def test_policy_bubble_is_the_theory(costs):
    """Policy-only interleaved 1F1B with free communication, each chunk op 1/v of a stage op,
    the plan built for the costs it is timed with: makespan = m(F+B) + (p-1)(F+B)/v, so the
    bubble share of the step is (p-1)/(v*m + p-1) and the bubble itself 1/v of one-chunk 1F1B's
    (p-1)(F+B). The schedule meets it exactly; the tolerance, 1e-9 relative, is float rounding
    of the summed op times. (Built for other costs, the transfer pairing may cost more: up to
    +22% at p 3, F=B, with a plan built for B = 2F.)"""
    for p in (2, 3, 4, 8):
        for v in (1, 2, 3, 4):
            for m in (p, 2 * p, 32 // p * p):
                plan = build_plan(num_stages=p, num_microbatches=m, num_chunks=v, ref_mode="none",
                                  costs=chunk_costs(costs, v))
                run = simulate(plan, costs=chunk_costs(costs, v))
                unit = costs.fwd + costs.bwd
                assert run.makespan == pytest.approx(m * unit + (p - 1) * unit / v, rel=1e-9)
                assert run.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-9)


def test_reference_in_the_bubbles_costs_no_more_than_a_separate_pass():
    costs = Costs()
    for p, m, v in [(2, 8, 2), (4, 8, 2), (4, 8, 4), (4, 16, 2)]:
        timed = {case: simulate(vpp_plan(p, m, v, case), costs=chunk_costs(costs, v)).makespan for case in VPP_CASES}
        policy = timed[VPP_CASES[0]]
        assert timed[("interleaved", False, True)] <= timed[("sequential", False, True)] + 1e-9
        assert timed[("interleaved", False, True)] <= policy + m * costs.ref_fwd + 1e-9
        assert timed[STEADY_CARRYING] <= timed[STEADY] + 1e-9  # carrying never costs a steady step time
        run = simulate(vpp_plan(p, m, v, ("interleaved", False, True)), costs=chunk_costs(costs, v))
        assert run.max_ref_acts_in_flight <= max_in_flight(v)


# ----------------------------------------------------------------------------- layers and memory


def test_chunk_layers_are_megatrons_slices():
    # 8 layers, pp 2, vpp 2: stage 0 holds 0-1 and 4-5, stage 1 holds 2-3 and 6-7.
    held = {(s, c): list(chunk_layers(8, pp=2, pp_rank=s, vpp=2, chunk=c)) for s in range(2) for c in range(2)}
    assert held == {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6, 7]}
    for layers, pp, vpp in [(24, 4, 3), (32, 8, 4), (12, 2, 2)]:
        every = sorted(i for s in range(pp) for c in range(vpp)
                       for i in chunk_layers(layers, pp=pp, pp_rank=s, vpp=vpp, chunk=c))
        assert every == list(range(layers))
        # megatron-core's offset: vp_stage * layers/vpp + pp_rank * layers/(pp*vpp)
        assert all(chunk_layers(layers, pp=pp, pp_rank=s, vpp=vpp, chunk=c).start
                   == c * (layers // vpp) + s * (layers // (pp * vpp)) for s in range(pp) for c in range(vpp))
    with pytest.raises(ConversionError) as info:
        chunk_layers(10, pp=2, pp_rank=0, vpp=2, chunk=0)
    assert "--vpp 2" in str(info.value) and "multiple of pp x vpp" in str(info.value)
    assert "\n" not in str(info.value)


def test_first_stage_holds_the_most_chunk_forwards():
    for p, v, m in [(2, 2, 4), (4, 2, 8), (4, 4, 16), (8, 2, 16)]:
        stash = [stage.policy_stash for stage in plan_memory(vpp_plan(p, m, v))]
        assert stash[0] == min(2 * (p - 1) + (v - 1) * p + 1, m * v) == max(stash)
        # In units of a whole stage's forward (1/v each), more than the p of one-chunk 1F1B.
        assert stash[0] / v > min(p, m)


# ----------------------------------------------------------------------------- the benchmark


def test_benchmark_smoke(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import vpp

    out = vpp.main(["--stages", "2", "--microbatches", "4", "--chunks", "1", "2", "--costs", "unit",
                    "--out", str(tmp_path / "vpp.json")])
    assert json.loads((tmp_path / "vpp.json").read_text()) == json.loads(json.dumps(out))
    rows = out["rows"]
    assert {(r["vpp"], r["mode"]) for r in rows} == {(v, mode) for v in (1, 2) for mode in vpp.MODES}
    for r in rows:
        if "bubble_theory" in r:
            assert r["bubble_fraction"] == pytest.approx(r["bubble_theory"], abs=1e-9)
    assert capsys.readouterr().out.count("\n| unit | 2 | 4 |") == len(rows)


# ----------------------------------------------------------------------------- the whole sweep


def sweep(*, max_stages: int = 8, max_chunks: int = 4, max_microbatches: int = 32) -> int:
    """Build and validate every plan with chunks of the cases above; returns how many."""
    count = 0
    for p in range(2, max_stages + 1):
        for v in range(2, max_chunks + 1):
            for m in allowed_counts(p, max_microbatches):
                for case in VPP_CASES:
                    carry_in, carry_out = (*case, False, False)[3:5]
                    validate_plan(build_plan(num_stages=p, num_microbatches=m, num_chunks=v, ref_mode=case[0],
                                             ref_current=case[1], ref_next=case[2], carry_in=carry_in,
                                             carry_out=carry_out))
                    count += 1
    return count


if __name__ == "__main__":
    start = time.perf_counter()
    print(f"{sweep()} plans with chunks valid in {time.perf_counter() - start:.0f} s", file=sys.stderr)
