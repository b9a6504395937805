"""Tests for the pipeline schedule plan: builder, validator, simulator."""

import dataclasses
from collections import Counter
from functools import lru_cache

import pytest

from mcore_dpo.pipeline.plan import MAX_REF_ACTS_IN_FLIGHT, REF_MODES, Costs, Op, OpKind, Plan, PlanError, carried, format_plan
from mcore_dpo.pipeline.check import closed_form_makespans, simulate, validate_plan
from mcore_dpo.pipeline.schedule import build_plan

COMPUTE = {OpKind.FWD, OpKind.BWD, OpKind.REF_FWD}
# (ref_mode, ref_current, ref_next) -> global batches whose reference the plan must compute
MODE_CASES = {
    ("none", False, True): (),
    ("precomputed", False, True): (),
    ("sequential", False, True): (0,),
    ("interleaved", False, False): (),
    ("interleaved", False, True): (1,),
    ("interleaved", True, False): (0,),
    ("interleaved", True, True): (0, 1),
}


@lru_cache(maxsize=None)
def plan_for(p: int, m: int, mode: str = "interleaved", current: bool = False, next_: bool = True) -> Plan:
    return build_plan(num_stages=p, num_microbatches=m, ref_mode=mode, ref_current=current, ref_next=next_)


def makespan(plan: Plan, costs: Costs = Costs()) -> float:
    return simulate(plan, costs=costs).makespan


def policy_order(ops) -> list[Op]:
    return [op for op in ops if op.kind in (OpKind.FWD, OpKind.BWD)]


def edited(plan: Plan, stage: int, ops: list[Op]) -> Plan:
    stages = list(plan.stages)
    stages[stage] = tuple(ops)
    return dataclasses.replace(plan, stages=tuple(stages))


def without(ops, op: Op) -> list[Op]:
    """`ops` less `op`, also when `op` is one of the transfers of a P2P op."""
    out = []
    for entry in ops:
        if entry == op:
            continue
        if entry.kind == OpKind.P2P and op in entry.parts:
            rest = [part for part in entry.parts if part != op]
            entry = rest[0] if len(rest) == 1 else dataclasses.replace(entry, parts=tuple(rest))
        out.append(entry)
    assert any(entry == op or op in entry.parts for entry in ops), f"{op} not in ops"
    return out


def assert_rejected(plan: Plan, fragment: str) -> None:
    with pytest.raises(PlanError) as info:
        validate_plan(plan)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


# ----------------------------------------------------------------------------- every plan is valid


@pytest.mark.parametrize("p", range(1, 9))
def test_all_plans_valid_and_complete(p):
    for m in range(1, 17):
        reference_1f1b = plan_for(p, m, "none")
        for (mode, current, next_), ref_batches in MODE_CASES.items():
            plan = plan_for(p, m, mode, current, next_)
            validate_plan(plan)
            assert plan.ref_batches == ref_batches
            for s, ops in enumerate(plan.stages):
                compute = Counter((op.kind, op.microbatch, op.batch) for op in ops if op.kind in COMPUTE)
                expected = Counter()
                for mb in range(m):
                    expected[(OpKind.FWD, mb, 0)] += 1
                    expected[(OpKind.BWD, mb, 0)] += 1
                    for batch in ref_batches:
                        expected[(OpKind.REF_FWD, mb, batch)] += 1
                assert compute == expected, (p, m, mode, current, next_, s)
                if p == 1:
                    assert all(op.kind in COMPUTE for op in ops)
                # Reference forwards only fill gaps: the policy keeps its exact 1F1B order.
                assert policy_order(ops) == policy_order(reference_1f1b.stages[s])
            if mode == "interleaved":
                assert simulate(plan).max_ref_acts_in_flight <= MAX_REF_ACTS_IN_FLIGHT


@lru_cache(maxsize=None)
def carry_plan(p: int, m: int, *, current: bool = False, carry_in: bool = True, next_: bool = True) -> Plan:
    return build_plan(num_stages=p, num_microbatches=m, ref_mode="interleaved", ref_current=current,
                      ref_next=next_, carry_in=carry_in, carry_out=next_)


def refs_of(plan: Plan, stage: int, batch: int) -> list[int]:
    return [op.microbatch for op in plan.stages[stage] if op.kind == OpKind.REF_FWD and op.batch == batch]


