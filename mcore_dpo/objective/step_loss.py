"""The loss of one training step, as the pipeline's last stage calls it for each microbatch,
and the forward-only pass that orders the whole batch first for the losses that sort it.

`StepLoss(mb, logps)` turns a microbatch's policy log-probs into its share of the step's loss:
it pairs them with their reference log-probs (`ReferenceSource.rows`), computes the per-pair
losses of the configured loss (`loss.pair_losses`) and adds the microbatch's metric sums, which
stay on the device until the step's end (one read per step, not per microbatch).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_dpo.objective.logprobs import SequenceLogps, pair_logps
from mcore_dpo.objective.loss import METRIC_SUM_KEYS, BatchSort, metric_sum_vector, pair_losses
from mcore_dpo.objective.loss_spec import LossSpec
from mcore_dpo.pipeline.executor import forward_only_ops, run_ops
from mcore_dpo.rank.metrics import global_sort
from mcore_dpo.rank.reference import ReferenceSource, StepReference


class StepLoss:
    """One step's loss over this rank's microbatches (module docstring).

    `groups[mb]`: the positions in the global batch of microbatch mb's pairs; `computed`: the
    executor's reference log-probs by (batch offset, microbatch), taken as they are used;
    `sort`: the whole batch's order for the losses that need it (aot)."""

    def __init__(self, *, spec: LossSpec, pairs: Sequence, groups: list[list[int]], dp: int,
                 reference: ReferenceSource, computed: dict[tuple[int, int], SequenceLogps],
                 pair_ids: Sequence[int] = (), given: torch.Tensor | None = None, sort: BatchSort | None = None,
                 device: torch.device):
        self.spec, self.groups, self.dp = spec, groups, dp
        self.reference, self.computed, self.pair_ids, self.given = reference, computed, pair_ids, given
        self.sort = sort
        self.num_pairs = len(pairs)
        self.chosen_tokens = sum(len(p.chosen_ids) for p in pairs)
        self.sums = torch.zeros(len(METRIC_SUM_KEYS), dtype=torch.float64, device=device)

    def __call__(self, mb: int, logps: SequenceLogps) -> torch.Tensor:
        positions = self.groups[mb]
        ref = self.reference.rows(positions=positions, pair_ids=self.pair_ids, given=self.given,
                                  stored=self.computed.pop((0, mb), None))
        pl = pair_logps(logps, ref, b=len(positions), positions=positions)
        kwargs = dict(spec=self.spec, num_pairs_global=self.num_pairs, chosen_tokens_global=self.chosen_tokens,
                      sort=self.sort)
        self.sums.add_(metric_sum_vector(pl, **kwargs))
        # DDP averages gradients over dp ranks; scale by dp so the result is the global mean.
        return pair_losses(pl, **kwargs).sum() / self.num_pairs * self.dp


@torch.no_grad()
def sort_batch(rank, *, policy: torch.nn.Module, reference: ReferenceSource, batch, mbs: list, groups: list[list[int]],
               spec: LossSpec, ref: StepReference) -> tuple[BatchSort | None, dict, StepReference]:
    """aot/aot_unpaired: a forward-only policy pass (with the reference's, when it is not at hand
    already) over this rank's microbatches `mbs` of `batch` (a `worker.StepBatch`), then the
    BatchSort of the whole global batch on the last stage. Returns it, the reference log-probs
    the pass computed (keyed like the executor's), and what the plan still computes of the
    reference. `rank`: the worker's `rank.Rank`."""
    mesh = rank.mesh
    with_reference = reference.model is not None and (rank.config.ref_mode == "sequential" or ref.current)
    ctx = rank.stage_context({0: mbs}, policy=policy, reference=reference.model, forward_only=True)
    policy_rows: dict[int, SequenceLogps] = {}
    ctx.loss_fn = _Record(policy_rows)
    run_ops(forward_only_ops(mesh=mesh, num_microbatches=len(mbs), policy=True, reference=with_reference), ctx)
    if with_reference:  # then the plan has no reference forward of this batch
        ref = StepReference(plan_mode="none" if rank.config.ref_mode == "sequential" else ref.plan_mode,
                            current=False, next=ref.next)
    if not mesh.is_last_stage:
        return None, {}, ref
    computed = dict(ctx.ref_logps)
    parts = {}
    for mb, logps in policy_rows.items():
        positions = groups[mb]
        stored = computed.get((0, mb)) if with_reference else reference.stored(mb)
        rows = reference.rows(positions=positions, pair_ids=batch.pair_ids, given=batch.ref_logps, stored=stored)
        parts[mb] = pair_logps(logps, rows, b=len(positions), positions=positions)
    sort = global_sort(parts, num_pairs=len(batch.pairs), spec=spec, mesh=mesh, device=rank.platform.device)
    return sort, computed, ref


class _Record:
    """The "loss" of the sort pass: each microbatch's policy log-probs, kept."""

    def __init__(self, rows: dict[int, SequenceLogps]):
        self.rows = rows

    def __call__(self, mb: int, logps: SequenceLogps) -> torch.Tensor:
        self.rows[mb] = logps
        return torch.zeros(())
