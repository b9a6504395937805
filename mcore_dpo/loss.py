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
L+, L- = completion token counts; β = beta; ε = label_smoothing; z = βΔ.

| loss type    | per-pair loss                                                     |
|--------------|-------------------------------------------------------------------|
| sigmoid      | -logσ(z)                                                          |
| cdpo         | -(1-ε)logσ(z) - ε·logσ(-z)   (label-smoothed sigmoid, "cDPO")     |
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

Differences from TRL worth knowing:
- bco_pair: TRL shifts both rewards by a running mean of past rewards
  (`delta`); here delta = 0, which keeps the loss a pure function of the
  batch and identical for any split.
- ipo and sigmoid_norm divide by the token counts inside their own formula
  only, as TRL 1.16's ipo does; the logged logps/rewards are sums over the
  completion tokens for every loss type, as in TRL 1.16. (TRL releases before
  1.0 turned every log-prob into a per-token mean when "ipo" was asked.)
- logits/chosen and logits/rejected: the exact mean over every completion
  token of the global batch (finalize_metrics divides global sums). TRL logs
  the mean of per-microbatch token means, which differs when microbatches hold
  different token counts (docs/DESIGN.md, "Metrics").
- label_smoothing is used by cdpo, robust and exo_pair only; plain sigmoid
  never smooths (ask for "cdpo" for that).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

LOSS_TYPES: tuple[str, ...] = (
    "sigmoid",
    "cdpo",
    "hinge",
    "ipo",
    "robust",
    "exo_pair",
    "nca_pair",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "discopop",
    "sigmoid_norm",
    "sft",
)

# Types whose formula reads label_smoothing; for the others it would be silently ignored.
_SMOOTHED_TYPES: frozenset[str] = frozenset({"cdpo", "robust", "exo_pair"})

# TRL's default label_smoothing for exo_pair, quoted in the error message.
_EXO_PAIR_DEFAULT_EPS = 1e-3

# Keys of `metric_sums`, in a fixed order so the engine can pack them into one
# tensor for a single all-reduce: torch.tensor([sums[k] for k in METRIC_SUM_KEYS]).
METRIC_SUM_KEYS: tuple[str, ...] = (
    "num_pairs",
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
    "nll_sum",
)


@dataclass(frozen=True)
class LossSpec:
    """Which losses to optimise and their hyper-parameters."""

    loss_types: tuple[str, ...] = ("sigmoid",)
    """One or more names from LOSS_TYPES; the loss is the weighted sum of their per-pair losses."""
    loss_weights: tuple[float, ...] = (1.0,)
    """One non-negative weight per entry of loss_types."""
    beta: float = 0.1
    """Inverse temperature β of the implicit reward β·(log π - log π_ref)."""
    label_smoothing: float = 0.0
    """ε in [0, 0.5): assumed probability that a preference label is flipped (cdpo, robust, exo_pair)."""
    reference_free: bool = False
    """Treat the reference log-probs as 0 (no reference model)."""
    discopop_tau: float = 0.05
    """Temperature τ of the discopop mixing gate σ(βΔ/τ)."""

    def validate(self) -> None:
        """Raise ValueError (one line, naming the field) if the spec cannot be trained."""
        types = tuple(self.loss_types)
        if not types:
            raise ValueError("loss_types: at least one loss type is required")
        for name in types:
            if name not in LOSS_TYPES:
                raise ValueError(f"loss_types: unknown loss type {name!r}; choose from {', '.join(LOSS_TYPES)}")
        duplicates = sorted({name for name in types if types.count(name) > 1})
        if duplicates:
            raise ValueError(f"loss_types: {', '.join(duplicates)} listed more than once; merge their weights")
        weights = tuple(self.loss_weights)
        if len(weights) != len(types):
            raise ValueError(
                f"loss_weights: has {len(weights)} entries but loss_types has {len(types)}; give one weight per type"
            )
        for name, weight in zip(types, weights):
            if not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
                raise ValueError(f"loss_weights: weight {weight!r} for {name!r} must be a finite number >= 0")
        if sum(weights) <= 0:
            raise ValueError("loss_weights: all weights are 0; at least one must be positive")
        if not math.isfinite(self.beta) or self.beta <= 0:
            raise ValueError(f"beta: must be a finite number > 0, got {self.beta!r}")
        eps = self.label_smoothing
        if not math.isfinite(eps) or not 0.0 <= eps < 0.5:
            raise ValueError(f"label_smoothing: must be in [0, 0.5) (0.5 makes the labels pure noise), got {eps!r}")
        if "exo_pair" in types and eps <= 0:
            raise ValueError(
                f"label_smoothing: exo_pair needs label_smoothing > 0 (its loss has a log ε term); "
                f"TRL's default is {_EXO_PAIR_DEFAULT_EPS:g}"
            )
        if eps > 0 and not _SMOOTHED_TYPES.intersection(types):
            raise ValueError(
                f"label_smoothing: {eps!r} has no effect on loss types {', '.join(types)}; it is used by "
                f"{', '.join(sorted(_SMOOTHED_TYPES))} (use cdpo for label-smoothed sigmoid)"
            )
        if not math.isfinite(self.discopop_tau) or self.discopop_tau <= 0:
            raise ValueError(f"discopop_tau: must be a finite number > 0, got {self.discopop_tau!r}")

    @property
    def needs_reference(self) -> bool:
        """Whether the engine must run a reference forward at all."""
        if self.reference_free:
            return False
        return any(name != "sft" for name in self.loss_types)


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


