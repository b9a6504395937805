"""The interleaved 1F1B schedule (virtual pipeline stages, `--vpp`) as a plan.

With v model chunks per pipeline rank, chunk c of stage s is virtual stage c*p + s of a
pipeline of p*v stages folded onto p ranks: activations go from stage s to s+1 within a
chunk, and from the last stage's chunk c to stage 0's chunk c+1 (the wrap-around link);
gradients go the other way. Each chunk holds 1/v of a stage's layers, so an op of a v-chunk
plan costs 1/v of one of a plain plan (`chunk_costs`), and the warm-up and cool-down bubble
shrinks from about (p-1)/m of a step to about (p-1)/(v*m).

The policy order per stage is megatron-core's `forward_backward_pipelining_with_interleaving`
with its default `microbatch_group_size_per_vp_stage` = p: forwards run through the table
of groups of p microbatches, each group through every chunk in turn; backwards in the same
table with the chunks reversed; stage s runs 2*(p-s-1) + (v-1)*p forwards before its first
backward. megatron-core refuses a microbatch count that is not a multiple of p for this
group size (`check_microbatches`).

Reference modes as in `pipeline/schedule.py`: "none"/"precomputed" policy only;
"sequential" a forward-only reference pass first (in table order); "interleaved" the
reference forwards (the next batch's, and this batch's with `ref_current`) go into the
idle time of the policy schedule, whose order stays megatron-core's. Candidates: a list
scheduler in time (`_fill`: idle time, or also policy slack for a few target step times, a
few limits on the reference activations in flight) and, for the next batch alone, each
forward in the latest idle slot, last virtual stage first (`_interleave_late`); the fastest
few are paired for rendezvous transfers and the fastest paired plan within
`max_in_flight(v)` is kept.

Carrying (`carry_out` / `carry_in`), as in one-chunk plans, by `plan.carried` and `plan.kept`
with chunks: stage s idles s chunk forwards at the start of a step before its first policy
forward arrives, so a carrying step leaves the next batch's reference forwards of its last s
microbatches through its LAST chunk (the last lap round the ring, virtual stages (v-1)p + s)
to the start of the next step, and stage s-1 keeps its last-chunk output for the first of
them (KEEP_REF_ACT, chunk v-1) instead of sending it. These reference activations have passed
(v-1)p + s - 1 virtual stages; the next step opens stage s's list with the carried forwards
and stage s-1's with sending the kept one (SEND_KEPT_REF_ACT). No earlier chunk carries:
what chunk c < v-1 carried, every virtual stage after it would carry too, stage 0's chunk
c+1 among them, and stage 0 has no warm-up idle time. Simulated at unit costs (F=1, B=2,
refF=1, each chunk op 1/v) a steady carrying step takes 0.92x-1.00x of the same step
without carrying at p 2/4/8, m 8/16/32, v 2/4, never more.

Look at a plan:  python -c "from mcore_dpo.pipeline.schedule import *; print(format_plan(
build_plan(num_stages=2, num_microbatches=4, num_chunks=2, ref_mode='interleaved')))"
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable

from mcore_dpo.pipeline.check import timeline
from mcore_dpo.pipeline.plan import (
    COMPUTE_KINDS,
    MAX_REF_ACTS_IN_FLIGHT,
    Costs,
    Op,
    OpKind,
    Plan,
    PlanError,
    carried,
    cost_of,
    kept,
    virtual_neighbour,
)
from mcore_dpo.pipeline.list_schedule import (
    add_comm,
    expected_ref_batches,
    latest_starts,
    paired,
    run_events,
    smallest_fit,
)


_FINALISTS = 4  # candidate plans paired and timed again


def check_microbatches(*, num_stages: int, num_microbatches: int, num_chunks: int) -> None:
    """Raise PlanError (one line) unless megatron-core's interleaved schedule takes this count."""
    if num_chunks > 1 and num_stages < 2:
        raise PlanError(f"--vpp {num_chunks} needs pipeline parallelism (pp >= 2), got pp {num_stages}")
    if num_chunks > 1 and num_microbatches % num_stages:
        raise PlanError(f"--vpp {num_chunks}: the microbatch count ({num_microbatches}) must be a multiple of pp "
                        f"({num_stages}), as megatron-core's interleaved 1F1B needs with its microbatch group of pp")


