"""The DPO loss family and its metrics, as pure functions on per-pair log-probs.

The engine computes, for each microbatch, the summed completion log-probs of
every pair under the policy and the reference (`PairLogps`), then calls:

    losses = pair_losses(logps, spec=spec, num_pairs_global=N, chosen_tokens_global=T)
    (losses.sum() / N).backward()          # summed over microbatches and DP ranks
    sums = metric_sums(logps, spec=spec, num_pairs_global=N, chosen_tokens_global=T)
    # ... add `sums` key by key over microbatches and ranks (see METRIC_SUM_KEYS) ...
    metrics = finalize_metrics(total_sums, spec=spec)

N is the number of pairs and T the number of chosen completion tokens in the
whole global batch. Because every per-pair loss is scaled to be averaged over
N, the global-batch loss (and its gradient) does not depend on how the pairs
are split into microbatches and data-parallel ranks.

Notation (per pair): c, r = policy log-probs of the chosen / rejected
completion summed over its tokens; c0, r0 the same under the reference
(0 in reference-free mode); u+ = c - c0, u- = r - r0, Δ = u+ - u-;
L+, L- = completion token counts; β = beta; ε = label_smoothing; z = βΔ;
h(δ) = -(1-ε)logσ(βδ) - ε·logσ(-βδ).

| loss type    | per-pair loss                                                     |
|--------------|-------------------------------------------------------------------|
| sigmoid      | -logσ(z)                                                          |
| cdpo         | h(Δ)   (label-smoothed sigmoid, "cDPO")                           |
| hinge        | relu(1 - z)                                                       |
| ipo          | (u+/L+ - u-/L- - 1/(2β))²                                         |
| robust       | [-(1-ε)logσ(z) + ε·logσ(-z)] / (1-2ε)                             |
| exo_pair     | σ(z)[logσ(z) - log(1-ε)] + σ(-z)[logσ(-z) - log ε]   (ε > 0)      |
| nca_pair     | -logσ(βu+) - ½logσ(-βu+) - ½logσ(-βu-)                            |
| bco_pair     | -logσ(βu+) - logσ(-βu-)                                           |
| sppo_hard    | (u+ - 1/(2β))² + (u- + 1/(2β))²                                   |
| apo_zero     | 1 - σ(βu+) + σ(βu-)                                               |
| apo_down     | σ(βu+) + 1 - σ(z)                                                 |
| discopop     | g = σ(z/τ): (1-g)(-logσ(z)) + g·e^(-z)                            |
| sigmoid_norm | -logσ(β(u+/L+ - u-/L-))   (length-normalised sigmoid)             |
| sft          | token-mean NLL over the chosen completion tokens of the batch     |
| aot          | h(sort(c - r)_k - sort(c0 - r0)_k), k = rank of the pair's c - r  |
| aot_unpaired | h(sort(u+)_k - sort(u-)_k), k = rank of the pair's u+             |

Options (TRL 1.16 `DPOConfig` fields, applied as TRL 1.16's `DPOTrainer._compute_loss` does):
- f_divergence_type: the losses built on the chosen-rejected difference (sigmoid, cdpo,
  hinge, ipo, robust, exo_pair, discopop, sigmoid_norm) read a score f'(u±) instead of u±:
  reverse_kl u; forward_kl 1 - e^(-u); js_divergence log 2 + logσ(u); alpha_divergence
  (e^(t) - 1)/(α-1) with t = (α-1)u clamped at 80 (|α-1| < 1e-6 falls back to reverse_kl).
  The other types refuse a non-default value, as TRL 1.16 does. The reward metrics stay β·u±.
- use_weighting (WPO): every per-pair loss is multiplied by w+·w-, where
  w = exp(mean over the completion tokens of log p(token) - log Σ_v p_v²) under the policy,
  without gradient.
- ld_alpha (LD-DPO) changes the log-probs themselves (objective/logprobs.py), not the formulas.

aot and aot_unpaired sort over the whole global batch. A microbatch alone cannot know the
rank of its pairs, so the caller passes a `BatchSort` made by `batch_sort` from the
log-probs of every pair of the global batch; ties are broken by the pair's position in the
global batch (a stable sort), so losses and gradients do not depend on how the batch is
split. TRL 1.16 sorts within each device's microbatch: with the whole batch in one
microbatch on one device the two definitions are the same.

Differences from TRL 1.16 worth knowing:
- label_smoothing is read by cdpo, robust, exo_pair, aot and aot_unpaired only. TRL 1.16's
  sigmoid ignores label_smoothing without a word; here a label_smoothing that no chosen type
  reads is an error that points to cdpo.
- use_weighting with sft is refused: TRL 1.16's `_compute_loss` raises on it (an in-place
  product on an expanded tensor), so there is no TRL 1.16 definition to follow. With hinge,
  TRL 1.16 raises in the backward pass (in-place product on relu's saved output); here it is
  the weighted hinge loss the formula describes.
- cdpo is this engine's name for label-smoothed sigmoid (it equals TRL 1.16's aot when the
  batch has one pair); it accepts f_divergence_type like sigmoid.
- logits/chosen and logits/rejected: the exact mean over every completion
  token of the global batch (finalize_metrics divides global sums). TRL 1.16 logs
  the mean of per-microbatch token means, which differs when microbatches hold
  different token counts (docs/DESIGN.md, "Metrics").
- The logged logps/rewards are sums over the completion tokens for every loss
  type, as in TRL 1.16 (`DPOTrainer._compute_loss`); ipo and sigmoid_norm divide
  by the token counts inside their own formula only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mcore_dpo.objective.metric_sums import PAIR_SUM_KEYS, pair_means, sums_count
from mcore_dpo.objective.loss_spec import (
    SORTED_TYPES,
    LossSpec,
)

# TRL 1.16's clamp of (α-1)u before the exponential of alpha_divergence (float32 value).
_ALPHA_DIVERGENCE_CLAMP = 80.0

# Keys of `metric_sums`, in a fixed order so the engine can pack them into one
# tensor for a single all-reduce: torch.tensor([sums[k] for k in METRIC_SUM_KEYS]).
METRIC_SUM_KEYS: tuple[str, ...] = ("num_pairs", *PAIR_SUM_KEYS, "nll_sum")


@dataclass
class PairLogps:
    """Per-pair quantities of one microbatch; every tensor has shape [b]."""

    chosen_logps: Tensor
    """Policy log-prob of the chosen completion, summed over its tokens (carries the gradient)."""
    rejected_logps: Tensor
    """Policy log-prob of the rejected completion, summed over its tokens (carries the gradient)."""
    ref_chosen_logps: Tensor
    """Reference log-prob of the chosen completion (no gradient; zeros when reference-free)."""
    ref_rejected_logps: Tensor
    """Reference log-prob of the rejected completion (no gradient; zeros when reference-free)."""
    chosen_num_tokens: Tensor
    """Number of chosen completion tokens."""
    rejected_num_tokens: Tensor
    """Number of rejected completion tokens."""
    chosen_logit_sum: Tensor
    """Sum over chosen completion tokens of the vocabulary-mean logit (metrics only)."""
    rejected_logit_sum: Tensor
    """Sum over rejected completion tokens of the vocabulary-mean logit (metrics only)."""
    chosen_nll_sum: Tensor | None = None
    """Policy NLL summed over the chosen completion tokens, for "sft"; None means -chosen_logps."""
    chosen_wpo_log_weight: Tensor | None = None
    """log w+ for use_weighting: mean over chosen completion tokens of log p - log Σ_v p_v² (no gradient)."""
    rejected_wpo_log_weight: Tensor | None = None
    """log w- for use_weighting, the same over the rejected completion tokens."""
    pair_index: Tensor | None = None
    """Position of each pair in the global batch (int64), for aot/aot_unpaired; None = 0..b-1."""


@dataclass(frozen=True)
class BatchSort:
    """What aot and aot_unpaired need from the whole global batch: ranks and sorted values,
    every tensor [N] and indexed by the pair's position in the global batch (no gradient)."""

    logratio_rank: Tensor
    """aot: rank of c - r (policy) among the batch."""
    ref_logratio_sorted: Tensor
    """aot: c0 - r0 (reference) of the batch, sorted ascending."""
    chosen_rank: Tensor
    """aot_unpaired: rank of u+ among the batch."""
    rejected_rank: Tensor
    """aot_unpaired: rank of u- among the batch."""
    chosen_sorted: Tensor
    """aot_unpaired: u+ of the batch, sorted ascending."""
    rejected_sorted: Tensor
    """aot_unpaired: u- of the batch, sorted ascending."""


