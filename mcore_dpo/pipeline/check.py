"""Checking and timing plans, without any process.

- `validate_plan`: every op once, dependencies in order, messages matched in order on each
  link, and no deadlock under rendezvous transfers (see `pipeline/plan.py`): a send waits for the
  peer's matching receive, a receive for the peer's send, and a rank runs its ops in order.
- `validate_stages`: the transfer rules alone, for any per-stage op lists (forward-only
  chains for evaluation and the reference precompute).
- `simulate`: the plan in time under `Costs`: compute takes its cost and a receive waits for
  its message (the host view on NCCL: an isend returns at once).
- `validate_host_device`: the two-level model of NCCL (`host_device_run`): each rank's host
  enqueues the ops, its GPU runs them in order; the first message on each link direction
  blocks both hosts until the peer's host posts its partner (NCCL connects lazily, in
  `ncclGroupEnd`), and a compute op may sync the host with its GPU (a host read of a device
  value). `validate_plan` runs it with warmed-up links and every compute op syncing.

Rendezvous is the stricter model: a plan that passes it also never deadlocks when sends are
buffered (gloo, small NCCL messages), and execution under it does not depend on timing, so
one order-only run decides it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from mcore_dpo.pipeline.plan import (
    COMPUTE_KINDS,
    RECV_KINDS,
    REF_MODES,
    SEND_KINDS,
    Costs,
    Op,
    OpKind,
    Plan,
    PlanError,
    SimResult,
    carried,
    check_costs,
    cost_of,
    kept,
    message,
    num_chunks_of,
    op_word,
    peer,
    transfers,
    virtual_neighbour,
)

Stages = tuple[tuple[Op, ...], ...]
# A message: ((src stage, dst stage), its index among the messages on that link)
Key = tuple[tuple[int, int], int]


def _expected_ops(
    *, stage: int, num_stages: int, num_microbatches: int, ref_batches: tuple[int, ...], carry_in: bool,
    carry_out: bool, num_next_microbatches: int | None = None, num_chunks: int = 1,
) -> Counter:
    """The ops stage `stage` must run, each model chunk as virtual stage chunk*p + stage."""
    m_next = num_microbatches if num_next_microbatches is None else num_next_microbatches
    expected: Counter = Counter()
    for chunk in range(num_chunks):
        # Carried in: this batch's microbatches; carried out and kept: the next batch's.
        rule = dict(num_stages=num_stages, chunk=chunk, num_chunks=num_chunks)
        mine = carried(stage, num_microbatches=num_microbatches, **rule)
        mine_next = carried(stage, num_microbatches=m_next, **rule)
        kept_in = kept(stage, num_microbatches=num_microbatches, **rule)
        kept_out = kept(stage, num_microbatches=m_next, **rule)
        first, last = (virtual_neighbour(stage, chunk, step=step, num_stages=num_stages, num_chunks=num_chunks)
                       is None for step in (-1, 1))
        for mb in range(num_microbatches):
            expected[Op(OpKind.FWD, mb, chunk=chunk)] += 1
            expected[Op(OpKind.BWD, mb, chunk=chunk)] += 1
            if not first:
                expected[Op(OpKind.RECV_ACT, mb, chunk=chunk)] += 1
                expected[Op(OpKind.SEND_GRAD, mb, chunk=chunk)] += 1
            if not last:
                expected[Op(OpKind.SEND_ACT, mb, chunk=chunk)] += 1
                expected[Op(OpKind.RECV_GRAD, mb, chunk=chunk)] += 1
        for batch in ref_batches:
            for mb in range(num_microbatches if batch == 0 else m_next):
                if batch == 1 and carry_out and mb in mine_next:
                    continue  # left to the start of the next step
                expected[Op(OpKind.REF_FWD, mb, batch, chunk=chunk)] += 1
                if not first:
                    expected[Op(OpKind.RECV_REF_ACT, mb, batch, chunk=chunk)] += 1
                if not last:
                    keep = batch == 1 and carry_out and mb in kept_out
                    expected[Op(OpKind.KEEP_REF_ACT if keep else OpKind.SEND_REF_ACT, mb, batch, chunk=chunk)] += 1
        if carry_in:
            for mb in mine:
                expected[Op(OpKind.REF_FWD, mb, 0, chunk=chunk)] += 1
                if not first:
                    expected[Op(OpKind.RECV_REF_ACT, mb, 0, chunk=chunk)] += 1
                if not last:
                    expected[Op(OpKind.SEND_REF_ACT, mb, 0, chunk=chunk)] += 1
            for mb in kept_in:
                expected[Op(OpKind.SEND_KEPT_REF_ACT, mb, 0, chunk=chunk)] += 1
    return expected


def _check_ops(stages: Stages) -> None:
    """Every entry is an Op; P2P ops hold only sends and receives, two or more."""
    for s, ops in enumerate(stages):
        for i, op in enumerate(ops):
            if not isinstance(op, Op) or not isinstance(op.kind, OpKind):
                raise PlanError(f"plan stage {s} op {i}: not an Op with an OpKind: {op!r}")
            if op.kind is OpKind.P2P:
                bad = [part for part in op.parts if not isinstance(part, Op)
                       or not (part.kind in SEND_KINDS or part.kind in RECV_KINDS)]
                if bad or len(op.parts) < 2:
                    raise PlanError(f"plan stage {s} op {i}: a p2p op holds two or more sends/receives, "
                                    f"got {op.parts!r}")
            elif op.parts:
                raise PlanError(f"plan stage {s} op {i}: only p2p ops have parts, got {op!r}")


def _flat(ops: tuple[Op, ...]) -> list[tuple[int, Op]]:
    """(index of the op in the stage, op) with each P2P op replaced by its parts."""
    return [(i, part) for i, op in enumerate(ops) for part in (op.parts if op.kind is OpKind.P2P else (op,))]


def _check_structure(plan: Plan) -> None:
    p, m = plan.num_stages, plan.num_microbatches
    if plan.ref_mode not in REF_MODES:
        raise PlanError(f"plan.ref_mode must be one of {REF_MODES}, got {plan.ref_mode!r}")
    if not isinstance(m, int) or m < 1:
        raise PlanError(f"plan.num_microbatches must be an int >= 1, got {m!r}")
    if not isinstance(plan.next_m, int) or plan.next_m < 1:
        raise PlanError(f"plan.num_next_microbatches must be None or an int >= 1, got {plan.num_next_microbatches!r}")
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
    v = plan.num_chunks
    if not isinstance(v, int) or v < 1 or (v > 1 and p < 2):
        raise PlanError(f"plan.num_chunks={v!r}: model chunks need an int >= 1, and more than one needs >= 2 stages")
    _check_ops(plan.stages)
    if num_chunks_of(plan.stages) > v:
        raise PlanError(f"plan has ops of model chunk {num_chunks_of(plan.stages) - 1}, but num_chunks={v}")

    for s, ops in enumerate(plan.stages):
        flat = _flat(ops)
        have = Counter(op for _, op in flat)
        want = _expected_ops(stage=s, num_stages=p, num_microbatches=m, ref_batches=plan.ref_batches,
                             carry_in=plan.carry_in, carry_out=plan.carry_out,
                             num_next_microbatches=plan.num_next_microbatches, num_chunks=v)
        for op in [] if have == want else sorted(set(have) | set(want), key=repr):
            if have[op] != want[op]:
                raise PlanError(f"plan stage {s}: {op.kind.value} mb={op.microbatch} batch={op.batch}{_in(op)} "
                                f"appears {have[op]} times, expected {want[op]}")
        pos = {op: i for i, op in flat}

        def before(a: Op, b: Op, why: str) -> None:
            if pos[a] > pos[b]:
                raise PlanError(f"plan stage {s}: {a.kind.value} mb={a.microbatch} batch={a.batch}{_in(a)} "
                                f"comes after {b.kind.value} mb={b.microbatch}{_in(b)} ({why})")

        for c in range(v):
            # Chunk c of stage s is virtual stage c*p + s: first/last of the whole model or not.
            first, last = (virtual_neighbour(s, c, step=step, num_stages=p, num_chunks=v) is None for step in (-1, 1))
            for mb in range(m):
                fwd, bwd = Op(OpKind.FWD, mb, chunk=c), Op(OpKind.BWD, mb, chunk=c)
                before(fwd, bwd, "backward needs its forward")
                if not first:
                    before(Op(OpKind.RECV_ACT, mb, chunk=c), fwd, "forward needs its input")
                    before(bwd, Op(OpKind.SEND_GRAD, mb, chunk=c), "grad is sent after the backward")
                if not last:
                    before(fwd, Op(OpKind.SEND_ACT, mb, chunk=c), "activation is sent after the forward")
                    before(Op(OpKind.RECV_GRAD, mb, chunk=c), bwd, "backward needs the output grad")
            for ref in [op for _, op in flat if op.kind == OpKind.REF_FWD and op.chunk == c]:
                mb, batch = ref.microbatch, ref.batch
                if not first:
                    before(Op(OpKind.RECV_REF_ACT, mb, batch, chunk=c), ref, "reference forward needs its input")
                if not last:
                    keep = Op(OpKind.KEEP_REF_ACT, mb, batch, chunk=c)
                    before(ref, keep if keep in pos else Op(OpKind.SEND_REF_ACT, mb, batch, chunk=c),
                           "activation is sent after the forward, or kept")
                if last and batch == 0:
                    before(ref, Op(OpKind.FWD, mb, chunk=c), "the loss needs this batch's reference log-probs")


def _in(op: Op) -> str:
    """` chunk=c` in a message about an op of model chunk c > 0."""
    return f" chunk={op.chunk}" if op.chunk else ""


def message_keys(stages: Stages) -> list[list[list[Key]]]:
    """keys[s][i] = the messages op i of stage s sends or receives, numbered per link in
    issue order (NCCL matches point-to-point messages between two ranks in order). Raises
    PlanError when a link's sends and receives do not pair up one to one, in order."""
    p, v = len(stages), num_chunks_of(stages)
    count: dict[tuple[tuple[int, int], bool], int] = {}
    sent: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    got: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    keys: list[list[list[Key]]] = []
    for s, ops in enumerate(stages):
        keys.append([])
        for op in ops:
            op_keys = []
            for part in transfers(op):
                other = peer(part, stage=s, num_stages=p, num_chunks=v)
                if not 0 <= other < p:
                    raise PlanError(f"plan stage {s}: {part.kind.value} mb={part.microbatch} has no peer "
                                    f"(stage {other} does not exist)")
                is_send = part.kind in SEND_KINDS
                link = (s, other) if is_send else (other, s)
                msg = message(part, stage=s, num_stages=p, num_chunks=v)
                (sent if is_send else got).setdefault(link, []).append(msg)
                n = count.get((link, is_send), 0)
                op_keys.append((link, n))
                count[(link, is_send)] = n + 1
            keys[-1].append(op_keys)
    for link in sorted(set(sent) | set(got)):
        a, b = sent.get(link, []), got.get(link, [])
        for k, (x, y) in enumerate(zip(a, b)):
            if x != y:
                raise PlanError(f"plan link stage {link[0]}->{link[1]}: message {k} is sent as {x} "
                                f"but received as {y} (p2p is matched in order)")
        if len(a) != len(b):
            raise PlanError(f"plan link stage {link[0]}->{link[1]}: {len(a)} messages sent, {len(b)} received")
    return keys


