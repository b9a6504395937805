"""Building the pipeline schedule of one training step, as a plan (see `pipeline/plan.py`).

The point of building the schedule as data: the frozen reference forward can be placed
into the bubbles of the policy 1F1B schedule, and the result can be checked
(`validate_plan`) and timed (`simulate`, both in `pipeline/check.py`) without any process.

Reference modes (`REF_MODES`):
- "none" / "precomputed": policy-only 1F1B.
- "sequential": a forward-only reference pass over this batch, then 1F1B.
- "interleaved": reference forwards of the NEXT global batch fill the bubbles
  of this step (batch=1); `ref_current=True` also computes this batch's
  reference (batch=0), needed on the first step and after a resume.

Carrying (interleaved, pp > 1): stage s idles at the start of a 1F1B step
until its first activation arrives, about s forwards. With `carry_out=True` a
step leaves the reference forwards of the next batch's last s microbatches on
stage s (`carried`) to the start of the next step, and stage s-1 keeps its
output for the first of them (KEEP_REF_ACT) instead of sending it. The next
step is built with `carry_in=True`: stage s-1 sends the kept activation first
thing (SEND_KEPT_REF_ACT), and stage s runs the carried reference forwards in
its warm-up idle time. Every message stays inside one step.

Transfers: each send goes right after the op that produced its tensor and each receive
right before its consumer; then `list_schedule.pair_crossing_transfers` makes the lists safe under
rendezvous transfers (a send waits for the matching receive, as on NCCL): where a stage
would wait in a send whose receive its peer has not posted, the peer posts that receive
together with the transfer it waits in (one P2P op), as megatron-core pairs
send_forward_recv_backward. Forward-only passes (`forward_only_stages`) are chains that
need no pairing.

Look at a plan:  python -c "from mcore_dpo.pipeline.schedule import *;
print(format_plan(build_plan(num_stages=4, num_microbatches=8, ref_mode='interleaved')))"

The steps this builder shares with the interleaved one (`pipeline/interleaved.py`, model
chunks, to which `build_plan` hands plans with `num_chunks` > 1) are in `pipeline/list_schedule.py`:
transfer placement and pairing, the event loop, the latest-start pass. The op types are in
plan.py and the checks in check.py.
"""

from __future__ import annotations

import functools
import heapq

from mcore_dpo.pipeline.check import Stages, timeline
from mcore_dpo.pipeline.interleaved import build_interleaved
from mcore_dpo.pipeline.list_schedule import (
    add_comm,
    expected_ref_batches,
    latest_times,
    paired,
    run_events,
    smallest_fit,
)
from mcore_dpo.pipeline.plan import (
    COMPUTE_KINDS,
    MAX_REF_ACTS_IN_FLIGHT,
    REF_MODES,
    Costs,
    Op,
    OpKind,
    Plan,
    carried,
    check_costs,
    cost_of,
)


# ----------------------------------------------------------------------------- building


def _one_f_one_b(*, stage: int, num_stages: int, num_microbatches: int) -> list[Op]:
    """Policy compute ops of one stage in the standard non-interleaved 1F1B order."""
    warmup = min(num_stages - stage - 1, num_microbatches)
    ops = [Op(OpKind.FWD, mb) for mb in range(warmup)]
    for i in range(num_microbatches - warmup):
        ops += [Op(OpKind.FWD, warmup + i), Op(OpKind.BWD, i)]
    ops += [Op(OpKind.BWD, mb) for mb in range(num_microbatches - warmup, num_microbatches)]
    return ops


