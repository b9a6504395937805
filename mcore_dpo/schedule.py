"""The pipeline schedule of one training step, as a plan.

A plan is, for each pipeline stage, the ordered list of ops (policy forward,
policy backward, reference forward, and the point-to-point sends/receives
between neighbouring stages) that the executor runs top to bottom. Sends are
non-blocking, receives block until their message has arrived, and messages
between one ordered pair of stages are matched in order (as NCCL does).

The point of building the schedule as data: the frozen reference forward can
be placed into the bubbles of the policy 1F1B schedule, and the result can be
checked (`validate_plan`) and timed (`simulate`) without any process.

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

Look at a plan:  python -c "from mcore_dpo.schedule import *;
print(format_plan(build_plan(num_stages=4, num_microbatches=8, ref_mode='interleaved')))"
"""

from __future__ import annotations

import functools
import heapq
from collections import Counter
from dataclasses import dataclass
from enum import Enum


class OpKind(str, Enum):
    FWD = "fwd"  # policy forward of microbatch mb (on the last stage this includes the loss)
    BWD = "bwd"  # policy backward of mb
    REF_FWD = "ref_fwd"  # reference forward of mb (no grad; last stage: ref log-probs)
    RECV_ACT = "recv_act"  # policy activations, stage s -> s+1
    SEND_ACT = "send_act"
    RECV_GRAD = "recv_grad"  # activation grads, stage s+1 -> s
    SEND_GRAD = "send_grad"
    RECV_REF_ACT = "recv_ref_act"  # reference activations, s -> s+1
    SEND_REF_ACT = "send_ref_act"
    KEEP_REF_ACT = "keep_ref_act"  # hold a next-batch reference activation for the next step
    SEND_KEPT_REF_ACT = "send_kept_ref_act"  # send the one held since the last step (batch 0 now)


REF_MODES = ("interleaved", "sequential", "precomputed", "none")

# Reference activations produced by a stage and not yet consumed by the next
# stage, per link (one stage-output tensor each, far less than the activations
# 1F1B stashes for backward). The interleaved planner never exceeds this; 3 is
# what the bubble-filling optimum needs at p=4, m=8.
MAX_REF_ACTS_IN_FLIGHT = 3

_COMPUTE = (OpKind.FWD, OpKind.BWD, OpKind.REF_FWD)
# send/recv kind -> (payload, stage offset of the peer)
_SENDS = {OpKind.SEND_ACT: ("act", 1), OpKind.SEND_REF_ACT: ("ref_act", 1), OpKind.SEND_GRAD: ("grad", -1),
          OpKind.SEND_KEPT_REF_ACT: ("ref_act", 1)}
_RECVS = {OpKind.RECV_ACT: ("act", -1), OpKind.RECV_REF_ACT: ("ref_act", -1), OpKind.RECV_GRAD: ("grad", 1)}
_SHORT = {
    OpKind.FWD: "F", OpKind.BWD: "B", OpKind.REF_FWD: "R",
    OpKind.RECV_ACT: "ra", OpKind.SEND_ACT: "sa", OpKind.RECV_GRAD: "rg",
    OpKind.SEND_GRAD: "sg", OpKind.RECV_REF_ACT: "rr", OpKind.SEND_REF_ACT: "sr",
    OpKind.KEEP_REF_ACT: "kr", OpKind.SEND_KEPT_REF_ACT: "sk",
}


class PlanError(ValueError):
    """A plan breaks a rule the executor relies on (message is one line)."""


@dataclass(frozen=True)
class Op:
    kind: OpKind
    microbatch: int
    batch: int = 0  # 0 = this step's global batch, 1 = the NEXT global batch (reference only)
    # The peer is implied: ACT/REF_ACT go to stage+1 (come from stage-1), GRAD the other way.