def rendezvous_run(stages: Stages, keys: list[list[list[Key]]]) -> tuple[list[int], set[Key]]:
    """Run the stages in order under rendezvous transfers until nothing moves.

    Returns where each stage stopped (len(ops) when done) and the messages delivered. An op
    posts all its transfers at once; a message is delivered once both its sender and its
    receiver have posted it; the op ends when all its messages are delivered.
    """
    ptr = [0] * len(stages)
    done: set[Key] = set()
    advance(keys, ptr=ptr, done=done)
    return ptr, done


def advance(keys: list[list[list[Key]]], *, ptr: list[int], done: set[Key]) -> None:
    """rendezvous_run from a given state (`ptr`, `done`, both updated in place)."""
    p = len(keys)
    moved = True
    while moved:
        moved = False
        for s in range(p):
            while ptr[s] < len(keys[s]):
                posted = keys[s][ptr[s]]
                for key in posted:
                    if key not in done:
                        (src, dst), _ = key
                        other = dst if s == src else src
                        if ptr[other] < len(keys[other]) and key in keys[other][ptr[other]]:
                            done.add(key)
                if not all(key in done for key in posted):
                    break
                ptr[s] += 1
                moved = True


def waits_for(keys: list[list[list[Key]]], ptr: list[int], done: set[Key]) -> dict:
    """{(stage, neighbour it waits for): its undelivered messages} where a rendezvous run stopped."""
    waits: dict[tuple[int, int], list[Key]] = {}
    for s in range(len(keys)):
        for key in keys[s][ptr[s]] if ptr[s] < len(keys[s]) else ():
            (src, dst), _ = key
            if key not in done:
                waits.setdefault((s, dst if s == src else src), []).append(key)
    return waits