@pytest.mark.parametrize("p", range(1, 9))
def test_carrying_plans_valid_and_complete_over_steps(p):
    # Steps 1..3 of a run: first (this batch's reference too, carries out), steady (carries in
    # and out), last (carries in, no next batch). Between two steps, each stage runs every
    # reference forward of the batch exactly once, and what a stage keeps is what it sends.
    for m in range(1, 17):
        steps = [carry_plan(p, m, current=True, carry_in=False), carry_plan(p, m), carry_plan(p, m, next_=False)]
        for plan in steps:
            validate_plan(plan)
            if p == 1:
                assert not (plan.carry_in or plan.carry_out)  # one stage: nothing to carry
            assert simulate(plan).max_ref_acts_in_flight <= MAX_REF_ACTS_IN_FLIGHT
            for s, ops in enumerate(plan.stages):
                assert policy_order(ops) == policy_order(plan_for(p, m, "none").stages[s])
        assert sorted(refs_of(steps[0], 0, 0)) == list(range(m))
        for before, after in zip(steps, steps[1:]):
            for s in range(p):
                ran = sorted(refs_of(before, s, 1) + refs_of(after, s, 0))
                assert ran == list(range(m)), (p, m, s)
                assert sorted(refs_of(after, s, 0)) == list(carried(s, num_stages=p, num_microbatches=m))
                kept = [op.microbatch for op in before.stages[s] if op.kind == OpKind.KEEP_REF_ACT]
                sent = [op.microbatch for op in after.stages[s] if op.kind == OpKind.SEND_KEPT_REF_ACT]
                assert kept == sent and len(kept) <= 1
        if p == 1:
            assert steps[1] == plan_for(1, m)  # nothing to carry with one stage


def test_carrying_fills_the_warm_up_bubble():
    # The last stage idles (p-1)(F+B) per 1F1B step: p-1 forwards at the start, which the
    # carried reference forwards take, and p-1 backwards at the end. Carrying reaches that bound.
    for p in range(2, 9):
        for m in range(1, 17):
            policy = makespan(plan_for(p, m, "none"))
            assert makespan(carry_plan(p, m)) == policy + max(0.0, m * 1.0 - 3 * (p - 1)), (p, m)
            assert makespan(carry_plan(p, m)) <= makespan(plan_for(p, m))
    assert makespan(carry_plan(4, 8)) == makespan(plan_for(4, 8, "none")) == 33.0
    assert makespan(carry_plan(2, 8)) == 32.0  # was 33 without carrying


def test_carried_reference_opens_the_step():
    plan = carry_plan(3, 4)
    lines = format_plan(plan).splitlines()
    assert lines[0].startswith("stage 0: sk3 F0") and lines[0].endswith("R3n kr3n B1 rg2 B2 rg3 B3")
    assert lines[1].startswith("stage 1: sk2 rr3 R3 sr3 ra0 F0") and lines[1].endswith("R2n kr2n")
    assert lines[2].startswith("stage 2: rr2 R2 rr3 R3 ra0 F0")


def test_rejects_broken_carry():
    plan = carry_plan(3, 4)
    ops = [op for op in plan.stages[0] if op.kind != OpKind.SEND_KEPT_REF_ACT]
    assert_rejected(edited(plan, 0, ops), "send_kept_ref_act mb=3 batch=0 appears 0 times")
    assert_rejected(dataclasses.replace(plan, carry_in=False), "appears 1 times, expected 0")
    assert_rejected(dataclasses.replace(plan_for(3, 4, "interleaved", True, True), carry_in=True),
                    "would run twice")
    ops = list(plan.stages[1])
    keep = Op(OpKind.KEEP_REF_ACT, 2, 1)
    ops.remove(keep)
    ops.insert(ops.index(Op(OpKind.REF_FWD, 2, 1)), keep)
    assert_rejected(edited(plan, 1, ops), "or kept")


def test_one_f_one_b_order_per_stage():
    plan = plan_for(4, 6, "none")
    words = format_plan(plan).splitlines()
    # Steady state: the send and the receive that cross on a link are posted together, as
    # megatron-core's send_forward_recv_backward / send_backward_recv_forward do.
    assert words[0] == ("stage 0: F0 sa0 F1 sa1 F2 sa2 F3 [sa3+rg0] B0 F4 [sa4+rg1] B1 F5 [sa5+rg2] B2 "
                        "rg3 B3 rg4 B4 rg5 B5")
    assert words[3] == ("stage 3: ra0 F0 B0 [sg0+ra1] F1 B1 [sg1+ra2] F2 B2 [sg2+ra3] F3 B3 [sg3+ra4] "
                        "F4 B4 [sg4+ra5] F5 B5 sg5")
    # Forwards before the first backward: warmup plus the first steady forward.
    forwards_first = [
        next(i for i, op in enumerate(policy_order(ops)) if op.kind == OpKind.BWD) for ops in plan.stages
    ]
    assert forwards_first == [4, 3, 2, 1]


