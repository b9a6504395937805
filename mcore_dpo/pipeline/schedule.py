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
right before its consumer; then `pair_crossing_transfers` makes the lists safe under
rendezvous transfers (a send waits for the matching receive, as on NCCL): where a stage
would wait in a send whose receive its peer has not posted, the peer posts that receive
together with the transfer it waits in (one P2P op), as megatron-core pairs
send_forward_recv_backward. Forward-only passes (`forward_only_stages`) are chains that
need no pairing.

Look at a plan:  python -c "from mcore_dpo.pipeline.schedule import *;
print(format_plan(build_plan(num_stages=4, num_microbatches=8, ref_mode='interleaved')))"

Over 500 lines: one algorithm (1F1B order, reference forwards placed in the bubbles,
carrying across steps, transfers paired so that no plan deadlocks) whose steps share their
intermediate lists, and whose transfer placement, pairing, event loop and latest-start pass
the interleaved builder (`pipeline/interleaved.py`, model chunks) reuses; the op types are in
plan.py and the checks in check.py.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq

from mcore_dpo.pipeline.plan import (
    COMPUTE_KINDS,
    MAX_REF_ACTS_IN_FLIGHT,
    REF_MODES,
    Costs,
    Op,
    OpKind,
    Plan,
    PlanError,
    carried,
    check_costs,
    cost_of,
    kept,
    p2p,
    transfers,
    virtual_neighbour,
)
from mcore_dpo.pipeline.check import (
    Key,
    Stages,
    advance,
    message_keys,
    timeline,
    waits_for,
)


def _expected_ref_batches(ref_mode: str, ref_current: bool, ref_next: bool) -> tuple[int, ...]:
    if ref_mode == "sequential":
        return (0,)
    if ref_mode == "interleaved":
        return tuple(b for b, on in ((0, ref_current), (1, ref_next)) if on)
    return ()


# ----------------------------------------------------------------------------- building


def _one_f_one_b(*, stage: int, num_stages: int, num_microbatches: int) -> list[Op]:
    """Policy compute ops of one stage in the standard non-interleaved 1F1B order."""
    warmup = min(num_stages - stage - 1, num_microbatches)
    ops = [Op(OpKind.FWD, mb) for mb in range(warmup)]
    for i in range(num_microbatches - warmup):
        ops += [Op(OpKind.FWD, warmup + i), Op(OpKind.BWD, i)]
    ops += [Op(OpKind.BWD, mb) for mb in range(num_microbatches - warmup, num_microbatches)]
    return ops


