"""Point-to-point transfers under rendezvous semantics: a send completes only once the peer
has posted the matching receive (NCCL with large messages), messages on a link are matched
in order, and a rank runs its ops one after the other.

The unpaired plans (every send right after its producer, every receive right before its
consumer) are what the engine ran while sends were buffered; `schedule._build_plan(...,
pair_transfers=False)` still builds them, so that these tests can show the validator
rejects them and that the real transfer code hangs on them over gloo.
"""

from __future__ import annotations

import datetime
import traceback
from functools import lru_cache
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from mcore_dpo.parallel.ports import free_port
from mcore_dpo.pipeline import schedule
from mcore_dpo.parallel.mesh import Layout, Mesh
from mcore_dpo.pipeline.executor import PeerError, StageContext, transfer
from mcore_dpo.pipeline.plan import Costs, Op, OpKind, Plan, PlanError, format_plan, transfers
from mcore_dpo.pipeline.check import (
    every_compute_op,
    every_forward,
    timeline,
    validate_host_device,
    validate_plan,
    validate_stages,
)
from mcore_dpo.pipeline.list_schedule import PREFER, pair_crossing_transfers
from mcore_dpo.pipeline.schedule import build_plan, forward_only_stages
from tests.helpers.ranks import rank_context, start_forked

# (ref_mode, ref_current, ref_next, carry_in, carry_out): every kind of step a run builds.
CASES = [
    ("none", False, True, False, False),
    ("precomputed", False, True, False, False),
    ("sequential", False, True, False, False),
    ("interleaved", False, False, False, False),
    ("interleaved", False, True, False, False),
    ("interleaved", True, False, False, False),
    ("interleaved", True, True, False, False),
    ("interleaved", True, True, False, True),  # first step of a carrying run
    ("interleaved", False, True, True, True),  # steady carrying step
    ("interleaved", False, False, True, False),  # last carrying step
]


def _kwargs(p: int, m: int, case: tuple) -> dict:
    mode, current, next_, carry_in, carry_out = case
    return dict(num_stages=p, num_microbatches=m, ref_mode=mode, ref_current=current, ref_next=next_,
                carry_in=carry_in, carry_out=carry_out)


@lru_cache(maxsize=None)
def unpaired(p: int, m: int, case: tuple = CASES[0]) -> Plan:
    return schedule._build_plan(**_kwargs(p, m, case), costs=Costs(), pair_transfers=False)


def rejected(plan: Plan) -> str:
    with pytest.raises(PlanError) as info:
        validate_plan(plan)
    return str(info.value)


# ----------------------------------------------------------------------------- the validator


def test_unpaired_plans_deadlock_where_peers_send_to_each_other():
    # Plain 1F1B, p=2, m=4: stage 0 sends act 1 while stage 1 sends grad 0.
    plan = unpaired(2, 4)
    assert format_plan(plan).splitlines()[0].startswith("stage 0: F0 sa0 F1 sa1 rg0 B0")
    assert rejected(plan) == ("plan deadlock under rendezvous transfers: stage 0 waits at op 3 (sa1) for stage 1, "
                              "which waits at op 3 (sg0)")
    # Interleaved p=4, m=8: a reference activation sent against a grad.
    message = rejected(unpaired(4, 8, CASES[4]))
    assert message == ("plan deadlock under rendezvous transfers: stage 2 waits at op 5 (sr0n) for stage 3, "
                       "which waits at op 3 (sg0)")
    # With buffered sends (gloo, or what the old validator assumed) they ran to the end.
    assert timeline(plan.stages, Costs()).makespan == 15.0


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_every_unpaired_plan_with_two_microbatches_or_more_is_rejected(p):
    for m in (2, 3, 8):
        for case in CASES:
            assert "deadlock under rendezvous" in rejected(unpaired(p, m, case)), (p, m, case)
    for case in CASES:  # one microbatch: only a next-batch reference activation can cross a grad
        crossing = case[0] == "interleaved" and case[2] and not case[4]  # next batch's reference, not carried
        old, new = unpaired(p, 1, case), build_plan(**_kwargs(p, 1, case))
        assert (old != new) == crossing, case
        if not crossing:
            validate_plan(old)


