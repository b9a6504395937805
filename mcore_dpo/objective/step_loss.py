"""The loss of one training step, as the pipeline's last stage calls it for each microbatch
(the whole-batch pass before the step, for the objectives that need one, is the rank's:
rank/prepass.py).

`StepLoss(mb, logps)` hands a microbatch's policy log-probs, with their reference log-probs
(`ReferenceSource.rows`), to the objective once (`Objective.microbatch`) and adds the
microbatch's metric sums (`Objective.accumulate`), which stay on the device until the step's end (one read per step,
not per microbatch).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_dpo.objective.contract import Objective
from mcore_dpo.objective.logprobs import SequenceLogps


class StepLoss:
    """One step's loss over this rank's microbatches (module docstring).

    `groups[mb]`: the positions in the global batch of microbatch mb's samples; `reference`:
    the rank's `rank.reference.ReferenceSource` (its `rows`); `computed`: the executor's
    reference log-probs by (batch offset, microbatch), taken as they are used; `prepass`: the
    objective's whole-batch state, for the objectives that need one (aot's sort)."""

    def __init__(self, *, objective: Objective, samples: Sequence, groups: list[list[int]], dp: int,
                 reference, computed: dict[tuple[int, int], SequenceLogps],
                 sample_ids: Sequence[int] = (), given: torch.Tensor | None = None, prepass: object | None = None,
                 device: torch.device):
        self.objective, self.groups, self.dp = objective, groups, dp
        self.reference, self.computed, self.sample_ids, self.given = reference, computed, sample_ids, given
        self.prepass = prepass
        self.totals = objective.totals(samples)
        self.sums = objective.empty_sums(device)

    def __call__(self, mb: int, logps: SequenceLogps) -> torch.Tensor:
        positions = self.groups[mb]
        ref = self.reference.rows(positions=positions, pair_ids=self.sample_ids, given=self.given,
                                  stored=self.computed.pop((0, mb), None))
        loss, sums = self.objective.microbatch(logps, ref, positions=positions, totals=self.totals,
                                               prepass=self.prepass)
        self.objective.accumulate(self.sums, sums)
        # DDP averages gradients over dp ranks; scale by dp so the result is the global mean.
        return loss * self.dp