@dataclass(frozen=True)
class Plan:
    num_stages: int
    num_microbatches: int
    ref_mode: str
    stages: tuple[tuple[Op, ...], ...]  # stages[s] = ordered ops of stage s
    # Global batches whose reference forwards this plan computes (0 = this batch,
    # 1 = the next one); the validator checks the ops against it.
    ref_batches: tuple[int, ...] = ()
    carry_in: bool = False  # starts with the reference forwards the previous plan carried out
    carry_out: bool = False  # leaves `carried` next-batch reference forwards to the next plan


@dataclass(frozen=True)
class Costs:
    """Op durations in arbitrary time units (usually: one policy forward = 1)."""

    fwd: float = 1.0
    bwd: float = 2.0
    ref_fwd: float = 1.0
    comm: float = 0.0  # latency of one point-to-point message


@dataclass(frozen=True)
class SimResult:
    makespan: float
    busy_time_per_stage: tuple[float, ...]
    bubble_fraction: float  # idle share of num_stages * makespan
    op_times: tuple[tuple[tuple[float, float], ...], ...]  # [stage][op index] = (start, end)
    max_ref_acts_in_flight: int  # worst link: ref activations produced, not yet consumed downstream


def _cost(kind: OpKind, costs: Costs) -> float:
    if kind == OpKind.FWD:
        return costs.fwd
    return costs.bwd if kind == OpKind.BWD else costs.ref_fwd


def _check_costs(costs: Costs) -> None:
    for name in ("fwd", "bwd", "ref_fwd"):
        if not getattr(costs, name) > 0:
            raise ValueError(f"Costs.{name} must be > 0, got {getattr(costs, name)!r}")
    if not costs.comm >= 0:
        raise ValueError(f"Costs.comm must be >= 0, got {costs.comm!r}")


def _expected_ref_batches(ref_mode: str, ref_current: bool, ref_next: bool) -> tuple[int, ...]:
    if ref_mode == "sequential":
        return (0,)
    if ref_mode == "interleaved":
        return tuple(b for b, on in ((0, ref_current), (1, ref_next)) if on)
    return ()


def carried(stage: int, *, num_stages: int, num_microbatches: int) -> range:
    """Microbatches whose next-batch reference forward `stage` leaves to the start of the
    next step in a carrying plan: the last min(stage, m). One forward per stage above it is
    the warm-up idle time it fills. The sets grow with the stage, so what stage s runs
    early, stage s+1 also runs early, and only the first of stage s+1's extra ones crosses
    the step boundary, as an activation that stage s keeps."""
    if num_stages < 2:
        return range(0)
    count = min(stage, num_microbatches)
    return range(num_microbatches - count, num_microbatches)