def sweep(*, stages, microbatches) -> int:
    """Build and validate every kind of plan for these sizes; returns how many."""
    count = 0
    for p in stages:
        for m in microbatches:
            for case in CASES:
                plan = build_plan(**_kwargs(p, m, case))
                validate_plan(plan)
                if p == 1:
                    assert not any(transfers(op) for ops in plan.stages for op in ops)
                count += 1
    return count


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_plans_with_many_microbatches_are_accepted(p):
    # test_schedule.py validates every mode for p <= 8, m <= 16; here up to 32. The whole
    # grid (p <= 8, m <= 32, every case) is `python tests/test_p2p_plan.py`.
    assert sweep(stages=[p], microbatches=[32] if p > 2 else [24, 32]) > 0


def test_pairing_keeps_what_the_old_plan_did():
    # Same compute order, same messages in the same order per link; only when transfers
    # are posted changes. The steady 1F1B state pairs like megatron-core's p2p helpers.
    for p, m, case in [(2, 4, CASES[0]), (4, 8, CASES[4]), (3, 5, CASES[8]), (8, 16, CASES[6])]:
        old, new = unpaired(p, m, case), build_plan(**_kwargs(p, m, case))
        for s in range(p):
            assert [op for op in old.stages[s] if not transfers(op)] == [op for op in new.stages[s] if not transfers(op)]
            flat = [part for op in new.stages[s] for part in transfers(op)]
            assert sorted(flat, key=repr) == sorted([op for op in old.stages[s] if transfers(op)], key=repr)
            for link_kind in (OpKind.SEND_ACT, OpKind.RECV_GRAD, OpKind.RECV_REF_ACT):
                assert ([op for op in flat if op.kind == link_kind]
                        == [op for op in old.stages[s] if op.kind == link_kind])
    assert format_plan(build_plan(num_stages=2, num_microbatches=3, ref_mode="none")).splitlines() == [
        "stage 0: F0 sa0 F1 [sa1+rg0] B0 F2 [sa2+rg1] B1 rg2 B2",
        "stage 1: ra0 F0 B0 [sg0+ra1] F1 B1 [sg1+ra2] F2 B2 sg2",
    ]


@pytest.mark.parametrize("prefer", PREFER)
def test_each_pairing_rule_gives_a_valid_plan(prefer):
    for p, m, case in [(2, 4, CASES[0]), (4, 8, CASES[6]), (3, 7, CASES[8]), (6, 9, CASES[2])]:
        old = unpaired(p, m, case)
        validate_plan(Plan(old.num_stages, old.num_microbatches, old.ref_mode,
                           pair_crossing_transfers(old.stages, prefer=prefer), old.ref_batches, old.carry_in,
                           old.carry_out))


def test_forward_only_chains_need_no_pairing():
    for p in range(1, 9):
        for m in (1, 2, 3, 5, 8, 32):
            for policy, reference in [(True, True), (True, False), (False, True)]:
                stages = forward_only_stages(num_stages=p, num_microbatches=m, policy=policy, reference=reference)
                validate_stages(stages)
                assert pair_crossing_transfers(stages) == stages


def test_validate_stages_rules():
    f, b, sa, ra, sg, rg = (Op(OpKind.FWD, 0), Op(OpKind.BWD, 0), Op(OpKind.SEND_ACT, 0), Op(OpKind.RECV_ACT, 0),
                            Op(OpKind.SEND_GRAD, 0), Op(OpKind.RECV_GRAD, 0))
    f1, sa1, ra1 = Op(OpKind.FWD, 1), Op(OpKind.SEND_ACT, 1), Op(OpKind.RECV_ACT, 1)
    crossing = ((f, sa, f1, sa1, rg, b), (ra, f, b, sg, ra1, f1))
    with pytest.raises(PlanError, match="deadlock under rendezvous"):
        validate_stages(crossing)
    paired = ((f, sa, f1, Op(OpKind.P2P, -1, 0, (sa1, rg)), b), (ra, f, b, Op(OpKind.P2P, -1, 0, (sg, ra1)), f1))
    validate_stages(paired)
    assert pair_crossing_transfers(crossing) in {paired, ((f, sa, f1, sa1, rg, b), (ra, f, b, paired[1][3], f1))}
    with pytest.raises(PlanError, match="two or more"):
        validate_stages(((f, Op(OpKind.P2P, -1, 0, (sa,))), (ra, f)))
    with pytest.raises(PlanError, match="two or more"):
        validate_stages(((f, Op(OpKind.P2P, -1, 0, (sa, f1))), (ra, f)))
    with pytest.raises(PlanError, match="sent as"):
        validate_stages(((f, sa1), (ra, f)))
    with pytest.raises(PlanError, match="1 messages sent, 0 received"):
        validate_stages(((f, sa), (f,)))
    with pytest.raises(PlanError, match="has no peer"):
        validate_stages(((ra, f),))