def _greedy_interleaved(
    *,
    num_stages: int,
    num_microbatches: int,
    ref_batches: tuple[int, ...],
    costs: Costs,
    max_in_flight: int,
    num_next_microbatches: int | None = None,
) -> list[list[Op]]:
    """List-schedule the reference forwards into the idle time of policy 1F1B.

    Time-stepped simulation: a free stage starts its next policy op (1F1B order,
    never reordered) when its inputs have arrived; otherwise it starts the next
    reference forward whose input has arrived. Batch-0 reference forwards are
    needed by the loss, so REF(mb, batch 0) joins the policy chain right before
    FWD(mb) if it has not run yet as a filler. At most `max_in_flight` reference
    activations wait between two stages.
    """
    p, m = num_stages, num_microbatches
    chains = [_one_f_one_b(stage=s, num_stages=p, num_microbatches=m) for s in range(p)]
    m_next = m if num_next_microbatches is None else num_next_microbatches
    refs = [Op(OpKind.REF_FWD, mb, b) for b in ref_batches for mb in range(m if b == 0 else m_next)]
    end: dict[tuple[int, Op], float] = {}  # (stage, op) -> end time, once started
    chain_pos, ref_pos = [0] * p, [0] * p
    free_at = [0.0] * p
    orders: list[list[Op]] = [[] for _ in range(p)]
    events: list[float] = [0.0]

    def input_time(s: int, op: Op) -> float | None:
        """When op's inputs are on stage s (None: producer not started yet)."""
        if op.kind == OpKind.BWD:
            src = (s, Op(OpKind.FWD, op.microbatch)) if s == p - 1 else (s + 1, op)
            comm = 0.0 if s == p - 1 else costs.comm
        else:
            if s == 0:
                return 0.0
            src, comm = (s - 1, op), costs.comm
        return end[src] + comm if src in end else None

    def start(s: int, op: Op, t: float) -> None:
        finish = t + cost_of(op.kind, costs)
        end[(s, op)] = finish
        free_at[s] = finish
        orders[s].append(op)
        heapq.heappush(events, finish)
        heapq.heappush(events, finish + costs.comm)

    def visit(s: int, t: float) -> None:
        head = chains[s][chain_pos[s]] if chain_pos[s] < len(chains[s]) else None
        ref = refs[ref_pos[s]] if ref_pos[s] < len(refs) else None
        forced = (
            head is not None and head.kind == OpKind.FWD
            and ref is not None and ref.batch == 0 and ref.microbatch <= head.microbatch
        )
        if forced:
            head = ref
        if head is not None:
            ready = input_time(s, head)
            if ready is not None and ready <= t:
                start(s, head, t)
                if forced:
                    ref_pos[s] += 1
                else:
                    chain_pos[s] += 1
                return
        if ref is None or forced:
            return
        ref_ready = input_time(s, ref)
        in_flight = ref_pos[s] - ref_pos[s + 1] if s < p - 1 else 0
        if ref_ready is None or ref_ready > t or in_flight >= max_in_flight:
            return
        start(s, ref, t)
        ref_pos[s] += 1

    total = sum(len(c) for c in chains) + p * len(refs)
    run_events(events, free_at, visit=visit, busy=lambda: sum(chain_pos) + sum(ref_pos) < total)
    return orders


def _place_refs_late(
    *, base: list[list[Op]], base_times: list[list[tuple[float, float]]], refs: list[list[Op]], costs: Costs,
    makespan: float,
) -> list[list[Op]] | None:
    """Fit `refs[s]` into the idle time of stage s of a base schedule, each as late as possible.

    The base ops keep their times; all must end by `makespan`. Each stage's list is a prefix
    of the one before it, in the same order (a reference forward that stage s+1 does not
    run in this step is carried over). Going backwards from the last stage, each reference
    forward takes the latest idle slot that ends before the same microbatch starts
    downstream, which leaves upstream stages the most room, so this finds a fit whenever
    one exists for that order. None: no fit.
    """
    num_stages, dur, eps = len(base), costs.ref_fwd, 1e-9 * max(1.0, makespan)
    starts: list[list[float]] = [[0.0] * len(stage_refs) for stage_refs in refs]
    for s in reversed(range(num_stages)):
        # Idle intervals of stage s, earliest first, with the open end cut at `makespan`.
        free, busy_until = [], 0.0
        for start, end in base_times[s]:
            if start - busy_until > eps:
                free.append([busy_until, start])
            busy_until = end
        free.append([busy_until, makespan])
        idx, limit = len(free) - 1, makespan
        downstream = starts[s + 1] if s < num_stages - 1 else []
        for j in reversed(range(len(refs[s]))):
            due = min(limit, downstream[j] - costs.comm) if j < len(downstream) else limit
            while idx >= 0 and min(due, free[idx][1]) - free[idx][0] < dur - eps:
                idx -= 1
            if idx < 0:
                return None
            begin = min(due, free[idx][1]) - dur
            free[idx][1] = begin
            starts[s][j] = limit = begin
    orders = []
    for s in range(num_stages):
        timed = [(start, 0, i, op) for i, (op, (start, _)) in enumerate(zip(base[s], base_times[s]))]
        timed += [(starts[s][j], 1, j, op) for j, op in enumerate(refs[s])]
        orders.append([op for *_, op in sorted(timed)])
    return orders