def _kept(stage: int, *, num_stages: int, num_microbatches: int) -> range:
    """Next-batch reference activations that `stage` keeps for the next step (carry_out)."""
    if stage >= num_stages - 1:
        return range(0)
    mine = carried(stage, num_stages=num_stages, num_microbatches=num_microbatches)
    theirs = carried(stage + 1, num_stages=num_stages, num_microbatches=num_microbatches)
    return range(theirs.start, mine.start)


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
    compute_orders: list[list[Op]], *, num_microbatches: int, carry_in: bool = False, carry_out: bool = False
) -> tuple[tuple[Op, ...], ...]:
    """Put each send right after its producer and each recv right before its consumer.

    Messages on one link are matched in order, so a consumer first receives every
    earlier message on that link (they were sent earlier, so this never waits longer).
    With carry_in, each stage first sends the activations it kept in the last step;
    with carry_out, the ones to keep are kept instead of sent.
    """
    num_stages, m = len(compute_orders), num_microbatches
    kept = [set(_kept(s, num_stages=num_stages, num_microbatches=m)) if carry_out else set() for s in range(num_stages)]
    kept_in = [list(_kept(s, num_stages=num_stages, num_microbatches=m)) if carry_in else [] for s in range(num_stages)]
    # Send order per link (src, dst) = order of the producing ops on src.
    link_msgs: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for s, ops in enumerate(compute_orders):
        for mb in kept_in[s]:
            link_msgs.setdefault((s, s + 1), []).append(("ref_act", mb, 0))
        for op in ops:
            if op.kind in (OpKind.FWD, OpKind.REF_FWD) and s < num_stages - 1:
                if op.kind == OpKind.REF_FWD and op.batch == 1 and op.microbatch in kept[s]:
                    continue
                payload = "act" if op.kind == OpKind.FWD else "ref_act"
                link_msgs.setdefault((s, s + 1), []).append((payload, op.microbatch, op.batch))
            if op.kind == OpKind.BWD and s > 0:
                link_msgs.setdefault((s, s - 1), []).append(("grad", op.microbatch, op.batch))
    link_pos = {link: {msg: k for k, msg in enumerate(msgs)} for link, msgs in link_msgs.items()}
    recv_kind = {"act": OpKind.RECV_ACT, "ref_act": OpKind.RECV_REF_ACT, "grad": OpKind.RECV_GRAD}
    stages = []
    for s, ops in enumerate(compute_orders):
        received = {src: 0 for src in (s - 1, s + 1) if 0 <= src < num_stages}
        out: list[Op] = [Op(OpKind.SEND_KEPT_REF_ACT, mb, 0) for mb in kept_in[s]]
        for op in ops:
            need = None
            if op.kind in (OpKind.FWD, OpKind.REF_FWD) and s > 0:
                need = (s - 1, ("act" if op.kind == OpKind.FWD else "ref_act", op.microbatch, op.batch))
            elif op.kind == OpKind.BWD and s < num_stages - 1:
                need = (s + 1, ("grad", op.microbatch, op.batch))
            if need is not None:
                src, msg = need
                queue = link_msgs[(src, s)]
                while received[src] <= link_pos[(src, s)][msg]:
                    payload, mb, batch = queue[received[src]]
                    out.append(Op(recv_kind[payload], mb, batch))
                    received[src] += 1
            out.append(op)
            if op.kind == OpKind.FWD and s < num_stages - 1:
                out.append(Op(OpKind.SEND_ACT, op.microbatch))
            elif op.kind == OpKind.REF_FWD and s < num_stages - 1:
                keep = op.batch == 1 and op.microbatch in kept[s]
                out.append(Op(OpKind.KEEP_REF_ACT if keep else OpKind.SEND_REF_ACT, op.microbatch, op.batch))
            elif op.kind == OpKind.BWD and s > 0:
                out.append(Op(OpKind.SEND_GRAD, op.microbatch))
        stages.append(tuple(out))
    return tuple(stages)