def _ranks(values: Tensor) -> tuple[Tensor, Tensor]:
    """(rank of each entry, sorted values); ties keep their order in the batch."""
    order = torch.sort(values, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(values.numel(), device=values.device)
    return rank, values[order]


def batch_sort(logps: PairLogps, *, spec: LossSpec) -> BatchSort:
    """The BatchSort of a global batch from the log-probs of all its pairs, in batch order."""
    with torch.no_grad():
        terms = _terms(logps, spec=spec)
        dtype = terms.chosen_logratio.dtype
        chosen, rejected = logps.chosen_logps.to(dtype), logps.rejected_logps.to(dtype)
        if spec.reference_free:
            ref_logratio = torch.zeros_like(chosen)
        else:
            ref_logratio = logps.ref_chosen_logps.to(dtype) - logps.ref_rejected_logps.to(dtype)
        logratio_rank, _ = _ranks(chosen - rejected)
        _, ref_sorted = _ranks(ref_logratio)
        chosen_rank, chosen_sorted = _ranks(terms.chosen_logratio)
        rejected_rank, rejected_sorted = _ranks(terms.rejected_logratio)
    return BatchSort(logratio_rank, ref_sorted, chosen_rank, rejected_rank, chosen_sorted, rejected_sorted)


def _check_inputs(logps: PairLogps, *, num_pairs_global: int, chosen_tokens_global: int) -> None:
    # Shape checks only: anything that reads tensor values would force a device sync.
    shape = logps.chosen_logps.shape
    if len(shape) != 1:
        raise ValueError(f"chosen_logps: expected shape [b], got {list(shape)}")
    for name in (
        "rejected_logps",
        "ref_chosen_logps",
        "ref_rejected_logps",
        "chosen_num_tokens",
        "rejected_num_tokens",
        "chosen_logit_sum",
        "rejected_logit_sum",
        "chosen_nll_sum",
        "chosen_wpo_log_weight",
        "rejected_wpo_log_weight",
        "pair_index",
    ):
        value = getattr(logps, name)
        if value is not None and value.shape != shape:
            raise ValueError(f"{name}: expected shape {list(shape)} like chosen_logps, got {list(value.shape)}")
    if num_pairs_global <= 0:
        raise ValueError(f"num_pairs_global: must be > 0, got {num_pairs_global}")
    if chosen_tokens_global <= 0:
        raise ValueError(f"chosen_tokens_global: must be > 0, got {chosen_tokens_global}")


def _compute_dtype(tensor: Tensor) -> torch.dtype:
    # Half-precision log-prob sums lose the small differences DPO is made of.
    return tensor.dtype if tensor.dtype in (torch.float32, torch.float64) else torch.float32


@dataclass
class _Terms:
    """The quantities the loss formulas are written in, in the compute dtype."""

    chosen_logratio: Tensor  # u+
    rejected_logratio: Tensor  # u-
    chosen_num_tokens: Tensor  # L+, as floats, at least 1
    rejected_num_tokens: Tensor  # L-
    chosen_nll_sum: Tensor


def _terms(logps: PairLogps, *, spec: LossSpec) -> _Terms:
    dtype = _compute_dtype(logps.chosen_logps)
    chosen = logps.chosen_logps.to(dtype)
    rejected = logps.rejected_logps.to(dtype)
    if spec.reference_free:
        chosen_logratio, rejected_logratio = chosen, rejected
    else:
        # The reference is frozen: never let a gradient reach it, whatever the caller passed.
        chosen_logratio = chosen - logps.ref_chosen_logps.detach().to(dtype)
        rejected_logratio = rejected - logps.ref_rejected_logps.detach().to(dtype)
    # A completion with no tokens has a log-prob of 0; dividing 0 by 1 keeps it 0 instead of nan.
    chosen_num_tokens = logps.chosen_num_tokens.to(dtype).clamp(min=1.0)
    rejected_num_tokens = logps.rejected_num_tokens.to(dtype).clamp(min=1.0)
    nll = -chosen if logps.chosen_nll_sum is None else logps.chosen_nll_sum.to(dtype)
    return _Terms(chosen_logratio, rejected_logratio, chosen_num_tokens, rejected_num_tokens, nll)


def f_divergence_score(logratio: Tensor, *, f_divergence_type: str, alpha: float = 0.5) -> Tensor:
    """f'(π/π_ref) written in u = log(π/π_ref), as TRL 1.16's `DPOTrainer._compute_loss` does."""
    if f_divergence_type == "reverse_kl":
        return logratio
    if f_divergence_type == "forward_kl":
        return 1.0 - torch.exp(-logratio)
    if f_divergence_type == "js_divergence":
        return math.log(2.0) + F.logsigmoid(logratio)
    if f_divergence_type == "alpha_divergence":
        if abs(alpha - 1.0) < 1e-6:  # the limit α -> 1 is reverse KL
            return logratio
        t = torch.clamp((alpha - 1.0) * logratio, max=_ALPHA_DIVERGENCE_CLAMP)
        return (torch.exp(t) - 1.0) / (alpha - 1.0)
    raise ValueError(f"f_divergence_type: unknown {f_divergence_type!r}")


def _smoothed_sigmoid(delta: Tensor, *, beta: float, eps: float) -> Tensor:
    return -(1.0 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)


def _sorted_losses(
    loss_type: str, logps: PairLogps, terms: _Terms, *, spec: LossSpec, sort: BatchSort
) -> Tensor:
    """aot / aot_unpaired for the pairs of one microbatch, given the sort of the whole batch.

    Each pair carries the loss of the sorted position its own value lands on, so the values sum
    to the batch loss. aot_unpaired moves u+ and u- independently: the u- gradient comes from
    the position of u-, through a term whose value is zero (term - term.detach())."""
    beta, eps = spec.beta, spec.label_smoothing
    dtype = terms.chosen_logratio.dtype
    index = logps.pair_index
    if index is None:
        index = torch.arange(logps.chosen_logps.numel(), device=logps.chosen_logps.device)
    if loss_type == "aot":
        logratio = logps.chosen_logps.to(dtype) - logps.rejected_logps.to(dtype)
        ref_sorted = sort.ref_logratio_sorted.to(dtype)[sort.logratio_rank[index]]
        return _smoothed_sigmoid(logratio - ref_sorted, beta=beta, eps=eps)
    rejected_at_chosen_rank = sort.rejected_sorted.to(dtype)[sort.chosen_rank[index]]
    chosen_at_rejected_rank = sort.chosen_sorted.to(dtype)[sort.rejected_rank[index]]
    main = _smoothed_sigmoid(terms.chosen_logratio - rejected_at_chosen_rank, beta=beta, eps=eps)
    other = _smoothed_sigmoid(chosen_at_rejected_rank - terms.rejected_logratio, beta=beta, eps=eps)
    return main + (other - other.detach())


def _single_type_losses(
    loss_type: str, terms: _Terms, *, spec: LossSpec, num_pairs_global: int, chosen_tokens_global: int
) -> Tensor:
    beta = spec.beta
    eps = spec.label_smoothing
    u_chosen, u_rejected = terms.chosen_logratio, terms.rejected_logratio
    # The difference-based losses read f-divergence scores (u itself for reverse_kl).
    score_chosen = f_divergence_score(u_chosen, f_divergence_type=spec.f_divergence_type,
                                      alpha=spec.f_alpha_divergence_coef)
    score_rejected = f_divergence_score(u_rejected, f_divergence_type=spec.f_divergence_type,
                                        alpha=spec.f_alpha_divergence_coef)
    z = beta * (score_chosen - score_rejected)
    if loss_type == "sigmoid":
        return -F.logsigmoid(z)
    if loss_type == "cdpo":
        return -(1.0 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    if loss_type == "hinge":
        return torch.relu(1.0 - z)
    if loss_type == "ipo":
        per_token_margin = score_chosen / terms.chosen_num_tokens - score_rejected / terms.rejected_num_tokens
        return (per_token_margin - 1.0 / (2.0 * beta)) ** 2
    if loss_type == "robust":
        return (-(1.0 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1.0 - 2.0 * eps)
    if loss_type == "exo_pair":
        # KL(σ(z) || 1-ε): written with logsigmoid so neither log(0) nor 0·inf can appear.
        log_p, log_q = F.logsigmoid(z), F.logsigmoid(-z)
        return torch.exp(log_p) * (log_p - math.log(1.0 - eps)) + torch.exp(log_q) * (log_q - math.log(eps))
    if loss_type == "nca_pair":
        chosen_reward, rejected_reward = beta * u_chosen, beta * u_rejected
        return (
            -F.logsigmoid(chosen_reward) - 0.5 * F.logsigmoid(-chosen_reward) - 0.5 * F.logsigmoid(-rejected_reward)
        )
    if loss_type == "bco_pair":
        # As TRL 1.16's `DPOTrainer._compute_loss`: no running reward mean.
        return -F.logsigmoid(beta * u_chosen) - F.logsigmoid(-beta * u_rejected)
    if loss_type == "sppo_hard":
        half_inv_beta = 1.0 / (2.0 * beta)
        return (u_chosen - half_inv_beta) ** 2 + (u_rejected + half_inv_beta) ** 2
    if loss_type == "apo_zero":
        return 1.0 - torch.sigmoid(beta * u_chosen) + torch.sigmoid(beta * u_rejected)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * u_chosen) + 1.0 - torch.sigmoid(z)
    if loss_type == "discopop":
        tau = spec.discopop_tau
        # g·e^(-z) as exp(log g - z): e^(-z) alone overflows for z << 0, exactly where g vanishes.
        logistic = -F.logsigmoid(z) * torch.sigmoid(-z / tau)
        exponential = torch.exp(F.logsigmoid(z / tau) - z)
        return logistic + exponential
    if loss_type == "sigmoid_norm":
        z_norm = beta * (score_chosen / terms.chosen_num_tokens - score_rejected / terms.rejected_num_tokens)
        return -F.logsigmoid(z_norm)
    if loss_type == "sft":
        # Averaging these over the global pairs gives Σ nll / T: the token mean over the global batch.
        return terms.chosen_nll_sum * (num_pairs_global / chosen_tokens_global)
    raise ValueError(f"loss_types: unknown loss type {loss_type!r}")


def _wpo_weights(logps: PairLogps, *, dtype: torch.dtype) -> Tensor:
    if logps.chosen_wpo_log_weight is None or logps.rejected_wpo_log_weight is None:
        raise ValueError("chosen_wpo_log_weight: use_weighting needs the WPO log-weights of both completions")
    # exp(a)·exp(b), not exp(a + b): the product TRL 1.16 forms (chosen_weights * rejected_weights).
    chosen = torch.exp(logps.chosen_wpo_log_weight.detach().to(dtype))
    rejected = torch.exp(logps.rejected_wpo_log_weight.detach().to(dtype))
    return chosen * rejected


def pair_losses(
    logps: PairLogps,
    *,
    spec: LossSpec,
    num_pairs_global: int,
    chosen_tokens_global: int,
    sort: BatchSort | None = None,
) -> Tensor:
    """Per-pair loss [b] (weighted sum over spec.loss_types), differentiable in the policy log-probs.

    The global-batch loss is sum(pair_losses) / num_pairs_global summed over all
    microbatches and ranks; chosen_tokens_global (chosen completion tokens in the
    global batch) is needed only to scale "sft" to a global token mean. aot and
    aot_unpaired need `sort`, the BatchSort of the whole global batch, and
    `logps.pair_index`; when `logps` is the whole batch both may be left out.
    """
    spec.validate()
    _check_inputs(logps, num_pairs_global=num_pairs_global, chosen_tokens_global=chosen_tokens_global)
    terms = _terms(logps, spec=spec)
    if spec.needs_batch_sort and sort is None:
        if logps.chosen_logps.numel() != num_pairs_global or logps.pair_index is not None:
            raise ValueError("sort: aot and aot_unpaired need the BatchSort of the whole global batch")
        sort = batch_sort(logps, spec=spec)
    weights = _wpo_weights(logps, dtype=terms.chosen_logratio.dtype) if spec.use_weighting else None
    total: Tensor | None = None
    for loss_type, weight in zip(spec.loss_types, spec.loss_weights):
        if loss_type in SORTED_TYPES:
            assert sort is not None
            losses = _sorted_losses(loss_type, logps, terms, spec=spec, sort=sort)
        else:
            losses = _single_type_losses(
                loss_type,
                terms,
                spec=spec,
                num_pairs_global=num_pairs_global,
                chosen_tokens_global=chosen_tokens_global,
            )
        if weights is not None:
            losses = losses * weights
        losses = weight * losses
        total = losses if total is None else total + losses
    assert total is not None  # validate() guarantees at least one type
    return total


def metric_sums(
    logps: PairLogps,
    *,
    spec: LossSpec,
    num_pairs_global: int,
    chosen_tokens_global: int,
    sort: BatchSort | None = None,
) -> dict[str, float]:
    """metric_sum_vector as a dict of Python floats keyed by METRIC_SUM_KEYS (reads the device)."""
    vector = metric_sum_vector(
        logps, spec=spec, num_pairs_global=num_pairs_global, chosen_tokens_global=chosen_tokens_global, sort=sort
    )
    return dict(zip(METRIC_SUM_KEYS, vector.tolist()))


def metric_sum_vector(
    logps: PairLogps,
    *,
    spec: LossSpec,
    num_pairs_global: int,
    chosen_tokens_global: int,
    sort: BatchSort | None = None,
    losses: Tensor | None = None,
) -> torch.Tensor:
    """Additive metric sums of one microbatch: float64 [len(METRIC_SUM_KEYS)], on the device.

    Add the vectors over microbatches and data-parallel ranks, then read them once and call
    finalize_metrics: nothing here waits for the device. `losses`: the microbatch's
    `pair_losses`, when the caller has them already (the loss then runs once).
    """
    with torch.no_grad():
        if losses is None:
            losses = pair_losses(logps, spec=spec, num_pairs_global=num_pairs_global,
                                 chosen_tokens_global=chosen_tokens_global, sort=sort)
        terms = _terms(logps, spec=spec)
        # Sums in float64: they are added over many microbatches and ranks before division.
        dtype = torch.float64
        chosen_rewards = spec.beta * terms.chosen_logratio
        rejected_rewards = spec.beta * terms.rejected_logratio
        values = torch.stack(
            [
                torch.full((), float(losses.numel()), dtype=dtype, device=losses.device),
                losses.to(dtype).sum(),
                chosen_rewards.to(dtype).sum(),
                rejected_rewards.to(dtype).sum(),
                (terms.chosen_logratio > terms.rejected_logratio).to(dtype).sum(),
                (chosen_rewards - rejected_rewards).to(dtype).sum(),
                logps.chosen_logps.to(dtype).sum(),
                logps.rejected_logps.to(dtype).sum(),
                logps.chosen_logit_sum.to(dtype).sum(),
                logps.rejected_logit_sum.to(dtype).sum(),
                # Raw counts, not the clamped ones: these are the denominators of token means.
                logps.chosen_num_tokens.to(dtype).sum(),
                logps.rejected_num_tokens.to(dtype).sum(),
                terms.chosen_nll_sum.to(dtype).sum(),
            ]
        )
    return values


def finalize_metrics(sums: dict[str, float], *, spec: LossSpec) -> dict[str, float]:
    """Turn metric sums added over a whole global batch into means under the metric names of
    TRL 1.16's `DPOTrainer._compute_loss`. Reference-free
    runs report no rewards/*: a reward is a log-ratio against a reference, and with none the
    numbers would only be β·log π under another name."""
    metrics = pair_means(sums, sums_count(sums, METRIC_SUM_KEYS, count="num_pairs"))
    if spec.reference_free:
        metrics = {key: value for key, value in metrics.items() if not key.startswith("rewards/")}
    if "sft" in spec.loss_types:
        metrics["nll_loss"] = sums["nll_sum"] / max(sums["num_chosen_tokens"], 1.0)
    return metrics
