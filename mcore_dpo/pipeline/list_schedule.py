"""The list-scheduling steps both plan builders share: the plain 1F1B one (`pipeline/schedule.py`)
and the interleaved one with model chunks (`pipeline/interleaved.py`). schedule.py hands plans
with chunks to interleaved.py; both build on this module, which imports neither.

- `expected_ref_batches`: which global batches' reference forwards a step runs.
- `add_comm`: each send right after its producer, each receive right before its consumer,
  along the (virtual) pipeline.
- `run_events`: the event loop of a list scheduler in time.
- `latest_starts` / `latest_times`: when each compute op starts at the latest for a given
  step time (the slack a reference forward can use).
- `smallest_fit`: bisect the smallest step time at which a placement fits.
- `pair_crossing_transfers` / `paired`: make the lists deadlock-free under rendezvous
  transfers (a send waits for its receive, as on NCCL), pairing crossing transfers into one
  P2P op as megatron-core pairs send_forward_recv_backward.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq

from mcore_dpo.pipeline.check import (
    Key,
    Stages,
    advance,
    message_keys,
    timeline,
    waits_for,
)
from mcore_dpo.pipeline.plan import (
    Costs,
    Op,
    OpKind,
    Plan,
    PlanError,
    cost_of,
    kept,
    p2p,
    transfers,
    virtual_neighbour,
)


def expected_ref_batches(ref_mode: str, ref_current: bool, ref_next: bool) -> tuple[int, ...]:
    if ref_mode == "sequential":
        return (0,)
    if ref_mode == "interleaved":
        return tuple(b for b, on in ((0, ref_current), (1, ref_next)) if on)
    return ()


def add_comm(
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
    rule = dict(num_stages=num_stages, num_chunks=num_chunks)
    # (chunk, microbatch) of the activations each stage keeps for the next step / kept in the last one
    keep_out = [{(c, mb) for c in range(num_chunks) for mb in kept(s, num_microbatches=m_next, chunk=c, **rule)}
                if carry_out else set() for s in range(num_stages)]
    kept_in = [[(c, mb) for c in range(num_chunks) for mb in kept(s, num_microbatches=m, chunk=c, **rule)]
               if carry_in else [] for s in range(num_stages)]

    def neighbour(s: int, op: Op, step: int) -> tuple[int, int] | None:
        return virtual_neighbour(s, op.chunk, step=step, num_stages=num_stages, num_chunks=num_chunks)
    # Send order per link (src, dst) = order of the producing ops on src; a message is
    # (payload, microbatch, batch, the receiver's chunk).
    link_msgs: dict[tuple[int, int], list[tuple[str, int, int, int]]] = {}
    for s, ops in enumerate(compute_orders):
        for chunk, mb in kept_in[s]:
            down = virtual_neighbour(s, chunk, step=1, **rule)
            link_msgs.setdefault((s, down[0]), []).append(("ref_act", mb, 0, down[1]))
        for op in ops:
            down, up = neighbour(s, op, 1), neighbour(s, op, -1)
            if op.kind in (OpKind.FWD, OpKind.REF_FWD) and down is not None:
                if op.kind == OpKind.REF_FWD and op.batch == 1 and (op.chunk, op.microbatch) in keep_out[s]:
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
        out: list[Op] = [Op(OpKind.SEND_KEPT_REF_ACT, mb, 0, chunk=chunk) for chunk, mb in kept_in[s]]
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
                keep = op.batch == 1 and (op.chunk, op.microbatch) in keep_out[s]
                out.append(Op(OpKind.KEEP_REF_ACT if keep else OpKind.SEND_REF_ACT, op.microbatch, op.batch,
                              chunk=op.chunk))
            elif op.kind == OpKind.BWD and up is not None:
                out.append(Op(OpKind.SEND_GRAD, op.microbatch, chunk=op.chunk))
        stages.append(tuple(out))
    return tuple(stages)


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


def latest_times(orders: list[list[Op]], *, costs: Costs, makespan: float) -> list[list[tuple[float, float]]]:
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


def paired(plan: Plan, *, costs: Costs) -> Plan:
    """The plan with its crossing transfers paired, the fastest way under `costs`."""
    variants = list(dict.fromkeys(pair_crossing_transfers(plan.stages, prefer=prefer, costs=costs)
                                  for prefer in PREFER))
    makespans = [timeline(variant, costs).makespan for variant in variants]
    # The fastest; among equally fast ones, the first by repr (independent of PREFER's order).
    fastest = [variant for variant, makespan in zip(variants, makespans) if makespan == min(makespans)]
    return dataclasses.replace(plan, stages=min(fastest, key=repr) if len(fastest) > 1 else fastest[0])


# The builder pairs one plan's transfers in each `PREFER` way, from the same unpaired times.
_timeline_once = functools.lru_cache(maxsize=4)(timeline)


# Which stage posts a receive early when two stages each wait in a send to the other.
PREFER = ("timed", "downstream", "upstream", "both")


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
    if prefer not in PREFER:
        raise ValueError(f"prefer must be one of {PREFER}, got {prefer!r}")
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
