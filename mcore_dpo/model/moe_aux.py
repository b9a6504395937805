"""The router load-balancing loss of Hugging Face's Qwen3-MoE and Mixtral models, and the
per-layer expert load, as pure functions of the router logits.

For one forward (a microbatch: its chosen and rejected rows) over the MoE layers l = 1..L,
with router logits z[l, t] over E experts for each token t, the real-token mask m[t] (1 for
prompt and completion tokens, 0 for padding), top-k routing and p[l, t] = softmax(z[l, t]):

    C[e] = sum_l sum_t m[t] * [e in topk(p[l, t])]      (assignments, no gradient)
    S[e] = sum_l sum_t m[t] * p[l, t, e]                (probability mass)
    R    = L * sum_t m[t]
    aux  = E * sum_e (C[e] / R) * (S[e] / R)

which is transformers' `load_balancing_loss_func` (the Switch Transformer loss over the router
logits of all layers concatenated, with the attention mask). The trainer optimises
`loss + coef * mean over the step's microbatches of aux`, as TRL adds `router_aux_loss_coef *
aux_loss` to each microbatch's loss. megatron-core's own aux loss (per layer, over the tokens
of a sequence or the global batch) is a different quantity and is not used.
"""

from __future__ import annotations

import torch


def real_token_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """[rows, S] float: 1 for every real token of a right-padded row. A row's completion ends
    the row, and loss_mask[t] marks the completion token at t + 1, so the row holds
    (last marked t) + 2 tokens."""
    cols = torch.arange(loss_mask.shape[1], device=loss_mask.device)
    marked = loss_mask > 0
    last = torch.where(marked, cols, torch.full_like(cols, -2)).amax(dim=1)
    return (cols[None, :] < (last + 2)[:, None]).to(torch.float32)


def layer_sums(logits: torch.Tensor, mask: torch.Tensor, *, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (C, S) of the formula above: `logits` [N, E] (any leading shape flattened
    into N in the same order as `mask`), `mask` [N]. C carries no gradient; S does."""
    num_experts = logits.shape[-1]
    logits = logits.reshape(-1, num_experts).float()
    mask = mask.reshape(-1).to(logits.dtype)
    probs = torch.softmax(logits, dim=-1)
    chosen = torch.topk(probs.detach(), topk, dim=-1).indices
    counts = torch.zeros(num_experts, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(0, chosen.reshape(-1), mask.repeat_interleave(topk))
    return counts, (probs * mask[:, None]).sum(dim=0)


def load_balancing_loss(counts: torch.Tensor, prob_sums: torch.Tensor, *, num_layers: int,
                        num_tokens: torch.Tensor | float) -> torch.Tensor:
    """aux of one forward from C and S summed over its layers ([E] each) and sum_t m[t]."""
    rows = num_layers * num_tokens
    return counts.shape[-1] * torch.sum((counts / rows) * (prob_sums / rows))


def load_shares(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer, the smallest and largest share of the top-k assignments an expert received
    (`counts` [L, E]; 1/E each when perfectly balanced)."""
    shares = counts / counts.sum(dim=-1, keepdim=True).clamp_min(1)
    return shares.min(dim=-1).values, shares.max(dim=-1).values