def _greedy_interleaved(
    *,
    num_stages: int,
    num_microbatches: int,
    ref_batches: tuple[int, ...],
    costs: Costs,
    max_in_flight: int,
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
    refs = [Op(OpKind.REF_FWD, mb, b) for b in ref_batches for mb in range(m)]
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
        finish = t + _cost(op.kind, costs)
        end[(s, op)] = finish
        free_at[s] = finish
        orders[s].append(op)
        heapq.heappush(events, finish)
        heapq.heappush(events, finish + costs.comm)

    total = sum(len(c) for c in chains) + p * len(refs)
    while sum(chain_pos) + sum(ref_pos) < total:
        if not events:
            raise RuntimeError("interleaved scheduler stalled (bug)")
        t = heapq.heappop(events)
        # Downstream first: a stage consuming a reference activation frees a slot upstream.
        for s in reversed(range(p)):
            if free_at[s] > t:
                continue
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
                    continue
            if ref is None or forced:
                continue
            ref_ready = input_time(s, ref)
            in_flight = ref_pos[s] - ref_pos[s + 1] if s < p - 1 else 0
            if ref_ready is None or ref_ready > t or in_flight >= max_in_flight:
                continue
            start(s, ref, t)
            ref_pos[s] += 1
    return orders


def _latest_times(orders: list[list[Op]], *, costs: Costs, makespan: float) -> list[list[tuple[float, float]]]:
    """(start, end) of each compute op when everything runs as late as `makespan` allows.

    Warmup forwards have slack in 1F1B; running them late opens idle time early
    in the step, where reference forwards can start their way down the pipeline.
    """
    num_stages = len(orders)
    latest_start: dict[tuple[int, Op], float] = {}
    ptr = [len(ops) - 1 for ops in orders]
    next_start = [makespan] * num_stages
    while any(i >= 0 for i in ptr):
        progress = False
        for s in range(num_stages):
            while ptr[s] >= 0:
                op = orders[s][ptr[s]]
                # The op on a neighbour stage that consumes this op's output.
                if op.kind == OpKind.BWD:
                    consumer = (s - 1, op) if s > 0 else None
                else:
                    consumer = (s + 1, op) if s < num_stages - 1 else None
                due = next_start[s]
                if consumer is not None:
                    if consumer not in latest_start:
                        break
                    due = min(due, latest_start[consumer] - costs.comm)
                latest_start[(s, op)] = next_start[s] = due - _cost(op.kind, costs)
                ptr[s] -= 1
                progress = True
        if not progress:
            raise RuntimeError("base schedule has a dependency cycle (bug)")
    return [[(latest_start[(s, op)], latest_start[(s, op)] + _cost(op.kind, costs)) for op in ops]
            for s, ops in enumerate(orders)]


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
    run = _execute(base_plan, costs)
    if late_base:
        base_times = _latest_times(base, costs=costs, makespan=run.makespan)
    else:
        base_times = [[t for op, t in zip(ops, run.op_times[s]) if op.kind in _COMPUTE]
                      for s, ops in enumerate(base_plan)]

    def fit(makespan: float) -> list[list[Op]] | None:
        return _place_refs_late(base=base, base_times=base_times, refs=refs, costs=costs, makespan=makespan)

    low = run.makespan
    best = fit(low)
    if best is not None:
        return best
    high = low + (max(map(len, refs)) + len(base)) * (costs.ref_fwd + costs.comm)  # all refs after the base
    best = fit(high)
    assert best is not None, "reference forwards after the base schedule always fit"
    # Fitting is monotone in the makespan, so bisect; simulate() gives the exact time afterwards.
    while high - low > 1e-6 * costs.ref_fwd:
        mid = (low + high) / 2
        orders = fit(mid)
        if orders is None:
            low = mid
        else:
            high, best = mid, orders
    return best


@functools.lru_cache(maxsize=64)
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
) -> Plan:
    """Plan one training step; `ref_current`/`ref_next` and carrying only matter for
    "interleaved" (see the module docstring). With one stage there is nothing to carry and
    the plan's carry flags stay False.

    `costs` guide where the interleaved scheduler puts reference forwards; the
    plan is valid whatever the real durations turn out to be. Plans are immutable and
    memoized: a run asks for the same few plans every step.
    """
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
    _check_costs(costs)
    p, m = num_stages, num_microbatches
    carry_in, carry_out = carry_in and p > 1, carry_out and p > 1
    ref_batches = _expected_ref_batches(ref_mode, ref_current, ref_next)

    def plan_of(orders: list[list[Op]]) -> Plan:
        stages = _add_comm(orders, num_microbatches=m, carry_in=carry_in, carry_out=carry_out)
        return Plan(p, m, ref_mode, stages, ref_batches, carry_in, carry_out)

    def stage_range(s: int) -> range:
        return carried(s, num_stages=p, num_microbatches=m)

    # Carried-in reference forwards open each stage's list: its warm-up idle time.
    policy = [[Op(OpKind.REF_FWD, mb, 0) for mb in (stage_range(s) if carry_in else ())]
              + _one_f_one_b(stage=s, num_stages=p, num_microbatches=m) for s in range(p)]
    if not ref_batches:
        return plan_of(policy)
    current = [Op(OpKind.REF_FWD, mb, 0) for mb in range(m)] if 0 in ref_batches else []
    # Next-batch reference forwards run in this step by each stage: a prefix of 0..m-1.
    next_refs = [[Op(OpKind.REF_FWD, mb, 1) for mb in range(m) if not (carry_out and mb in stage_range(s))]
                 for s in range(p)] if 1 in ref_batches else [[] for _ in range(p)]
    if ref_mode == "sequential":
        return plan_of([current + policy[s] for s in range(p)])
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
                                         costs=costs, max_in_flight=max_in_flight)
            candidates.append(plan_of(orders))
    scored = []
    for index, plan in enumerate(candidates):
        run = _execute(plan.stages, costs)  # our own plans: no need to re-check their structure
        over = run.max_ref_acts_in_flight > MAX_REF_ACTS_IN_FLIGHT  # greedy ones never are
        scored.append((over, run.makespan, run.max_ref_acts_in_flight, index))
    return candidates[min(scored)[-1]]


