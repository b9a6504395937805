"""The reward-model (Bradley-Terry) objective and its metrics, as pure functions on per-pair rewards.

A reward model is a causal transformer with a scalar score head (num_labels = 1). It scores a
whole sequence by the head's output at one position, the sequence's last token that is not the
pad token, exactly as transformers' `GenericForSequenceClassification.forward` (the
`AutoModelForSequenceClassification` of every decoder family) picks it. For each microbatch the
engine computes the per-position scores (or gathers the hidden states first and applies the head
to one vector per row, which is cheaper), then:

    index = last_token_index(input_ids, pad_token_id)            # [rows]
    rewards = sequence_rewards(scores, index)                    # [rows]
    chosen, rejected = chosen_rejected(rewards)                  # [b], [b]: TRL's row layout
    losses = pair_losses(chosen, rejected, margin, spec=spec)
    (losses.sum() / N).backward()            # summed over microbatches and DP ranks
    vec = metric_sum_vector(chosen, rejected, margin, spec=spec, num_tokens=attention_mask.sum())
    # ... combine the vectors over microbatches and ranks (combine_metric_sums, or two
    # all-reduces: SUM over the first ADDITIVE_KEY_COUNT entries, MAX over the rest) ...
    metrics = finalize_metrics(dict(zip(METRIC_SUM_KEYS, total.tolist())), spec=spec)

N is the number of pairs in the whole global batch. Every per-pair loss is a term of a mean over
N, so the global-batch loss and its gradient do not depend on how the pairs are split.

Notation (per pair): r+, r- = rewards of the chosen / rejected sequence; m = the pair's margin
(0 without a "margin" column); κ = center_rewards_coefficient (0 when None).

    per-pair loss = -logσ(r+ - r- - m) + κ·(r+ + r-)²

The first term is the Bradley-Terry negative log-likelihood that the chosen sequence wins, with
the margin subtracted inside the sigmoid: the loss gets small only once r+ exceeds r- by more
than m (a larger m asks for a larger gap). The second pushes the pair's reward SUM towards 0 (Eisenstein et al.
2023, Eq. 2); it leaves r+ - r- alone. Averaged over N these give TRL 1.16's
`RewardTrainer.compute_loss`: mean(-logσ(r+ - r- - m)) + κ·mean((r+ + r-)²).

Metrics, under the names TRL 1.16's `RewardTrainer` logs while training (`compute_loss` fills
`_metrics`, `log` averages them; "loss" comes from transformers' Trainer):

| name        | value over the global batch                           | kept as               |
|-------------|-------------------------------------------------------|-----------------------|
| loss        | Σ per-pair loss / N                                   | sum                   |
| num_tokens  | tokens seen so far: chosen + rejected, no padding     | sum (+ earlier steps) |
| min_reward  | min over the 2N rewards (chosen and rejected)         | max of -r             |
| mean_reward | Σ (r+ + r-) / 2N                                      | sum                   |
| max_reward  | max over the 2N rewards                               | max of r              |
| accuracy    | fraction of pairs with r+ > r- (strictly; m unused)   | sum                   |
| margin      | Σ (r+ - r-) / N (the data margin m is not taken off)  | sum                   |

min and max are not sums: the metric vector keeps max(r) and max(-r) in its last two entries
(MAX_REDUCED_KEYS), so a single MAX all-reduce (or `combine_metric_sums` between microbatches)
covers both; the entries before them (ADDITIVE_KEY_COUNT) are added.

TRL 1.16's data conventions for reward data (`RewardTrainer._prepare_dataset` and
`DataCollatorForPreference`), which a run follows: the preference loader (data/pairs.py) reads
the rows with `whole_rows` (objective/registry.py), tokenizes prompt + completion as one text,
so that prompt_ids + chosen_ids are exactly TRL's chosen_ids, and reads the "margin" column (a
finite number per row, 0 for a row without one) as TRL does (tests/test_reward_math.py runs
TRL's own `_prepare_dataset` on the same rows):
- Columns: "chosen" and "rejected" (required), "prompt" (optional: explicit prompt; without it
  the prompt is implicit, i.e. already inside chosen and rejected), "margin" (optional float per
  pair), "tools" and "chat_template_kwargs" (optional, conversational rows only; not read here).
  TRL also takes a dataset that already has "chosen_ids" and "rejected_ids" as tokenised; the
  loader reads text only.
- The prompt is concatenated in front of each completion, and the whole sequence is scored:
  plain strings are joined with no separator (prompt + chosen); message lists are joined
  (prompt messages + chosen messages).
- Plain text: the EOS token's text is appended to chosen and to rejected unless the string
  already ends with it, before the prompt is put in front; then the text is tokenised with the
  tokenizer's own special tokens (a BOS where the tokenizer adds one).
- Conversational rows (lists of {"role", "content"} messages): no EOS is appended; the full
  conversation is rendered with the chat template without a generation prompt and tokenised
  without added special tokens (the template writes its own), with the row's tools and
  chat_template_kwargs.
- max_length (default 1024; here --max-length): a pair is dropped when either tokenised sequence
  is longer; nothing is truncated. None keeps every pair.
- An implicit prompt needs no shared text: chosen and rejected are scored whole.
- Padding token: the tokenizer's pad token, or its EOS token when it has none; the model's
  config.pad_token_id is set to it so that scoring skips it. Batches are right-padded with it,
  the b chosen rows first and the b rejected rows after them (`chosen_rejected`).

Differences from TRL 1.16 worth knowing:
- num_tokens, as `RewardObjective` logs it, is the global batch's own (num_tokens_before 0): the
  run's cumulative count is its tokens/real summed over steps.
- The loss is computed in float32 at least (float64 stays float64); TRL 1.16 computes it in the
  dtype of the score head's output (bfloat16 for a bfloat16 model).
- Every metric here is one global batch's. TRL 1.16 logs the mean of per-microbatch values over
  every microbatch since the last log (logging_steps, 10 by default): for mean_reward, accuracy,
  margin and loss the same as the exact means here when the microbatches are of equal size.
- min_reward and max_reward are the global batch's min and max over all ranks. TRL 1.16 logs
  the mean of each microbatch's min (max) over all processes, above the global min (below the
  global max) as soon as the microbatches' minima (maxima) differ.
- center_rewards_coefficient must be >= 0 here; TRL 1.16 takes any float, and a negative one
  rewards ever larger reward sums without bound.
- When the pad token is also the EOS token (TRL's fallback for a tokenizer without a pad
  token), the EOS that TRL appends counts as padding: the reward is read at the token before
  it. This is what TRL 1.16 and transformers do, and `last_token_index` does the same; a pad
  token of its own avoids it.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mcore_dpo.objective.contract import PAIR, BatchTotals, Objective
from mcore_dpo.objective.metric_sums import sums_count
from mcore_dpo.parallel.platform import to_device

# Keys of `metric_sum_vector`, in its fixed order. The first ADDITIVE_KEY_COUNT entries are added
# over microbatches and ranks; the last ones (MAX_REDUCED_KEYS) are combined with max.
METRIC_SUM_KEYS: tuple[str, ...] = (
    "num_pairs",
    "loss_sum",
    "reward_sum",
    "accuracy_sum",
    "margin_sum",
    "num_tokens",
    "max_reward",
    "neg_min_reward",
)
MAX_REDUCED_KEYS: tuple[str, ...] = ("max_reward", "neg_min_reward")
ADDITIVE_KEY_COUNT: int = len(METRIC_SUM_KEYS) - len(MAX_REDUCED_KEYS)

# The metric names TRL 1.16's RewardTrainer logs while training, in the order it fills them
# ("loss" is transformers' Trainer's; in evaluation each name gets an "eval_" prefix).
METRIC_NAMES: tuple[str, ...] = (
    "loss",
    "num_tokens",
    "min_reward",
    "mean_reward",
    "max_reward",
    "accuracy",
    "margin",
)


@dataclass(frozen=True)
class RewardSpec:
    """The reward-model objective's options: the TRL 1.16 `RewardConfig` fields that change the loss.

    The other RewardConfig fields shape the data (max_length, eos_token, pad_to_multiple_of,
    chat_template_path, dataset_num_proc), the model (disable_dropout, model_init_kwargs) or
    memory (activation_offloading), not the formula; the margin comes from the data."""

    center_rewards_coefficient: float | None = None
    """κ of the term κ·(r+ + r-)² that pulls each pair's reward sum towards 0; None or 0 is off
    (TRL 1.16's default is None; 0.01 is the value TRL suggests)."""

    def validate(self) -> None:
        """Raise ValueError (one line, naming the field) if the spec cannot be trained."""
        coef = self.center_rewards_coefficient
        if coef is None:
            return
        if isinstance(coef, bool) or not isinstance(coef, (int, float)):
            raise ValueError(f"center_rewards_coefficient: must be a number or None, got {coef!r}")
        if not math.isfinite(coef) or coef < 0:
            raise ValueError(
                f"center_rewards_coefficient: must be a finite number >= 0 (or None for off), got {coef!r}"
            )

    @property
    def center_coefficient(self) -> float:
        """κ as a float: 0.0 when center_rewards_coefficient is None."""
        return 0.0 if self.center_rewards_coefficient is None else float(self.center_rewards_coefficient)


# --------------------------------------------------------------------------- where the reward is read


def last_token_index(input_ids: Tensor, pad_token_id: int | None) -> Tensor:
    """The position [rows] (int64) whose score is each row's reward, as transformers'
    `GenericForSequenceClassification.forward` picks it from input_ids [rows, s].

    It is the rightmost position whose token is not pad_token_id, wherever the padding is
    (right or left), so a pad-valued token inside the text is skipped as if it were padding and
    a row that ends in pad-valued tokens is read before them. A row made only of pad tokens
    gives 0. With pad_token_id None a single row is read at its last position (s - 1) and more
    rows are refused, as transformers refuses them."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected shape [rows, s], got {list(input_ids.shape)}")
    rows, seq_len = input_ids.shape
    if seq_len == 0:
        raise ValueError("input_ids: the sequence dimension is empty; there is no token to read a reward at")
    if pad_token_id is None:
        if rows != 1:
            raise ValueError(
                f"pad_token_id: None cannot mark the padding of {rows} rows; set the tokenizer's pad token "
                f"(transformers refuses batches > 1 without one)"
            )
        return torch.full((rows,), seq_len - 1, dtype=torch.int64, device=input_ids.device)
    positions = torch.arange(seq_len, dtype=torch.int64, device=input_ids.device)
    not_pad = input_ids != pad_token_id
    # Pad positions count as 0, so an all-pad row gives 0 (transformers' argmax of all zeros).
    return torch.where(not_pad, positions, torch.zeros_like(positions)).amax(dim=-1)


def sequence_rewards(hidden_or_scores: Tensor, index: Tensor) -> Tensor:
    """Each row's value at its own position: [rows, s, *rest] and index [rows] -> [rows, *rest].

    With the score head's outputs [rows, s] this is the reward of each row. With hidden states
    [rows, s, h] it picks the one vector per row that the head needs (then head(...) gives the
    same rewards for 1/s of the head's work). Differentiable in hidden_or_scores."""
    if hidden_or_scores.dim() < 2:
        raise ValueError(f"hidden_or_scores: expected shape [rows, s, ...], got {list(hidden_or_scores.shape)}")
    rows = hidden_or_scores.shape[0]
    if index.shape != (rows,):
        raise ValueError(f"index: expected shape [{rows}] (one position per row), got {list(index.shape)}")
    row_ids = torch.arange(rows, device=hidden_or_scores.device)
    return hidden_or_scores[row_ids, index.to(device=hidden_or_scores.device, dtype=torch.int64)]


@dataclass
class SequenceScores:
    """What the last stage hands a score-head objective (Objective.head "score"), per row."""

    score: Tensor  # [rows]: the score head's output at the row's last token that is not padding, differentiable
    num_tokens: Tensor  # [rows]: the row's tokens, padding excluded


def row_scores(scores: Tensor, tokens: Tensor, *, loss_mask: Tensor, pad_token_id: int) -> SequenceScores:
    """Each row's score from the score head's outputs [rows, s, 1] of right-padded rows tokens
    [rows, s] (read at `last_token_index`), and its length from its loss mask [rows, s] (label
    position t predicts token t + 1: a row's last masked position + 2 tokens)."""
    index = last_token_index(tokens, pad_token_id)
    after = torch.arange(2, tokens.shape[1] + 2, device=loss_mask.device)
    lengths = torch.where(loss_mask > 0, after, torch.zeros_like(after)).amax(dim=-1)
    return SequenceScores(score=sequence_rewards(scores[..., 0], index), num_tokens=lengths)


def last_segment_token_index(tokens: Tensor, segment_ids: Tensor, *, num_sequences: int, pad_token_id: int,
                             shared_prompt: Tensor | None = None) -> Tensor:
    """`last_token_index` for rows of segments: the flat position [num_sequences] (into tokens
    [rows, W] read row by row) of each sequence's last token that is not pad_token_id, its
    sequence given by `segment_ids` [rows, W] (ids >= num_sequences: padding). A sequence made
    only of pad tokens is read at its first position, as an unpacked row of them is read at 0.

    Shared-prompt rows (`shared_prompt` [rows, W], data/prefix_sharing.py): a pair's prompt body
    is written once, in its chosen segment (j), and is also the start of its rejected sequence
    (b + j, b = num_sequences / 2), whose branch alone has segment b + j: a rejected branch of
    pad tokens only is read in that body, as its whole unpacked row would be."""
    if tokens.shape != segment_ids.shape or tokens.dim() != 2:
        raise ValueError(f"segment_ids: expected the shape of tokens {list(tokens.shape)}, got {list(segment_ids.shape)}")
    ids = segment_ids.reshape(-1).clamp(max=num_sequences)  # the padding: one slot of its own
    positions = torch.arange(ids.numel(), dtype=torch.int64, device=tokens.device)
    none, past = torch.full_like(positions, -1), torch.full_like(positions, ids.numel())
    not_pad = tokens.reshape(-1) != pad_token_id

    def per_segment(values: Tensor, reduce: str, start: int) -> Tensor:
        out = torch.full((num_sequences + 1,), start, dtype=torch.int64, device=tokens.device)
        return out.scatter_reduce(0, ids, values, reduce=reduce)

    last = per_segment(torch.where(not_pad, positions, none), "amax", -1)
    first = per_segment(positions, "amin", ids.numel())
    if shared_prompt is not None:
        body = shared_prompt.reshape(-1)
        b = num_sequences // 2
        body_last = per_segment(torch.where(body & not_pad, positions, none), "amax", -1)[:b]
        body_first = per_segment(torch.where(body, positions, past), "amin", ids.numel())[:b]
        last[b:2 * b] = torch.where(last[b:2 * b] >= 0, last[b:2 * b], body_last)
        first[b:2 * b] = torch.minimum(first[b:2 * b], body_first)
    return torch.where(last >= 0, last, first)[:num_sequences]


def segment_scores(scores: Tensor, tokens: Tensor, *, segment_ids: Tensor, num_sequences: int,
                   pad_token_id: int, shared_prompt: Tensor | None = None) -> SequenceScores:
    """`row_scores` of rows of segments (data/packing.py's packed rows, data/prefix_sharing.py's
    shared-prompt rows): each sequence's score from the score head's outputs [rows, W, 1], read
    at `last_segment_token_index`, in the unpacked order of its segment id (the b chosen
    sequences, then the b rejected ones), and its tokens (a rejected sequence's prompt body,
    written once in its chosen segment, counted for both)."""
    index = last_segment_token_index(tokens, segment_ids, num_sequences=num_sequences, pad_token_id=pad_token_id,
                                     shared_prompt=shared_prompt)
    ids = segment_ids.reshape(-1).clamp(max=num_sequences)
    lengths = torch.bincount(ids, minlength=num_sequences + 1)[:num_sequences]
    if shared_prompt is not None:
        b = num_sequences // 2
        body = torch.bincount(ids[shared_prompt.reshape(-1)], minlength=num_sequences + 1)[:b]
        lengths = torch.cat([lengths[:b], lengths[b:] + body])
    return SequenceScores(score=scores.reshape(-1, scores.shape[-1])[index, 0], num_tokens=lengths)


def chosen_rejected(rewards: Tensor) -> tuple[Tensor, Tensor]:
    """Split [2b, ...] rows into (chosen [b, ...], rejected [b, ...]): TRL 1.16's collator puts
    the b chosen sequences first and the b rejected ones after them."""
    if rewards.dim() < 1 or rewards.shape[0] % 2:
        raise ValueError(
            f"rewards: expected an even number of rows (b chosen then b rejected), got {list(rewards.shape)}"
        )
    half = rewards.shape[0] // 2
    return rewards[:half], rewards[half:]


# --------------------------------------------------------------------------- losses and metrics


def _compute_dtype(tensor: Tensor) -> torch.dtype:
    # A bfloat16 head output is upcast: the log-sigmoid of small differences needs the bits.
    return tensor.dtype if tensor.dtype in (torch.float32, torch.float64) else torch.float32


def _check_inputs(chosen_rewards: Tensor, rejected_rewards: Tensor, margin: Tensor | None) -> None:
    # Shape checks only: anything that reads tensor values would force a device sync.
    shape = chosen_rewards.shape
    if len(shape) != 1:
        raise ValueError(f"chosen_rewards: expected shape [b], got {list(shape)}")
    if rejected_rewards.shape != shape:
        raise ValueError(
            f"rejected_rewards: expected shape {list(shape)} like chosen_rewards, got {list(rejected_rewards.shape)}"
        )
    if margin is not None and margin.shape != shape:
        raise ValueError(f"margin: expected shape {list(shape)} like chosen_rewards, got {list(margin.shape)}")


def pair_losses(
    chosen_rewards: Tensor, rejected_rewards: Tensor, margin: Tensor | None = None, *, spec: RewardSpec
) -> Tensor:
    """Per-pair loss [b]: -logσ(r+ - r- - m) + κ·(r+ + r-)², differentiable in both rewards.

    The global-batch loss is sum(pair_losses) / N summed over all microbatches and ranks (N the
    pairs of the global batch). margin (the data's "margin" column) carries no gradient."""
    spec.validate()
    _check_inputs(chosen_rewards, rejected_rewards, margin)
    dtype = _compute_dtype(chosen_rewards)
    chosen = chosen_rewards.to(dtype)
    rejected = rejected_rewards.to(dtype)
    gap = chosen - rejected
    if margin is not None:
        gap = gap - margin.detach().to(dtype)
    losses = -F.logsigmoid(gap)
    if spec.center_rewards_coefficient is not None:
        losses = losses + spec.center_coefficient * (chosen + rejected) ** 2
    return losses


def metric_sum_vector(
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
    margin: Tensor | None = None,
    *,
    spec: RewardSpec,
    num_tokens: Tensor,
) -> Tensor:
    """The metric sums of one microbatch: float64 [len(METRIC_SUM_KEYS)], on the device.

    num_tokens: the microbatch's tokens, chosen and rejected, padding excluded (the attention
    mask's sum; any shape, summed). Combine the vectors of microbatches and ranks with
    combine_metric_sums (or SUM / MAX all-reduces, see the module docstring), read them once,
    and call finalize_metrics: nothing here waits for the device."""
    with torch.no_grad():
        losses = pair_losses(chosen_rewards, rejected_rewards, margin, spec=spec)
        dtype = torch.float64
        chosen = chosen_rewards.to(dtype)
        rejected = rejected_rewards.to(dtype)
        device = losses.device
        if chosen.numel():
            every = torch.cat([chosen, rejected])
            max_reward, neg_min_reward = every.amax(), (-every).amax()
        else:  # an empty microbatch: the identity of max
            max_reward = neg_min_reward = torch.full((), -math.inf, dtype=dtype, device=device)
        values = torch.stack(
            [
                torch.full((), float(losses.numel()), dtype=dtype, device=device),
                losses.to(dtype).sum(),
                chosen.sum() + rejected.sum(),
                (chosen_rewards > rejected_rewards).to(dtype).sum(),
                (chosen - rejected).sum(),
                num_tokens.to(device=device, dtype=dtype).sum(),
                max_reward,
                neg_min_reward,
            ]
        )
    return values


def combine_metric_sums(a: Tensor, b: Tensor) -> Tensor:
    """Two metric vectors as one: the first ADDITIVE_KEY_COUNT entries added, the rest by max."""
    if a.shape != (len(METRIC_SUM_KEYS),) or b.shape != a.shape:
        raise ValueError(
            f"a: expected two vectors of shape [{len(METRIC_SUM_KEYS)}], got {list(a.shape)} and {list(b.shape)}"
        )
    k = ADDITIVE_KEY_COUNT
    return torch.cat([a[:k] + b[:k], torch.maximum(a[k:], b[k:])])


def finalize_metrics(
    sums: Mapping[str, float], *, spec: RewardSpec, num_tokens_before: float = 0.0
) -> dict[str, float]:
    """The global batch's metrics under METRIC_NAMES from its combined sums.

    num_tokens is cumulative in TRL 1.16 (tokens of every training step so far): pass the
    total of the earlier steps as num_tokens_before."""
    spec.validate()
    num_pairs = sums_count(sums, METRIC_SUM_KEYS, count="num_pairs")
    return {
        "loss": sums["loss_sum"] / num_pairs,
        "num_tokens": num_tokens_before + sums["num_tokens"],
        "min_reward": -sums["neg_min_reward"],
        "mean_reward": sums["reward_sum"] / (2.0 * num_pairs),
        "max_reward": sums["max_reward"],
        "accuracy": sums["accuracy_sum"] / num_pairs,
        "margin": sums["margin_sum"] / num_pairs,
    }


# --------------------------------------------------------------------------- the objective


@dataclass(frozen=True)
class RewardTotals(BatchTotals):
    """A global batch's normalisers and its pairs' data margins, float64 [samples] by position in
    the batch on the host (0 for a pair without one), or None when no pair has one."""

    margins: Tensor | None = None


class RewardObjective(Objective):
    """A Bradley-Terry reward model on preference pairs: a score head, no reference, no log-probs.

    Its metrics are TRL 1.16's names (METRIC_NAMES) for one global batch; num_tokens is the
    batch's own tokens (TRL counts every step's so far: the run's logs carry tokens/real)."""

    name = "reward"
    shape = PAIR
    needs_reference = False
    needs_prepass = False
    head = "score"
    metric_keys = METRIC_SUM_KEYS
    max_keys = MAX_REDUCED_KEYS

    def totals(self, samples: Sequence) -> RewardTotals:
        margins = [getattr(sample, "margin", None) for sample in samples]
        return RewardTotals(num_samples=len(samples), chosen_tokens=1,  # the loss is a mean over pairs only
                            margins=(torch.tensor([m or 0.0 for m in margins], dtype=torch.float64)
                                     if any(m is not None for m in margins) else None))

    def microbatch(self, logps: SequenceScores, reference: Tensor | None, *, positions: Sequence[int],
                   totals: RewardTotals, prepass: object | None = None) -> tuple[Tensor, Tensor]:
        chosen, rejected = chosen_rejected(logps.score)
        margin = None
        if totals.margins is not None:  # a host copy to the device, without waiting for it
            margin = to_device(totals.margins[list(positions)], chosen.device)
        losses = pair_losses(chosen, rejected, margin, spec=self.spec)
        sums = metric_sum_vector(chosen, rejected, margin, spec=self.spec, num_tokens=logps.num_tokens)
        return losses.sum() / totals.num_samples, sums

    def finalize(self, sums: dict[str, float]) -> dict[str, float]:
        return finalize_metrics(sums, spec=self.spec)


def spec_of(config) -> RewardSpec:
    """The RewardSpec of a run's configuration; ValueError (one line) for a shared option the
    reward model does not read and for the row layouts its score head does not read yet."""
    for name, default in (("loss_type", "sigmoid"), ("label_smoothing", 0.0), ("beta", 0.1)):
        if getattr(config, name) != default:
            raise ValueError(f"{name}: not an option of --objective reward (its one loss is Bradley-Terry)")
    return RewardSpec(center_rewards_coefficient=config.center_rewards_coefficient)


def from_config(config) -> RewardObjective:
    return RewardObjective(spec_of(config))
