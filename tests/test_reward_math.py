"""Tests for mcore_dpo.objective.reward against TRL 1.16's own code: `RewardTrainer.compute_loss`
and `RewardTrainer.log` run on given rewards (a stand-in model returns them as its logits), the
reward position against transformers' LlamaForSequenceClassification built here (tiny, random,
nothing downloaded), the data conventions against `RewardTrainer._prepare_dataset` with the
project's tokenizer, split invariance of the metric sums, and the spec's errors."""
from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from mcore_dpo.objective.reward import (
    ADDITIVE_KEY_COUNT,
    MAX_REDUCED_KEYS,
    METRIC_NAMES,
    METRIC_SUM_KEYS,
    RewardSpec,
    chosen_rejected,
    combine_metric_sums,
    finalize_metrics,
    last_token_index,
    metric_sum_vector,
    pair_losses,
    sequence_rewards,
)

import transformers  # noqa: E402
import trl.trainer.reward_trainer as trl_reward  # noqa: E402

RTOL = 1e-6
TOKENIZER_DIR = "mcore_dpo/assets/tokenizer"
SPECS = {
    "plain": RewardSpec(),
    "center": RewardSpec(center_rewards_coefficient=0.01),
    "center_big": RewardSpec(center_rewards_coefficient=0.7),
}


# --------------------------------------------------------------------------- TRL 1.16 on given rewards


class _GivenRewards(nn.Module):
    """Stands in for a sequence-classification model: returns the given [2b] rewards as its
    logits [2b, 1], whatever the inputs (TRL passes input_ids, attention_mask, margin, use_cache)."""

    def __init__(self, rewards: torch.Tensor):
        super().__init__()
        self.rewards = rewards

    def forward(self, **inputs):
        assert inputs["input_ids"].shape[0] == self.rewards.shape[0]
        return SimpleNamespace(logits=self.rewards.unsqueeze(-1))


class _OneProcess:
    """accelerate's gathers in a single process: the tensor itself."""

    @staticmethod
    def gather(tensor):
        return tensor

    @staticmethod
    def gather_for_metrics(tensor):
        return tensor


def _trl_trainer(spec: RewardSpec, model: nn.Module):
    """A RewardTrainer with only what compute_loss and log read (no Trainer.__init__)."""
    trainer = trl_reward.RewardTrainer.__new__(trl_reward.RewardTrainer)
    model.train()
    trainer.model = model
    trainer.args = SimpleNamespace(center_rewards_coefficient=spec.center_rewards_coefficient)
    trainer.accelerator = _OneProcess()
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer._total_train_tokens = 0
    trainer._tp_size = 1
    return trainer


def _trl_step(spec, chosen, rejected, margin=None, *, attention_mask=None):
    """TRL 1.16's compute_loss on the given rewards: (loss tensor, the trainer, after the call)."""
    b = chosen.shape[0]
    rewards = torch.cat([chosen, rejected])
    model = _GivenRewards(rewards)
    trainer = _trl_trainer(spec, model)
    if attention_mask is None:
        attention_mask = torch.ones(2 * b, 5, dtype=torch.int64)
    inputs = {"input_ids": torch.zeros_like(attention_mask), "attention_mask": attention_mask}
    if margin is not None:
        inputs["margin"] = margin
    loss = trl_reward.RewardTrainer.compute_loss(trainer, model, inputs)
    return loss, trainer


def _trl_logged(trainer, monkeypatch, loss_value: float) -> dict[str, float]:
    """What TRL 1.16's RewardTrainer.log hands to transformers' Trainer.log."""
    seen = {}
    monkeypatch.setattr(transformers.Trainer, "log", lambda self, logs, start_time=None: seen.update(logs))
    trainer.log({"loss": loss_value})
    return seen


