"""What a pipeline plan is: its ops, the plan itself, op costs, and the carrying rule.

A plan is, for each pipeline stage, the ordered list of ops the executor runs top to
bottom: compute (policy forward, policy backward, reference forward) and point-to-point
transfers between neighbouring stages. `pipeline/schedule.py` builds plans, `pipeline/check.py` checks
and times them; this module only defines them.

Transfers follow rendezvous semantics (what NCCL does with a large message): a send
completes only once the peer has posted the matching receive, messages on one link and
direction are matched in order, and a rank runs its ops one after the other. Where two
peers would each wait for the other, the plan pairs the crossing send and receive into one
P2P op: its transfers are posted together (`torch.distributed.batch_isend_irecv`) and
the op ends when all of them have completed. A message may carry riders (`pipeline.Riders`:
the MoE aux-loss counts with a policy act or grad), posted in the same transfer right after
its tensor, so they add no message that the checks would have to order.
"""

from __future__ import annotations

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
    P2P = "p2p"  # several sends/receives posted together (Op.parts); ends when all have completed


REF_MODES = ("interleaved", "sequential", "precomputed", "none")

# Reference activations produced by a stage and not yet consumed by the next
# stage, per link (one stage-output tensor each, far less than the activations
# 1F1B stashes for backward). The interleaved planner never exceeds this; 3 is
# what the bubble-filling optimum needs at p=4, m=8.
MAX_REF_ACTS_IN_FLIGHT = 3

COMPUTE_KINDS = (OpKind.FWD, OpKind.BWD, OpKind.REF_FWD)
# send/recv kind -> (payload, stage offset of the peer)
SEND_KINDS = {OpKind.SEND_ACT: ("act", 1), OpKind.SEND_REF_ACT: ("ref_act", 1), OpKind.SEND_GRAD: ("grad", -1),
              OpKind.SEND_KEPT_REF_ACT: ("ref_act", 1)}
RECV_KINDS = {OpKind.RECV_ACT: ("act", -1), OpKind.RECV_REF_ACT: ("ref_act", -1), OpKind.RECV_GRAD: ("grad", 1)}
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
    # The peer is implied: ACT/REF_ACT go to stage+1 (come from stage-1), GRAD the other way;
    # with model chunks, along the virtual pipeline (`virtual_neighbour`).
    parts: tuple[Op, ...] = ()  # P2P only: its sends and receives (microbatch is -1 then)
    # The model chunk (virtual stage) of this stage the op belongs to; always 0 without --vpp.
    chunk: int = 0


def p2p(parts: list[Op] | tuple[Op, ...]) -> Op:
    """One transfer op for `parts`: the op itself when there is one, else a P2P op."""
    parts = tuple(parts)
    return parts[0] if len(parts) == 1 else Op(OpKind.P2P, -1, 0, parts)


def transfers(op: Op) -> tuple[Op, ...]:
    """The sends and receives an op posts (none for compute and KEEP_REF_ACT)."""
    if op.kind is OpKind.P2P:
        return op.parts
    return (op,) if op.kind in SEND_KINDS or op.kind in RECV_KINDS else ()


def virtual_neighbour(stage: int, chunk: int, *, step: int, num_stages: int, num_chunks: int) -> tuple[int, int] | None:
    """(stage, chunk) one virtual stage downstream (step=1) or upstream (step=-1) of chunk
    `chunk` on `stage`, or None past either end. Virtual stage c*p + s is chunk c of stage s,
    so the last stage's chunk c feeds stage 0's chunk c+1 (the wrap-around link)."""
    index = chunk * num_stages + stage + step
    if not 0 <= index < num_stages * num_chunks:
        return None
    return index % num_stages, index // num_stages


def num_chunks_of(stages: tuple[tuple[Op, ...], ...]) -> int:
    """Model chunks per stage of these op lists: one more than the largest chunk any op names."""
    return 1 + max((part.chunk for ops in stages for op in ops for part in (op, *op.parts)), default=0)


def _far_end(op: Op, *, stage: int, num_stages: int, num_chunks: int) -> tuple[int, int]:
    """(stage, chunk) at the other end of a send or receive; without model chunks a stage
    beyond either end when there is none (callers report it)."""
    step = (SEND_KINDS.get(op.kind) or RECV_KINDS[op.kind])[1]
    if num_chunks == 1:
        return stage + step, 0
    return virtual_neighbour(stage, op.chunk, step=step, num_stages=num_stages, num_chunks=num_chunks) or (-1, -1)