# ----------------------------------------------------------------------------- host and GPU (NCCL's lazy connections)


def _hangs(plan: Plan, *, warmed_up: bool, syncs) -> bool:
    try:
        validate_host_device(plan.stages, warmed_up=warmed_up, syncs=syncs)
    except PlanError as error:
        assert "hangs under the host/GPU model" in str(error)
        return True
    return False


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
def test_with_warmed_up_links_every_plan_passes_the_host_device_model_whatever_syncs(p):
    """Every kind of step, m <= 32, unequal next-batch counts, with every compute op syncing
    the host (the worst case: a MoE forward syncs in megatron-core's token dispatcher; its aux
    counts ride on the act and grad messages, `rank/moe_step.py`) or none."""
    for m in (1, 2, 3, 4, 7, 8, 16, 32):
        for case in CASES:
            plan = build_plan(**_kwargs(p, m, case))
            for syncs in (every_compute_op, every_forward, lambda s, op: False):
                assert not _hangs(plan, warmed_up=True, syncs=syncs), (p, m, case)
    for m, m_next in ((1, 3), (2, 5), (5, 2), (8, 3), (3, 8), (32, 17)):
        for current, carry_in, carry_out in ((True, False, True), (False, True, True), (False, True, False),
                                             (False, False, False), (True, False, False)):
            plan = build_plan(num_stages=p, num_microbatches=m, num_next_microbatches=m_next, ref_mode="interleaved",
                              ref_current=current, ref_next=True, carry_in=carry_in, carry_out=carry_out)
            validate_plan(plan)  # runs the host/GPU model with warmed-up links, every compute op syncing
            assert not _hangs(plan, warmed_up=True, syncs=every_compute_op), (p, m, m_next)


def test_without_warm_up_first_step_plans_hang_when_forwards_sync():
    """The first step of a run (no carried reference), p in {2, 4, 8}, m in {1, 2, ..., 32}:
    144 plans. Without warm-up, the first message on each link blocks both hosts until the
    peer's host posts its partner; a forward that syncs holds its host until its GPU has
    delivered an earlier message, which may wait for a peer host that waits in a handshake."""
    first_step = [case for case in CASES if not case[3]]
    plans = {(p, m, case): build_plan(**_kwargs(p, m, case)) for p in (2, 4, 8) for m in (1, 2, 4, 8, 16, 32)
             for case in first_step}
    assert len(plans) == 144
    hanging = {key for key, plan in plans.items() if _hangs(plan, warmed_up=False, syncs=every_forward)}
    assert len(hanging) == 37
    # Only steps that run the next batch's reference in the bubbles hang: p 2 from m 2, p 4 from m 4, p 8 from m 4.
    assert {(p, m) for p, m, _ in hanging} == {(2, m) for m in (2, 4, 8, 16, 32)} | {
        (4, m) for m in (4, 8, 16, 32)} | {(8, m) for m in (4, 8, 16, 32)}
    assert all(case[0] == "interleaved" and case[2] for _, _, case in hanging)
    # None when only the last stage syncs (its log-probs), none when nothing syncs, none warmed up.
    last_only = [key for key, plan in plans.items()
                 if _hangs(plan, warmed_up=False, syncs=lambda s, op, p=key[0]: s == p - 1 and every_forward(s, op))]
    assert last_only == []
    assert not any(_hangs(plan, warmed_up=False, syncs=lambda s, op: False) for plan in plans.values())
    assert not any(_hangs(plan, warmed_up=True, syncs=every_forward) for plan in plans.values())
    plan = build_plan(num_stages=2, num_microbatches=2, ref_mode="interleaved")
    assert format_plan(plan).splitlines() == ["stage 0: F0 sa0 F1 sa1 R0n sr0n rg0 B0 R1n sr1n rg1 B1",
                                              "stage 1: ra0 F0 B0 [sg0+ra1+rr0n] F1 B1 [sg1+rr1n] R0n R1n"]
    with pytest.raises(PlanError) as info:
        validate_host_device(plan.stages, warmed_up=False, syncs=every_forward)
    assert str(info.value) == (
        "plan hangs under the host/GPU model without warmed-up links: host 0 waits at op 4 (R0n) for its GPU "
        "(GPU 0 waits at op 3 (sa1) for stage 1); host 1 waits at op 3 ([sg0+ra1+rr0n]) to connect link 1->0")
    validate_host_device(plan.stages, warmed_up=True, syncs=every_forward)


# ----------------------------------------------------------------------------- the real transfer code on gloo