def _random_rewards(b: int, *, seed: int, dtype=torch.float64, with_margin: bool = False, ties: bool = False):
    gen = torch.Generator().manual_seed(seed)
    chosen = 2.0 * torch.randn(b, generator=gen, dtype=dtype) + 0.3
    rejected = 2.0 * torch.randn(b, generator=gen, dtype=dtype)
    if ties:  # equal rewards are not wins (r+ > r- strictly)
        rejected[: b // 3] = chosen[: b // 3]
    margin = torch.rand(b, generator=gen, dtype=dtype) * 3.0 if with_margin else None
    return chosen, rejected, margin


def _metrics_of(chosen, rejected, margin, spec, num_tokens, before=0.0):
    vec = metric_sum_vector(chosen, rejected, margin, spec=spec, num_tokens=num_tokens)
    return finalize_metrics(dict(zip(METRIC_SUM_KEYS, vec.tolist())), spec=spec, num_tokens_before=before)


def _close(a: float, b: float, rtol: float = RTOL) -> bool:
    return math.isclose(a, b, rel_tol=rtol, abs_tol=1e-12)


@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("with_margin", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_loss_and_gradient_match_trl(spec_name, with_margin, dtype):
    spec = SPECS[spec_name]
    chosen, rejected, margin = _random_rewards(16, seed=3, dtype=dtype, with_margin=with_margin)
    if margin is not None:
        margin = margin.float()  # TRL's collator makes the margin float32
    trl_c = chosen.clone().requires_grad_(True)
    trl_r = rejected.clone().requires_grad_(True)
    trl_loss, _ = _trl_step(spec, trl_c, trl_r, margin)
    trl_loss.backward()

    ours_c = chosen.clone().requires_grad_(True)
    ours_r = rejected.clone().requires_grad_(True)
    losses = pair_losses(ours_c, ours_r, margin, spec=spec)
    assert losses.shape == (16,)
    loss = losses.sum() / 16
    loss.backward()
    assert _close(loss.item(), trl_loss.item())
    torch.testing.assert_close(ours_c.grad, trl_c.grad, rtol=RTOL, atol=1e-9)
    torch.testing.assert_close(ours_r.grad, trl_r.grad, rtol=RTOL, atol=1e-9)


def test_margin_and_center_terms_by_hand():
    # One pair, every term written out: a sign or a misplaced margin shows here.
    chosen, rejected, margin = torch.tensor([1.5]), torch.tensor([0.25]), torch.tensor([2.0])
    gap = 1.5 - 0.25 - 2.0
    bt = math.log1p(math.exp(-gap))
    assert _close(pair_losses(chosen, rejected, margin, spec=RewardSpec()).item(), bt)
    expected = bt + 0.1 * (1.5 + 0.25) ** 2
    got = pair_losses(chosen, rejected, margin, spec=RewardSpec(center_rewards_coefficient=0.1)).item()
    assert _close(got, expected)
    assert _close(pair_losses(chosen, rejected, spec=RewardSpec()).item(), math.log1p(math.exp(-1.25)))
    # κ = 0 is the same as None.
    assert _close(pair_losses(chosen, rejected, margin, spec=RewardSpec(center_rewards_coefficient=0.0)).item(), bt)


@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("with_margin", [False, True])
def test_metrics_match_trl_logs(spec_name, with_margin, monkeypatch):
    spec = SPECS[spec_name]
    chosen, rejected, margin = _random_rewards(12, seed=11, with_margin=with_margin, ties=True)
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 9, (24,), generator=gen)
    attention_mask = (torch.arange(9) < lengths[:, None]).to(torch.int64)
    trl_loss, trainer = _trl_step(spec, chosen, rejected, margin, attention_mask=attention_mask)
    logged = _trl_logged(trainer, monkeypatch, trl_loss.item())

    num_tokens = lengths[:12] + lengths[12:]  # per pair, chosen + rejected
    ours = _metrics_of(chosen, rejected, margin, spec, num_tokens)
    assert tuple(ours) == METRIC_NAMES
    assert set(ours) == set(logged), "the metric names differ from TRL 1.16's"
    for name in METRIC_NAMES:
        assert _close(ours[name], float(logged[name])), (name, ours[name], logged[name])
    # The ties are losses for accuracy, and the data margin is not taken off "margin".
    assert ours["accuracy"] < 1.0


def test_num_tokens_is_cumulative_like_trl(monkeypatch):
    spec = RewardSpec()
    chosen, rejected, _ = _random_rewards(4, seed=2)
    mask = torch.ones(8, 6, dtype=torch.int64)
    mask[:, 4:] = 0
    _, trainer = _trl_step(spec, chosen, rejected, attention_mask=mask)
    trainer._total_train_tokens += 1000  # earlier steps
    trl_reward.RewardTrainer.compute_loss(trainer, trainer.model, {"input_ids": torch.zeros_like(mask),
                                                                    "attention_mask": mask})
    logged = _trl_logged(trainer, monkeypatch, 0.0)
    ours = _metrics_of(chosen, rejected, None, spec, torch.tensor(32), before=1032.0)
    assert ours["num_tokens"] == logged["num_tokens"] == 1064


def test_trl_logs_mean_of_microbatch_min_max(monkeypatch):
    # The difference the module docstring states: with two microbatches in one logging step, TRL
    # 1.16 logs the mean of their minima (maxima); the means agree for equal microbatches.
    spec = RewardSpec()
    chosen, rejected, _ = _random_rewards(8, seed=21)
    trainer = None
    for part in (slice(0, 4), slice(4, 8)):
        _, step = _trl_step(spec, chosen[part], rejected[part])
        if trainer is None:
            trainer = step
        else:
            for key, values in step._metrics["train"].items():
                if key != "num_tokens":
                    trainer._metrics["train"][key].extend(values)
    logged = _trl_logged(trainer, monkeypatch, 0.0)
    ours = _metrics_of(chosen, rejected, None, spec, torch.tensor(0))
    for name in ("mean_reward", "accuracy", "margin"):
        assert _close(ours[name], logged[name]), name
    every = torch.cat([chosen, rejected])
    assert ours["min_reward"] == every.min().item() < logged["min_reward"]
    assert ours["max_reward"] == every.max().item() > logged["max_reward"]


# --------------------------------------------------------------------------- split invariance


@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("with_margin", [False, True])
def test_metric_sums_do_not_depend_on_the_split(spec_name, with_margin):
    spec = SPECS[spec_name]
    chosen, rejected, margin = _random_rewards(20, seed=7, with_margin=with_margin, ties=True)
    tokens = torch.randint(2, 50, (20,), generator=torch.Generator().manual_seed(1))
    whole = metric_sum_vector(chosen, rejected, margin, spec=spec, num_tokens=tokens)
    assert whole.dtype == torch.float64 and whole.shape == (len(METRIC_SUM_KEYS),)
    for bounds in ((0, 7, 8, 20), (0, 1, 2, 3, 19, 20), (0, 0, 10, 20)):  # (0, 0) an empty microbatch
        total = None
        for lo, hi in zip(bounds, bounds[1:]):
            m = None if margin is None else margin[lo:hi]
            part = metric_sum_vector(chosen[lo:hi], rejected[lo:hi], m, spec=spec, num_tokens=tokens[lo:hi])
            total = part if total is None else combine_metric_sums(total, part)
        torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)
        # The loss too: per-pair losses over microbatches / N are the global loss.
        split = sum(pair_losses(chosen[lo:hi], rejected[lo:hi], None if margin is None else margin[lo:hi],
                                spec=spec).sum() for lo, hi in zip(bounds, bounds[1:])) / 20
        assert _close(split.item(), pair_losses(chosen, rejected, margin, spec=spec).mean().item(), 1e-12)
    # A plain sum of the vectors would be wrong in the max entries: the layout says which are which.
    assert METRIC_SUM_KEYS[ADDITIVE_KEY_COUNT:] == MAX_REDUCED_KEYS


