"""Per-token log-probs from vocab-parallel logits, without gathering the vocabulary.

Policy and reference go through the same function, so they can never disagree by code path.
Each tensor-parallel rank holds logits for a contiguous slice of the (padded) vocabulary.
Padded vocabulary columns are masked out of the softmax: they are not part of the model.

Two per-token options of TRL 1.16's `DPOTrainer._compute_loss` live here, because they need
the tokens rather than the sums (`LogpsOptions`):
- ld_alpha (LD-DPO): rows come as [chosen rows; rejected rows] of b pairs (or a packed row's
  segments in that order); with s = min(L+, L-) of the pair, a sequence's log-prob is the sum
  over its first s completion tokens plus ld_alpha times the sum over the rest. Policy and
  reference alike.
- wpo (use_weighting): the mean over completion tokens of log p(token) - log Σ_v p_v²,
  the log of the WPO weight, without gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore_dpo.objective.loss import PairLogps
from mcore_dpo.parallel.platform import to_device


@dataclass
class SequenceLogps:
    """Per-sequence sums over completion tokens, one entry per row of the microbatch."""

    logp_sum: torch.Tensor  # [rows], differentiable when the logits are (LD-weighted with ld_alpha)
    num_tokens: torch.Tensor  # [rows]
    logit_sum: torch.Tensor  # [rows], sum over tokens of the vocabulary-mean logit (detached)
    plain_logp_sum: torch.Tensor | None = None  # [rows], unweighted sum; only with ld_alpha (sft reads it)
    wpo_log_weight: torch.Tensor | None = None  # [rows], only with wpo (detached)
    # only with whole_sequence: the sum and count over every predicted token of the sequence,
    # prompt and completion (all but its first token), e.g. ORPO's NLL
    whole_logp_sum: torch.Tensor | None = None  # [rows], differentiable
    whole_num_tokens: torch.Tensor | None = None  # [rows]


@dataclass(frozen=True)
class LogpsOptions:
    """Per-token options of the completion log-probs (see the module docstring)."""

    ld_alpha: float | None = None
    wpo: bool = False
    whole_sequence: bool = False  # also sum over the prompt's tokens (`whole_sequence_mask`)


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

    if start + v_local > vocab_size:  # this rank holds padded columns (a host-side fact: no device read)
        logits = logits.masked_fill(~real_cols, float("-inf"))
    else:
        # vocab_parallel_cross_entropy works in place on its input; keep the caller's tensor intact.
        logits = logits.clone()
    logp = -vocab_parallel_cross_entropy(logits, labels)
    return logp, mean_logit


@torch.no_grad()
def log_sum_sq_probs(logits: torch.Tensor, *, vocab_size: int, tp_rank: int, tp_group: object) -> torch.Tensor:
    """logits [b, s, v_local] -> log Σ_v p_v² [b, s] over the whole (unpadded) vocabulary, float32."""
    logits = logits.float()
    v_local = logits.shape[-1]
    start = tp_rank * v_local
    real_cols = torch.arange(start, start + v_local, device=logits.device) < vocab_size
    logits = logits.masked_fill(~real_cols, float("-inf"))
    peak = logits.max(-1).values
    multi = tp_group is not None and dist.get_world_size(tp_group) > 1
    if multi:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - peak.unsqueeze(-1)
    sums = torch.stack([shifted.exp().sum(-1), (2 * shifted).exp().sum(-1)])
    if multi:
        dist.all_reduce(sums, group=tp_group)
    # log Σ e^(2x) - 2 log Σ e^x; the shift by the max cancels.
    return torch.log(sums[1]) - 2 * torch.log(sums[0])


def ld_weights(loss_mask: torch.Tensor, *, ld_alpha: float, segment_ids: torch.Tensor | None = None,
               num_sequences: int | None = None) -> torch.Tensor:
    """Per-token LD-DPO weights, shaped like `loss_mask`: 1 on a completion's first min(L+, L-)
    tokens, ld_alpha on the rest, 0 off the completion. Rows are [chosen; rejected], or, for a
    packed row (`segment_ids`, as `segment_sums` takes them), the sequences are its segments:
    sequence j < b is pair j's chosen and b + j its rejected (b = num_sequences / 2)."""
    mask = loss_mask.to(torch.float32)
    if segment_ids is None:
        rows = loss_mask.shape[0]
        if rows % 2:
            raise ValueError(f"loss_mask: LD-DPO needs rows [chosen; rejected], got an odd count {rows}")
        position = mask.cumsum(-1)  # 1, 2, ... over the completion tokens
        lengths = mask.sum(-1)
        shared = torch.minimum(lengths[: rows // 2], lengths[rows // 2 :]).repeat(2).unsqueeze(-1)
        return mask * torch.where(position <= shared, 1.0, ld_alpha)
    if num_sequences % 2:
        raise ValueError(f"num_sequences: LD-DPO needs chosen and rejected sequences, got an odd count {num_sequences}")
    ids = segment_ids.reshape(-1).clamp(max=num_sequences)  # the padding: one slot of its own
    flat = mask.reshape(-1)
    running = flat.cumsum(0)
    # A segment's completion tokens before it: the running count at its first token, less that token.
    before = torch.full((num_sequences + 1,), float("inf"), device=flat.device)
    before = before.scatter_reduce(0, ids, running - flat, reduce="amin")
    position = running - before[ids]
    lengths = segment_sums(mask, segment_ids=segment_ids, num_sequences=num_sequences)
    half = num_sequences // 2
    shared = torch.minimum(lengths[:half], lengths[half:]).repeat(2)
    shared = torch.cat([shared, shared.new_zeros(1)])[ids]
    return (flat * torch.where(position <= shared, 1.0, ld_alpha)).reshape(mask.shape)


def whole_sequence_mask(loss_mask: torch.Tensor, *, segment_ids: torch.Tensor | None,
                        num_sequences: int | None) -> torch.Tensor:
    """1.0 at every position whose label is a token of the sequence after its first: from the
    sequence's first position through its last completion position (`loss_mask` marks the
    completion). A sequence is a row starting at position 0, or with `segment_ids` a segment of a
    packed row (ids >= num_sequences are padding), which starts at its first position. A sequence
    without completion tokens gets none."""
    mask = loss_mask.to(torch.float32)
    if segment_ids is None:  # through the last completion position: a reversed running maximum
        return mask.flip(-1).cummax(-1).values.flip(-1)
    ids = segment_ids.reshape(-1).clamp(max=num_sequences)
    index = torch.arange(ids.numel(), device=ids.device)
    last = torch.full((num_sequences + 1,), -1, dtype=torch.long, device=ids.device)
    last = last.scatter_reduce(0, ids, torch.where(mask.reshape(-1) > 0, index, -1), reduce="amax")
    inside = (ids < num_sequences) & (index <= last[ids])
    return inside.to(torch.float32).reshape(mask.shape)


def segment_sums(values: torch.Tensor, *, segment_ids: torch.Tensor | None, num_sequences: int | None) -> torch.Tensor:
    """Per-sequence sums of per-token `values` [rows, s]: a sum per row, or, for a packed row
    (`segment_ids` [rows, s], each token's sequence; ids >= num_sequences are padding), a sum per
    segment. Differentiable."""
    if segment_ids is None:
        return values.sum(-1)
    ids = segment_ids.reshape(-1)
    out = torch.zeros(num_sequences + 1, dtype=values.dtype, device=values.device)
    out = out.index_add(0, ids.clamp(max=num_sequences), values.reshape(-1))
    return out[:num_sequences]


def sequence_logps(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    vocab_size: int,
    tp_rank: int,
    tp_group: object,
    options: LogpsOptions = LogpsOptions(),
    segment_ids: torch.Tensor | None = None,
    num_sequences: int | None = None,
    cp_group: object | None = None,
) -> SequenceLogps:
    """Sum the completion tokens' log-probs per sequence; prompt and padding are masked by
    loss_mask. A sequence is a row, or with `segment_ids` a segment of a packed row (one entry
    per sequence in the unpacked row order, `segment_sums`).

    Context parallelism (`cp_group`): `logits` hold this cp rank's positions of the rows
    (`parallel.context_parallel`), `labels`, `loss_mask` and `segment_ids` the whole rows. The
    per-token values are computed on the rank's positions and gathered whole over cp
    (`gather_replicated`) before anything per sequence, so the LD-DPO weights, the token counts
    and every sum are those of the whole rows, the same on every cp rank."""
    gather = None
    if cp_group is not None:
        from mcore_dpo.parallel.context_parallel import gather_replicated, local_part

        cp, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
        labels = local_part(labels, dim=1, cp=cp, cp_rank=cp_rank)

        def gather(values: torch.Tensor) -> torch.Tensor:
            return gather_replicated(values, dim=1, group=cp_group)

    logp, mean_logit = token_logprobs(logits, labels, vocab_size=vocab_size, tp_rank=tp_rank, tp_group=tp_group)
    if gather is not None:
        logp, mean_logit = gather(logp), gather(mean_logit)
    mask = loss_mask.to(logp.dtype)

    def per_sequence(values: torch.Tensor) -> torch.Tensor:
        return segment_sums(values, segment_ids=segment_ids, num_sequences=num_sequences)

    plain = per_sequence(logp * mask)
    num_tokens = per_sequence(mask)
    out = SequenceLogps(logp_sum=plain, num_tokens=num_tokens, logit_sum=per_sequence(mean_logit * mask))
    if options.ld_alpha is not None:
        out.logp_sum = per_sequence(logp * ld_weights(loss_mask, ld_alpha=options.ld_alpha, segment_ids=segment_ids,
                                                      num_sequences=num_sequences))
        out.plain_logp_sum = plain
    if options.wpo:
        sq = log_sum_sq_probs(logits, vocab_size=vocab_size, tp_rank=tp_rank, tp_group=tp_group)
        if gather is not None:
            sq = gather(sq)
        out.wpo_log_weight = per_sequence((logp.detach() - sq) * mask) / num_tokens.clamp(min=1.0)
    if options.whole_sequence:
        whole = whole_sequence_mask(loss_mask, segment_ids=segment_ids, num_sequences=num_sequences).to(logp.dtype)
        out.whole_logp_sum, out.whole_num_tokens = per_sequence(logp * whole), per_sequence(whole)
    return out


def table_rows(table: torch.Tensor, rows: list[int], *, device: torch.device) -> torch.Tensor:
    """Reference summed log-probs of some samples from a [samples, sequences] table, as a
    microbatch's rows (every sample's first sequence, then every sample's second, ...). No host
    sync: the row index and a host table's rows go to the device as non-blocking copies."""
    picked = table[to_device(torch.tensor(rows, dtype=torch.long), table.device)]
    return to_device(picked.T.reshape(-1), device)


def pair_logps(
    policy: SequenceLogps, ref_logp_sum: torch.Tensor | None, *, b: int, positions: list[int]
) -> PairLogps:
    """Split a microbatch's rows (chosen first, then rejected) into per-pair tensors; the
    reference's summed log-probs are zero when there is no reference. `positions`: the pairs'
    places in the global batch (built on the host, copied without blocking it)."""
    ref = ref_logp_sum.detach() if ref_logp_sum is not None else torch.zeros_like(policy.logp_sum).detach()
    wpo = policy.wpo_log_weight
    return PairLogps(
        chosen_logps=policy.logp_sum[:b],
        rejected_logps=policy.logp_sum[b:],
        ref_chosen_logps=ref[:b],
        ref_rejected_logps=ref[b:],
        chosen_num_tokens=policy.num_tokens[:b],
        rejected_num_tokens=policy.num_tokens[b:],
        chosen_logit_sum=policy.logit_sum[:b],
        rejected_logit_sum=policy.logit_sum[b:],
        # With LD-DPO the log-probs are weighted; sft keeps the plain NLL.
        chosen_nll_sum=None if policy.plain_logp_sum is None else -policy.plain_logp_sum[:b],
        chosen_wpo_log_weight=None if wpo is None else wpo[:b],
        rejected_wpo_log_weight=None if wpo is None else wpo[b:],
        pair_index=to_device(torch.tensor(positions, dtype=torch.long), policy.logp_sum.device),
    )