# ----------------------------------------------------------------------------- checking


def _message(op: Op) -> tuple[str, int, int]:
    payload = (_SENDS.get(op.kind) or _RECVS[op.kind])[0]
    return (payload, op.microbatch, op.batch)


def _expected_ops(
    *, stage: int, num_stages: int, num_microbatches: int, ref_batches: tuple[int, ...], carry_in: bool,
    carry_out: bool,
) -> Counter:
    first, last = stage == 0, stage == num_stages - 1
    shape = dict(num_stages=num_stages, num_microbatches=num_microbatches)
    mine, kept = carried(stage, **shape), _kept(stage, **shape)
    expected: Counter = Counter()
    for mb in range(num_microbatches):
        expected[Op(OpKind.FWD, mb)] += 1
        expected[Op(OpKind.BWD, mb)] += 1
        if not first:
            expected[Op(OpKind.RECV_ACT, mb)] += 1
            expected[Op(OpKind.SEND_GRAD, mb)] += 1
        if not last:
            expected[Op(OpKind.SEND_ACT, mb)] += 1
            expected[Op(OpKind.RECV_GRAD, mb)] += 1
        for batch in ref_batches:
            if batch == 1 and carry_out and mb in mine:
                continue  # left to the start of the next step
            expected[Op(OpKind.REF_FWD, mb, batch)] += 1
            if not first:
                expected[Op(OpKind.RECV_REF_ACT, mb, batch)] += 1
            if not last:
                keep = batch == 1 and carry_out and mb in kept
                expected[Op(OpKind.KEEP_REF_ACT if keep else OpKind.SEND_REF_ACT, mb, batch)] += 1
    if carry_in:
        for mb in mine:
            expected[Op(OpKind.REF_FWD, mb, 0)] += 1
            if not first:
                expected[Op(OpKind.RECV_REF_ACT, mb, 0)] += 1
            if not last:
                expected[Op(OpKind.SEND_REF_ACT, mb, 0)] += 1
        for mb in kept:
            expected[Op(OpKind.SEND_KEPT_REF_ACT, mb, 0)] += 1
    return expected


