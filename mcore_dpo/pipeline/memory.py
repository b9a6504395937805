"""The memory model of a plan: how many activations each stage holds at its peak, by category.

Walks each stage's op list in order, as the executor (`pipeline/executor.py`) runs it, and counts:

- `policy_stash`: microbatches whose policy forward has run and whose backward has not
  (unit: what one microbatch's forward through the stage saves for its backward; under
  --recompute, what recompute keeps: with full, each layer group's input. What a backward
  recomputes lives only inside that op: `memory_estimate.recompute_bytes` adds it to a stage;
  in a plan of v model chunks (--vpp) the unit is one chunk's forward, 1/v of the stage's layers,
  and the first stage holds the most: 2(p-1) + (v-1)p + 1 chunk forwards, against p without chunks);
- `reference_in_flight`: reference stage activations received and not yet consumed by their
  reference forward, or produced and not yet sent (unit: one stage-boundary activation,
  [seq, rows, hidden]);
- `carried`: reference activations kept for the next step (KEEP_REF_ACT) or kept by the
  previous one and not yet sent (SEND_KEPT_REF_ACT); same unit.

A transfer op holds what it sends and what it receives at once, until it ends; the peak is
over the state inside each transfer and after each op, as `pipeline/account.MemoryAccount`
observes it on a real run. Units: the model counts; bytes = count x the unit's bytes
(`memory_estimate.plan_activation_bytes` for a model shape).

Look at a plan's peaks:  python -c "from mcore_dpo.pipeline.memory import *; from mcore_dpo.pipeline.schedule import
build_plan; print(plan_memory(build_plan(num_stages=4, num_microbatches=8, ref_mode='interleaved')))"
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore_dpo.pipeline.plan import Op, OpKind, Plan, kept, transfers, virtual_neighbour

MEMORY_CATEGORIES = ("policy_stash", "reference_in_flight", "carried")


@dataclass(frozen=True)
class StageMemory:
    """Peak live activations of one stage over one step, in units (see the module docstring)."""

    policy_stash: int
    reference_in_flight: int
    carried: int


def _transfer_delta(part: Op) -> tuple[str | None, int]:
    """(category, +1 for a received tensor / -1 for a sent one) of one send or receive."""
    kind = part.kind
    if kind is OpKind.RECV_REF_ACT:
        return "reference_in_flight", 1
    if kind is OpKind.SEND_REF_ACT:
        return "reference_in_flight", -1
    if kind is OpKind.SEND_KEPT_REF_ACT:
        return "carried", -1
    return None, 0  # policy activations and grads: comm buffers, not modelled here


def stage_memory(ops: tuple[Op, ...], *, stage: int, num_stages: int, num_microbatches: int,
                 carry_in: bool, num_chunks: int = 1) -> StageMemory:
    """Peaks of one stage's op list; `carry_in`: the stage starts with the activations the
    previous step kept (`plan.kept`)."""
    live = dict.fromkeys(MEMORY_CATEGORIES, 0)
    if carry_in:
        live["carried"] = sum(len(kept(stage, num_stages=num_stages, num_microbatches=num_microbatches, chunk=chunk,
                                       num_chunks=num_chunks)) for chunk in range(num_chunks))
    peak = dict(live)

    def note() -> None:
        for name, value in live.items():
            peak[name] = max(peak[name], value)

    def has(op: Op, step: int) -> bool:
        """Whether op's chunk has a virtual stage upstream (-1) or downstream (1)."""
        return virtual_neighbour(stage, op.chunk, step=step, num_stages=num_stages, num_chunks=num_chunks) is not None

    for op in ops:
        parts = transfers(op)
        if parts:
            deltas = [_transfer_delta(part) for part in parts]
            for name, delta in deltas:  # inside the transfer: received buffers join the sent ones
                if name is not None and delta > 0:
                    live[name] += delta
            note()
            for name, delta in deltas:
                if name is not None and delta < 0:
                    live[name] += delta
        elif op.kind is OpKind.FWD:
            live["policy_stash"] += 1
        elif op.kind is OpKind.BWD:
            live["policy_stash"] -= 1
        elif op.kind is OpKind.REF_FWD:
            live["reference_in_flight"] += has(op, 1) - has(op, -1)
        elif op.kind is OpKind.KEEP_REF_ACT:
            live["reference_in_flight"] -= 1
            live["carried"] += 1
        note()
    return StageMemory(**peak)


def plan_memory(plan: Plan) -> tuple[StageMemory, ...]:
    """Peak live activations of every stage of a plan, in units."""
    return tuple(stage_memory(ops, stage=s, num_stages=plan.num_stages, num_microbatches=plan.num_microbatches,
                              carry_in=plan.carry_in, num_chunks=plan.num_chunks) for s, ops in enumerate(plan.stages))