def message(op: Op, *, stage: int = 0, num_stages: int = 1, num_chunks: int = 1) -> tuple:
    """(payload, microbatch, batch) of a send or receive, followed by the sender's chunk
    where it is not 0 (so both ends name the message alike)."""
    payload = (SEND_KINDS.get(op.kind) or RECV_KINDS[op.kind])[0]
    sender_chunk = op.chunk if op.kind in SEND_KINDS else \
        _far_end(op, stage=stage, num_stages=num_stages, num_chunks=num_chunks)[1]
    return (payload, op.microbatch, op.batch) + ((sender_chunk,) if sender_chunk else ())


def peer(op: Op, *, stage: int, num_stages: int = 1, num_chunks: int = 1) -> int:
    """The stage a send goes to or a receive comes from (-1 or num_stages: none)."""
    return _far_end(op, stage=stage, num_stages=num_stages, num_chunks=num_chunks)[0]


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
    # Microbatches of the next global batch (its reference forwards, batch 1); None: the same as
    # this batch's. Token-balanced microbatches (packing) make the two differ from step to step.
    num_next_microbatches: int | None = None
    # Model chunks per stage (--vpp): chunk c of stage s is virtual stage c*num_stages + s.
    num_chunks: int = 1

    @property
    def next_m(self) -> int:
        return self.num_microbatches if self.num_next_microbatches is None else self.num_next_microbatches


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


def cost_of(kind: OpKind, costs: Costs) -> float:
    if kind == OpKind.FWD:
        return costs.fwd
    return costs.bwd if kind == OpKind.BWD else costs.ref_fwd


def check_costs(costs: Costs) -> None:
    for name in ("fwd", "bwd", "ref_fwd"):
        if not getattr(costs, name) > 0:
            raise ValueError(f"Costs.{name} must be > 0, got {getattr(costs, name)!r}")
    if not costs.comm >= 0:
        raise ValueError(f"Costs.comm must be >= 0, got {costs.comm!r}")


def carried(stage: int, *, num_stages: int, num_microbatches: int, chunk: int = 0, num_chunks: int = 1) -> range:
    """Microbatches whose next-batch reference forward `stage` (its model chunk `chunk`) leaves
    to the start of the next step in a carrying plan: the last min(stage, m). One forward per
    stage above it is the warm-up idle time it fills. The sets grow with the stage, so what
    stage s runs early, stage s+1 also runs early, and only the first of stage s+1's extra ones
    crosses the step boundary, as an activation that stage s keeps.

    With model chunks (v > 1) the same rule holds for the last chunk, the last lap round the
    ring of virtual stages (v-1)p + s, and no earlier chunk carries: whatever a chunk c < v-1
    carried, every virtual stage after it would carry too, stage 0's chunk c+1 among them, and
    stage 0 has no warm-up idle time. A chunk forward costs 1/v of a stage's, as does the idle
    time: stage s idles s chunk forwards before its first policy forward, which its s carried
    ones fill."""
    if num_stages < 2:
        return range(0)
    count = min(stage, num_microbatches) if chunk == num_chunks - 1 else 0
    return range(num_microbatches - count, num_microbatches)


def kept(stage: int, *, num_stages: int, num_microbatches: int, chunk: int = 0, num_chunks: int = 1) -> range:
    """Next-batch reference activations that `stage` (its chunk `chunk`) keeps for the next step
    (carry_out): those its virtual stage downstream carries and it does not."""
    down = virtual_neighbour(stage, chunk, step=1, num_stages=num_stages, num_chunks=num_chunks)
    if down is None:
        return range(0)
    kw = dict(num_stages=num_stages, num_microbatches=num_microbatches, num_chunks=num_chunks)
    mine, theirs = carried(stage, chunk=chunk, **kw), carried(down[0], chunk=down[1], **kw)
    return range(theirs.start, mine.start)


def op_word(op: Op) -> str:
    """Short name of one op as format_plan writes it (`.c` = model chunk c, where not 0)."""
    if op.kind is OpKind.P2P:
        return "[" + "+".join(op_word(part) for part in op.parts) + "]"
    return f"{_SHORT[op.kind]}{op.microbatch}{'n' if op.batch else ''}{f'.{op.chunk}' if op.chunk else ''}"


def format_plan(plan: Plan) -> str:
    """One line per stage, e.g. `stage 1: ra0 F0 [sa0+rg0] rr0n R0n sr0n ...` (n = next
    batch; [..] = transfers posted together)."""
    return "\n".join(f"stage {s}: " + " ".join(map(op_word, ops)) for s, ops in enumerate(plan.stages))