def _check_structure(plan: Plan) -> None:
    p, m = plan.num_stages, plan.num_microbatches
    if plan.ref_mode not in REF_MODES:
        raise PlanError(f"plan.ref_mode must be one of {REF_MODES}, got {plan.ref_mode!r}")
    if not isinstance(m, int) or m < 1:
        raise PlanError(f"plan.num_microbatches must be an int >= 1, got {m!r}")
    if not isinstance(p, int) or p < 1 or len(plan.stages) != p:
        raise PlanError(f"plan.num_stages={p!r} but plan.stages has {len(plan.stages)} stages")
    allowed = {"none": [()], "precomputed": [()], "sequential": [(0,)],
               "interleaved": [(), (0,), (1,), (0, 1)]}[plan.ref_mode]
    if tuple(plan.ref_batches) not in allowed:
        raise PlanError(f"plan.ref_batches={plan.ref_batches!r} is not allowed for ref_mode {plan.ref_mode!r}")
    if (plan.carry_in or plan.carry_out) and (plan.ref_mode != "interleaved" or p < 2):
        raise PlanError(f"plan carries reference forwards, which needs ref_mode 'interleaved' and >= 2 stages "
                        f"(got {plan.ref_mode!r}, {p} stages)")
    if plan.carry_in and 0 in plan.ref_batches:
        raise PlanError("plan.carry_in with batch 0 in plan.ref_batches: this batch's reference would run twice")
    if plan.carry_out and 1 not in plan.ref_batches:
        raise PlanError("plan.carry_out without batch 1 in plan.ref_batches: nothing to carry")

    for s, ops in enumerate(plan.stages):
        for i, op in enumerate(ops):
            if not isinstance(op, Op) or not isinstance(op.kind, OpKind):
                raise PlanError(f"plan stage {s} op {i}: not an Op with an OpKind: {op!r}")
        have = Counter(ops)
        want = _expected_ops(stage=s, num_stages=p, num_microbatches=m, ref_batches=plan.ref_batches,
                             carry_in=plan.carry_in, carry_out=plan.carry_out)
        for op in [] if have == want else sorted(set(have) | set(want), key=repr):
            if have[op] != want[op]:
                raise PlanError(f"plan stage {s}: {op.kind.value} mb={op.microbatch} batch={op.batch} "
                                f"appears {have[op]} times, expected {want[op]}")
        pos = {op: i for i, op in enumerate(ops)}

        def before(a: Op, b: Op, why: str) -> None:
            if pos[a] > pos[b]:
                raise PlanError(f"plan stage {s}: {a.kind.value} mb={a.microbatch} batch={a.batch} "
                                f"comes after {b.kind.value} mb={b.microbatch} ({why})")

        for mb in range(m):
            fwd, bwd = Op(OpKind.FWD, mb), Op(OpKind.BWD, mb)
            before(fwd, bwd, "backward needs its forward")
            if s > 0:
                before(Op(OpKind.RECV_ACT, mb), fwd, "forward needs its input")
                before(bwd, Op(OpKind.SEND_GRAD, mb), "grad is sent after the backward")
            if s < p - 1:
                before(fwd, Op(OpKind.SEND_ACT, mb), "activation is sent after the forward")
                before(Op(OpKind.RECV_GRAD, mb), bwd, "backward needs the output grad")
        for ref in [op for op in ops if op.kind == OpKind.REF_FWD]:
            mb, batch = ref.microbatch, ref.batch
            if s > 0:
                before(Op(OpKind.RECV_REF_ACT, mb, batch), ref, "reference forward needs its input")
            if s < p - 1:
                kept = Op(OpKind.KEEP_REF_ACT, mb, batch)
                before(ref, kept if kept in pos else Op(OpKind.SEND_REF_ACT, mb, batch),
                       "activation is sent after the forward, or kept")
            if s == p - 1 and batch == 0:
                before(ref, Op(OpKind.FWD, mb), "the loss needs this batch's reference log-probs")

    # NCCL matches point-to-point messages between two ranks in order.
    for s in range(p):
        for dst in (s - 1, s + 1):
            if not 0 <= dst < p:
                continue
            sent = [_message(op) for op in plan.stages[s] if op.kind in _SENDS and s + _SENDS[op.kind][1] == dst]
            got = [_message(op) for op in plan.stages[dst] if op.kind in _RECVS and dst + _RECVS[op.kind][1] == s]
            for k, (a, b) in enumerate(zip(sent, got)):
                if a != b:
                    raise PlanError(f"plan link stage {s}->{dst}: message {k} is sent as {a} "
                                    f"but received as {b} (p2p is matched in order)")