def _add_comm(
    compute_orders: list[list[Op]], *, num_microbatches: int, carry_in: bool = False, carry_out: bool = False,
    num_next_microbatches: int | None = None, num_chunks: int = 1,
) -> tuple[tuple[Op, ...], ...]:
    """Put each send right after its producer and each recv right before its consumer.

    Messages on one link are matched in order, so a consumer first receives every
    earlier message on that link (they were sent earlier, so this never waits longer).
    With carry_in, each stage first sends the activations it kept in the last step;
    with carry_out, the ones to keep are kept instead of sent. With model chunks, messages
    follow the virtual pipeline (`virtual_neighbour`), the last stage's chunk c feeding
    stage 0's chunk c+1.
    """
    num_stages, m = len(compute_orders), num_microbatches
    m_next = m if num_next_microbatches is None else num_next_microbatches
    keep_out = [set(kept(s, num_stages=num_stages, num_microbatches=m_next)) if carry_out else set()
                for s in range(num_stages)]
    kept_in = [list(kept(s, num_stages=num_stages, num_microbatches=m)) if carry_in else [] for s in range(num_stages)]

    def neighbour(s: int, op: Op, step: int) -> tuple[int, int] | None:
        return virtual_neighbour(s, op.chunk, step=step, num_stages=num_stages, num_chunks=num_chunks)
    # Send order per link (src, dst) = order of the producing ops on src; a message is
    # (payload, microbatch, batch, the receiver's chunk).
    link_msgs: dict[tuple[int, int], list[tuple[str, int, int, int]]] = {}
    for s, ops in enumerate(compute_orders):
        for mb in kept_in[s]:
            link_msgs.setdefault((s, s + 1), []).append(("ref_act", mb, 0, 0))
        for op in ops:
            down, up = neighbour(s, op, 1), neighbour(s, op, -1)
            if op.kind in (OpKind.FWD, OpKind.REF_FWD) and down is not None:
                if op.kind == OpKind.REF_FWD and op.batch == 1 and op.microbatch in keep_out[s]:
                    continue
                payload = "act" if op.kind == OpKind.FWD else "ref_act"
                link_msgs.setdefault((s, down[0]), []).append((payload, op.microbatch, op.batch, down[1]))
            if op.kind == OpKind.BWD and up is not None:
                link_msgs.setdefault((s, up[0]), []).append(("grad", op.microbatch, op.batch, up[1]))
    link_pos = {link: {msg: k for k, msg in enumerate(msgs)} for link, msgs in link_msgs.items()}
    recv_kind = {"act": OpKind.RECV_ACT, "ref_act": OpKind.RECV_REF_ACT, "grad": OpKind.RECV_GRAD}
    stages = []
    for s, ops in enumerate(compute_orders):
        received = {src: 0 for src in (s - 1, s + 1, (s - 1) % num_stages, (s + 1) % num_stages)
                    if 0 <= src < num_stages}
        out: list[Op] = [Op(OpKind.SEND_KEPT_REF_ACT, mb, 0) for mb in kept_in[s]]
        for op in ops:
            need, down, up = None, neighbour(s, op, 1), neighbour(s, op, -1)
            if op.kind in (OpKind.FWD, OpKind.REF_FWD) and up is not None:
                need = (up[0], ("act" if op.kind == OpKind.FWD else "ref_act", op.microbatch, op.batch, op.chunk))
            elif op.kind == OpKind.BWD and down is not None:
                need = (down[0], ("grad", op.microbatch, op.batch, op.chunk))
            if need is not None:
                src, msg = need
                queue = link_msgs[(src, s)]
                while received[src] <= link_pos[(src, s)][msg]:
                    payload, mb, batch, chunk = queue[received[src]]
                    out.append(Op(recv_kind[payload], mb, batch, chunk=chunk))
                    received[src] += 1
            out.append(op)
            if op.kind == OpKind.FWD and down is not None:
                out.append(Op(OpKind.SEND_ACT, op.microbatch, chunk=op.chunk))
            elif op.kind == OpKind.REF_FWD and down is not None:
                keep = op.batch == 1 and op.microbatch in keep_out[s]
                out.append(Op(OpKind.KEEP_REF_ACT if keep else OpKind.SEND_REF_ACT, op.microbatch, op.batch,
                              chunk=op.chunk))
            elif op.kind == OpKind.BWD and up is not None:
                out.append(Op(OpKind.SEND_GRAD, op.microbatch, chunk=op.chunk))
        stages.append(tuple(out))
    return tuple(stages)


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


def run_events(events: list[float], free_at: list[float], *, visit, busy) -> None:
    """The time-stepped loop of a list scheduler: at each event time, while `busy()`, each free
    stage, downstream first (a stage consuming a reference activation frees a slot upstream),
    gets `visit(stage, time)`; visits push the end times of what they start onto `events`."""
    while busy():
        if not events:
            raise RuntimeError("list scheduler stalled (bug)")
        t = heapq.heappop(events)
        for s in reversed(range(len(free_at))):
            if free_at[s] <= t:
                visit(s, t)


def _latest_times(orders: list[list[Op]], *, costs: Costs, makespan: float) -> list[list[tuple[float, float]]]:
    """(start, end) of each compute op when everything runs as late as `makespan` allows.

    Warmup forwards have slack in 1F1B; running them late opens idle time early
    in the step, where reference forwards can start their way down the pipeline.
    """
    latest = latest_starts(orders, costs=costs, num_chunks=1, makespan=makespan)
    return [[(latest[(s, op)], latest[(s, op)] + cost_of(op.kind, costs)) for op in ops]
            for s, ops in enumerate(orders)]