def test_nothing_reads_the_device():
    # Meta tensors have no values: any .item(), .tolist() or value-dependent branch would raise.
    chosen, rejected, margin = (torch.randn(4, dtype=torch.float64, device="meta") for _ in range(3))
    spec = RewardSpec(center_rewards_coefficient=0.1)
    vec = metric_sum_vector(chosen, rejected, margin, spec=spec, num_tokens=torch.ones(4, device="meta"))
    assert vec.device.type == "meta" and vec.shape == (len(METRIC_SUM_KEYS),) and vec.dtype == torch.float64
    assert pair_losses(chosen, rejected, margin, spec=spec).device.type == "meta"
    combine_metric_sums(vec, vec)
    ids = torch.zeros(3, 5, dtype=torch.int64, device="meta")
    assert sequence_rewards(torch.zeros(3, 5, device="meta"), last_token_index(ids, 0)).shape == (3,)


def test_empty_microbatch_gives_the_identities():
    empty = torch.zeros(0, dtype=torch.float64)
    vec = metric_sum_vector(empty, empty, spec=RewardSpec(), num_tokens=torch.zeros(0))
    assert vec[:ADDITIVE_KEY_COUNT].eq(0).all()
    assert torch.isneginf(vec[ADDITIVE_KEY_COUNT:]).all()


