"""ORPO (odds-ratio preference optimisation) as pure functions on per-sample log-probs.
Reference-free: no reference model is read.

The engine computes, for each microbatch, the summed completion log-probs of every sample's chosen
and rejected completion under the policy, their token counts, and the NLL of the chosen sequence,
then calls:

    out = orpo_losses(chosen_logps_sum=..., rejected_logps_sum=..., chosen_num_tokens=...,
                      rejected_num_tokens=..., chosen_nll_sum=..., spec=spec,
                      num_samples_global=N, nll_tokens_global=T)
    (out.total.sum() / N).backward()          # summed over microbatches and DP ranks
    vector = orpo_metric_sum_vector(..., spec=spec, num_samples_global=N, nll_tokens_global=T)
    # ... add the vectors over microbatches and ranks (keys: ORPO_SUM_KEYS), read once ...
    metrics = finalize(dict(zip(ORPO_SUM_KEYS, vector.tolist())), spec)

N is the number of samples (preference pairs) in the whole global batch and T the number of tokens
the NLL averages over in it. ORPO's NLL covers the whole chosen sequence, prompt and completion:
every token of it but the first (which nothing predicts); padding excluded. Every per-sample total
is scaled to be averaged over N, so the global-batch loss and its gradient do not depend on how the
samples are split into microbatches and ranks.

Notation (per sample): c, r = policy log-probs of the chosen / rejected completion summed over its
tokens; L+, L- = completion token counts; ĉ = c/L+, r̂ = r/L- (per-token means, < 0); β = beta;
log1m(x) = log(1 - e^x), taken as log(-expm1(x)) for x >= -ln 2 and log1p(-e^x) below.

| quantity                   | per sample                                   |
|----------------------------|----------------------------------------------|
| log odds  o                | (ĉ - r̂) - (log1m(ĉ) - log1m(r̂))              |
| odds-ratio loss            | -β·logσ(o)                                   |
| rewards (chosen, rejected) | β·ĉ, β·r̂  (no gradient)                      |
| objective                  | mean(-β·logσ(o)) + NLL (token mean, above)   |

Logged (TRL 1.16 `ORPOTrainer` names): log_odds_ratio = mean logσ(o), log_odds_chosen = mean o,
nll_loss, rewards/* (accuracies: β·ĉ > β·r̂), logps/* (the per-token means ĉ, r̂), logits/*, loss.

Differences from TRL 1.16 worth knowing:
- TRL 1.16's `odds_ratio_loss` returns β·logσ(o) and the trainer subtracts its mean; `losses` here
  is the per-sample term to minimise, -β·logσ(o).
- The NLL is the token mean over the chosen sequences of the whole global batch. TRL 1.16 takes it
  per device microbatch (and logs the mean of the per-device values), which differs when
  microbatches hold different numbers of chosen tokens.
- logits/chosen and logits/rejected: the exact mean over every completion token of the global
  batch of the vocabulary-mean logit (finalize divides global sums). TRL 1.16 logs the mean of the
  padded logits tensor of each device microbatch without its last position, prompt and padding
  positions included.
- log_odds_ratio and log_odds_chosen are exact means over the global batch; TRL 1.16 logs the mean
  of per-device means (the same when every device holds the same number of samples).
- Inputs in float64 stay float64 (TRL 1.16 casts the log-probs to float32); half precision is
  computed in float32 as in TRL 1.16. The metric sums are float64.
- A completion with no tokens counts as one token in the per-token means (TRL 1.16 divides by 0).
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

# Keys of orpo_metric_sum_vector, in its order: the engine adds the vectors over microbatches and
# ranks (one all-reduce), then finalize reads them as a dict.
ORPO_SUM_KEYS: tuple[str, ...] = (
    "num_samples",
    *PAIR_SUM_KEYS,
    "nll_sum",
    "num_nll_tokens",
    "log_odds_ratio_sum",
    "log_odds_chosen_sum",
)

_MINUS_LN2 = -math.log(2.0)


@dataclass(frozen=True)
class OrpoSpec:
    """ORPO's hyper-parameter (TRL 1.16 `ORPOConfig` name and default)."""

    beta: float = 0.1
    """β (the paper's λ), the weight of the odds-ratio term against the NLL."""

    def validate(self) -> None:
        """Raise ValueError (one line, naming the field) if the spec cannot be trained."""
        beta = self.beta
        if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not math.isfinite(beta) or beta <= 0:
            raise ValueError(f"beta: must be a finite number > 0 (0 leaves plain SFT), got {beta!r}")