def latest_starts(orders: list[list[Op]], *, costs: Costs, num_chunks: int, makespan: float) -> dict:
    """{(stage, op): the latest start that lets every compute op end by `makespan`}: each op
    ends before the next op of its stage starts and before the op that consumes its output
    starts (one virtual stage downstream for a forward, upstream for a backward)."""
    num_stages = len(orders)
    latest: dict[tuple[int, Op], float] = {}
    ptr = [len(ops) - 1 for ops in orders]
    next_start = [makespan] * num_stages
    while any(i >= 0 for i in ptr):
        progress = False
        for s in range(num_stages):
            while ptr[s] >= 0:
                op = orders[s][ptr[s]]
                step = -1 if op.kind == OpKind.BWD else 1
                other = virtual_neighbour(s, op.chunk, step=step, num_stages=num_stages, num_chunks=num_chunks)
                due = next_start[s]
                if other is not None:
                    consumer = (other[0], dataclasses.replace(op, chunk=other[1]))
                    if consumer not in latest:
                        break
                    due = min(due, latest[consumer] - costs.comm)
                latest[(s, op)] = next_start[s] = due - cost_of(op.kind, costs)
                ptr[s] -= 1
                progress = True
        if not progress:
            raise RuntimeError("base schedule has a dependency cycle (bug)")
    return latest


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
    base_plan = _add_comm(base, num_microbatches=num_microbatches, carry_in=carry_in)
    run = timeline(base_plan, costs)
    if late_base:
        base_times = _latest_times(base, costs=costs, makespan=run.makespan)
    else:
        base_times = [[t for op, t in zip(ops, run.op_times[s]) if op.kind in COMPUTE_KINDS]
                      for s, ops in enumerate(base_plan)]

    def fit(makespan: float) -> list[list[Op]] | None:
        return _place_refs_late(base=base, base_times=base_times, refs=refs, costs=costs, makespan=makespan)

    high = run.makespan + (max(map(len, refs)) + len(base)) * (costs.ref_fwd + costs.comm)  # all refs after the base
    return smallest_fit(fit, low=run.makespan, high=high, tolerance=1e-6 * costs.ref_fwd)