def test_bfloat16_rewards_compute_in_float32():
    chosen, rejected, margin = _random_rewards(6, seed=4, with_margin=True)
    low = pair_losses(chosen.bfloat16(), rejected.bfloat16(), margin, spec=RewardSpec())
    assert low.dtype == torch.float32
    exact = pair_losses(chosen.bfloat16().double(), rejected.bfloat16().double(), margin, spec=RewardSpec())
    torch.testing.assert_close(low.double(), exact, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- where the reward is read


PAD = 0
EOS = 3


@pytest.fixture(scope="module")
def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_labels=1, pad_token_id=PAD, eos_token_id=EOS,
    )
    model = transformers.LlamaForSequenceClassification(config).eval()
    return model


def _position_scores(model, input_ids, attention_mask):
    """The score head at every position: [rows, s]."""
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return model.score(hidden).squeeze(-1)


def _rows():
    # Right padding, left padding, a pad-valued token inside the text, a row that ends in
    # pad-valued tokens that are real text (attention 1), a row with no padding, an all-pad row.
    ids = torch.tensor([
        [5, 6, 7, 8, 0, 0, 0],
        [0, 0, 9, 10, 11, 12, 13],
        [4, 0, 6, 0, 7, 0, 0],
        [4, 9, 9, 0, 0, 0, 0],
        [1, 2, 3, 4, 5, 6, 7],
        [0, 0, 0, 0, 0, 0, 0],
    ])
    mask = torch.tensor([
        [1, 1, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 1],
        [1, 0, 0, 0, 0, 0, 0],
    ])
    return ids, mask