@dataclass
class OrpoLosses:
    """Per-sample results of orpo_losses; every tensor has shape [b], in the compute dtype."""

    losses: Tensor
    """Odds-ratio loss per sample, -β·logσ(o), differentiable."""
    nll: Tensor
    """NLL contribution chosen_nll_sum·N/T (so that Σ over the global batch / N is the token-mean NLL)."""
    total: Tensor
    """losses + nll: what the engine sums, divides by N and backpropagates."""
    log_odds: Tensor
    """o, detached."""
    log_odds_ratio: Tensor
    """logσ(o), detached (TRL 1.16 logs its mean as log_odds_ratio)."""
    chosen_logps: Tensor
    """ĉ, the per-token mean chosen log-prob, detached."""
    rejected_logps: Tensor
    """r̂, detached."""
    chosen_rewards: Tensor
    """β·ĉ, detached."""
    rejected_rewards: Tensor
    """β·r̂, detached."""


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - e^x) for x <= 0, in the branch that keeps its precision on each side of -ln 2."""
    return torch.where(x < _MINUS_LN2, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _compute_dtype(tensor: Tensor) -> torch.dtype:
    return tensor.dtype if tensor.dtype in (torch.float32, torch.float64) else torch.float32


def _check(tensors: dict[str, Tensor], *, num_samples_global: int, nll_tokens_global: int) -> None:
    # Shape checks only: anything that reads tensor values would force a device sync.
    (first_name, first), *rest = tensors.items()
    if first.dim() != 1:
        raise ValueError(f"{first_name}: expected shape [b], got {list(first.shape)}")
    for name, value in rest:
        if value.shape != first.shape:
            raise ValueError(f"{name}: expected shape {list(first.shape)} like {first_name}, got {list(value.shape)}")
    if num_samples_global <= 0:
        raise ValueError(f"num_samples_global: must be > 0, got {num_samples_global}")
    if nll_tokens_global <= 0:
        raise ValueError(f"nll_tokens_global: must be > 0, got {nll_tokens_global}")


def orpo_losses(
    *,
    chosen_logps_sum: Tensor,
    rejected_logps_sum: Tensor,
    chosen_num_tokens: Tensor,
    rejected_num_tokens: Tensor,
    chosen_nll_sum: Tensor,
    spec: OrpoSpec,
    num_samples_global: int,
    nll_tokens_global: int,
) -> OrpoLosses:
    """Per-sample ORPO losses and rewards of one microbatch (all inputs [b]).

    chosen_logps_sum / rejected_logps_sum: policy log-probs summed over each completion's tokens
    (they carry the gradient); chosen_num_tokens / rejected_num_tokens: the completion token
    counts; chosen_nll_sum: the policy NLL summed over the chosen sequence's predicted tokens,
    prompt and completion (differentiable). num_samples_global (N) and nll_tokens_global (T, the
    tokens chosen_nll_sum covers, over the whole global batch) make Σ total / N over all
    microbatches and ranks equal mean(losses) + token-mean NLL.
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
        nll_tokens_global=nll_tokens_global,
    )
    dtype = _compute_dtype(chosen_logps_sum)
    # A completion with no tokens has a log-prob of 0; dividing 0 by 1 keeps it 0 instead of nan.
    chosen = chosen_logps_sum.to(dtype) / chosen_num_tokens.to(dtype).clamp(min=1.0)
    rejected = rejected_logps_sum.to(dtype) / rejected_num_tokens.to(dtype).clamp(min=1.0)
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    log_odds_ratio = F.logsigmoid(log_odds)
    losses = -spec.beta * log_odds_ratio
    # Averaged over the N samples of the global batch, these give Σ nll / T: the token mean.
    nll = chosen_nll_sum.to(dtype) * (num_samples_global / nll_tokens_global)
    return OrpoLosses(
        losses=losses,
        nll=nll,
        total=losses + nll,
        log_odds=log_odds.detach(),
        log_odds_ratio=log_odds_ratio.detach(),
        chosen_logps=chosen.detach(),
        rejected_logps=rejected.detach(),
        chosen_rewards=(spec.beta * chosen).detach(),
        rejected_rewards=(spec.beta * rejected).detach(),
    )