def max_in_flight(num_chunks: int) -> int:
    """The most reference activations a v-chunk plan leaves on one link: MAX_REF_ACTS_IN_FLIGHT
    for each of the v virtual links folded onto it."""
    return MAX_REF_ACTS_IN_FLIGHT * num_chunks


def chunk_costs(costs: Costs, num_chunks: int) -> Costs:
    """Op costs of a v-chunk plan from those of a whole stage: compute / v, the same comm."""
    return Costs(fwd=costs.fwd / num_chunks, bwd=costs.bwd / num_chunks, ref_fwd=costs.ref_fwd / num_chunks,
                 comm=costs.comm)


def schedule_table(*, num_stages: int, num_microbatches: int, num_chunks: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) of each forward, in order (megatron-core's `get_schedule_table`)."""
    group = num_stages
    return [(mb, chunk) for start in range(0, num_microbatches, group) for chunk in range(num_chunks)
            for mb in range(start, min(start + group, num_microbatches))]


def interleaved_1f1b(*, stage: int, num_stages: int, num_microbatches: int, num_chunks: int) -> list[Op]:
    """Policy compute ops of one stage in megatron-core's interleaved 1F1B order."""
    p, v = num_stages, num_chunks
    table = schedule_table(num_stages=p, num_microbatches=num_microbatches, num_chunks=v)
    total = len(table)
    warmup = min(2 * (p - stage - 1) + (v - 1) * p, total)
    forwards = [Op(OpKind.FWD, mb, chunk=chunk) for mb, chunk in table]
    backwards = [Op(OpKind.BWD, mb, chunk=v - 1 - chunk) for mb, chunk in table]
    ops = forwards[:warmup]
    for k in range(total - warmup):
        ops += [forwards[warmup + k], backwards[k]]
    return ops + backwards[total - warmup:]


def _fill(
    chains: list[list[Op]], refs: list[list[Op]], *, costs: Costs, num_chunks: int, max_in_flight: int,
    latest: dict | None, sources: dict, kept_in: set, kept_out: set,
) -> list[list[Op]]:
    """List-schedule each stage's reference forwards `refs[s]` (in order) into the idle time
    of its policy chain (never reordered), simulating in time: a free stage starts its next
    policy op once its input is there, else its next reference forward whose input is there,
    while fewer than `max_in_flight` of its reference activations wait downstream. With
    `latest` (`list_schedule.latest_starts`), a reference forward goes first where the policy op has the
    slack for it. This batch's reference (batch 0) feeds the loss, so REF(mb, c) joins the
    chain right before FWD(mb, c) if it has not run yet. Carrying: `kept_in` holds the (stage,
    op) whose outputs the last step kept (sent first thing, so in flight from the start),
    `kept_out` those whose outputs this step keeps instead of sending."""
    p, v = len(chains), num_chunks
    end: dict[tuple[int, Op], float] = {}
    chain_pos, free_at = [0] * p, [0.0] * p
    waiting = [sum(stage == s for stage, _ in kept_in) for s in range(p)]
    # `sources`: each op's input, (stage, op) -> (producer, comm), shared by the calls of one build
    orders: list[list[Op]] = [[] for _ in range(p)]
    events = [0.0]

    def neighbour(s: int, op: Op, step: int) -> tuple[int, int] | None:
        return virtual_neighbour(s, op.chunk, step=step, num_stages=p, num_chunks=v)

    def input_time(s: int, op: Op) -> float | None:
        """When op's input is on stage s (None: its producer has not run yet)."""
        if (s, op) not in sources:
            sources[(s, op)] = source(s, op)
        src, comm = sources[(s, op)]
        if src is None:
            return comm
        return end[src] + comm if src in end else None

    def source(s: int, op: Op) -> tuple[tuple[int, Op] | None, float]:
        """(stage, op) whose output op takes as input (None: none), and the comm time from it."""
        if op.kind is OpKind.BWD:
            down = neighbour(s, op, 1)
            src = (s, dataclasses.replace(op, kind=OpKind.FWD)) if down is None else \
                (down[0], dataclasses.replace(op, chunk=down[1]))
            return src, 0.0 if down is None else costs.comm
        up = neighbour(s, op, -1)
        if up is None:
            return None, 0.0
        src = (up[0], dataclasses.replace(op, chunk=up[1]))
        return (None, costs.comm) if src in kept_in else (src, costs.comm)

    def start(s: int, op: Op, t: float) -> None:
        end[(s, op)] = free_at[s] = t + cost_of(op.kind, costs)
        orders[s].append(op)
        if op.kind is OpKind.REF_FWD:
            up, down = neighbour(s, op, -1), neighbour(s, op, 1)
            waiting[s] += down is not None and (s, op) not in kept_out
            if up is not None:
                waiting[up[0]] -= 1
        heapq.heappush(events, free_at[s])
        heapq.heappush(events, free_at[s] + costs.comm)

    def blocked(s: int, op: Op) -> bool:
        """Whether op's output would go over the limit of its link. Stage 0 may always take one
        off the wrap-around link: that link closes a ring, in which every link could otherwise be
        full and wait for the next (only chunk 0 on stage 0 brings new ones into the ring)."""
        down = neighbour(s, op, 1)
        return down is not None and waiting[s] >= max_in_flight and not (s == 0 and op.chunk > 0)

    pending = [list(stage_refs) for stage_refs in refs]  # each stage's reference forwards not run yet

    def visit(s: int, t: float) -> None:
        head = chains[s][chain_pos[s]] if chain_pos[s] < len(chains[s]) else None
        own = head is not None and head.kind is OpKind.FWD and Op(OpKind.REF_FWD, head.microbatch, 0, chunk=head.chunk)
        if own and own in pending[s]:  # forced: the loss needs it, and so it runs first
            if (ready := input_time(s, own)) is not None and ready <= t:
                start(s, own, t)
                pending[s].remove(own)
            return
        ref = next((op for op in pending[s] if not blocked(s, op)
                    and (ready := input_time(s, op)) is not None and ready <= t), None)
        head_ready = head is not None and (ready := input_time(s, head)) is not None and ready <= t
        slack = latest is not None and head is not None and latest[(s, head)] >= t + costs.ref_fwd
        if head_ready and not (ref is not None and slack):
            start(s, head, t)
            chain_pos[s] += 1
        elif ref is not None:
            start(s, ref, t)
            pending[s].remove(ref)

    run_events(events, free_at, visit=visit,
               busy=lambda: any(pos < len(chain) for pos, chain in zip(chain_pos, chains)) or any(pending))
    return orders


def _place_late(
    chains: list[list[Op]], times: list[list[tuple[float, float]]], refs: Callable[[int, int], list[Op]], *,
    costs: Costs, num_chunks: int, makespan: float,
) -> list[list[Op]] | None:
    """Fit the reference forwards `refs(stage, chunk)` (in order) into the idle time
    of the policy ops at `times`, all ending by `makespan`; None: no fit. From the last virtual
    stage back to the first, each takes the latest idle slot of its stage that ends before the
    same forward starts one virtual stage downstream and before the next one on its own
    virtual stage, which leaves the stages upstream the most room."""
    p, v, dur = len(chains), num_chunks, costs.ref_fwd
    eps = 1e-9 * max(1.0, makespan)
    free = []  # per stage: idle [start, end] intervals, earliest first
    for stage_times in times:
        gaps, busy_until = [], 0.0
        for begin, end in stage_times:
            if begin - busy_until > eps:
                gaps.append([busy_until, begin])
            busy_until = max(busy_until, end)
        free.append(gaps + [[busy_until, makespan]])
    starts: dict[tuple[int, Op], float] = {}
    for index in reversed(range(p * v)):
        s, chunk = index % p, index // p
        down = virtual_neighbour(s, chunk, step=1, num_stages=p, num_chunks=v)
        limit = makespan
        for ref in reversed(refs(s, chunk)):
            # The same forward downstream, unless it is carried to the next step (then this one is kept).
            after = None if down is None else starts.get((down[0], dataclasses.replace(ref, chunk=down[1])))
            due = limit if after is None else min(limit, after - costs.comm)
            slot = next((gap for gap in reversed(free[s]) if min(due, gap[1]) - gap[0] >= dur - eps), None)
            if slot is None:
                return None
            begin = min(due, slot[1]) - dur
            if slot[1] - (begin + dur) > eps:  # the slot splits: the part after the forward stays idle
                free[s].insert(free[s].index(slot) + 1, [begin + dur, slot[1]])
            slot[1] = begin
            starts[(s, ref)] = limit = begin
    orders = []
    for s in range(p):
        timed = [(begin, 0, i, op) for i, (op, (begin, _)) in enumerate(zip(chains[s], times[s]))]
        timed += [(begin, 1, i, op) for i, ((stage, op), begin) in enumerate(starts.items()) if stage == s]
        orders.append([op for *_, op in sorted(timed)])
    return orders


def _interleave_late(
    chains: list[list[Op]], refs: Callable[[int, int], list[Op]], *, costs: Costs, num_chunks: int,
    policy_plan: Plan, late: bool, count: int,
) -> list[list[Op]]:
    """`_place_late` at the smallest makespan that fits (bisected), the policy ops at their
    simulated times or (`late`) as late as the policy-only makespan allows; `count` reference
    forwards per virtual stage at most (what bounds the search)."""
    run = timeline(policy_plan.stages, costs)
    if late:
        latest = latest_starts(chains, costs=costs, num_chunks=num_chunks, makespan=run.makespan)
        times = [[(latest[(s, op)], latest[(s, op)] + cost_of(op.kind, costs)) for op in ops]
                 for s, ops in enumerate(chains)]
    else:
        times = [[t for op, t in zip(ops, run.op_times[s]) if op.kind in COMPUTE_KINDS]
                 for s, ops in enumerate(policy_plan.stages)]

    def fit(makespan: float) -> list[list[Op]] | None:
        return _place_late(chains, times, refs, costs=costs, num_chunks=num_chunks, makespan=makespan)
    high = run.makespan + count * num_chunks * len(chains) * (costs.ref_fwd + costs.comm)
    return smallest_fit(fit, low=run.makespan, high=high, tolerance=1e-3 * costs.ref_fwd)


def build_interleaved(
    *, num_stages: int, num_microbatches: int, num_chunks: int, ref_mode: str, ref_current: bool, ref_next: bool,
    carry_in: bool, carry_out: bool, costs: Costs, pair_transfers: bool = True,
    num_next_microbatches: int | None = None,
) -> Plan:
    """`schedule.build_plan` with `num_chunks` > 1 (its arguments are checked there)."""
    p, m, v = num_stages, num_microbatches, num_chunks
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"num_chunks must be an int >= 1, got {v!r}")
    check_microbatches(num_stages=p, num_microbatches=m, num_chunks=v)
    ref_batches = expected_ref_batches(ref_mode, ref_current, ref_next)
    m_next = m if num_next_microbatches is None else num_next_microbatches
    rule = dict(num_stages=p, num_chunks=v)

    def carried_at(s: int, chunk: int, count: int) -> range:
        return carried(s, num_microbatches=count, chunk=chunk, **rule)

    # Carried-in reference forwards open each stage's list: its warm-up idle time (`plan.carried`).
    chains = [[Op(OpKind.REF_FWD, mb, 0, chunk=c) for c in range(v) for mb in (carried_at(s, c, m) if carry_in else ())]
              + interleaved_1f1b(stage=s, num_stages=p, num_microbatches=m, num_chunks=v) for s in range(p)]
    # (stage, reference forward) whose output the last step kept / this step keeps, for the next step
    kept_in = {(s, Op(OpKind.REF_FWD, mb, 0, chunk=c)) for s in range(p) for c in range(v)
               for mb in (kept(s, num_microbatches=m, chunk=c, **rule) if carry_in else ())}
    kept_out = {(s, Op(OpKind.REF_FWD, mb, 1, chunk=c)) for s in range(p) for c in range(v)
                for mb in (kept(s, num_microbatches=m_next, chunk=c, **rule) if carry_out else ())}

    def runs_here(s: int, op: Op) -> bool:
        """Whether stage s runs this reference forward in this step (not carried out to the next)."""
        return not (carry_out and op.batch == 1 and op.microbatch in carried_at(s, op.chunk, m_next))

    def refs_of(batch: int) -> list[Op]:
        count = m if batch == 0 else m_next
        return [Op(OpKind.REF_FWD, mb, batch, chunk=chunk)
                for mb, chunk in schedule_table(num_stages=p, num_microbatches=count, num_chunks=v)]
    refs = [op for batch in ref_batches for op in refs_of(batch)]
    # Fillers go earliest chunk first: stage 0 can run all its chunk-0 ones before the ring returns.
    fillers = sorted(refs, key=lambda op: (op.batch, op.chunk, op.microbatch))

    def plan_of(orders: list[list[Op]]) -> Plan:
        stages = add_comm(orders, num_microbatches=m, num_next_microbatches=num_next_microbatches, num_chunks=v,
                          carry_in=carry_in, carry_out=carry_out)
        return Plan(p, m, ref_mode, stages, ref_batches, carry_in, carry_out, num_next_microbatches, v)

    if ref_mode != "interleaved" or not refs:
        candidates = [plan_of([refs + chain for chain in chains])]  # policy only, or the reference pass first
    else:
        # Reference forwards where the policy idles, or also where it has slack for a target
        # step time of policy-only plus some of the reference work (a few targets, the fastest kept).
        policy_time = timeline(plan_of(chains).stages, costs).makespan
        work = len(refs) * costs.ref_fwd
        latests = [None] + [latest_starts(chains, costs=costs, num_chunks=v, makespan=policy_time + share * work)
                            for share in (0.0, 0.5, 1.0)]
        sources: dict = {}
        stage_fillers = [[op for op in fillers if runs_here(s, op)] for s in range(p)]
        candidates = [plan_of(_fill(chains, stage_fillers, costs=costs, num_chunks=v, max_in_flight=limit,
                                    latest=latest, sources=sources, kept_in=kept_in, kept_out=kept_out))
                      for limit in sorted({1, MAX_REF_ACTS_IN_FLIGHT, max_in_flight(v)}) for latest in latests]
        if 0 not in ref_batches:  # this batch's reference gates the loss: left to _fill

            def refs_at(s: int, chunk: int) -> list[Op]:
                return [op for op in refs if op.chunk == chunk and runs_here(s, op)]
            candidates += [plan_of(_interleave_late(chains, refs_at, costs=costs, num_chunks=v,
                                                    policy_plan=plan_of(chains), late=late, count=len(refs)))
                           for late in (True, False)]
    if not pair_transfers:
        return candidates[0]
    # Pairing makes some stages post receives early and wait in them, so the fastest unpaired
    # plan need not stay the fastest: pair the few fastest and keep the best of those.
    runs = [timeline(plan.stages, costs) for plan in candidates]
    order = sorted(range(len(candidates)), key=lambda i: (runs[i].max_ref_acts_in_flight > max_in_flight(v),
                                                          runs[i].makespan, i))
    finalists = [paired(candidates[i], costs=costs) for i in order[:_FINALISTS]]
    runs = [timeline(plan.stages, costs) for plan in finalists]
    best = min(range(len(finalists)), key=lambda i: (runs[i].max_ref_acts_in_flight > max_in_flight(v),
                                                    runs[i].makespan, runs[i].max_ref_acts_in_flight, i))
    return finalists[best]