def _check_rendezvous(stages: Stages) -> None:
    keys = message_keys(stages)
    ptr, done = rendezvous_run(stages, keys)
    waits = waits_for(keys, ptr, done)
    if not waits:
        return
    # Stages wait only for neighbours: a deadlock has two that wait for each other.
    s, t = min(((a, b) for a, b in waits if (b, a) in waits), default=min(waits))

    def where(stage: int) -> str:
        return f"op {ptr[stage]} ({op_word(stages[stage][ptr[stage]])})"

    raise PlanError(f"plan deadlock under rendezvous transfers: stage {s} waits at {where(s)} for stage {t}, "
                    f"which waits at {where(t)}")


def _timed_ops(stages: Stages, costs: Costs) -> list[list[tuple]]:
    """Each op once as (compute cost or None, its sends [(link, message)], its receives
    [(link, message)]); a kept activation is a transfer with neither (it stays in memory)."""
    out, p, v = [], len(stages), num_chunks_of(stages)
    for s, ops in enumerate(stages):
        timed = []
        for op in ops:
            if op.kind in COMPUTE_KINDS:
                timed.append((cost_of(op.kind, costs), (), ()))
                continue
            parts = transfers(op)
            ends = [(peer(part, stage=s, num_stages=p, num_chunks=v),
                     message(part, stage=s, num_stages=p, num_chunks=v), part.kind in SEND_KINDS) for part in parts]
            sends = tuple(((s, other), msg) for other, msg, is_send in ends if is_send)
            recvs = tuple(((other, s), msg) for other, msg, is_send in ends if not is_send)
            timed.append((None, sends, recvs))
        out.append(timed)
    return out