def test_last_token_index_matches_transformers(tiny_llama):
    ids, mask = _rows()
    index = last_token_index(ids, PAD)
    assert index.tolist() == [3, 6, 4, 2, 6, 0]
    assert index.dtype == torch.int64
    with torch.no_grad():
        theirs = tiny_llama(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
        scores = _position_scores(tiny_llama, ids, mask)
        hidden = tiny_llama.model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(sequence_rewards(scores, index), theirs, rtol=0, atol=0)
    # Gathering the hidden states first and applying the head to one vector per row: the same.
    with torch.no_grad():
        from_hidden = tiny_llama.score(sequence_rewards(hidden, index)).squeeze(-1)
    torch.testing.assert_close(from_hidden, theirs, rtol=1e-6, atol=1e-7)
    # A wrong position (the last attended token) would differ on the rows with pad-valued text.
    last_attended = mask.shape[1] - 1 - mask.flip(-1).argmax(-1)
    assert not torch.allclose(sequence_rewards(scores, last_attended), theirs)


def test_last_token_index_without_pad_token(tiny_llama):
    ids = torch.tensor([[5, 6, 0, 0]])
    tiny_llama.config.pad_token_id = None
    try:
        with torch.no_grad():
            theirs = tiny_llama(input_ids=ids).logits.squeeze(-1)
            scores = _position_scores(tiny_llama, ids, None)
        with pytest.raises(ValueError, match="batch sizes > 1"):
            tiny_llama(input_ids=ids.repeat(2, 1))
    finally:
        tiny_llama.config.pad_token_id = PAD
    index = last_token_index(ids, None)
    assert index.tolist() == [3]
    torch.testing.assert_close(sequence_rewards(scores, index), theirs, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"^pad_token_id: "):
        last_token_index(ids.repeat(2, 1), None)


def test_whole_pipeline_matches_trl_on_the_tiny_model(tiny_llama, monkeypatch):
    # TRL's collator and compute_loss on the real tiny model, against ids -> index -> scores ->
    # chosen/rejected -> pair_losses, with margins and κ; EOS equal to PAD in one row's text.
    examples = [
        {"chosen_ids": [1, 5, 6, EOS], "rejected_ids": [1, 5, 7, 8, 9, EOS], "margin": 0.5},
        {"chosen_ids": [1, 10, PAD, 11], "rejected_ids": [1, 12], "margin": 0.0},
        {"chosen_ids": [1, 13, 14, 15, 16, 17, 18], "rejected_ids": [1, 19, 20, PAD], "margin": 2.0},
    ]
    batch = trl_reward.DataCollatorForPreference(pad_token_id=PAD)(examples)
    spec = RewardSpec(center_rewards_coefficient=0.05)
    trainer = _trl_trainer(spec, tiny_llama)
    trl_loss = trl_reward.RewardTrainer.compute_loss(trainer, tiny_llama, dict(batch))
    logged = _trl_logged(trainer, monkeypatch, trl_loss.item())
    tiny_llama.eval()

    with torch.no_grad():
        scores = _position_scores(tiny_llama, batch["input_ids"], batch["attention_mask"])
    rewards = sequence_rewards(scores, last_token_index(batch["input_ids"], PAD))
    chosen, rejected = chosen_rejected(rewards)
    loss = pair_losses(chosen, rejected, batch["margin"], spec=spec).sum() / 3
    assert _close(loss.item(), trl_loss.item())
    ours = _metrics_of(chosen, rejected, batch["margin"], spec, batch["attention_mask"].sum())
    for name in METRIC_NAMES:
        assert _close(ours[name], float(logged[name])), name


def test_chosen_rejected_is_trls_row_layout():
    rows = torch.arange(6.0)
    chosen, rejected = chosen_rejected(rows)
    assert chosen.tolist() == [0.0, 1.0, 2.0] and rejected.tolist() == [3.0, 4.0, 5.0]
    with pytest.raises(ValueError, match=r"^rewards: "):
        chosen_rejected(torch.arange(5.0))


# --------------------------------------------------------------------------- data conventions


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def _trl_prepared(rows, tokenizer, max_length=None):
    import datasets

    datasets.disable_progress_bars()
    args = SimpleNamespace(dataset_num_proc=None, max_length=max_length)
    return list(trl_reward.RewardTrainer._prepare_dataset(None, datasets.Dataset.from_list(rows), tokenizer, args,
                                                          "train"))


_TRL_ROWS = [
    # explicit prompts, with and without the EOS text at the end, one long enough to be dropped
    {"prompt": "The sky is", "chosen": " blue", "rejected": " green<eos>"},
    {"prompt": "2 + 2 =", "chosen": " 4<eos>", "rejected": " 5"},
    {"prompt": "Count:", "chosen": " one two three four five six seven eight nine ten", "rejected": " one"},
    # a completion with no leading space: its first token may merge with the prompt's last
    {"prompt": "Hello", "chosen": "world", "rejected": "!"},
]
_TRL_IMPLICIT = [{"chosen": "The sky is blue", "rejected": "The sky is green"},
                 {"chosen": "a b c d e f g h i j k l m n", "rejected": "a"}, {"chosen": "a", "rejected": "b"}]
_TRL_CONVERSATIONS = [
    {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "hello"}],
     "rejected": [{"role": "assistant", "content": "go away, and take these many words with you"}]},
    {"prompt": [{"role": "user", "content": "and?"}], "chosen": [{"role": "assistant", "content": "yes"}],
     "rejected": [{"role": "assistant", "content": "no"}]},
]
_TRL_IMPLICIT_CONVERSATIONS = [
    {"chosen": [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}],
     "rejected": [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "5"}]},
    # nothing shared: a reward model scores both conversations whole
    {"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
     "rejected": [{"role": "user", "content": "bye"}, {"role": "assistant", "content": "go away, and take these "
                                                                                     "many words with you"}]},
]