def orpo_metric_sum_vector(
    *,
    chosen_logps_sum: Tensor,
    rejected_logps_sum: Tensor,
    chosen_num_tokens: Tensor,
    rejected_num_tokens: Tensor,
    chosen_nll_sum: Tensor,
    chosen_nll_num_tokens: Tensor,
    chosen_logit_sum: Tensor,
    rejected_logit_sum: Tensor,
    spec: OrpoSpec,
    num_samples_global: int,
    nll_tokens_global: int,
    losses: OrpoLosses | None = None,
) -> Tensor:
    """Additive metric sums of one microbatch: float64 [len(ORPO_SUM_KEYS)], on the inputs' device.
    `losses`: this microbatch's `orpo_losses`, when the caller has them already (the loss then
    runs once).

    The inputs are orpo_losses' plus chosen_nll_num_tokens [b] (the tokens each chosen_nll_sum
    covers) and chosen_logit_sum / rejected_logit_sum [b] (the sum over each completion's tokens of
    the vocabulary-mean logit). Add the vectors over microbatches and ranks, read them once and call
    finalize: nothing here waits for the device.
    """
    _check(
        {"chosen_logps_sum": chosen_logps_sum, "chosen_nll_num_tokens": chosen_nll_num_tokens,
         "chosen_logit_sum": chosen_logit_sum, "rejected_logit_sum": rejected_logit_sum},
        num_samples_global=num_samples_global,
        nll_tokens_global=nll_tokens_global,
    )
    with torch.no_grad():
        out = losses if losses is not None else orpo_losses(
            chosen_logps_sum=chosen_logps_sum,
            rejected_logps_sum=rejected_logps_sum,
            chosen_num_tokens=chosen_num_tokens,
            rejected_num_tokens=rejected_num_tokens,
            chosen_nll_sum=chosen_nll_sum,
            spec=spec,
            num_samples_global=num_samples_global,
            nll_tokens_global=nll_tokens_global,
        )
        dtype = torch.float64
        return torch.stack(
            [
                *pair_sums(losses=out.total, chosen_rewards=out.chosen_rewards, rejected_rewards=out.rejected_rewards,
                           chosen_logps=out.chosen_logps, rejected_logps=out.rejected_logps,
                           chosen_logit_sum=chosen_logit_sum, rejected_logit_sum=rejected_logit_sum,
                           chosen_num_tokens=chosen_num_tokens, rejected_num_tokens=rejected_num_tokens),
                chosen_nll_sum.to(dtype).sum(),
                chosen_nll_num_tokens.to(dtype).sum(),
                out.log_odds_ratio.to(dtype).sum(),
                out.log_odds.to(dtype).sum(),
            ]
        )


def finalize(sums: dict[str, float], spec: OrpoSpec) -> dict[str, float]:
    """Metric sums added over a whole global batch (keys ORPO_SUM_KEYS) -> means under TRL 1.16
    `ORPOTrainer`'s metric names (training names; TRL prefixes eval metrics with "eval_").

    loss, rewards/*, logps/*, log_odds_* are means over the samples; logits/* (vocabulary-mean
    logit) a mean over the completion tokens; nll_loss a mean over the NLL's tokens."""
    spec.validate()
    num_samples = sums_count(sums, ORPO_SUM_KEYS, count="num_samples")
    return {**pair_means(sums, num_samples), "nll_loss": sums["nll_sum"] / max(sums["num_nll_tokens"], 1.0),
            "log_odds_ratio": sums["log_odds_ratio_sum"] / num_samples,
            "log_odds_chosen": sums["log_odds_chosen_sum"] / num_samples}


class OrpoObjective(Objective):
    """ORPO on preference pairs: reference-free; its NLL reads the whole chosen sequence."""

    name = "orpo"
    shape = PAIR
    needs_reference = False
    needs_prepass = False
    whole_sequence = True
    metric_keys = ORPO_SUM_KEYS

    def totals(self, samples: Sequence) -> BatchTotals:
        # The NLL's tokens: every chosen sequence's tokens but its first.
        tokens = sum(len(p.prompt_ids) + len(p.chosen_ids) - 1 for p in samples)
        return BatchTotals(num_samples=len(samples), chosen_tokens=max(1, tokens))

    def microbatch(self, logps: SequenceLogps, reference: torch.Tensor | None, *, positions: Sequence[int],
                   totals: BatchTotals, prepass: object | None = None) -> tuple[Tensor, Tensor]:
        b = len(positions)
        inputs = dict(chosen_logps_sum=logps.logp_sum[:b], rejected_logps_sum=logps.logp_sum[b:],
                      chosen_num_tokens=logps.num_tokens[:b], rejected_num_tokens=logps.num_tokens[b:],
                      chosen_nll_sum=-logps.whole_logp_sum[:b], spec=self.spec,
                      num_samples_global=totals.num_samples, nll_tokens_global=totals.chosen_tokens)
        out = orpo_losses(**inputs)
        sums = orpo_metric_sum_vector(chosen_nll_num_tokens=logps.whole_num_tokens[:b],
                                      chosen_logit_sum=logps.logit_sum[:b], rejected_logit_sum=logps.logit_sum[b:],
                                      losses=out, **inputs)
        return out.total.sum() / totals.num_samples, sums

    def finalize(self, sums: dict[str, float]) -> dict[str, float]:
        return finalize(sums, self.spec)


def spec_of(config) -> OrpoSpec:
    """The OrpoSpec of a run's configuration; ValueError (one line) for a shared option ORPO
    does not read, and for shared-prompt rows (its NLL reads every chosen sequence's prompt)."""
    for name, default in (("loss_type", "sigmoid"), ("label_smoothing", 0.0)):
        if getattr(config, name) != default:
            raise ValueError(f"{name}: not an option of --objective orpo (its one loss reads --beta)")
    if config.prefix_sharing:
        raise ValueError("prefix_sharing: not with --objective orpo (its NLL covers the prompt of every chosen "
                         "sequence); use --no-prefix-sharing")
    return OrpoSpec(beta=config.beta)


def from_config(config) -> OrpoObjective:
    return OrpoObjective(spec_of(config))