def test_sequential_runs_reference_pass_first():
    plan = plan_for(3, 5, "sequential")
    for ops in plan.stages:
        kinds = [op.kind for op in ops if op.kind in COMPUTE]
        assert kinds[:5] == [OpKind.REF_FWD] * 5
        assert OpKind.REF_FWD not in kinds[5:]


def test_current_reference_precedes_loss_on_last_stage():
    for p, m in [(2, 3), (4, 8), (8, 16)]:
        last = plan_for(p, m, "interleaved", True, True).stages[-1]
        for mb in range(m):
            assert last.index(Op(OpKind.REF_FWD, mb, 0)) < last.index(Op(OpKind.FWD, mb))


# ----------------------------------------------------------------------------- the validator rejects broken plans


def test_rejects_dropped_op():
    plan = plan_for(4, 8)
    ops = without(plan.stages[2], Op(OpKind.RECV_REF_ACT, 3, 1))
    assert_rejected(edited(plan, 2, ops), "appears 0 times, expected 1")


def test_rejects_duplicated_op():
    plan = plan_for(4, 8)
    ops = list(plan.stages[1])
    ops.insert(ops.index(Op(OpKind.FWD, 5)), Op(OpKind.FWD, 5))
    assert_rejected(edited(plan, 1, ops), "appears 2 times, expected 1")


def test_rejects_extra_reference_batch():
    plan = plan_for(3, 4, "none")
    assert_rejected(dataclasses.replace(plan, ref_batches=(1,)), "not allowed for ref_mode 'none'")


def test_rejects_recv_before_peer_can_send():
    # Stage 0 waits for the grad of mb 0 before sending the activation that produces it.
    plan = plan_for(4, 8, "none")
    ops = without(plan.stages[0], Op(OpKind.RECV_GRAD, 0))
    ops.insert(ops.index(Op(OpKind.SEND_ACT, 0)), Op(OpKind.RECV_GRAD, 0))
    assert_rejected(edited(plan, 0, ops), "deadlock")


def test_rejects_reordered_sends():
    plan = plan_for(4, 8)
    ops = list(plan.stages[1])
    send = Op(OpKind.SEND_ACT, 1)
    ops.remove(send)
    ops.insert(ops.index(Op(OpKind.SEND_ACT, 2)) + 1, send)
    assert_rejected(edited(plan, 1, ops), "matched in order")


def test_rejects_swapped_forward_and_backward():
    plan = plan_for(2, 3, "none")
    ops = list(plan.stages[1])
    i, j = ops.index(Op(OpKind.FWD, 1)), ops.index(Op(OpKind.BWD, 1))
    ops[i], ops[j] = ops[j], ops[i]
    assert_rejected(edited(plan, 1, ops), "backward needs its forward")


def test_rejects_send_before_compute():
    plan = plan_for(3, 4)
    send, ref = Op(OpKind.SEND_REF_ACT, 2, 1), Op(OpKind.REF_FWD, 2, 1)
    ops = without(plan.stages[0], send)
    ops.insert(ops.index(ref), send)
    assert_rejected(edited(plan, 0, ops), "sent after the forward")


def test_rejects_loss_before_current_reference():
    plan = plan_for(3, 4, "interleaved", True, False)
    ops = list(plan.stages[2])
    ref = Op(OpKind.REF_FWD, 0, 0)
    ops.remove(ref)
    ops.insert(ops.index(Op(OpKind.FWD, 0)) + 1, ref)
    assert_rejected(edited(plan, 2, ops), "needs this batch's reference")


def test_rejects_wrong_stage_count():
    plan = plan_for(3, 4)
    assert_rejected(dataclasses.replace(plan, num_stages=4), "plan.num_stages=4")


# ----------------------------------------------------------------------------- simulator and figures


@pytest.mark.parametrize("costs", [Costs(), Costs(fwd=1.5, bwd=2.5), Costs(fwd=0.7, bwd=3.1, ref_fwd=0.4)])
def test_1f1b_matches_closed_form(costs):
    for p in range(1, 9):
        for m in range(1, 17):
            closed = closed_form_makespans(num_stages=p, num_microbatches=m, costs=costs)
            assert makespan(plan_for(p, m, "none"), costs) == pytest.approx(closed["1f1b"])


def test_closed_forms():
    closed = closed_form_makespans(num_stages=4, num_microbatches=8)
    assert closed == {"1f1b": 33.0, "separate_pass": 44.0, "concatenated": 44.0}


def test_sequential_costs_one_reference_pass():
    # The policy pipeline trails the reference pass without a barrier, so only
    # m reference forwards land on the critical path, not m + p - 1.
    for p in range(1, 9):
        for m in range(1, 17):
            closed = closed_form_makespans(num_stages=p, num_microbatches=m)
            seq = makespan(plan_for(p, m, "sequential"))
            assert seq == closed["1f1b"] + m * 1.0
            assert seq <= closed["separate_pass"]


