"""What the engine asks of an objective (DPO and its loss family, and the objectives after it).

The schedule, the rank and the evaluator never know the loss. They know an `Objective`:

- `shape`: the sequences a sample is made of, in the order of a microbatch's rows (a pair:
  chosen, then rejected). Reference tables hold one column per sequence.
- `needs_reference`: whether a reference model is built and run at all.
- `needs_prepass`: whether the loss reads the whole global batch before any microbatch's loss
  (aot's sort). The rank then runs a forward-only pass, gathers every sample's per-sequence
  log-prob sums of the policy and the reference into two [samples, sequences] tables over the
  data-parallel ranks, and hands them to `prepass` once; the step's microbatches get its result.
- `whole_sequence`: whether the last stage also sums each sequence's log-probs over its prompt
  tokens (ORPO's NLL), besides the completion's.
- `head`: what the last stage ends in and hands `microbatch`. "lm": the LM head, each row's
  log-prob sums (`SequenceLogps`); "score": a scalar score head (`model/score_head.py`), each
  row's score at its last token that is not padding (`objective.reward.SequenceScores`).
- `metric_keys`: the sums one microbatch contributes (combined over microbatches and
  data-parallel ranks, read once per step) and `finalize`, which turns the global sums into
  the logged metrics. They are added, except the last `max_keys`, which are combined by max
  (a minimum is kept as the max of its negation).
- `microbatch`: the loss of one microbatch, called once by the last pipeline stage as each
  microbatch's forward ends, returning both its share of the global loss and its metric sums.

Losses are written so that the global batch's loss does not depend on how the batch is split:
`totals` are the global batch's normalisers, known on the host before the step.

Adding an objective: a module under objective/ with a subclass and a `from_config(config)`,
its name in `registry.py`, its flags in config.py, and its tests (docs/DESIGN.md, "Objectives").
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mcore_dpo.objective.logprobs import SequenceLogps


@dataclass(frozen=True)
class SampleShape:
    """The sequences of one sample, in the order of a microbatch's rows: a microbatch of b
    samples holds b rows of the first sequence, then b rows of the second, and so on."""

    sequences: tuple[str, ...]

    @property
    def count(self) -> int:
        return len(self.sequences)


PAIR = SampleShape(sequences=("chosen", "rejected"))  # a preference pair


@dataclass(frozen=True)
class BatchTotals:
    """A global batch's normalisers, from the host before the step (an objective's `totals` may
    return a subclass that carries more of the batch's host data: reward's data margins)."""

    num_samples: int
    chosen_tokens: int
    """The tokens the objective's token means divide by (at least 1): the chosen completions' for
    DPO's sft and CPO's NLL, the whole chosen sequences' (all but the first token) for ORPO's."""


class Objective(abc.ABC):
    """One training objective (module docstring)."""

    name: str
    shape: SampleShape
    needs_reference: bool
    needs_prepass: bool
    metric_keys: tuple[str, ...]
    whole_sequence: bool = False
    """Whether the loss also reads each sequence's log-probs over its prompt (SequenceLogps.whole_*)."""
    head: str = "lm"
    """What the last stage ends in (module docstring): "lm" (log-probs) or "score" (a score head)."""
    max_keys: tuple[str, ...] = ()
    """The last entries of metric_keys, combined by max instead of added."""

    def __init__(self, spec):
        """`spec`: the objective's hyper-parameters (its module's `spec_of`), validated here."""
        spec.validate()
        self.spec = spec

    def totals(self, samples: Sequence) -> BatchTotals:
        """The normalisers of a global batch (or of the whole held-out set); by default a pair's:
        the samples, and the chosen completions' tokens."""
        return BatchTotals(num_samples=len(samples), chosen_tokens=max(1, sum(len(p.chosen_ids) for p in samples)))

    @abc.abstractmethod
    def microbatch(self, logps: SequenceLogps, reference: torch.Tensor | None, *, positions: Sequence[int],
                   totals: BatchTotals, prepass: object | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, sums) of one microbatch: its share of the global batch's loss (a differentiable
        scalar; the shares of every microbatch and data-parallel rank add up to the loss) and its
        metric sums, float64 [len(metric_keys)] on the device. `logps`: the policy's per-row sums
        (a score head's objective: its `SequenceScores`, see `head`); `reference`: the reference's,
        in the same row order (None without a reference);
        `positions`: the samples' places in the global batch. Reads nothing on the host."""

    def prepass(self, policy: torch.Tensor, reference: torch.Tensor) -> object:
        """The whole batch's state for `microbatch` (needs_prepass objectives): from the policy's
        and the reference's log-prob sums of every sample, [samples, sequences] each in batch order
        (zeros without a reference)."""
        raise NotImplementedError(f"{self.name}: no whole-batch pass")

    def empty_sums(self, device: torch.device) -> torch.Tensor:
        """Metric sums of nothing, float64 [len(metric_keys)]: 0, and -inf for the max_keys."""
        sums = torch.zeros(len(self.metric_keys), dtype=torch.float64, device=device)
        if self.max_keys:
            sums[len(self.metric_keys) - len(self.max_keys):] = -torch.inf
        return sums

    def accumulate(self, total: torch.Tensor, sums: torch.Tensor) -> None:
        """Combine a microbatch's metric sums into `total` (in place): added, the max_keys by max."""
        k = len(self.metric_keys) - len(self.max_keys)
        total[:k].add_(sums[:k])
        if self.max_keys:
            total[k:].copy_(torch.maximum(total[k:], sums[k:]))

    @abc.abstractmethod
    def finalize(self, sums: dict[str, float]) -> dict[str, float]:
        """The logged metrics from the sums of a whole global batch (keys: metric_keys)."""