def timeline(stages: Stages, costs: Costs) -> SimResult:
    """Run per-stage op lists in time: compute takes its cost, sends don't block the host
    (an op's sends are posted when it starts), receives wait for their messages."""
    p = len(stages)
    timed = _timed_ops(stages, costs)
    clock, ptr = [0.0] * p, [0] * p
    links: dict[tuple[int, int], list[tuple[tuple[str, int, int], float]]] = {}
    taken: dict[tuple[int, int], int] = {}  # messages received so far, per link
    sent_by = [-1] * p  # index of the op whose sends stage s has posted
    times: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    progress = True
    while progress:
        progress = False
        for s in range(p):
            ops = timed[s]
            while ptr[s] < len(ops):
                cost, sends, recvs = ops[ptr[s]]
                t = clock[s]
                if cost is not None:
                    clock[s] = t + cost
                else:
                    if sent_by[s] != ptr[s]:
                        for link, msg in sends:
                            links.setdefault(link, []).append((msg, t + costs.comm))
                        sent_by[s] = ptr[s]
                    need: dict[tuple[int, int], int] = {}
                    arrival = t
                    for link, expected in recvs:
                        queue, index = links.get(link, ()), taken.get(link, 0) + need.get(link, 0)
                        if index >= len(queue):
                            break  # blocked until the peer sends
                        msg, at = queue[index]
                        if msg != expected:
                            raise PlanError(f"plan link stage {link[0]}->{s}: received {msg}, "
                                            f"stage {s} expected {expected}")
                        need[link] = need.get(link, 0) + 1
                        arrival = max(arrival, at)
                    else:
                        recvs = ()
                    if recvs:
                        break
                    for link, n in need.items():
                        taken[link] = taken.get(link, 0) + n
                    clock[s] = arrival
                times[s].append((t, clock[s]))
                ptr[s] += 1
                progress = True
    for s in range(p):
        if ptr[s] < len(stages[s]):
            raise PlanError(f"plan deadlock: stage {s} waits forever at op {ptr[s]} ({op_word(stages[s][ptr[s]])})")

    makespan = max(clock)
    busy = tuple(
        sum(end - start for op, (start, end) in zip(stages[s], times[s]) if op.kind in COMPUTE_KINDS)
        for s in range(p)
    )
    worst, v = 0, num_chunks_of(stages)
    for s, t in [(s, s + 1) for s in range(p - 1)] + ([(p - 1, 0)] if v > 1 else []):
        # +1 when stage s sends a reference activation to t, -1 when t starts on one from s.
        deltas = [(times[s][i][0], 1) for i, op in enumerate(stages[s]) for part in transfers(op)
                  if part.kind in (OpKind.SEND_REF_ACT, OpKind.SEND_KEPT_REF_ACT)
                  and peer(part, stage=s, num_stages=p, num_chunks=v) == t]
        deltas += [(times[t][i][0], -1) for i, op in enumerate(stages[t]) if op.kind == OpKind.REF_FWD
                   and (virtual_neighbour(t, op.chunk, step=-1, num_stages=p, num_chunks=v) or (-1,))[0] == s]
        level = 0
        for _, delta in sorted(deltas):
            level += delta
            worst = max(worst, level)
    bubble = 1.0 - sum(busy) / (p * makespan) if makespan > 0 else 0.0
    return SimResult(makespan, busy, bubble, tuple(tuple(ts) for ts in times), worst)


