"""DPO and its loss family (objective/loss.py, configured by objective/loss_spec.py) as an
`Objective`: a sample is a pair, chosen then rejected; aot and aot_unpaired read the whole
batch's order first (their `prepass`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_dpo.objective.contract import PAIR, BatchTotals, Objective
from mcore_dpo.objective.logprobs import SequenceLogps, pair_logps
from mcore_dpo.objective.loss import METRIC_SUM_KEYS, PairLogps, batch_sort, finalize_metrics, metric_sum_vector, pair_losses
from mcore_dpo.objective.loss_spec import LossSpec


class DpoObjective(Objective):
    """The DPO loss family on preference pairs."""

    name = "dpo"
    shape = PAIR
    metric_keys = METRIC_SUM_KEYS

    def __init__(self, spec: LossSpec):
        super().__init__(spec)
        self.needs_reference = spec.needs_reference
        self.needs_prepass = spec.needs_batch_sort

    def microbatch(self, logps: SequenceLogps, reference: torch.Tensor | None, *, positions: Sequence[int],
                   totals: BatchTotals, prepass: object | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = pair_logps(logps, reference, b=len(positions), positions=positions)
        kwargs = dict(spec=self.spec, num_pairs_global=totals.num_samples, chosen_tokens_global=totals.chosen_tokens,
                      sort=prepass)
        losses = pair_losses(pairs, **kwargs)  # once: the metric sums read the same values
        sums = metric_sum_vector(pairs, losses=losses.detach(), **kwargs)
        return losses.sum() / totals.num_samples, sums

    def prepass(self, policy: torch.Tensor, reference: torch.Tensor) -> object:
        """aot's BatchSort of the whole batch, in the loss's own dtype (float32), so that its
        sorted values equal the live ones exactly."""
        policy, reference = policy.float(), reference.float()
        zeros = torch.zeros(policy.shape[0], device=policy.device)
        whole = PairLogps(policy[:, 0], policy[:, 1], reference[:, 0], reference[:, 1], zeros, zeros, zeros, zeros)
        return batch_sort(whole, spec=self.spec)

    def finalize(self, sums: dict[str, float]) -> dict[str, float]:
        return finalize_metrics(sums, spec=self.spec)


def from_config(config) -> DpoObjective:
    return DpoObjective(config.loss_spec())
