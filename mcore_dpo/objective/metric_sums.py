"""What the pair objectives' metric sums share: the sums every one of them adds (PAIR_SUM_KEYS,
`pair_sums`), the check of a whole batch's sums before they are divided (`sums_count`), and the
means TRL logs for every pair objective (`pair_means`). Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

# The sums every pair objective adds over microbatches and ranks, after its count of pairs.
PAIR_SUM_KEYS: tuple[str, ...] = (
    "loss_sum",
    "reward_chosen_sum",
    "reward_rejected_sum",
    "accuracy_sum",
    "margin_sum",
    "logps_chosen_sum",
    "logps_rejected_sum",
    "logit_chosen_sum",
    "logit_rejected_sum",
    "num_chosen_tokens",
    "num_rejected_tokens",
)


def pair_sums(*, losses: Tensor, chosen_rewards: Tensor, rejected_rewards: Tensor, chosen_logps: Tensor,
              rejected_logps: Tensor, chosen_logit_sum: Tensor, rejected_logit_sum: Tensor,
              chosen_num_tokens: Tensor, rejected_num_tokens: Tensor) -> list[Tensor]:
    """One microbatch's count of pairs, then its PAIR_SUM_KEYS sums: float64 scalars on the device
    (each input [pairs]; sums in float64, as they are added over many microbatches and ranks).
    The token counts are the raw ones, not clamped: they are the denominators of token means."""
    dtype = torch.float64
    return [
        torch.full((), float(losses.numel()), dtype=dtype, device=losses.device),
        losses.to(dtype).sum(),
        chosen_rewards.to(dtype).sum(),
        rejected_rewards.to(dtype).sum(),
        (chosen_rewards > rejected_rewards).to(dtype).sum(),
        (chosen_rewards - rejected_rewards).to(dtype).sum(),
        chosen_logps.to(dtype).sum(),
        rejected_logps.to(dtype).sum(),
        chosen_logit_sum.to(dtype).sum(),
        rejected_logit_sum.to(dtype).sum(),
        chosen_num_tokens.to(dtype).sum(),
        rejected_num_tokens.to(dtype).sum(),
    ]


def sums_count(sums: Mapping[str, float], keys: Sequence[str], *, count: str) -> float:
    """`sums[count]`, the number of samples behind metric sums that hold every one of `keys`;
    ValueError (one line) for a missing key or a count that is not positive."""
    missing = [key for key in keys if key not in sums]
    if missing:
        raise ValueError(f"sums: missing keys {', '.join(missing)}")
    if sums[count] <= 0:
        raise ValueError(f"sums: {count} must be > 0, got {sums[count]}")
    return sums[count]


def pair_means(sums: Mapping[str, float], num_pairs: float) -> dict[str, float]:
    """What every pair objective of TRL logs: loss, rewards/* and logps/* as means over the pairs,
    logits/* (the vocabulary-mean logit) over the completion tokens of their side; an empty side
    (a data bug) reports 0 rather than dividing by zero."""
    return {
        "loss": sums["loss_sum"] / num_pairs,
        "rewards/chosen": sums["reward_chosen_sum"] / num_pairs,
        "rewards/rejected": sums["reward_rejected_sum"] / num_pairs,
        "rewards/accuracies": sums["accuracy_sum"] / num_pairs,
        "rewards/margins": sums["margin_sum"] / num_pairs,
        "logps/chosen": sums["logps_chosen_sum"] / num_pairs,
        "logps/rejected": sums["logps_rejected_sum"] / num_pairs,
        "logits/chosen": sums["logit_chosen_sum"] / max(sums["num_chosen_tokens"], 1.0),
        "logits/rejected": sums["logit_rejected_sum"] / max(sums["num_rejected_tokens"], 1.0),
    }