# Which compute ops sync the host with its GPU: syncs(stage, op) -> bool.
Syncs = Callable[[int, Op], bool]


def every_compute_op(stage: int, op: Op) -> bool:
    """The worst case: every forward and backward waits for the GPU (what validate_plan assumes)."""
    return True


def every_forward(stage: int, op: Op) -> bool:
    return op.kind in (OpKind.FWD, OpKind.REF_FWD)


def _links(keys: list[list[list[Key]]]) -> set[tuple[int, int]]:
    return {link for ops in keys for op_keys in ops for link, _ in op_keys}


def host_device_run(stages: Stages, *, warmed_up: bool, syncs: Syncs) -> tuple[list[int], list[int], set]:
    """Run the stages under the two-level model until nothing moves.

    Each stage has a host that posts its ops in order and a GPU that runs what has been
    posted, in order. A compute op that `syncs` keeps the host until its GPU has run every
    op before it. A transfer op is posted at once, except that the first message on a link
    direction (its message 0) first connects the link: both hosts wait in the ops holding it
    until both have reached them (`warmed_up`: every link was connected at start-up). On the
    GPUs the transfers are rendezvous (`advance`): a message is delivered once both GPUs are
    at the ops holding it. Returns (host positions, GPU positions, connected links).
    """
    keys = message_keys(stages)
    p = len(stages)
    first = {(s, link): i for s in range(p) for i, op_keys in enumerate(keys[s]) for link, n in op_keys if n == 0}
    connected = _links(keys) if warmed_up else set()
    host, gpu, done = [0] * p, [0] * p, set()
    moved = True
    while moved:
        moved = False
        for s in range(p):
            while host[s] < len(stages[s]):
                i = host[s]
                if stages[s][i].kind in COMPUTE_KINDS:
                    if syncs(s, stages[s][i]) and gpu[s] < i:
                        break
                else:
                    for link, _ in keys[s][i]:
                        other = link[1] if link[0] == s else link[0]
                        if link not in connected and host[other] == first[(other, link)]:
                            connected.add(link)
                    if any(link not in connected for link, _ in keys[s][i]):
                        break
                host[s] += 1
                moved = True
            while gpu[s] < host[s]:
                for key in keys[s][gpu[s]]:
                    (src, dst), _ = key
                    other = dst if s == src else src
                    if gpu[other] < host[other] and key in keys[other][gpu[other]]:
                        done.add(key)
                if not all(key in done for key in keys[s][gpu[s]]):
                    break
                gpu[s] += 1
                moved = True
    return host, gpu, connected


