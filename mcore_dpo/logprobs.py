"""Per-token log-probs from vocab-parallel logits, without gathering the vocabulary.

Policy and reference go through the same function, so they can never disagree by code path.
Each tensor-parallel rank holds logits for a contiguous slice of the (padded) vocabulary.
Padded vocabulary columns are masked out of the softmax: they are not part of the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class SequenceLogps:
    """Per-sequence sums over completion tokens, one entry per row of the microbatch."""

    logp_sum: torch.Tensor  # [rows], differentiable when the logits are
    num_tokens: torch.Tensor  # [rows]
    logit_sum: torch.Tensor  # [rows], sum over tokens of the vocabulary-mean logit (detached)


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_size: int,
    tp_rank: int,
    tp_group: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [b, s, v_local] (this rank's vocab slice), labels [b, s] ->
    (log p(label) [b, s], vocabulary-mean logit [b, s] detached), both in float32."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = logits.float()
    v_local = logits.shape[-1]
    start = tp_rank * v_local
    real_cols = (torch.arange(start, start + v_local, device=logits.device) < vocab_size)

    with torch.no_grad():
        mean_logit = (logits * real_cols).sum(-1)
        if dist.get_world_size(tp_group) > 1:
            dist.all_reduce(mean_logit, group=tp_group)
        mean_logit = mean_logit / vocab_size

    if not bool(real_cols.all()):
        logits = logits.masked_fill(~real_cols, float("-inf"))
    else:
        # vocab_parallel_cross_entropy works in place on its input; keep the caller's tensor intact.
        logits = logits.clone()
    logp = -vocab_parallel_cross_entropy(logits, labels)
    return logp, mean_logit


def sequence_logps(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    vocab_size: int,
    tp_rank: int,
    tp_group: object,
) -> SequenceLogps:
    """Sum the completion tokens' log-probs per row; prompt and padding are masked by loss_mask."""
    logp, mean_logit = token_logprobs(logits, labels, vocab_size=vocab_size, tp_rank=tp_rank, tp_group=tp_group)
    mask = loss_mask.to(logp.dtype)
    return SequenceLogps(
        logp_sum=(logp * mask).sum(-1),
        num_tokens=mask.sum(-1),
        logit_sum=(mean_logit * mask).sum(-1),
    )