def test_interleaved_meets_goal_at_p4_m8():
    policy = makespan(plan_for(4, 8, "none"))
    interleaved = makespan(plan_for(4, 8))
    assert interleaved <= 1.07 * policy
    assert interleaved == 35.0  # 8 reference forwards, 6 fit in the last stage's drain bubble


def test_interleaved_reaches_bubble_bound():
    # The last stage is idle only while the policy grads drain ((p-1)*B); any
    # reference work beyond that extends the step. The plan loses nothing more.
    for p in range(2, 9):
        for m in range(1, 17):
            policy = makespan(plan_for(p, m, "none"))
            assert makespan(plan_for(p, m)) == policy + max(0.0, m * 1.0 - (p - 1) * 2.0), (p, m)


def test_interleaved_beats_separate_pass_with_other_costs():
    costs = Costs(fwd=1.0, bwd=2.2, ref_fwd=0.8, comm=0.1)
    for p, m in [(2, 4), (4, 8), (8, 16)]:
        plan = build_plan(num_stages=p, num_microbatches=m, ref_mode="interleaved", costs=costs)
        validate_plan(plan)
        sequential = makespan(plan_for(p, m, "sequential"), costs)
        assert makespan(plan, costs) < sequential


def test_single_stage_interleaved_costs_four_thirds():
    for m in (1, 4, 16):
        policy = makespan(plan_for(1, m, "none"))
        assert makespan(plan_for(1, m)) == pytest.approx(4 / 3 * policy)
        assert makespan(plan_for(1, m, "interleaved", True, True)) == pytest.approx(5 / 3 * policy)


def test_first_step_no_slower_than_sequential():
    for p, m in [(2, 4), (4, 8), (8, 16)]:
        first = makespan(plan_for(p, m, "interleaved", True, False))
        assert first <= makespan(plan_for(p, m, "sequential"))


def test_sim_result_accounting():
    costs = Costs(comm=0.25)
    plan = plan_for(4, 8)
    result = simulate(plan, costs=costs)
    assert result.busy_time_per_stage == (8 * (1 + 2 + 1),) * 4
    assert result.bubble_fraction == pytest.approx(1 - 4 * 32 / (4 * result.makespan))
    assert result.makespan > makespan(plan)  # latency costs something
    for s, ops in enumerate(plan.stages):
        assert len(result.op_times[s]) == len(ops)
        assert max(end for _, end in result.op_times[s]) <= result.makespan
        for op, (start, end) in zip(ops, result.op_times[s]):
            if op.kind == OpKind.RECV_ACT:
                producer = plan.stages[s - 1].index(Op(OpKind.FWD, op.microbatch))
                assert end >= result.op_times[s - 1][producer][1] + 0.25


def test_bad_inputs_raise_one_line():
    for kwargs, fragment in [
        (dict(num_stages=0, num_microbatches=4, ref_mode="none"), "num_stages"),
        (dict(num_stages=2, num_microbatches=0, ref_mode="none"), "num_microbatches"),
        (dict(num_stages=2, num_microbatches=4, ref_mode="concat"), "ref_mode"),
        (dict(num_stages=2, num_microbatches=4, ref_mode="none", costs=Costs(bwd=0)), "Costs.bwd"),
        (dict(num_stages=2, num_microbatches=4, ref_mode="sequential", carry_out=True), "'interleaved' only"),
        (dict(num_stages=2, num_microbatches=4, ref_mode="interleaved", ref_current=True, carry_in=True),
         "exclude each other"),
        (dict(num_stages=2, num_microbatches=4, ref_mode="interleaved", ref_next=False, carry_out=True),
         "carry_out needs ref_next"),
    ]:
        with pytest.raises(ValueError) as info:
            build_plan(**kwargs)
        assert fragment in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ValueError, match="Costs.comm"):
        simulate(plan_for(2, 2), costs=Costs(comm=-1))


def test_format_plan_one_line_per_stage():
    plan = plan_for(3, 4, "interleaved", True, True)
    lines = format_plan(plan).splitlines()
    assert [line.split(":")[0] for line in lines] == ["stage 0", "stage 1", "stage 2"]
    for line, ops in zip(lines, plan.stages):
        assert len(line.split()) - 2 == len(ops)
    assert "R0n" in lines[0] and "sr0n" in lines[0] and "rr0n" in lines[1]


def test_ref_modes_listed():
    assert REF_MODES == ("interleaved", "sequential", "precomputed", "none")
