"""The forward-only pass before a step, for the objectives that read the whole global batch
first (`Objective.needs_prepass`: aot's sort): the policy's (and, where not at hand, the
reference's) log-probs of every microbatch of this rank, then the objective's `prepass` over
the global batch on the last stage, whose result the step's loss (objective/step_loss.py) uses.
"""

from __future__ import annotations

import torch

from mcore_dpo.objective.contract import Objective
from mcore_dpo.objective.logprobs import SequenceLogps
from mcore_dpo.pipeline.executor import forward_only_ops, run_ops
from mcore_dpo.rank.metrics import whole_batch_prepass
from mcore_dpo.rank.reference import ReferenceSource, StepReference


@torch.no_grad()
def run_prepass(rank, *, policy: torch.nn.Module, reference: ReferenceSource, batch, mbs: list,
                groups: list[list[int]], objective: Objective, ref: StepReference) -> tuple[object, dict, StepReference]:
    """A forward-only policy pass (with the reference's, when it is not at hand already) over
    this rank's microbatches `mbs` of `batch` (a `worker.StepBatch`), then the objective's
    whole-batch state on the last stage (None elsewhere). Returns it, the reference log-probs
    the pass computed (keyed like the executor's), and what the plan still computes of the
    reference. `rank`: the worker's `rank.Rank`."""
    mesh = rank.mesh
    with_reference = reference.model is not None and (rank.config.ref_mode == "sequential" or ref.current)
    policy_rows: dict[int, SequenceLogps] = {}
    ctx = rank.stage_context({0: mbs}, policy=policy, reference=reference.model, forward_only=True,
                             loss_fn=_Record(policy_rows))
    run_ops(forward_only_ops(mesh=mesh, num_microbatches=len(mbs), policy=True, reference=with_reference), ctx)
    if with_reference:  # then the plan has no reference forward of this batch
        ref = StepReference(plan_mode="none" if rank.config.ref_mode == "sequential" else ref.plan_mode,
                            current=False, next=ref.next)
    if not mesh.is_last_stage:
        return None, {}, ref
    computed = dict(ctx.ref_logps)
    parts = []
    for mb, logps in policy_rows.items():
        positions = groups[mb]
        stored = computed.get((0, mb)) if with_reference else reference.stored(mb)
        rows = reference.rows(positions=positions, pair_ids=batch.pair_ids, given=batch.ref_logps, stored=stored)
        parts.append((logps, rows, positions))
    state = whole_batch_prepass(parts, objective=objective, num_samples=len(batch.pairs), mesh=mesh,
                                device=rank.platform.device)
    return state, computed, ref


class _Record:
    """The "loss" of the pre-pass: each microbatch's policy log-probs, kept."""

    def __init__(self, rows: dict[int, SequenceLogps]):
        self.rows = rows

    def __call__(self, mb: int, logps: SequenceLogps) -> torch.Tensor:
        self.rows[mb] = logps
        return torch.zeros(())