def _interleave_late(
    *, base: list[list[Op]], refs: list[list[Op]], costs: Costs, late_base: bool, num_microbatches: int,
    carry_in: bool,
) -> list[list[Op]]:
    """Reference forwards `refs[s]` in the bubbles of stage s of the base schedule, for the
    smallest makespan that fits.

    `late_base`: run the base ops as late as its own makespan allows (else as early
    as possible) before looking for idle time.
    """
    base_plan = add_comm(base, num_microbatches=num_microbatches, carry_in=carry_in)
    run = timeline(base_plan, costs)
    if late_base:
        base_times = latest_times(base, costs=costs, makespan=run.makespan)
    else:
        base_times = [[t for op, t in zip(ops, run.op_times[s]) if op.kind in COMPUTE_KINDS]
                      for s, ops in enumerate(base_plan)]

    def fit(makespan: float) -> list[list[Op]] | None:
        return _place_refs_late(base=base, base_times=base_times, refs=refs, costs=costs, makespan=makespan)

    high = run.makespan + (max(map(len, refs)) + len(base)) * (costs.ref_fwd + costs.comm)  # all refs after the base
    return smallest_fit(fit, low=run.makespan, high=high, tolerance=1e-6 * costs.ref_fwd)


def build_plan(
    *,
    num_stages: int,
    num_microbatches: int,
    ref_mode: str,
    ref_current: bool = False,
    ref_next: bool = True,
    carry_in: bool = False,
    carry_out: bool = False,
    costs: Costs = Costs(),
    num_next_microbatches: int | None = None,
    num_chunks: int = 1,
) -> Plan:
    """Plan one training step; `ref_current`/`ref_next` and carrying only matter for
    "interleaved" (see the module docstring). With one stage there is nothing to carry and
    the plan's carry flags stay False.

    `costs` guide where the interleaved scheduler puts reference forwards; the
    plan is valid whatever the real durations turn out to be. Plans are immutable and
    memoized: a run asks for the same few plans every step.

    `num_next_microbatches`: how many microbatches the next global batch has (its reference
    forwards and what is carried out are counted in it); None: as many as this one. With
    token-balanced microbatches the count changes from step to step: a step carries out the
    last microbatches of the next batch by the next batch's count, which is exactly what the
    next step (built with that count as `num_microbatches`) carries in.

    `num_chunks` > 1: model chunks per stage (--vpp), megatron-core's interleaved 1F1B
    (`pipeline/interleaved.py`); every op then names its chunk.
    """
    if num_next_microbatches == num_microbatches:
        num_next_microbatches = None  # one cache entry and one plan for equal counts
    return _cached_plan(num_stages=num_stages, num_microbatches=num_microbatches, ref_mode=ref_mode,
                        ref_current=ref_current, ref_next=ref_next, carry_in=carry_in, carry_out=carry_out,
                        costs=costs, pair_transfers=True, num_next_microbatches=num_next_microbatches,
                        num_chunks=num_chunks)


# Token-balanced microbatches make (m, next m) vary: the cache holds a few hundred small plans.
@functools.lru_cache(maxsize=256)
def _cached_plan(**kwargs) -> Plan:
    return _build_plan(**kwargs)