def validate_host_device(stages: Stages, *, warmed_up: bool = True, syncs: Syncs = every_compute_op) -> None:
    """Raise PlanError (one line) unless these per-stage op lists run to the end under the
    two-level host/GPU model (`host_device_run`). A plan that passes `validate_stages` passes
    this with `warmed_up` whatever syncs: once no host waits in a transfer, a sync only holds a
    host until its GPU gets there, and the GPUs run the rendezvous model."""
    keys = message_keys(stages)
    host, gpu, connected = host_device_run(stages, warmed_up=warmed_up, syncs=syncs)
    if all(host[s] == gpu[s] == len(ops) for s, ops in enumerate(stages)):
        return

    def op_at(s: int, i: int) -> str:
        return f"op {i} ({op_word(stages[s][i])})"

    def gpu_wait(s: int) -> str:
        (src, dst), _ = keys[s][gpu[s]][0]
        return f"GPU {s} waits at {op_at(s, gpu[s])} for stage {dst if s == src else src}"

    waits = []
    for s, ops in enumerate(stages):
        if host[s] < len(ops) and ops[host[s]].kind in COMPUTE_KINDS:
            waits.append(f"host {s} waits at {op_at(s, host[s])} for its GPU"
                         + (f" ({gpu_wait(s)})" if gpu[s] < host[s] else ""))
        elif host[s] < len(ops):
            link = next(link for link, _ in keys[s][host[s]] if link not in connected)
            waits.append(f"host {s} waits at {op_at(s, host[s])} to connect link {link[0]}->{link[1]}")
        elif gpu[s] < len(ops):
            waits.append(gpu_wait(s))
    lazy = "" if warmed_up else " without warmed-up links"
    raise PlanError(f"plan hangs under the host/GPU model{lazy}: " + "; ".join(waits))


def validate_stages(stages: Stages) -> None:
    """Raise PlanError (one line) unless the transfers of these per-stage op lists pair up in
    order on every link and run to the end under rendezvous semantics, and under the
    host/GPU model with warmed-up links whatever the compute ops sync."""
    _check_ops(stages)
    _check_rendezvous(stages)
    validate_host_device(stages)


def validate_plan(plan: Plan) -> None:
    """Raise PlanError (one line) unless every stage's op list is complete, ordered and
    deadlock-free under rendezvous transfers, and under the host/GPU model with warmed-up
    links (what the executor sets up: `pipeline.warm_up_links`) whatever the compute ops sync."""
    _check_structure(plan)
    _check_rendezvous(plan.stages)
    validate_host_device(plan.stages)


def simulate(plan: Plan, *, costs: Costs = Costs()) -> SimResult:
    """Validate the plan, then time it under `costs`."""
    check_costs(costs)
    validate_plan(plan)
    return timeline(plan.stages, costs)


def closed_form_makespans(*, num_stages: int, num_microbatches: int, costs: Costs = Costs()) -> dict[str, float]:
    """Textbook step times with free communication (comm is ignored)."""
    slots = num_microbatches + num_stages - 1
    policy = slots * (costs.fwd + costs.bwd)
    return {
        "1f1b": policy,
        "separate_pass": policy + slots * costs.ref_fwd,
        "concatenated": slots * (costs.fwd + costs.bwd + costs.ref_fwd),
    }