def _execute(stages: tuple[tuple[Op, ...], ...], costs: Costs) -> SimResult:
    """Run per-stage op lists in time: compute takes its cost, sends don't block, recvs wait."""
    p = len(stages)
    clock, ptr = [0.0] * p, [0] * p
    links: dict[tuple[int, int], list[tuple[tuple[str, int, int], float]]] = {}
    taken: Counter = Counter()
    times: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    progress = True
    while progress:
        progress = False
        for s in range(p):
            ops = stages[s]
            while ptr[s] < len(ops):
                op, t = ops[ptr[s]], clock[s]
                if op.kind in _COMPUTE:
                    clock[s] = t + _cost(op.kind, costs)
                elif op.kind in _SENDS:
                    links.setdefault((s, s + _SENDS[op.kind][1]), []).append((_message(op), t + costs.comm))
                elif op.kind == OpKind.KEEP_REF_ACT:
                    pass  # held in memory for the next step
                else:
                    link = (s + _RECVS[op.kind][1], s)
                    queue = links.get(link, [])
                    if taken[link] >= len(queue):
                        break  # blocked until the peer sends
                    msg, arrival = queue[taken[link]]
                    if msg != _message(op):
                        raise PlanError(f"plan link stage {link[0]}->{s}: received {msg}, "
                                        f"stage {s} expected {_message(op)}")
                    taken[link] += 1
                    clock[s] = max(t, arrival)
                times[s].append((t, clock[s]))
                ptr[s] += 1
                progress = True
    for s in range(p):
        if ptr[s] < len(stages[s]):
            op = stages[s][ptr[s]]
            raise PlanError(f"plan deadlock: stage {s} waits forever at op {ptr[s]} "
                            f"({op.kind.value} mb={op.microbatch} batch={op.batch})")

    makespan = max(clock)
    busy = tuple(
        sum(end - start for op, (start, end) in zip(stages[s], times[s]) if op.kind in _COMPUTE)
        for s in range(p)
    )
    worst = 0
    for s in range(p - 1):
        # +1 when stage s sends a reference activation, -1 when stage s+1 starts on it.
        deltas = [(times[s][i][1], 1) for i, op in enumerate(stages[s])
                  if op.kind in (OpKind.SEND_REF_ACT, OpKind.SEND_KEPT_REF_ACT)]
        deltas += [(times[s + 1][i][0], -1) for i, op in enumerate(stages[s + 1]) if op.kind == OpKind.REF_FWD]
        level = 0
        for _, delta in sorted(deltas):
            level += delta
            worst = max(worst, level)
    bubble = 1.0 - sum(busy) / (p * makespan) if makespan > 0 else 0.0
    return SimResult(makespan, busy, bubble, tuple(tuple(ts) for ts in times), worst)


def validate_plan(plan: Plan) -> None:
    """Raise PlanError (one line) unless every stage's op list is complete, ordered and deadlock-free."""
    _check_structure(plan)
    _execute(plan.stages, Costs())


def simulate(plan: Plan, *, costs: Costs = Costs()) -> SimResult:
    """Validate the plan, then time it under `costs`."""
    _check_costs(costs)
    _check_structure(plan)
    return _execute(plan.stages, costs)


def closed_form_makespans(*, num_stages: int, num_microbatches: int, costs: Costs = Costs()) -> dict[str, float]:
    """Textbook step times with free communication (comm is ignored)."""
    slots = num_microbatches + num_stages - 1
    policy = slots * (costs.fwd + costs.bwd)
    return {
        "1f1b": policy,
        "separate_pass": policy + slots * costs.ref_fwd,
        "concatenated": slots * (costs.fwd + costs.bwd + costs.ref_fwd),
    }


def format_plan(plan: Plan) -> str:
    """One line per stage, e.g. `stage 1: ra0 F0 sa0 rr0n R0n sr0n ...` (n = next batch)."""
    lines = []
    for s, ops in enumerate(plan.stages):
        words = [f"{_SHORT[op.kind]}{op.microbatch}{'n' if op.batch else ''}" for op in ops]
        lines.append(f"stage {s}: " + " ".join(words))
    return "\n".join(lines)
