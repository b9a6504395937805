"""The loss of one training step, as the pipeline's last stage calls it for each microbatch
(the pass that orders the whole batch first, for the losses that sort it, is the rank's:
rank/batch_sort.py).

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


class StepLoss:
    """One step's loss over this rank's microbatches (module docstring).

    `groups[mb]`: the positions in the global batch of microbatch mb's pairs; `reference`: the
    rank's `rank.reference.ReferenceSource` (its `rows`); `computed`: the
    executor's reference log-probs by (batch offset, microbatch), taken as they are used;
    `sort`: the whole batch's order for the losses that need it (aot)."""

    def __init__(self, *, spec: LossSpec, pairs: Sequence, groups: list[list[int]], dp: int,
                 reference, computed: dict[tuple[int, int], SequenceLogps],
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