@pytest.mark.parametrize("rows", [_TRL_ROWS, _TRL_IMPLICIT, _TRL_CONVERSATIONS, _TRL_IMPLICIT_CONVERSATIONS],
                         ids=["plain", "implicit", "conversational", "implicit-conversational"])
@pytest.mark.parametrize("max_length", [None, 12])
def test_the_runs_pairs_are_trls_reward_sequences(rows, max_length, tokenizer, tmp_path):
    """What --objective reward trains on (the loader with whole_rows, and the token store that
    equals it): for every row TRL 1.16's RewardTrainer keeps, in order, prompt + chosen and
    prompt + rejected are exactly TRL's chosen_ids and rejected_ids (plain text with the EOS text
    appended, implicit prompts, conversations rendered by the chat template); a pair with a
    sequence over max_length is dropped, never cut, as TRL filters it."""
    from mcore_dpo.data.pairs import load_pairs
    from mcore_dpo.data.store import key_inputs, open_or_build, store_key

    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    kept = _trl_prepared(rows, tokenizer, max_length=max_length)
    pairs, stats = load_pairs(str(path), tokenizer=tokenizer, max_length=max_length or 10_000, whole_rows=True)
    assert [(list(p.prompt_ids + p.chosen_ids), list(p.prompt_ids + p.rejected_ids)) for p in pairs] == [
        (row["chosen_ids"], row["rejected_ids"]) for row in kept]
    assert stats.num_dropped_too_long == len(rows) - len(kept) and stats.num_truncated_pairs == 0
    if max_length:
        assert 0 < len(kept) < len(rows)  # both outcomes occur
    store = open_or_build(str(path), tokenizer_dir=TOKENIZER_DIR, tokenizer=tokenizer, max_length=max_length or 10_000,
                          cache_dir=tmp_path / "cache", workers=1, log=lambda line: None, whole_rows=True)
    assert [store.pair(i) for i in range(len(store))] == pairs
    inputs = dict(tokenizer_dir=TOKENIZER_DIR, tokenizer=tokenizer, max_length=max_length or 10_000, on_bad_row="error")
    assert store_key(key_inputs([str(path)], **inputs, whole_rows=True)) == Path(store.path).name
    assert store_key(key_inputs([str(path)], **inputs)) != Path(store.path).name  # the rule is part of the key


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("value", [-0.01, math.nan, math.inf, "0.01", True])
def test_spec_refuses_bad_coefficients(value):
    with pytest.raises(ValueError, match=r"^center_rewards_coefficient: ") as error:
        RewardSpec(center_rewards_coefficient=value).validate()
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"^center_rewards_coefficient: "):
        pair_losses(torch.zeros(2), torch.zeros(2), spec=RewardSpec(center_rewards_coefficient=value))


