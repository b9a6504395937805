"""Evaluation of a policy rank: policy and reference forwards over every held-out pair, in
global-batch chunks, and the same metrics as a training step, averaged over all of them.

`Evaluator` is given the rank (its mesh, sizes and stage contexts), the policy and the
reference source at construction; the worker calls `evaluate`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_dpo.model import lora
from mcore_dpo.data.pairs import TokenizedPair, eval_passes
from mcore_dpo.data.even_passes import rank_passes
from mcore_dpo.objective.logprobs import SequenceLogps, table_rows
from mcore_dpo.data.packing import eval_microbatches
from mcore_dpo.pipeline.executor import forward_only_ops, run_ops
from mcore_dpo.rank.metrics import reduce_metrics, whole_batch_prepass
from mcore_dpo.rank.reference import ReferenceSource


class Evaluator:
    """`evaluate(pairs)` over a policy rank's models (module docstring). `rank`: the worker's
    rank (`worker.Rank`: config, mesh, layout, device, packing, `stage_context`)."""

    def __init__(self, *, rank, policy: torch.nn.Module, reference: ReferenceSource):
        self.rank, self.policy, self.reference = rank, policy, reference

    @torch.no_grad()
    def evaluate(self, pairs: Sequence[TokenizedPair], ref_logps: torch.Tensor | None = None) -> dict[str, float] | None:
        """Policy and reference forward over EVERY held-out pair (in global-batch chunks, the last
        one possibly partial; see `eval_passes`); metrics are means over all of them. The
        reference log-probs come from `ref_logps` ([pairs, 2], separate mode), the table
        precomputed for these pairs, or the colocated reference model."""
        if self.rank.config.lora:  # held-out metrics without adapter dropout
            with lora.mode(self.policy.module, "eval"):
                return self._evaluate(pairs, ref_logps)
        return self._evaluate(pairs, ref_logps)

    def _evaluate(self, pairs: Sequence[TokenizedPair], ref_logps: torch.Tensor | None) -> dict[str, float] | None:
        rank = self.rank
        config, mesh, device = rank.config, rank.mesh, rank.platform.device
        if ref_logps is None:
            ref_logps = self.reference.eval_table
        objective = rank.objective
        # The whole held-out set is the "global batch" of the metrics (sft: its token mean).
        num_pairs, totals = len(pairs), objective.totals(pairs)
        rows = rank.rows
        costs = [rows.cost(p) for p in pairs] if rows.packing else None

        def passes_of(dp_rank: int) -> list:
            passes = eval_passes(num_pairs=num_pairs, global_batch_size=config.global_batch_size, dp=rank.layout.dp,
                                 dp_rank=dp_rank, micro_batch_size=config.micro_batch_size)
            if rows.packing:  # each chunk's share in packed rows, split by tokens as a training step
                passes = [(None, g) for g in eval_microbatches(costs, passes, max_tokens=config.packing_budget)]
            return passes

        # ep > 1: the same forwards on every rank; the dummies' results are dropped.
        passes = rank_passes(passes_of, dp=rank.layout.dp, dp_rank=mesh.dp_rank, even=rank.layout.ep > 1)
        with_reference = self.reference.model is not None and ref_logps is None
        parts: list = []
        for chunk, groups, num_real in passes:
            mbs = rows.microbatches(pairs, groups, pad_over=chunk)
            computed: dict = {}  # the pass's reference log-probs, by (batch offset, microbatch)
            collect = _Collect(parts, groups=groups, num_real=num_real, table=ref_logps,
                               computed=computed if with_reference else None, device=device)
            ctx = rank.stage_context({0: mbs}, policy=self.policy, reference=self.reference.model, forward_only=True,
                                     loss_fn=collect, ref_logps=computed)
            run_ops(forward_only_ops(mesh=mesh, num_microbatches=len(mbs), policy=True, reference=with_reference), ctx)
        sums = objective.empty_sums(device)
        if mesh.is_last_stage:
            # aot sorts over the whole held-out set: the metrics wait for every microbatch.
            prepass = (whole_batch_prepass(parts, objective=objective, num_samples=num_pairs, mesh=mesh, device=device)
                       if objective.needs_prepass else None)
            for logps, reference, positions in parts:
                objective.accumulate(sums, objective.microbatch(logps, reference, positions=positions,
                                                                totals=totals, prepass=prepass)[1])
        metrics = reduce_metrics(sums, objective=objective, mesh=mesh)
        if metrics is None:
            return None
        return {f"eval/{k}": v for k, v in metrics.items()}


class _Collect:
    """The "loss" of an evaluation pass: each real microbatch's policy log-probs, reference
    rows and sample positions, kept for the metrics (the reference's from `table` by sample
    index, as the pass computed them into `computed`, or none: a reference-free run)."""

    def __init__(self, parts: list, *, groups: list[list[int]], num_real: int,
                 table: torch.Tensor | None, computed: dict | None, device: torch.device):
        self.parts, self.groups, self.num_real = parts, groups, num_real
        self.table, self.computed, self.device = table, computed, device

    def __call__(self, mb: int, logps: SequenceLogps) -> torch.Tensor:
        ids = self.groups[mb]
        if self.table is not None:
            ref = table_rows(self.table, ids, device=self.device)
        else:
            ref = self.computed.pop((0, mb)).logp_sum if self.computed is not None else None
        if mb < self.num_real:
            self.parts.append((logps, ref, ids))
        return torch.zeros(())