def smallest_fit(fit, *, low: float, high: float, tolerance: float) -> list[list[Op]]:
    """fit(makespan) at the smallest makespan in [low, high] where it fits (not None), to
    `tolerance`; fitting is monotone in the makespan, so bisect (simulate() gives the exact
    time afterwards). At `high` it must fit."""
    best = fit(low)
    if best is not None:
        return best
    best = fit(high)
    assert best is not None, "reference forwards after the base schedule always fit"
    while high - low > tolerance:
        mid = (low + high) / 2
        orders = fit(mid)
        if orders is None:
            low = mid
        else:
            high, best = mid, orders
    return best


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
        from mcore_dpo.pipeline import interleaved  # it builds on this module's transfer placement

        return interleaved.build_interleaved(
            num_stages=num_stages, num_microbatches=num_microbatches, num_chunks=num_chunks, ref_mode=ref_mode,
            ref_current=ref_current, ref_next=ref_next, carry=carry_in or carry_out, costs=costs,
            pair_transfers=pair_transfers, num_next_microbatches=num_next_microbatches)
    p, m = num_stages, num_microbatches
    m_next = m if num_next_microbatches is None else num_next_microbatches
    carry_in, carry_out = carry_in and p > 1, carry_out and p > 1
    ref_batches = _expected_ref_batches(ref_mode, ref_current, ref_next)

    def plan_of(orders: list[list[Op]]) -> Plan:
        return Plan(p, m, ref_mode, _add_comm(orders, num_microbatches=m, carry_in=carry_in, carry_out=carry_out,
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


# ----------------------------------------------------------------------------- transfers


def paired(plan: Plan, *, costs: Costs) -> Plan:
    """The plan with its crossing transfers paired, the fastest way under `costs`."""
    variants = list(dict.fromkeys(pair_crossing_transfers(plan.stages, prefer=prefer, costs=costs)
                                  for prefer in _PREFER))
    makespans = [timeline(variant, costs).makespan for variant in variants]
    # The fastest; among equally fast ones, the first by repr (independent of _PREFER's order).
    fastest = [variant for variant, makespan in zip(variants, makespans) if makespan == min(makespans)]
    return dataclasses.replace(plan, stages=min(fastest, key=repr) if len(fastest) > 1 else fastest[0])


# The builder pairs one plan's transfers in each `_PREFER` way, from the same unpaired times.
_timeline_once = functools.lru_cache(maxsize=4)(timeline)

# Which stage posts a receive early when two stages each wait in a send to the other.
_PREFER = ("timed", "downstream", "upstream", "both")


def pair_crossing_transfers(stages: Stages, *, prefer: str = "timed", costs: Costs = Costs()) -> Stages:
    """The same op lists, made deadlock-free under rendezvous transfers.

    Runs the lists under the rendezvous model (`plan_check.rendezvous_run`) until it stops.
    Stages only wait for their neighbours, so a deadlock is two neighbours each waiting for
    the other. At least one of them waits in a send whose receive the other has not posted
    (two stages each waiting only to receive would also hang with buffered sends, which the
    unpaired plan never does): that receive moves into the op the other stage waits in, so
    the two are posted together (a P2P op), and the run goes on. Moving a receive earlier
    keeps every dependency (its tensor is used later, as before) and the order of messages
    on each link (it is the next receive on its link). Lists that need no pairing come back
    unchanged.

    When both wait in a send to the other, either move resolves the pair: `prefer`
    "downstream" moves only the receive of the message that flows down the pipeline,
    "upstream" only the other, "both" both, and "timed" the one whose receiver would wait
    least for its message when the unpaired lists run under `costs` with buffered sends.
    They differ in how long a stage then waits; the builder keeps the fastest.
    """
    if prefer not in _PREFER:
        raise ValueError(f"prefer must be one of {_PREFER}, got {prefer!r}")
    lists = [list(ops) for ops in stages]
    keys = message_keys(stages)
    ptr, done = [0] * len(lists), set()
    # Buffered-send times of the unpaired lists: when each op starts, when each message is sent.
    run = _timeline_once(stages, costs)
    start_at = [[start for start, _ in times] for times in run.op_times]
    sent_at = {key: start_at[s][i] for s in range(len(lists)) for i, op_keys in enumerate(keys[s])
               for key in op_keys if key[0][0] == s}

    def delay(key: Key) -> float:
        """How long the receiver of `key` would wait for it, posting it in its current op."""
        dst = key[0][1]
        return max(0.0, sent_at[key] - start_at[dst][ptr[dst]])
    while True:
        advance(keys, ptr=ptr, done=done)
        waits = waits_for(keys, ptr, done)
        moves: dict[int, list[Key]] = {}  # receiving stage -> messages it posts now
        for (s, t), pending in waits.items():
            if s > t or (t, s) not in waits:
                continue
            # Every send has its receive (message_keys checks), so neither stage is done.
            down = [key for key in pending + waits[(t, s)] if key not in keys[key[0][1]][ptr[key[0][1]]]]
            if prefer != "both" and len({link for link, _ in down}) == 2:
                downstream = prefer == "downstream"
                if prefer == "timed":
                    worst = {d: max((delay(key) for key in down if (key[0][1] > key[0][0]) == d)) for d in (True, False)}
                    downstream = worst[True] <= worst[False]
                down = [key for key in down if (key[0][1] > key[0][0]) == downstream]
            for key in down:
                moves.setdefault(key[0][1], []).append(key)
        if not moves:
            # No two stages wait for each other, but a longer cycle may (the wrap-around link of
            # model chunks closes a ring): one receive that a waiting send needs joins its stage's
            # op, the one whose stage would wait least for it.
            sends = [key for (s, t), pending in waits.items() for key in pending
                     if key[0][0] == s and key not in keys[t][ptr[t]]]
            if sends:
                key = min(sends, key=lambda key: (delay(key), key))
                moves[key[0][1]] = [key]
        if not moves:
            if any(ptr[s] < len(lists[s]) for s in range(len(lists))):
                raise PlanError("transfers cannot be paired: the plan waits for a message nobody sends")
            return tuple(map(tuple, lists))
        for dst, wanted in moves.items():
            # Each wanted receive is the next one on its link: a short scan ahead finds it.
            found, i = [], ptr[dst] + 1
            while len(found) < len(wanted):
                found += [(i, key) for key in keys[dst][i] if key in wanted]
                i += 1
            moved = []
            for i, key in reversed(found):  # later ops first, so earlier indices stay put
                parts = list(transfers(lists[dst][i]))
                part = parts.pop(keys[dst][i].index(key))
                keys[dst][i] = [k for k in keys[dst][i] if k != key]
                moved.append((key, part))
                if parts:
                    lists[dst][i] = p2p(parts)
                else:
                    del lists[dst][i], keys[dst][i], start_at[dst][i]
            now = ptr[dst]
            moved.sort()
            lists[dst][now] = p2p(transfers(lists[dst][now]) + tuple(part for _, part in moved))
            keys[dst][now] = keys[dst][now] + [key for key, _ in moved]


def forward_only_stages(*, num_stages: int, num_microbatches: int, policy: bool, reference: bool) -> Stages:
    """Ops of a forward-only pass (evaluation, precomputing the reference): a chain per
    microbatch on every stage, reference first. Messages only flow downstream, so a send
    never waits for a stage that waits for it (`validate_stages` checks it)."""
    stages = []
    for s in range(num_stages):
        ops: list[Op] = []
        for mb in range(num_microbatches):
            for enabled, recv, fwd, send in (
                (reference, OpKind.RECV_REF_ACT, OpKind.REF_FWD, OpKind.SEND_REF_ACT),
                (policy, OpKind.RECV_ACT, OpKind.FWD, OpKind.SEND_ACT),
            ):
                if not enabled:
                    continue
                if s > 0:
                    ops.append(Op(recv, mb))
                ops.append(Op(fwd, mb))
                if s < num_stages - 1:
                    ops.append(Op(send, mb))
        stages.append(tuple(ops))
    return tuple(stages)