def test_spec_defaults_are_trls():
    config_fields = {f.name: f.default for f in trl_reward.RewardConfig.__dataclass_fields__.values()}
    assert RewardSpec().center_rewards_coefficient is config_fields["center_rewards_coefficient"] is None
    for value in (None, 0, 0.0, 0.01, 3):
        RewardSpec(center_rewards_coefficient=value).validate()


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"^rejected_rewards: "):
        pair_losses(torch.zeros(3), torch.zeros(4), spec=RewardSpec())
    with pytest.raises(ValueError, match=r"^margin: "):
        pair_losses(torch.zeros(3), torch.zeros(3), torch.zeros(2), spec=RewardSpec())
    with pytest.raises(ValueError, match=r"^chosen_rewards: "):
        pair_losses(torch.zeros(3, 1), torch.zeros(3, 1), spec=RewardSpec())
    with pytest.raises(ValueError, match=r"^input_ids: "):
        last_token_index(torch.zeros(3, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match=r"^sums: "):
        finalize_metrics({}, spec=RewardSpec())


# --------------------------------------------------------------------------- the objective (contract.py)


def test_the_objective_over_any_split_gives_the_whole_batch_loss_and_metrics():
    """Microbatches of 2, 1 and 3 pairs through RewardObjective.microbatch, their sums combined by
    Objective.accumulate (the max entries by max), give the whole batch's loss and metrics."""
    from mcore_dpo.objective.reward import RewardObjective, RewardTotals, SequenceScores

    objective = RewardObjective(RewardSpec(center_rewards_coefficient=0.2))
    chosen, rejected, _ = _random_rewards(6, seed=3, with_margin=False, ties=True)
    tokens = torch.arange(5, 17, dtype=torch.int64)  # chosen rows, then rejected rows
    totals = RewardTotals(num_samples=6, chosen_tokens=1, margins=torch.linspace(-1.0, 2.0, 6, dtype=torch.float64))

    def scores(ids: list[int]) -> SequenceScores:
        rows = ids + [i + 6 for i in ids]
        return SequenceScores(score=torch.cat([chosen, rejected])[rows], num_tokens=tokens[rows])

    whole_loss, whole_sums = objective.microbatch(scores(list(range(6))), None, positions=range(6), totals=totals)
    total, loss = objective.empty_sums(torch.device("cpu")), 0.0
    for ids in ([4, 0], [5], [1, 3, 2]):
        part_loss, part_sums = objective.microbatch(scores(ids), None, positions=ids, totals=totals)
        objective.accumulate(total, part_sums)
        loss += part_loss.item()
    assert _close(loss, whole_loss.item(), 1e-12)
    torch.testing.assert_close(total, whole_sums, rtol=1e-12, atol=1e-12)
    metrics = objective.finalize(dict(zip(objective.metric_keys, total.tolist())))
    every = torch.cat([chosen, rejected]).double()
    assert metrics["min_reward"] == every.min().item() and metrics["max_reward"] == every.max().item()
    assert metrics["num_tokens"] == tokens.sum().item() and set(metrics) == set(METRIC_NAMES)
    assert objective.metric_keys[-len(objective.max_keys):] == MAX_REDUCED_KEYS
    assert objective.head == "score" and not objective.needs_reference


def test_row_scores_read_the_last_token_that_is_not_padding():
    """The last stage's scores [rows, s, 1]: read where transformers reads them (before trailing
    pad-valued tokens, so before an EOS that pads), each row's length from its loss mask."""
    from mcore_dpo.objective.reward import row_scores

    pad = 2
    tokens = torch.tensor([[1, 5, 6, 2, 2, 2], [1, 5, 7, 8, 9, 2], [1, 4, 2, 6, 2, 2]])
    lengths = [4, 6, 4]  # prompt [1, 5] or [1, 4]; the completions end in the EOS (the pad)
    loss_mask = torch.zeros(3, 6)
    for row, n in enumerate(lengths):
        loss_mask[row, 1:n - 1] = 1.0  # labels of positions 1 .. n-2 are completion tokens
    out = torch.arange(18.0).view(3, 6, 1).requires_grad_()
    got = row_scores(out, tokens, loss_mask=loss_mask, pad_token_id=pad)
    assert got.score.tolist() == [2.0, 10.0, 15.0]  # positions 2, 4, 3
    assert got.num_tokens.tolist() == lengths
    got.score.sum().backward()
    assert out.grad.sum().item() == 3.0


@pytest.mark.parametrize("layout", ["packed", "shared", "packed-shared"])
def test_rows_of_segments_give_each_sequence_the_score_of_its_padded_row(layout):
    """segment_scores on packed rows (collate_packed) and shared-prompt rows (collate_shared, or
    packed with prefix_sharing) equals row_scores on collate's padded rows: each sequence's score
    read at its last token that is not padding (an EOS that pads, a pad-valued token inside the
    text; a rejected completion of pad tokens only read inside the prompt, which shared-prompt
    rows hold once, in the chosen segment), in the padded rows' order (chosen ones, then rejected
    ones), and its length; a gradient reaches exactly the positions read."""
    from mcore_dpo.data.packing import collate_packed
    from mcore_dpo.data.pairs import TokenizedPair, collate
    from mcore_dpo.data.prefix_sharing import collate_shared
    from mcore_dpo.objective.reward import row_scores, segment_scores

    pad = 2
    pairs = [TokenizedPair((1, 5), (6, 2), (7, 8, 9, 2), source_line=1),
             TokenizedPair((1, 4, 2), (6, 2, 3, 2), (2,), source_line=2),
             TokenizedPair((3,), (9, 9, 9, 9, 2), (8, 2), source_line=3),
             TokenizedPair((), (1, 9, 2), (1, 8, 8, 2), source_line=4)]  # a row used whole, no prompt
    b = len(pairs)
    padded = collate(pairs, pad_token_id=pad, seq_len=9)
    rows = {"packed": lambda: collate_packed(pairs, pad_token_id=pad, multiple=8),
            "shared": lambda: collate_shared(pairs, pad_token_id=pad, seq_len=16),
            "packed-shared": lambda: collate_packed(pairs, pad_token_id=pad, multiple=8, prefix_sharing=True)}[layout]()
    assert (rows.shared_prompt is not None) == ("shared" in layout)

    def value(sequence: int, position: int) -> float:
        """The same score for the same token of a sequence; a prompt body's tokens (which shared
        rows hold once) the same in both sequences of the pair."""
        if sequence < 2 * b and position < len(pairs[sequence % b].prompt_ids) - 1:
            return 100.0 * (sequence % b) + position + 50.0
        return 100.0 * sequence + position

    width = padded.tokens.shape[1]
    padded_out = torch.tensor([[value(r, t) for t in range(width)] for r in range(2 * b)]).unsqueeze(-1)
    out = torch.tensor([[value(k, t) if k < 2 * b else -1.0 for k, t in zip(ids, positions)]
                        for ids, positions in zip(rows.segment_ids.tolist(), rows.position_ids.tolist())])
    out = out.unsqueeze(-1).requires_grad_()
    want = row_scores(padded_out, padded.tokens, loss_mask=padded.loss_mask, pad_token_id=pad)
    got = segment_scores(out, rows.tokens, segment_ids=rows.segment_ids, num_sequences=rows.num_sequences,
                         pad_token_id=pad, shared_prompt=rows.shared_prompt)
    assert got.score.tolist() == want.score.tolist()
    assert want.score[b + 1].item() == value(b + 1, 1)  # pair 1's rejected [2] is read at its prompt's 4
    # prompt + completion, the EOS included
    assert got.num_tokens.tolist() == want.num_tokens.tolist() == [4, 7, 6, 3, 6, 4, 3, 4]
    got.score.sum().backward()
    assert out.grad.sum().item() == 2 * b and out.grad.abs().max().item() == 1.0


def test_the_margin_column_reaches_the_pairs_and_the_token_store(tokenizer, tmp_path):
    """TRL's optional "margin" column: a finite number per row, kept with the pair by the loader and
    by the token store (NaN-free round trip); anything else is a bad row; not an unused column."""
    import json

    from mcore_dpo.data.pairs import load_pairs
    from mcore_dpo.data.store import open_or_build

    rows = [{"prompt": "a b", "chosen": " c", "rejected": " d", "margin": 0.25},
            {"prompt": "e", "chosen": " f g", "rejected": " h", "margin": -2},
            {"prompt": "i", "chosen": " j", "rejected": " k", "margin": "wide"},
            {"prompt": "l", "chosen": " m", "rejected": " n"}]
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    pairs, stats = load_pairs(str(path), tokenizer=tokenizer, max_length=64, on_bad_row="skip")
    assert [p.margin for p in pairs] == [0.25, -2.0, None] and stats.first_bad_lines == (3,)
    assert stats.unused_columns == ()
    store = open_or_build([str(path)], tokenizer_dir=None, tokenizer=tokenizer, max_length=64,
                          cache_dir=tmp_path / "cache", on_bad_row="skip", workers=1, log=lambda _m: None)
    assert list(store) == pairs
    from mcore_dpo.objective.reward import RewardObjective

    totals = RewardObjective(RewardSpec()).totals(pairs)
    assert totals.margins.tolist() == [0.25, -2.0, 0.0]
    assert RewardObjective(RewardSpec()).totals(pairs[2:]).margins is None