def _single_type_losses(
    loss_type: str, terms: _Terms, *, spec: LossSpec, num_pairs_global: int, chosen_tokens_global: int
) -> Tensor:
    beta = spec.beta
    eps = spec.label_smoothing
    u_chosen, u_rejected = terms.chosen_logratio, terms.rejected_logratio
    z = beta * (u_chosen - u_rejected)
    if loss_type == "sigmoid":
        return -F.logsigmoid(z)
    if loss_type == "cdpo":
        return -(1.0 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    if loss_type == "hinge":
        return torch.relu(1.0 - z)
    if loss_type == "ipo":
        per_token_margin = u_chosen / terms.chosen_num_tokens - u_rejected / terms.rejected_num_tokens
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
        # TRL subtracts a running reward mean `delta` from both rewards; delta = 0 here (see module docstring).
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
        z_norm = beta * (u_chosen / terms.chosen_num_tokens - u_rejected / terms.rejected_num_tokens)
        return -F.logsigmoid(z_norm)
    if loss_type == "sft":
        # Averaging these over the global pairs gives Σ nll / T: the token mean over the global batch.
        return terms.chosen_nll_sum * (num_pairs_global / chosen_tokens_global)
    raise ValueError(f"loss_types: unknown loss type {loss_type!r}")


def pair_losses(
    logps: PairLogps, *, spec: LossSpec, num_pairs_global: int, chosen_tokens_global: int
) -> Tensor:
    """Per-pair loss [b] (weighted sum over spec.loss_types), differentiable in the policy log-probs.

    The global-batch loss is sum(pair_losses) / num_pairs_global summed over all
    microbatches and ranks; chosen_tokens_global (chosen completion tokens in the
    global batch) is needed only to scale "sft" to a global token mean.
    """
    spec.validate()
    _check_inputs(logps, num_pairs_global=num_pairs_global, chosen_tokens_global=chosen_tokens_global)
    terms = _terms(logps, spec=spec)
    total: Tensor | None = None
    for loss_type, weight in zip(spec.loss_types, spec.loss_weights):
        losses = weight * _single_type_losses(
            loss_type,
            terms,
            spec=spec,
            num_pairs_global=num_pairs_global,
            chosen_tokens_global=chosen_tokens_global,
        )
        total = losses if total is None else total + losses
    assert total is not None  # validate() guarantees at least one type
    return total


def metric_sums(
    logps: PairLogps, *, spec: LossSpec, num_pairs_global: int, chosen_tokens_global: int
) -> dict[str, float]:
    """metric_sum_vector as a dict of Python floats keyed by METRIC_SUM_KEYS (reads the device)."""
    vector = metric_sum_vector(
        logps, spec=spec, num_pairs_global=num_pairs_global, chosen_tokens_global=chosen_tokens_global
    )
    return dict(zip(METRIC_SUM_KEYS, vector.tolist()))


def metric_sum_vector(
    logps: PairLogps, *, spec: LossSpec, num_pairs_global: int, chosen_tokens_global: int
) -> torch.Tensor:
    """Additive metric sums of one microbatch: float64 [len(METRIC_SUM_KEYS)], on the device.

    Add the vectors over microbatches and data-parallel ranks, then read them once and call
    finalize_metrics: nothing here waits for the device.
    """
    with torch.no_grad():
        losses = pair_losses(
            logps, spec=spec, num_pairs_global=num_pairs_global, chosen_tokens_global=chosen_tokens_global
        )
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
    """Turn metric sums added over a whole global batch into TRL-named means."""
    missing = [key for key in METRIC_SUM_KEYS if key not in sums]
    if missing:
        raise ValueError(f"sums: missing keys {', '.join(missing)}")
    num_pairs = sums["num_pairs"]
    if num_pairs <= 0:
        raise ValueError(f"sums: num_pairs must be > 0, got {num_pairs}")
    # An empty chosen/rejected side would be a data bug; report 0 rather than dividing by zero.
    chosen_tokens = max(sums["num_chosen_tokens"], 1.0)
    rejected_tokens = max(sums["num_rejected_tokens"], 1.0)
    metrics = {
        "loss": sums["loss_sum"] / num_pairs,
        "rewards/chosen": sums["reward_chosen_sum"] / num_pairs,
        "rewards/rejected": sums["reward_rejected_sum"] / num_pairs,
        "rewards/accuracies": sums["accuracy_sum"] / num_pairs,
        "rewards/margins": sums["margin_sum"] / num_pairs,
        "logps/chosen": sums["logps_chosen_sum"] / num_pairs,
        "logps/rejected": sums["logps_rejected_sum"] / num_pairs,
        "logits/chosen": sums["logit_chosen_sum"] / chosen_tokens,
        "logits/rejected": sums["logit_rejected_sum"] / rejected_tokens,
    }
    if "sft" in spec.loss_types:
        metrics["nll_loss"] = sums["nll_sum"] / chosen_tokens
    return metrics
