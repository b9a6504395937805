"""CPO (Contrastive Preference Optimization) and its SimPO / AlphaPO variants, as pure functions
on per-sample log-probs. Reference-free: no reference model is read.

The engine computes, for each microbatch, the summed completion log-probs of every sample's chosen
and rejected completion under the policy and their token counts, then calls:

    out = cpo_losses(chosen_logps_sum=..., rejected_logps_sum=..., chosen_num_tokens=...,
                     rejected_num_tokens=..., spec=spec, num_samples_global=N, chosen_tokens_global=T)
    (out.total.sum() / N).backward()          # summed over microbatches and DP ranks
    vector = cpo_metric_sum_vector(..., spec=spec, num_samples_global=N, chosen_tokens_global=T)
    # ... add the vectors over microbatches and ranks (keys: CPO_SUM_KEYS), read once ...
    metrics = finalize(dict(zip(CPO_SUM_KEYS, vector.tolist())), spec)

N is the number of samples (preference pairs) and T the number of chosen completion tokens in the
whole global batch. Every per-sample total is scaled to be averaged over N, so the global-batch
loss and its gradient do not depend on how the samples are split into microbatches and ranks.

Notation (per sample): c, r = policy log-probs of the chosen / rejected completion summed over
its tokens; L+, L- = completion token counts; β = beta; ε = label_smoothing; γ = simpo_gamma;
a = alpha; λ = cpo_alpha. The loss types marked "mean" read the per-token means
ĉ = c/L+, r̂ = r/L-; the others read ĉ = c, r̂ = r. The reward shape is
s(x) = x for a = 0 and s(x) = (1 - e^(-a·x))/a otherwise (AlphaPO's (1 - p^(-a))/a with p = e^x);
Δ = s(ĉ) - s(r̂); h(t) = -(1-ε)·logσ(t) - ε·logσ(-t).

| loss type | reads | per-sample preference loss            | NLL weight |
|-----------|-------|----------------------------------------|------------|
| sigmoid   | sum   | h(βΔ)                                  | λ          |
| hinge     | sum   | relu(1 - βΔ)                           | λ          |
| ipo       | mean  | (Δ - 1/(2β))²                          | λ          |
| simpo     | mean  | h(β(Δ - γ/β)) = h(βΔ - γ)              | λ          |
| alphapo   | mean  | as simpo                               | 0          |

The objective is mean(preference loss) + weight · NLL, where NLL is the cross-entropy averaged
over every chosen completion token of the global batch. Rewards (logged, no gradient) are β·s(ĉ)
and β·s(r̂); logps/* log ĉ and r̂, so they are per-token means for ipo, simpo and alphapo.

alphapo is TRL 1.16's shorthand (`CPOConfig.__post_init__`): it trains as simpo with cpo_alpha
set to 0; the reward shape comes from alpha, which applies to every loss type and is 0 (plain
log-probs) unless set.

Differences from TRL 1.16 worth knowing:
- label_smoothing with hinge or ipo is an error here; TRL 1.16 warns and ignores it. A cpo_alpha
  other than 0 or its default with alphapo is an error too (TRL 1.16 overwrites it with 0).
- The NLL is the token mean over the chosen completions of the whole global batch. TRL 1.16
  takes it per device microbatch (and logs the mean of the per-device values), which differs when
  microbatches hold different numbers of chosen tokens.
- logits/chosen and logits/rejected: the exact mean over every completion token of the global
  batch of the vocabulary-mean logit (finalize divides global sums). TRL 1.16 logs the mean of
  the whole padded logits tensor of each device microbatch, prompt and padding positions included.
- The reward shape is computed as -expm1(-a·x)/a. TRL 1.16 forms exp(x) first, which underflows
  to 0 in float32 below x ≈ -104 (a summed log-prob of a long completion, for sigmoid and hinge)
  and turns the loss into inf/nan; the two agree wherever TRL 1.16's value is finite (in float32
  to a few 1e-6 relative: the roundings differ).
- A completion with no tokens counts as one token in the per-token means (its mean is 0, not
  nan), as in the DPO losses.
- Half-precision inputs are computed in float32 (TRL 1.16 computes in the input dtype); the
  metric sums are float64.
- With cpo_alpha 0 (and alphapo) TRL 1.16 neither computes nor logs an NLL: `nll_loss` is 0.0
  there, and so it is here.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mcore_dpo.objective.contract import PAIR, BatchTotals, Objective
from mcore_dpo.objective.metric_sums import PAIR_SUM_KEYS, pair_means, pair_sums, sums_count
from mcore_dpo.objective.logprobs import SequenceLogps

CPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "hinge", "ipo", "simpo", "alphapo")

# The types that read per-token mean log-probs (TRL 1.16's `average_log_prob` for ipo and simpo;
# alphapo is simpo).
CPO_MEAN_TYPES: frozenset[str] = frozenset({"ipo", "simpo", "alphapo"})

# The types whose formula reads label_smoothing.
_SMOOTHED_TYPES: frozenset[str] = frozenset({"sigmoid", "simpo", "alphapo"})

# Keys of cpo_metric_sum_vector, in its order: the engine adds the vectors over microbatches and
# ranks (one all-reduce), then finalize reads them as a dict.
CPO_SUM_KEYS: tuple[str, ...] = ("num_samples", *PAIR_SUM_KEYS, "nll_sum")


@dataclass(frozen=True)
class CpoSpec:
    """The CPO loss type and its hyper-parameters (TRL 1.16 `CPOConfig` names and defaults)."""

    cpo_loss_type: str = "sigmoid"
    """One of CPO_LOSS_TYPES (TRL 1.16's `loss_type`)."""
    beta: float = 0.1
    """β, the scale of the reward margin inside the loss (IPO's regularisation τ for ipo)."""
    label_smoothing: float = 0.0
    """ε in [0, 0.5): assumed probability that a preference label is flipped (sigmoid, simpo, alphapo)."""
    cpo_alpha: float = 1.0
    """λ >= 0, weight of the NLL (behaviour cloning) term on the chosen completions; alphapo uses 0."""
    simpo_gamma: float = 0.5
    """γ, SimPO's target reward margin (simpo and alphapo only)."""
    alpha: float = 0.0
    """a, AlphaPO's reward shape (1 - p^(-a))/a for every loss type; 0 keeps the log-prob itself."""

    def validate(self) -> None:
        """Raise ValueError (one line, naming the field) if the spec cannot be trained."""
        if self.cpo_loss_type not in CPO_LOSS_TYPES:
            raise ValueError(
                f"loss_type: unknown {self.cpo_loss_type!r}; choose from {', '.join(CPO_LOSS_TYPES)}"
            )
        if not _finite(self.beta) or self.beta <= 0:
            raise ValueError(f"beta: must be a finite number > 0, got {self.beta!r}")
        eps = self.label_smoothing
        if not _finite(eps) or not 0.0 <= eps < 0.5:
            raise ValueError(f"label_smoothing: must be in [0, 0.5) (0.5 makes the labels pure noise), got {eps!r}")
        if eps > 0 and self.cpo_loss_type not in _SMOOTHED_TYPES:
            raise ValueError(
                f"label_smoothing: {self.cpo_loss_type} does not read it (TRL 1.16 ignores it with a warning); "
                f"it is used by {', '.join(sorted(_SMOOTHED_TYPES))}"
            )
        if not _finite(self.cpo_alpha) or self.cpo_alpha < 0:
            raise ValueError(f"cpo_alpha: must be a finite number >= 0, got {self.cpo_alpha!r}")
        if self.cpo_loss_type == "alphapo" and self.cpo_alpha not in (0.0, CpoSpec.cpo_alpha):
            raise ValueError(
                f"cpo_alpha: alphapo trains without the NLL term (cpo_alpha 0, as TRL 1.16 sets it), got "
                f"{self.cpo_alpha!r}; use simpo with alpha for AlphaPO plus NLL"
            )
        if not _finite(self.simpo_gamma):
            raise ValueError(f"simpo_gamma: must be a finite number, got {self.simpo_gamma!r}")
        if not _finite(self.alpha):
            raise ValueError(f"alpha: must be a finite number, got {self.alpha!r}")

    @property
    def effective_loss_type(self) -> str:
        """The formula trained: alphapo is simpo."""
        return "simpo" if self.cpo_loss_type == "alphapo" else self.cpo_loss_type

    @property
    def effective_cpo_alpha(self) -> float:
        """The NLL weight trained: 0 for alphapo, else cpo_alpha."""
        return 0.0 if self.cpo_loss_type == "alphapo" else float(self.cpo_alpha)

    @property
    def uses_token_means(self) -> bool:
        """Whether the loss reads per-token mean log-probs (ipo, simpo, alphapo) rather than sums."""
        return self.cpo_loss_type in CPO_MEAN_TYPES


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class CpoLosses:
    """Per-sample results of cpo_losses; every tensor has shape [b], in the compute dtype."""

    losses: Tensor
    """Preference loss per sample (the table's column), differentiable."""
    nll: Tensor
    """NLL contribution chosen_nll_sum·N/T (so that Σ over the global batch / N is the token-mean NLL);
    zeros when the effective cpo_alpha is 0."""
    total: Tensor
    """losses + effective cpo_alpha · nll: what the engine sums, divides by N and backpropagates."""
    chosen_logps: Tensor
    """ĉ: the chosen log-prob the loss reads (per-token mean for ipo/simpo/alphapo, else the sum), detached."""
    rejected_logps: Tensor
    """r̂, likewise."""
    chosen_rewards: Tensor
    """β·s(ĉ), detached."""
    rejected_rewards: Tensor
    """β·s(r̂), detached."""


def _compute_dtype(tensor: Tensor) -> torch.dtype:
    # Half-precision log-prob sums lose the small differences the loss is made of.
    return tensor.dtype if tensor.dtype in (torch.float32, torch.float64) else torch.float32


def _check(shape_of: dict[str, Tensor | None], *, num_samples_global: int, tokens_global: tuple[str, int]) -> None:
    # Shape checks only: anything that reads tensor values would force a device sync.
    (first_name, first), *rest = shape_of.items()
    assert first is not None
    if first.dim() != 1:
        raise ValueError(f"{first_name}: expected shape [b], got {list(first.shape)}")
    for name, value in rest:
        if value is not None and value.shape != first.shape:
            raise ValueError(f"{name}: expected shape {list(first.shape)} like {first_name}, got {list(value.shape)}")
    if num_samples_global <= 0:
        raise ValueError(f"num_samples_global: must be > 0, got {num_samples_global}")
    name, tokens = tokens_global
    if tokens <= 0:
        raise ValueError(f"{name}: must be > 0, got {tokens}")


def reward_shape(logps: Tensor, *, alpha: float) -> Tensor:
    """s(x): x for alpha 0, else AlphaPO's (1 - p^(-alpha))/alpha with p = e^x, as -expm1(-alpha·x)/alpha."""
    if alpha == 0.0:
        return logps
    return -torch.expm1(-alpha * logps) / alpha


def smoothed_sigmoid_loss(t: Tensor, *, label_smoothing: float) -> Tensor:
    """h(t) = -(1-ε)·logσ(t) - ε·logσ(-t)."""
    return -(1.0 - label_smoothing) * F.logsigmoid(t) - label_smoothing * F.logsigmoid(-t)


def cpo_losses(
    *,
    chosen_logps_sum: Tensor,
    rejected_logps_sum: Tensor,
    chosen_num_tokens: Tensor,
    rejected_num_tokens: Tensor,
    spec: CpoSpec,
    num_samples_global: int,
    chosen_tokens_global: int,
    chosen_nll_sum: Tensor | None = None,
) -> CpoLosses:
    """Per-sample CPO losses and rewards of one microbatch (all inputs [b]).

    chosen_logps_sum / rejected_logps_sum: policy log-probs summed over each completion's tokens
    (they carry the gradient); chosen_num_tokens / rejected_num_tokens: the completion token
    counts; chosen_nll_sum: the NLL summed over the chosen completion tokens, None meaning
    -chosen_logps_sum (the same tokens, so the same number). num_samples_global (N) and
    chosen_tokens_global (T) count the whole global batch: Σ total / N over all microbatches and
    ranks is mean(losses) + cpo_alpha · (token-mean NLL).
    """
    spec.validate()
    _check(
        {
            "chosen_logps_sum": chosen_logps_sum,
            "rejected_logps_sum": rejected_logps_sum,
            "chosen_num_tokens": chosen_num_tokens,
            "rejected_num_tokens": rejected_num_tokens,
            "chosen_nll_sum": chosen_nll_sum,
        },
        num_samples_global=num_samples_global,
        tokens_global=("chosen_tokens_global", chosen_tokens_global),
    )
    dtype = _compute_dtype(chosen_logps_sum)
    chosen = chosen_logps_sum.to(dtype)
    rejected = rejected_logps_sum.to(dtype)
    if spec.uses_token_means:
        # A completion with no tokens has a log-prob of 0; dividing 0 by 1 keeps it 0 instead of nan.
        chosen = chosen / chosen_num_tokens.to(dtype).clamp(min=1.0)
        rejected = rejected / rejected_num_tokens.to(dtype).clamp(min=1.0)
    chosen_score = reward_shape(chosen, alpha=spec.alpha)
    rejected_score = reward_shape(rejected, alpha=spec.alpha)
    delta = chosen_score - rejected_score
    beta = spec.beta
    loss_type = spec.effective_loss_type
    if loss_type == "sigmoid":
        losses = smoothed_sigmoid_loss(beta * delta, label_smoothing=spec.label_smoothing)
    elif loss_type == "simpo":
        # β(Δ - γ/β), in that order of operations.
        losses = smoothed_sigmoid_loss(beta * (delta - spec.simpo_gamma / beta), label_smoothing=spec.label_smoothing)
    elif loss_type == "hinge":
        losses = torch.relu(1.0 - beta * delta)
    elif loss_type == "ipo":
        losses = (delta - 1.0 / (2.0 * beta)) ** 2
    else:  # validate() has refused anything else
        raise AssertionError(loss_type)
    weight = spec.effective_cpo_alpha
    if weight == 0.0:
        nll = torch.zeros_like(losses)
        total = losses
    else:
        nll_sum = -chosen_logps_sum.to(dtype) if chosen_nll_sum is None else chosen_nll_sum.to(dtype)
        # Averaged over the N samples of the global batch, these give Σ nll / T: the token mean.
        nll = nll_sum * (num_samples_global / chosen_tokens_global)
        total = losses + weight * nll
    return CpoLosses(
        losses=losses,
        nll=nll,
        total=total,
        chosen_logps=chosen.detach(),
        rejected_logps=rejected.detach(),
        chosen_rewards=(beta * chosen_score).detach(),
        rejected_rewards=(beta * rejected_score).detach(),
    )


def cpo_metric_sum_vector(
    *,
    chosen_logps_sum: Tensor,
    rejected_logps_sum: Tensor,
    chosen_num_tokens: Tensor,
    rejected_num_tokens: Tensor,
    chosen_logit_sum: Tensor,
    rejected_logit_sum: Tensor,
    spec: CpoSpec,
    num_samples_global: int,
    chosen_tokens_global: int,
    chosen_nll_sum: Tensor | None = None,
    losses: CpoLosses | None = None,
) -> Tensor:
    """Additive metric sums of one microbatch: float64 [len(CPO_SUM_KEYS)], on the inputs' device.
    `losses`: this microbatch's `cpo_losses`, when the caller has them already (the loss then
    runs once).

    The inputs are cpo_losses' plus chosen_logit_sum / rejected_logit_sum [b]: the sum over each
    completion's tokens of the vocabulary-mean logit. Add the vectors over microbatches and ranks,
    read them once and call finalize: nothing here waits for the device.
    """
    _check(
        {"chosen_logps_sum": chosen_logps_sum, "chosen_logit_sum": chosen_logit_sum,
         "rejected_logit_sum": rejected_logit_sum},
        num_samples_global=num_samples_global,
        tokens_global=("chosen_tokens_global", chosen_tokens_global),
    )
    with torch.no_grad():
        out = losses if losses is not None else cpo_losses(
            chosen_logps_sum=chosen_logps_sum,
            rejected_logps_sum=rejected_logps_sum,
            chosen_num_tokens=chosen_num_tokens,
            rejected_num_tokens=rejected_num_tokens,
            spec=spec,
            num_samples_global=num_samples_global,
            chosen_tokens_global=chosen_tokens_global,
            chosen_nll_sum=chosen_nll_sum,
        )
        dtype = torch.float64
        if spec.effective_cpo_alpha == 0.0:
            nll_sum = torch.zeros((), dtype=dtype, device=chosen_logps_sum.device)
        elif chosen_nll_sum is None:
            nll_sum = -chosen_logps_sum.to(dtype).sum()
        else:
            nll_sum = chosen_nll_sum.to(dtype).sum()
        return torch.stack([
            *pair_sums(losses=out.total, chosen_rewards=out.chosen_rewards, rejected_rewards=out.rejected_rewards,
                       chosen_logps=out.chosen_logps, rejected_logps=out.rejected_logps,
                       chosen_logit_sum=chosen_logit_sum, rejected_logit_sum=rejected_logit_sum,
                       chosen_num_tokens=chosen_num_tokens, rejected_num_tokens=rejected_num_tokens),
            nll_sum,
        ])


def finalize(sums: dict[str, float], spec: CpoSpec) -> dict[str, float]:
    """Metric sums added over a whole global batch (keys CPO_SUM_KEYS) -> means under TRL 1.16
    `CPOTrainer`'s metric names (training names; TRL prefixes eval metrics with "eval_").

    loss, rewards/*, logps/* are means over the samples; logits/* the vocabulary-mean logit and
    nll_loss the cross-entropy, each a mean over the completion tokens (chosen ones for nll_loss)."""
    spec.validate()
    means = pair_means(sums, sums_count(sums, CPO_SUM_KEYS, count="num_samples"))
    nll = sums["nll_sum"] / max(sums["num_chosen_tokens"], 1.0) if spec.effective_cpo_alpha != 0.0 else 0.0
    return {**means, "nll_loss": nll}


class CpoObjective(Objective):
    """CPO (and SimPO, AlphaPO) on preference pairs: reference-free, no whole-batch pass."""

    name = "cpo"
    shape = PAIR
    needs_reference = False
    needs_prepass = False
    metric_keys = CPO_SUM_KEYS

    def microbatch(self, logps: SequenceLogps, reference: torch.Tensor | None, *, positions: Sequence[int],
                   totals: BatchTotals, prepass: object | None = None) -> tuple[Tensor, Tensor]:
        b = len(positions)
        plain = logps.plain_logp_sum  # with --ld-alpha the weighted sums; CPO's NLL reads the plain ones
        inputs = dict(chosen_logps_sum=logps.logp_sum[:b], rejected_logps_sum=logps.logp_sum[b:],
                      chosen_num_tokens=logps.num_tokens[:b], rejected_num_tokens=logps.num_tokens[b:],
                      chosen_nll_sum=None if plain is None else -plain[:b], spec=self.spec,
                      num_samples_global=totals.num_samples, chosen_tokens_global=totals.chosen_tokens)
        out = cpo_losses(**inputs)
        sums = cpo_metric_sum_vector(chosen_logit_sum=logps.logit_sum[:b], rejected_logit_sum=logps.logit_sum[b:],
                                     losses=out, **inputs)
        return out.total.sum() / totals.num_samples, sums

    def finalize(self, sums: dict[str, float]) -> dict[str, float]:
        return finalize(sums, self.spec)


def spec_of(config) -> CpoSpec:
    """The CpoSpec of a run's configuration (--loss-type is CPO's loss type)."""
    return CpoSpec(cpo_loss_type=config.loss_type, beta=config.beta, label_smoothing=config.label_smoothing,
                   cpo_alpha=config.cpo_alpha, simpo_gamma=config.simpo_gamma, alpha=config.alpha)


def from_config(config) -> CpoObjective:
    return CpoObjective(spec_of(config))
