"""The policy worker's evaluation: policy and reference forwards over every held-out pair, in
global-batch chunks, and the same metrics as a training step, averaged over all of them.

A mixin of `worker.PolicyWorker` (as `worker_checkpoint.PolicyCheckpointing` is): it uses the
rank's mesh, models, pipeline context and metric reduction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_dpo import lora
from mcore_dpo.data import TokenizedPair, collate, eval_passes, padded_seq_len
from mcore_dpo.even_passes import even_passes
from mcore_dpo.logprobs import SequenceLogps, pair_logps, table_rows
from mcore_dpo.loss import METRIC_SUM_KEYS, PairLogps, metric_sum_vector
from mcore_dpo.packing import collate_packed, eval_microbatches, pair_tokens
from mcore_dpo.pipeline import forward_only_ops, run_ops


class PolicyEvaluation:
    """`evaluate` for PolicyWorker (see the module docstring)."""

    @torch.no_grad()
    def evaluate(self, pairs: Sequence[TokenizedPair], ref_logps: torch.Tensor | None = None) -> dict[str, float] | None:
        """Policy and reference forward over EVERY held-out pair (in global-batch chunks, the last
        one possibly partial; see `eval_passes`); metrics are means over all of them. The
        reference log-probs come from `ref_logps` ([pairs, 2], separate mode), the table
        precomputed for these pairs, or the colocated reference model."""
        if self.config.lora:  # held-out metrics without adapter dropout
            with lora.mode(self.policy.module, "eval"):
                return self._evaluate(pairs, ref_logps)
        return self._evaluate(pairs, ref_logps)

    def _evaluate(self, pairs: Sequence[TokenizedPair], ref_logps: torch.Tensor | None) -> dict[str, float] | None:
        if ref_logps is None:
            ref_logps = self._ref_eval
        config = self.config
        spec = config.loss_spec()
        sums = torch.zeros(len(METRIC_SUM_KEYS), dtype=torch.float64, device=self.platform.device)
        # The whole held-out set is the "global batch" of the metrics (sft: its token mean).
        num_pairs, chosen_tokens = len(pairs), max(1, sum(len(p.chosen_ids) for p in pairs))
        costs = [pair_tokens(p) for p in pairs] if self.packing else None

        def passes_of(dp_rank: int) -> list:
            passes = eval_passes(num_pairs=num_pairs, global_batch_size=config.global_batch_size, dp=self.layout.dp,
                                 dp_rank=dp_rank, micro_batch_size=config.micro_batch_size)
            if self.packing:  # each chunk's share in packed rows, split by tokens as a training step
                passes = [(None, g) for g in eval_microbatches(costs, passes, max_tokens=config.packing_budget)]
            return passes

        if self.layout.ep > 1:  # the same forwards on every rank; the dummies' results are dropped
            passes = even_passes([passes_of(r) for r in range(self.layout.dp)], dp_rank=self.mesh.dp_rank)
        else:
            passes = [(chunk, groups, len(groups)) for chunk, groups in passes_of(self.mesh.dp_rank)]
        parts: list[PairLogps] = []
        for chunk, groups, num_real in passes:
            if self.packing:
                mbs = [collate_packed([pairs[i] for i in ids], pad_token_id=self.pad_token_id,
                                      multiple=self.seq_multiple) for ids in groups]
            else:
                seq_len = padded_seq_len([pairs[i] for i in chunk], multiple=self.seq_multiple)
                mbs = [collate([pairs[i] for i in ids], pad_token_id=self.pad_token_id, seq_len=seq_len)
                       for ids in groups]
            ctx = self._context({0: mbs}, forward_only=True)

            def loss_fn(mb: int, logps: SequenceLogps, groups=groups, ctx=ctx, num_real=num_real) -> torch.Tensor:
                ids = groups[mb]
                if ref_logps is not None:
                    ref = table_rows(ref_logps, ids, device=self.platform.device)
                else:
                    ref = ctx.ref_logps.pop((0, mb)).logp_sum if self.reference is not None else None
                if mb < num_real:
                    parts.append(pair_logps(logps, ref, b=len(ids), positions=ids))
                return torch.zeros(())

            ctx.loss_fn = loss_fn
            ops = forward_only_ops(
                mesh=self.mesh, num_microbatches=len(mbs), policy=True,
                reference=self.reference is not None and ref_logps is None,
            )  # fmt: skip
            run_ops(ops, ctx)
        if self.mesh.is_last_stage:
            # aot sorts over the whole held-out set: the metrics wait for every microbatch.
            sort = (self._global_sort({i: pl for i, pl in enumerate(parts)}, num_pairs=num_pairs, spec=spec)
                    if spec.needs_batch_sort else None)
            for pl in parts:
                sums.add_(metric_sum_vector(pl, spec=spec, num_pairs_global=num_pairs, chosen_tokens_global=chosen_tokens,
                                            sort=sort))
        metrics = self._reduce_metrics(sums, spec=spec)
        if metrics is None:
            return None
        return {f"eval/{k}": v for k, v in metrics.items()}