def _build_plan(
    *, num_stages: int, num_microbatches: int, ref_mode: str, ref_current: bool, ref_next: bool, carry_in: bool,
    carry_out: bool, costs: Costs, pair_transfers: bool, num_next_microbatches: int | None = None,
    num_chunks: int = 1,
) -> Plan:
    """build_plan; pair_transfers=False leaves every transfer on its own (safe only where sends
    never wait, i.e. buffered; kept to show what the rendezvous check rejects)."""
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")
    if ref_mode not in REF_MODES:
        raise ValueError(f"ref_mode must be one of {REF_MODES}, got {ref_mode!r}")
    if (carry_in or carry_out) and ref_mode != "interleaved":
        raise ValueError(f"carry_in/carry_out apply to ref_mode 'interleaved' only, not {ref_mode!r}")
    if carry_in and ref_current:
        raise ValueError("carry_in and ref_current exclude each other: a carrying step already has this batch's reference")
    if carry_out and not ref_next:
        raise ValueError("carry_out needs ref_next: only the next batch's reference forwards can be carried")
    if num_next_microbatches is not None and (not isinstance(num_next_microbatches, int) or num_next_microbatches < 1):
        raise ValueError(f"num_next_microbatches must be None or an int >= 1, got {num_next_microbatches!r}")
    check_costs(costs)
    if num_chunks != 1:
        return build_interleaved(
            num_stages=num_stages, num_microbatches=num_microbatches, num_chunks=num_chunks, ref_mode=ref_mode,
            ref_current=ref_current, ref_next=ref_next, carry_in=carry_in, carry_out=carry_out, costs=costs,
            pair_transfers=pair_transfers, num_next_microbatches=num_next_microbatches)
    p, m = num_stages, num_microbatches
    m_next = m if num_next_microbatches is None else num_next_microbatches
    carry_in, carry_out = carry_in and p > 1, carry_out and p > 1
    ref_batches = expected_ref_batches(ref_mode, ref_current, ref_next)

    def plan_of(orders: list[list[Op]]) -> Plan:
        return Plan(p, m, ref_mode, add_comm(orders, num_microbatches=m, carry_in=carry_in, carry_out=carry_out,
                                              num_next_microbatches=num_next_microbatches),
                    ref_batches, carry_in, carry_out, num_next_microbatches)

    def finish(plan: Plan) -> Plan:
        return paired(plan, costs=costs) if pair_transfers else plan

    def stage_range(s: int) -> range:
        return carried(s, num_stages=p, num_microbatches=m)

    # Carried-in reference forwards open each stage's list: its warm-up idle time.
    policy = [[Op(OpKind.REF_FWD, mb, 0) for mb in (stage_range(s) if carry_in else ())]
              + _one_f_one_b(stage=s, num_stages=p, num_microbatches=m) for s in range(p)]
    if not ref_batches:
        return finish(plan_of(policy))
    current = [Op(OpKind.REF_FWD, mb, 0) for mb in range(m)] if 0 in ref_batches else []
    # Next-batch reference forwards run in this step by each stage: a prefix of 0..m-1.
    next_refs = [[Op(OpKind.REF_FWD, mb, 1) for mb in range(m_next)
                  if not (carry_out and mb in carried(s, num_stages=p, num_microbatches=m_next))]
                 for s in range(p)] if 1 in ref_batches else [[] for _ in range(p)]
    if ref_mode == "sequential":
        return finish(plan_of([current + policy[s] for s in range(p)]))
    # Interleaved: build a few candidates, keep the fastest under `costs` whose
    # reference activations in flight stay within MAX_REF_ACTS_IN_FLIGHT.
    bases = [policy]
    candidates = []
    if current:
        # This batch's reference gates the loss: first schedule it (greedy or as a
        # prologue), then fit the next batch's reference into what is left idle.
        current_only = [_greedy_interleaved(num_stages=p, num_microbatches=m, ref_batches=(0,),
                                            costs=costs, max_in_flight=MAX_REF_ACTS_IN_FLIGHT)]
        bases = current_only + [[current + chain for chain in policy]]
        candidates.append(plan_of([current + next_refs[s] + policy[s] for s in range(p)]))  # prologue
    for base in bases:
        if not any(next_refs):
            candidates.append(plan_of(base))
            continue
        for late_base in (True, False):
            candidates.append(plan_of(_interleave_late(base=base, refs=next_refs, costs=costs, late_base=late_base,
                                                       num_microbatches=m, carry_in=carry_in)))
    if not (carry_in or carry_out):
        for max_in_flight in range(1, MAX_REF_ACTS_IN_FLIGHT + 1):
            orders = _greedy_interleaved(num_stages=p, num_microbatches=m, ref_batches=ref_batches,
                                         costs=costs, max_in_flight=max_in_flight,
                                         num_next_microbatches=num_next_microbatches)
            candidates.append(plan_of(orders))
    scored = []
    for index, plan in enumerate(candidates):
        run = timeline(plan.stages, costs)  # our own plans: no need to re-check their structure
        over = run.max_ref_acts_in_flight > MAX_REF_ACTS_IN_FLIGHT  # greedy ones never are
        scored.append((over, run.makespan, run.max_ref_acts_in_flight, index))
    return finish(candidates[min(scored)[-1]])


def forward_only_stages(*, num_stages: int, num_microbatches: int, policy: bool, reference: bool,
                        num_chunks: int = 1) -> Stages:
    """Ops of a forward-only pass (evaluation, precomputing the reference): a chain per
    microbatch on every stage, reference first. Messages only flow downstream, so a send
    never waits for a stage that waits for it (`validate_stages` checks it).

    With model chunks (`num_chunks` > 1, --vpp) each microbatch's chain runs through every
    virtual stage in turn, chunk by chunk (the last stage's chunk c feeding stage 0's chunk
    c+1): one chain at a time goes round the ring, so again no stage waits for one that waits."""
    stages = []
    last = num_stages * num_chunks - 1
    for s in range(num_stages):
        ops: list[Op] = []
        for mb in range(num_microbatches):
            for enabled, recv, fwd, send in (
                (reference, OpKind.RECV_REF_ACT, OpKind.REF_FWD, OpKind.SEND_REF_ACT),
                (policy, OpKind.RECV_ACT, OpKind.FWD, OpKind.SEND_ACT),
            ):
                if not enabled:
                    continue
                for chunk in range(num_chunks):
                    virtual = chunk * num_stages + s
                    if virtual > 0:
                        ops.append(Op(recv, mb, chunk=chunk))
                    ops.append(Op(fwd, mb, chunk=chunk))
                    if virtual < last:
                        ops.append(Op(send, mb, chunk=chunk))
        stages.append(tuple(ops))
    return tuple(stages)