def _code(payload: str, mb: int, batch: int) -> float:
    return {"act": 1.0, "grad": -1.0, "ref_act": 1000.0}[payload] * (mb + 1) + 100.0 * batch


def _stage_process(rank: int, stages, port: int, timeout_s: float, results) -> None:
    """Run one stage's ops with the pipeline's transfer code; compute ops only check what
    arrived and produce a tensor that names its message."""
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(stages),
                                timeout=datetime.timedelta(seconds=timeout_s))
        p = len(stages)
        mesh = Mesh(layout=Layout(tp=1, pp=p, dp=1), rank=rank, tp_rank=0, pp_rank=rank, dp_rank=0, tp_group=None,
                    pp_group=None, dp_group=None, model_parallel_group=None,
                    prev_rank=rank - 1 if rank > 0 else None, next_rank=rank + 1 if rank < p - 1 else None,
                    embedding_group=None)
        micro = [SimpleNamespace(tokens=torch.zeros(2, 8))] * 16
        ctx = StageContext(mesh=mesh, policy=None, reference=None, microbatches={0: micro, 1: micro}, hidden_size=4,
                           dtype=torch.float32, device=torch.device("cpu"), vocab_size=0)
        checked = 0

        def arrived(tensor: torch.Tensor, *code) -> None:
            nonlocal checked
            assert torch.all(tensor == _code(*code)), (rank, code)
            checked += 1

        def make(*code) -> torch.Tensor:
            return torch.full((8, 2, 4), _code(*code))

        for op in stages[rank]:  # the executor's scratch is keyed by model chunk (0: none) first
            mb, batch, chunk = op.microbatch, op.batch, op.chunk
            if op.kind is OpKind.FWD:
                if rank > 0:
                    arrived(ctx._policy_in.pop((chunk, mb)), "act", mb, 0)
                if rank < p - 1:
                    ctx._policy_out[(chunk, mb)] = make("act", mb, 0)
            elif op.kind is OpKind.BWD:
                if rank < p - 1:
                    arrived(ctx._grad_in.pop((chunk, mb)), "grad", mb, 0)
                if rank > 0:
                    ctx._grad_out[(chunk, mb)] = make("grad", mb, 0)
            elif op.kind is OpKind.REF_FWD:
                if rank > 0:
                    arrived(ctx._ref_in.pop((chunk, batch, mb)), "ref_act", mb, batch)
                if rank < p - 1:
                    ctx._ref_out[(chunk, batch, mb)] = make("ref_act", mb, batch)
            else:
                transfer(ctx, op)
        results.put((rank, "ok", checked))
    except PeerError as error:
        results.put((rank, "peer", str(error)))
    except Exception:  # noqa: BLE001 - reported to the test
        results.put((rank, "crash", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_stages(stages, *, timeout_s: float) -> dict[int, tuple[str, object]]:
    results = rank_context("fork").Queue()
    port = free_port()
    procs = start_forked(_stage_process, nprocs=len(stages), args_of=lambda r: (r, stages, port, timeout_s, results))
    out = {}
    for _ in procs:
        rank, status, detail = results.get(timeout=timeout_s + 120)
        out[rank] = (status, detail)
    for proc in procs:
        proc.join(timeout=30)
    return out


def test_gloo_transfers_run_paired_plans_and_hang_on_unpaired_ones():
    # Waiting for each send makes gloo hold it until the peer's receive is posted, so the
    # CPU runs the plan under the same rendezvous semantics as NCCL.
    plan = build_plan(num_stages=3, num_microbatches=4, ref_mode="interleaved", ref_current=True)
    out = _run_stages(plan.stages, timeout_s=60)
    assert {r: status for r, (status, _) in out.items()} == {0: "ok", 1: "ok", 2: "ok"}, out
    # Every message arrived and held what it should: acts and two batches of reference acts
    # downstream, grads upstream.
    assert (out[0][1], out[1][1], out[2][1]) == (4, 4 + 4 + 8, 4 + 8)
    out = _run_stages(unpaired(2, 4).stages, timeout_s=5)
    assert out[0][0] == "peer" and "send_act of microbatch 1 to rank 1" in out[0][1], out
    assert out[1][0] == "peer" and "send_grad of microbatch 0 to rank 0" in out[1][1], out


if __name__ == "__main__":
    import time

    start = time.perf_counter()
    total = sweep(stages=range(1, 9), microbatches=range(1, 33))
    print(f"{total} plans (p <= 8, m <= 32, {len(CASES)} kinds of step) accepted in {time.perf_counter() - start:.0f} s")
