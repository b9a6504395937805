"""KTO (unpaired preferences): the loss, its KL estimate, its metrics and its data conventions,
as pure functions on per-sample log-probs.

A KTO sample is one (prompt, completion, label) row: label True for a desirable completion,
False for an undesirable one. Besides its own sequence, each sample has a KL sequence: its
prompt followed by another sample's completion (`kl_completion_index`). The engine computes,
for each microbatch, the summed completion log-probs of every sample under the policy and
the reference (`SampleLogps`), and for the KL estimate those of the KL sequences, then calls:

    cols = kl_columns(kl_logps, ref_kl_logps)     # per microbatch; add over microbatches and ranks
    kl = kl_estimate(cols_total[0], cols_total[1]) # one 0-dim value for the whole global batch
    losses = sample_losses(logps, spec=spec, kl=kl)
    (losses.sum() / N).backward()                  # summed over microbatches and DP ranks
    sums = metric_sum_vector(logps, spec=spec, kl=kl)
    # ... add `sums` over microbatches and ranks (METRIC_SUM_KEYS) ...
    metrics = finalize_metrics(dict(zip(METRIC_SUM_KEYS, total_sums.tolist())), spec=spec)

N is the number of samples in the global batch. The KL estimate needs every sample's KL
log-ratio before any loss, so a step that uses it first runs a forward-only pass over the KL
sequences (policy at the current weights, and reference), as TRL 1.16 computes the policy KL
log-probs under `torch.no_grad()` in the same step.

Notation (per sample): p, p0 = policy / reference log-prob of the completion summed over its
tokens; u = p - p0; β = beta; w+ = desirable_weight, w- = undesirable_weight; KL sequence
log-ratio k = q - q0 (q, q0 the same sums over the KL sequence's completion tokens).

    kl = max(0, mean of k over the batch)   (no gradient; 0 for apo_zero_unpaired)

| loss type         | desirable (label True) | undesirable (label False) |
|-------------------|------------------------|---------------------------|
| kto               | w+·(1 - σ(β(u - kl)))  | w-·(1 - σ(β(kl - u)))     |
| apo_zero_unpaired | w+·(1 - σ(βu))         | w-·σ(βu)                  |

The batch loss is the plain mean of these per-sample values over the N samples: the weights
scale the terms but do not enter the denominator (TRL 1.16 takes `nanmean` of the weighted
losses of a microbatch, and the Trainer averages microbatches and ranks). Rewards are β·u.
apo_zero_unpaired reads no KL: TRL 1.16 builds no KL sequences for it and logs kl = 0.

Data conventions (TRL 1.16's `KTOTrainer._prepare_dataset`, `unpair_preference_dataset` and
`DataCollatorForUnpairedPreference`):
- Paired rows {prompt, chosen, rejected} become unpaired rows in chunks of 1000 (the default
  batch size of `datasets.Dataset.map(batched=True)`): the chunk's desirable rows in order,
  then its undesirable rows in order (`unpair`). Other columns are copied onto both rows.
- A plain-text completion gets the tokenizer's EOS text appended unless it already ends with
  it (conversational ones end with whatever the chat template renders). The prompt is
  tokenized alone, then prompt + completion together; the completion tokens are those after
  the two sequences' common prefix (the prompt's tail is dropped where they differ). Rows
  whose prompt alone has max_length or more tokens are dropped.
- KL completions: the rows, after the above, are cut into consecutive chunks of
  per_device_train_batch_size (the last one possibly shorter) and each row takes the
  completion tokens of the previous row of its chunk, the first row that of the chunk's last
  (`kl_completion_index`). The KL sequence is the row's own prompt tokens followed by those
  completion tokens (tokenized with their own prompt), truncated to max_length like the
  main sequence. With the sequential sampler each such chunk is exactly one device's
  microbatch. An eval set is chunked by per_device_train_batch_size too, whatever its batch size.

Differences from TRL 1.16 worth knowing:
- The loss: TRL 1.16's step loss is the mean over microbatches and ranks of each
  microbatch's mean; here the mean over the global batch, which is the same number whenever
  every microbatch holds the same number of samples (TRL's per-device batch size), and does
  not depend on the split otherwise.
- The KL estimate: TRL 1.16 estimates it at each forward call, from that call's microbatch on
  every process (each process's mean, all-gathered and averaged, then clamped at 0); with
  gradient accumulation each accumulation step has its own kl. Here one estimate from the
  whole global batch (all microbatches, all dp ranks): TRL's with gradient_accumulation_steps
  = 1 and equal per-device batches.
- KL pairing: `kl_completion_index` takes the chunk size as an argument. With
  per_device_train_batch_size it is TRL 1.16's pairing; an engine that rotates over another
  batch (the global batch) pairs prompts with other completions than TRL does. The engine
  (`KtoObjective`, data/unpaired.py) chunks by --micro-batch-size over the token store's order:
  with several --data files that is source after source, which a weighted mix's batches do
  not follow (the KL completions then come from other batches).
- Metrics: TRL 1.16 logs the average over the forward calls of a logging interval of each
  call's value, a call without desirable (undesirable) samples adding nothing to the
  rewards/chosen, logps/chosen (rejected) lists, and rewards/margins only from calls with
  both. Here sums over the global batch divided once: rewards/chosen is the mean over every
  desirable sample of the batch, rewards/margins the difference of the two means, and
  logits/* exact token means. Identical when a step is one forward call per process (no
  gradient accumulation) logged every step.
- NaN: TRL 1.16's `nanmean`/`nansum` leave NaN samples out of the loss and the reward metrics;
  here a NaN log-prob propagates, as a bug should.
- TRL 1.16 also logs `entropy` and `num_tokens` (and `aux_loss` for MoE models); this module
  does not compute them.
- `validate` refuses weights below 0 or both 0, and a non-positive beta; TRL 1.16 takes any float.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mcore_dpo.data.unpaired import UNPAIR_CHUNK_SIZE, Unpaired
from mcore_dpo.objective.contract import BatchTotals, Objective, SampleShape
from mcore_dpo.objective.metric_sums import sums_count
from mcore_dpo.objective.logprobs import SequenceLogps
from mcore_dpo.parallel.platform import to_device

# TRL 1.16's `KTOConfig.loss_type` choices.
KTO_LOSS_TYPES: tuple[str, ...] = ("kto", "apo_zero_unpaired")

# Keys of `metric_sum_vector`, in a fixed order so the engine can add the vectors over
# microbatches and ranks as one tensor.
METRIC_SUM_KEYS: tuple[str, ...] = (
    "num_samples",
    "num_chosen",
    "num_rejected",
    "loss_sum",
    "kl_sum",
    "reward_chosen_sum",
    "reward_rejected_sum",
    "logps_chosen_sum",
    "logps_rejected_sum",
    "logit_chosen_sum",
    "logit_rejected_sum",
    "num_chosen_tokens",
    "num_rejected_tokens",
)


@dataclass(frozen=True)
class KtoSpec:
    """The KTO loss and its hyper-parameters (TRL 1.16's `KTOConfig` fields and defaults)."""

    loss_type: str = "kto"
    """One of KTO_LOSS_TYPES."""
    beta: float = 0.1
    """Inverse temperature β of the implicit reward β·(log π - log π_ref)."""
    desirable_weight: float = 1.0
    """w+: factor on the loss of every desirable sample (to balance unequal counts)."""
    undesirable_weight: float = 1.0
    """w-: factor on the loss of every undesirable sample."""

    def validate(self) -> None:
        """Raise ValueError (one line, naming the field) if the spec cannot be trained."""
        if self.loss_type not in KTO_LOSS_TYPES:
            raise ValueError(f"loss_type: unknown {self.loss_type!r}; choose from {', '.join(KTO_LOSS_TYPES)}")
        if not isinstance(self.beta, (int, float)) or not math.isfinite(self.beta) or self.beta <= 0:
            raise ValueError(f"beta: must be a finite number > 0, got {self.beta!r}")
        for name in ("desirable_weight", "undesirable_weight"):
            weight = getattr(self, name)
            if not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
                raise ValueError(f"{name}: must be a finite number >= 0, got {weight!r}")
        if self.desirable_weight == 0 and self.undesirable_weight == 0:
            raise ValueError("desirable_weight: both weights are 0, so the loss would be 0; make one positive")

    @property
    def needs_kl(self) -> bool:
        """Whether the loss reads the KL estimate (and the engine runs the KL sequences)."""
        return self.loss_type != "apo_zero_unpaired"


@dataclass
class SampleLogps:
    """Per-sample quantities of one microbatch; every tensor has shape [b]."""

    logps: Tensor
    """Policy log-prob of the completion, summed over its tokens (carries the gradient)."""
    ref_logps: Tensor
    """Reference log-prob of the completion (no gradient)."""
    label: Tensor
    """True for a desirable completion, False for an undesirable one (bool)."""
    num_tokens: Tensor | None = None
    """Number of completion tokens (metrics only; None: no logits/* metrics)."""
    logit_sum: Tensor | None = None
    """Sum over the completion tokens of the vocabulary-mean logit (metrics only)."""


def _compute_dtype(tensor: Tensor) -> torch.dtype:
    # Half-precision log-prob sums lose the small differences the loss is made of.
    return tensor.dtype if tensor.dtype in (torch.float32, torch.float64) else torch.float32


def _check_inputs(logps: SampleLogps) -> None:
    # Shape and dtype checks only: anything that reads tensor values would force a device sync.
    shape = logps.logps.shape
    if len(shape) != 1:
        raise ValueError(f"logps: expected shape [b], got {list(shape)}")
    for name in ("ref_logps", "label", "num_tokens", "logit_sum"):
        value = getattr(logps, name)
        if value is not None and value.shape != shape:
            raise ValueError(f"{name}: expected shape {list(shape)} like logps, got {list(value.shape)}")
    if logps.label.dtype != torch.bool:
        raise ValueError(f"label: expected a bool tensor, got {logps.label.dtype}")


def _logratios(logps: SampleLogps) -> Tensor:
    """u = p - p0 in the compute dtype; the reference never receives a gradient."""
    dtype = _compute_dtype(logps.logps)
    return logps.logps.to(dtype) - logps.ref_logps.detach().to(dtype)


def kl_logratios(kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    """Per-sample KL log-ratios k = q - q0 [b] of the KL sequences, without gradient."""
    if kl_logps.dim() != 1 or ref_kl_logps.shape != kl_logps.shape:
        raise ValueError(
            f"kl_logps: expected two tensors of one shape [b], got "
            f"{list(kl_logps.shape)} and {list(ref_kl_logps.shape)}"
        )
    dtype = _compute_dtype(kl_logps)
    return kl_logps.detach().to(dtype) - ref_kl_logps.detach().to(dtype)


def kl_columns(kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    """float64 [2] = (sum of the KL log-ratios, number of samples) of one microbatch; add the
    vectors over microbatches and dp ranks, then call kl_estimate."""
    ratios = kl_logratios(kl_logps, ref_kl_logps).to(torch.float64)
    count = torch.full((), float(ratios.numel()), dtype=torch.float64, device=ratios.device)
    return torch.stack([ratios.sum(), count])


def kl_estimate(kl_sum: Tensor | float, count: Tensor | float) -> Tensor:
    """The KL term: max(0, kl_sum / count) as a 0-dim float64 tensor, without gradient."""
    if not isinstance(count, Tensor) and count <= 0:
        raise ValueError(f"count: must be > 0, got {count!r}")
    total = kl_sum if isinstance(kl_sum, Tensor) else torch.tensor(float(kl_sum), dtype=torch.float64)
    return (total.detach().to(torch.float64) / count).clamp(min=0.0).reshape(())


def _kl_for(spec: KtoSpec, kl: Tensor | None, *, dtype: torch.dtype, device: torch.device) -> Tensor:
    if not spec.needs_kl:
        return torch.zeros((), dtype=dtype, device=device)
    if kl is None:
        raise ValueError(f"kl: loss_type {spec.loss_type!r} needs the batch's KL estimate (kl_estimate)")
    if kl.numel() != 1:
        raise ValueError(f"kl: expected one value (a 0-dim tensor), got shape {list(kl.shape)}")
    return kl.detach().reshape(()).to(dtype=dtype, device=device)


def sample_losses(logps: SampleLogps, *, spec: KtoSpec, kl: Tensor | None = None) -> Tensor:
    """Per-sample weighted loss [b], differentiable in logps.logps.

    The global-batch loss is the sum of these over every microbatch and rank divided by the
    number of samples N of the global batch. `kl` is the 0-dim estimate of the whole global
    batch (kl_estimate); apo_zero_unpaired ignores it and may leave it None."""
    spec.validate()
    _check_inputs(logps)
    u = _logratios(logps)
    kl_term = _kl_for(spec, kl, dtype=u.dtype, device=u.device)
    beta = spec.beta
    if spec.loss_type == "kto":
        desirable = 1.0 - torch.sigmoid(beta * (u - kl_term))
        undesirable = 1.0 - torch.sigmoid(beta * (kl_term - u))
    else:  # apo_zero_unpaired
        desirable = 1.0 - torch.sigmoid(beta * u)
        undesirable = torch.sigmoid(beta * u)
    label = logps.label.to(u.device)
    return torch.where(label, spec.desirable_weight * desirable, spec.undesirable_weight * undesirable)


def metric_sum_vector(logps: SampleLogps, *, spec: KtoSpec, kl: Tensor | None = None) -> Tensor:
    """Additive metric sums of one microbatch: float64 [len(METRIC_SUM_KEYS)], on the device.

    Add the vectors over microbatches and data-parallel ranks, then read them once and call
    finalize_metrics: nothing here waits for the device. `kl_sum` is kl times the rows, so
    the finalized kl is the batch's estimate (a sample-weighted mean over batches if the sums
    of several batches are added)."""
    with torch.no_grad():
        losses = sample_losses(logps, spec=spec, kl=kl)
        u = _logratios(logps)
        kl_term = _kl_for(spec, kl, dtype=u.dtype, device=u.device)
        dtype = torch.float64
        chosen = logps.label.to(u.device)
        rejected = ~chosen
        rewards = (spec.beta * u).to(dtype)
        policy = logps.logps.to(dtype)
        zeros = torch.zeros(u.shape, dtype=dtype, device=u.device)
        tokens = zeros if logps.num_tokens is None else logps.num_tokens.to(dtype)
        logits = zeros if logps.logit_sum is None else logps.logit_sum.to(dtype)
        num_chosen = chosen.to(dtype).sum()
        num_rejected = rejected.to(dtype).sum()
        values = torch.stack(
            [
                num_chosen + num_rejected,
                num_chosen,
                num_rejected,
                losses.to(dtype).sum(),
                kl_term.to(dtype) * float(u.numel()),
                torch.where(chosen, rewards, zeros).sum(),
                torch.where(rejected, rewards, zeros).sum(),
                torch.where(chosen, policy, zeros).sum(),
                torch.where(rejected, policy, zeros).sum(),
                torch.where(chosen, logits, zeros).sum(),
                torch.where(rejected, logits, zeros).sum(),
                torch.where(chosen, tokens, zeros).sum(),
                torch.where(rejected, tokens, zeros).sum(),
            ]
        )
    return values


def metric_sums(logps: SampleLogps, *, spec: KtoSpec, kl: Tensor | None = None) -> dict[str, float]:
    """metric_sum_vector as a dict of Python floats keyed by METRIC_SUM_KEYS (reads the device)."""
    return dict(zip(METRIC_SUM_KEYS, metric_sum_vector(logps, spec=spec, kl=kl).tolist()))


def finalize_metrics(sums: Mapping[str, float], *, spec: KtoSpec) -> dict[str, float]:
    """Turn metric sums added over a whole global batch into TRL 1.16 `KTOTrainer`'s metrics:
    loss and kl always; rewards/chosen and logps/chosen when the batch has a desirable sample,
    rewards/rejected and logps/rejected when it has an undesirable one, rewards/margins when
    it has both; logits/chosen (rejected) when those samples have completion tokens. The names
    do not depend on `spec` (TRL 1.16 logs kl = 0 for apo_zero_unpaired too)."""
    num_samples = sums_count(sums, METRIC_SUM_KEYS, count="num_samples")
    num_chosen, num_rejected = sums["num_chosen"], sums["num_rejected"]
    metrics = {
        "loss": sums["loss_sum"] / num_samples,
        "kl": sums["kl_sum"] / num_samples,  # 0 for apo_zero_unpaired (metric_sum_vector adds no kl)
    }
    if sums["num_chosen_tokens"] > 0:
        metrics["logits/chosen"] = sums["logit_chosen_sum"] / sums["num_chosen_tokens"]
    if sums["num_rejected_tokens"] > 0:
        metrics["logits/rejected"] = sums["logit_rejected_sum"] / sums["num_rejected_tokens"]
    if num_chosen > 0:
        metrics["rewards/chosen"] = sums["reward_chosen_sum"] / num_chosen
        metrics["logps/chosen"] = sums["logps_chosen_sum"] / num_chosen
    if num_rejected > 0:
        metrics["rewards/rejected"] = sums["reward_rejected_sum"] / num_rejected
        metrics["logps/rejected"] = sums["logps_rejected_sum"] / num_rejected
    if num_chosen > 0 and num_rejected > 0:
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return metrics


# --------------------------------------------------------------------------- data conventions


def unpair(rows: Sequence[Mapping[str, Any]], *, chunk_size: int = UNPAIR_CHUNK_SIZE) -> list[dict[str, Any]]:
    """Paired rows {prompt, chosen, rejected, ...} -> unpaired rows {prompt, completion, label, ...}.

    In TRL 1.16's order: the rows are taken in consecutive chunks of chunk_size (1000, as
    `Dataset.map(batched=True)` does by default); each chunk gives its desirable rows
    (completion = chosen, label True) in order, then its undesirable rows (completion =
    rejected, label False) in order. Every other column, prompt included, is copied onto both."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: must be an integer >= 1, got {chunk_size!r}")
    for index, row in enumerate(rows):
        for key in ("chosen", "rejected"):
            if key not in row:
                raise ValueError(f"rows[{index}]: no {key!r} column (paired rows need chosen and rejected)")

    def one(row: Mapping[str, Any], completion_key: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if "prompt" in row:
            out["prompt"] = row["prompt"]
        out["completion"] = row[completion_key]
        out["label"] = completion_key == "chosen"
        # As TRL: the other columns are copied last (so they win over a name clash).
        out.update({key: value for key, value in row.items() if key not in ("chosen", "rejected", "prompt")})
        return out

    result: list[dict[str, Any]] = []
    for start in range(0, len(rows), chunk_size):
        chunk = rows[start:start + chunk_size]
        result.extend(one(row, "chosen") for row in chunk)
        result.extend(one(row, "rejected") for row in chunk)
    return result


def kl_completion_index(num_samples: int, *, batch_size: int) -> list[int]:
    """For sample i of num_samples unpaired samples (in dataset order), the index of the sample
    whose completion follows prompt i in its KL sequence.

    The samples are cut into consecutive chunks of batch_size (the last one shorter when
    batch_size does not divide num_samples) and each chunk is rotated by one:
    (x1, y1), ..., (xm, ym) -> (x1, ym), (x2, y1), ..., (xm, ym-1). TRL 1.16 uses
    batch_size = per_device_train_batch_size (and refuses 1); a last chunk of one sample is
    paired with its own completion, as in TRL 1.16."""
    if not isinstance(batch_size, int) or batch_size < 2:
        raise ValueError(
            f"batch_size: must be an integer >= 2 (with 1 every KL completion is the sample's own), got {batch_size!r}"
        )
    if not isinstance(num_samples, int) or num_samples < 0:
        raise ValueError(f"num_samples: must be an integer >= 0, got {num_samples!r}")
    index: list[int] = []
    for start in range(0, num_samples, batch_size):
        size = min(batch_size, num_samples - start)
        index.extend(start + (offset - 1) % size for offset in range(size))
    return index


# --------------------------------------------------------------------------- the objective


KTO_SHAPE = SampleShape(sequences=("completion", "kl"))  # a sample's own sequence, then its KL sequence


@dataclass(frozen=True)
class KtoTotals(BatchTotals):
    """A global batch's normalisers and its samples' labels, in batch order."""

    labels: tuple[bool, ...] = ()


class KtoObjective(Objective):
    """KTO (and apo_zero_unpaired) on unpaired samples (data/unpaired.py): each microbatch row of
    the first sequence is a sample's prompt + completion, of the second its KL sequence. kto
    reads the KL estimate of the whole batch from the whole-batch pass (`prepass`);
    apo_zero_unpaired needs none, and its KL rows (the sample's own sequence again) are unread."""

    name = "kto"
    shape = KTO_SHAPE
    needs_reference = True
    metric_keys = METRIC_SUM_KEYS

    def __init__(self, spec: KtoSpec):
        super().__init__(spec)
        self.needs_prepass = spec.needs_kl

    def totals(self, samples: Sequence) -> KtoTotals:
        labels = tuple(sample.label for sample in samples)
        if None in labels:
            raise ValueError("kto: a sample without a label (a preference pair, not an unpaired sample)")
        return KtoTotals(num_samples=len(samples), chosen_tokens=max(1, sum(len(s.chosen_ids) for s in samples)),
                         labels=labels)

    def microbatch(self, logps: SequenceLogps, reference: Tensor | None, *, positions: Sequence[int],
                   totals: BatchTotals, prepass: object | None = None) -> tuple[Tensor, Tensor]:
        b = len(positions)
        device = logps.logp_sum.device
        label = to_device(torch.tensor([totals.labels[i] for i in positions], dtype=torch.bool), device)
        samples = SampleLogps(logps=logps.logp_sum[:b], ref_logps=reference[:b], label=label,
                              num_tokens=logps.num_tokens[:b], logit_sum=logps.logit_sum[:b])
        losses = sample_losses(samples, spec=self.spec, kl=prepass)
        return losses.sum() / totals.num_samples, metric_sum_vector(samples, spec=self.spec, kl=prepass)

    def prepass(self, policy: Tensor, reference: Tensor) -> Tensor:
        """The KL estimate of the whole batch: max(0, mean KL log-ratio of its KL sequences)."""
        columns = kl_columns(policy[:, 1], reference[:, 1])
        return kl_estimate(columns[0], columns[1])

    def finalize(self, sums: dict[str, float]) -> dict[str, float]:
        return finalize_metrics(sums, spec=self.spec)


def spec_of(config) -> KtoSpec:
    """The KtoSpec of a run's configuration (--loss-type kto, its default here (config.py), or
    apo_zero_unpaired); ValueError (one line) for what KTO cannot train."""
    if config.label_smoothing != 0.0:
        raise ValueError("label_smoothing: not an option of --objective kto")
    if config.ref_mode == "none":
        raise ValueError("ref_mode: kto trains against a reference model; --ref-mode none does not apply")
    spec = KtoSpec(loss_type=config.loss_type, beta=config.beta,
                   desirable_weight=config.desirable_weight, undesirable_weight=config.undesirable_weight)
    if spec.loss_type in KTO_LOSS_TYPES and spec.needs_kl:
        if config.micro_batch_size < 2:
            raise ValueError("micro_batch_size: kto's KL sequences pair each prompt with another completion of its "
                             f"microbatch, so it needs 2 or more, got {config.micro_batch_size}")
        if not config.no_shuffle:
            raise ValueError("no_shuffle: kto's KL sequences pair neighbouring samples of the file, so it reads the "
                             "file in order (--no-shuffle), as TRL 1.16; or use --loss-type apo_zero_unpaired")
    return spec


def unpaired_data(config) -> Unpaired:
    """How the token store holds this run's samples: KL completions from chunks of
    --micro-batch-size samples (TRL's per_device_train_batch_size), none for apo_zero_unpaired."""
    return Unpaired(kl_batch_size=config.micro_batch_size if spec_of(config).needs_kl else None)


def from_config(config) -> KtoObjective:
    return KtoObjective(spec_of(config))
