"""Tests for mcore_dpo.objective.cpo and mcore_dpo.objective.orpo against TRL 1.16's own methods.

TRL's trainer methods are called unbound, with a SimpleNamespace standing in for the trainer: it
carries the attributes they read (beta, loss_type, accelerator.gather_for_metrics, ...).
Two levels:
- per sample: random log-prob sums and token counts into `CPOTrainer.cpo_loss` /
  `ORPOTrainer.odds_ratio_loss` and into ours;
- token level: random logits of a fake model on a padded batch with prompts, through TRL's
  `get_batch_loss_metrics` (its batch concatenation, log-probs, cross-entropy NLL, loss and
  metrics), against ours fed by per-sample sums taken from the same logits, whole and split into
  two microbatches of unequal size. The gradient of the loss with respect to the logits is
  compared too.
TRL 1.16 comes with the test extra (setup.py).
"""
from __future__ import annotations

import dataclasses
import os
from types import MethodType, SimpleNamespace
from unittest import mock

import pytest
import torch

from mcore_dpo.objective import cpo, orpo
from mcore_dpo.objective.cpo import CPO_LOSS_TYPES, CPO_SUM_KEYS, CpoSpec, cpo_losses, cpo_metric_sum_vector
from mcore_dpo.objective.orpo import ORPO_SUM_KEYS, OrpoSpec, orpo_losses, orpo_metric_sum_vector

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

RTOL = 1e-6
PAD = 0
VOCAB = 13
B = 5
SPLIT = (2, 3)  # two microbatches of unequal size (and unequal token counts)

# Every CPO loss type, with the options that change its formula.
CPO_SPECS = {
    "sigmoid": CpoSpec(),
    "sigmoid_smoothed_alpha": CpoSpec(beta=0.2, label_smoothing=0.1, alpha=0.25, cpo_alpha=0.5),
    "sigmoid_no_nll": CpoSpec(cpo_alpha=0.0),
    "hinge": CpoSpec(cpo_loss_type="hinge", beta=0.2),
    "hinge_alpha": CpoSpec(cpo_loss_type="hinge", beta=0.05, alpha=-0.3),
    "ipo": CpoSpec(cpo_loss_type="ipo", beta=0.3),
    "ipo_alpha": CpoSpec(cpo_loss_type="ipo", beta=0.3, alpha=0.5, cpo_alpha=2.0),
    "simpo": CpoSpec(cpo_loss_type="simpo", beta=2.0, simpo_gamma=0.7, label_smoothing=0.1),
    "alphapo": CpoSpec(cpo_loss_type="alphapo", beta=2.0, alpha=0.25),
    "alphapo_plain": CpoSpec(cpo_loss_type="alphapo"),
}


def _trl():
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    return SimpleNamespace(CPOConfig=CPOConfig, CPOTrainer=CPOTrainer, ORPOConfig=ORPOConfig, ORPOTrainer=ORPOTrainer)


def _accelerator():
    return SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda tensor: tensor)


def _trl_cpo_options(trl, spec: CpoSpec) -> tuple[str, float]:
    """loss_type and cpo_alpha as TRL 1.16's `CPOConfig.__post_init__` leaves them (alphapo's mapping),
    without the TrainingArguments checks of the base class."""
    from trl.trainer.base_config import _BaseConfig

    config = object.__new__(trl.CPOConfig)
    config.loss_type, config.cpo_alpha = spec.cpo_loss_type, spec.cpo_alpha
    with mock.patch.object(_BaseConfig, "__post_init__", lambda self: None):
        trl.CPOConfig.__post_init__(config)
    return config.loss_type, config.cpo_alpha


def _trl_cpo(trl, spec: CpoSpec) -> SimpleNamespace:
    """A stand-in for a CPOTrainer, with the attributes its loss methods read."""
    loss_type, cpo_alpha = _trl_cpo_options(trl, spec)
    trainer = SimpleNamespace(
        beta=spec.beta, label_smoothing=spec.label_smoothing, loss_type=loss_type, cpo_alpha=cpo_alpha,
        simpo_gamma=spec.simpo_gamma, alpha=spec.alpha, is_encoder_decoder=False, pad_token_id=PAD,
        aux_loss_enabled=False, accelerator=_accelerator(),
        concatenated_inputs=trl.CPOTrainer.concatenated_inputs, get_batch_logps=trl.CPOTrainer.get_batch_logps,
    )
    for name in ("cpo_loss", "concatenated_forward", "get_batch_loss_metrics"):
        setattr(trainer, name, MethodType(getattr(trl.CPOTrainer, name), trainer))
    return trainer


def _trl_orpo(trl, spec: OrpoSpec) -> SimpleNamespace:
    """A stand-in for an ORPOTrainer, with the attributes its loss methods read."""
    trainer = SimpleNamespace(
        beta=spec.beta, is_encoder_decoder=False, padding_value=PAD, aux_loss_enabled=False,
        accelerator=_accelerator(),
        concatenated_inputs=trl.ORPOTrainer.concatenated_inputs, get_batch_logps=trl.ORPOTrainer.get_batch_logps,
    )
    for name in ("odds_ratio_loss", "concatenated_forward", "get_batch_loss_metrics"):
        setattr(trainer, name, MethodType(getattr(trl.ORPOTrainer, name), trainer))
    return trainer


def _close(ours, theirs, *, what: str, rtol: float = RTOL, atol: float = 0.0) -> None:
    ours, theirs = torch.as_tensor(ours, dtype=torch.float64), torch.as_tensor(theirs, dtype=torch.float64)
    torch.testing.assert_close(ours, theirs, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------- per-sample data
def _sample_sums(seed: int = 0):
    """float32 [B] log-prob sums (negative) and token counts 1..20; the first sample's chosen mean is
    above -ln 2 and the others below, so both branches of log(1 - e^x) are taken."""
    g = torch.Generator().manual_seed(seed)
    chosen_n = torch.randint(1, 21, (B,), generator=g)
    rejected_n = torch.randint(1, 21, (B,), generator=g)
    chosen = -(torch.rand(B, generator=g) * 2.5 + 0.8) * chosen_n
    rejected = -(torch.rand(B, generator=g) * 2.5 + 0.8) * rejected_n
    chosen[0], chosen_n[0] = -0.3, 1
    return chosen.float(), rejected.float(), chosen_n, rejected_n


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", CPO_SPECS)
def test_cpo_losses_and_rewards_match_trl_cpo_loss(name, dtype):
    trl = _trl()
    spec = CPO_SPECS[name]
    chosen, rejected, chosen_n, rejected_n = _sample_sums()
    chosen, rejected = chosen.to(dtype), rejected.to(dtype)
    out = cpo_losses(chosen_logps_sum=chosen, rejected_logps_sum=rejected, chosen_num_tokens=chosen_n,
                     rejected_num_tokens=rejected_n, spec=spec, num_samples_global=B, chosen_tokens_global=100)
    trainer = _trl_cpo(trl, spec)
    # What TRL's get_batch_logps hands cpo_loss: per-token means for ipo and simpo (alphapo is simpo).
    mean = trainer.loss_type in ("ipo", "simpo")
    assert spec.uses_token_means == mean
    trl_chosen, trl_rejected = (chosen / chosen_n, rejected / rejected_n) if mean else (chosen, rejected)
    losses, chosen_rewards, rejected_rewards = trainer.cpo_loss(trl_chosen, trl_rejected)
    assert out.losses.dtype == losses.dtype == dtype
    # In float32 the AlphaPO shape rounds differently: TRL 1.16 forms e^x and raises it to a power, this
    # engine takes expm1 (both stay within 1e-6 of the float64 value; their difference, squared by ipo
    # or cancelled in Δ, reaches 2e-6). In float64 the two agree to rounding.
    rtol = 1e-12 if dtype == torch.float64 else (5e-6 if spec.alpha else RTOL)
    _close(out.losses, losses, what="losses", rtol=rtol)
    _close(out.chosen_rewards, chosen_rewards, what="rewards/chosen", rtol=rtol)
    _close(out.rejected_rewards, rejected_rewards, what="rewards/rejected", rtol=rtol)
    _close(out.chosen_logps, trl_chosen, what="chosen logps", rtol=rtol)
    assert spec.effective_cpo_alpha == trainer.cpo_alpha
    # Not a constant: the losses move with the inputs.
    assert out.losses.unique().numel() > 1


def test_orpo_losses_and_rewards_match_trl_odds_ratio_loss():
    trl = _trl()
    spec = OrpoSpec(beta=0.25)
    chosen, rejected, chosen_n, rejected_n = _sample_sums()
    nll = torch.rand(B) * 30
    out = orpo_losses(chosen_logps_sum=chosen, rejected_logps_sum=rejected, chosen_num_tokens=chosen_n,
                      rejected_num_tokens=rejected_n, chosen_nll_sum=nll, spec=spec, num_samples_global=B,
                      nll_tokens_global=100)
    trainer = _trl_orpo(trl, spec)
    losses, chosen_rewards, rejected_rewards, ratio_mean, log_odds_mean = trainer.odds_ratio_loss(
        chosen / chosen_n, rejected / rejected_n)
    _close(out.losses, -losses, what="losses (TRL returns their negative)")
    _close(out.chosen_rewards, chosen_rewards, what="rewards/chosen")
    _close(out.rejected_rewards, rejected_rewards, what="rewards/rejected")
    _close(out.log_odds_ratio.mean(), ratio_mean, what="log_odds_ratio")
    _close(out.log_odds.mean(), log_odds_mean, what="log_odds_chosen")
    _close(out.total, out.losses + nll * (B / 100), what="total")
    # Both branches of log(1 - e^x) against the plain formula in float64.
    x = torch.tensor([-1e-3, -0.3, -0.69, -0.7, -3.0], dtype=torch.float64)
    _close(orpo.log1mexp(x), torch.log(1 - torch.exp(x)), what="log1mexp", rtol=1e-12)
    # Far below, log(1 - e^x) = -e^x - e^(2x)/2 - ...: the plain formula would round to 0 there.
    x = torch.tensor([-40.0], dtype=torch.float64)
    _close(orpo.log1mexp(x), -torch.exp(x) - torch.exp(2 * x) / 2, what="log1mexp far below", rtol=1e-12)
    _close(orpo.log1mexp(torch.tensor([-0.7, -0.5])), torch.log(1 - torch.exp(torch.tensor([-0.7, -0.5]))),
           what="log1mexp float32", rtol=1e-6)


def test_half_precision_inputs_are_computed_in_float32():
    chosen, rejected, chosen_n, rejected_n = _sample_sums()
    common = dict(chosen_num_tokens=chosen_n, rejected_num_tokens=rejected_n, num_samples_global=B)
    for dtype in (torch.bfloat16, torch.float16):
        c, r = chosen.to(dtype), rejected.to(dtype)
        out = cpo_losses(chosen_logps_sum=c, rejected_logps_sum=r, spec=CpoSpec(cpo_loss_type="simpo"),
                         chosen_tokens_global=100, **common)
        ref = cpo_losses(chosen_logps_sum=c.float(), rejected_logps_sum=r.float(), spec=CpoSpec(cpo_loss_type="simpo"),
                         chosen_tokens_global=100, **common)
        assert out.total.dtype == torch.float32
        _close(out.total, ref.total, what=f"cpo {dtype}")
        out = orpo_losses(chosen_logps_sum=c, rejected_logps_sum=r, chosen_nll_sum=-c, spec=OrpoSpec(),
                          nll_tokens_global=100, **common)
        assert out.total.dtype == torch.float32


def test_alphapo_reward_shape_stays_finite_where_exp_underflows():
    # A summed log-prob of -200 underflows exp() in float32; the shape reads it through expm1.
    logps = torch.tensor([-200.0, -150.0])
    shaped = cpo.reward_shape(logps, alpha=0.1)
    assert torch.isfinite(shaped).all()
    _close(shaped, (1 - torch.exp(-0.1 * logps.double())) / 0.1, what="shape", rtol=1e-6)


# --------------------------------------------------------------------------- token-level data
def _token_batch(seed: int = 1):
    """A padded batch as TRL's DPODataCollatorWithPadding leaves it (right padding, prompt and padding
    labelled -100), and per-row token lists to compute the engine's per-sample sums from."""
    g = torch.Generator().manual_seed(seed)
    rows = {"chosen": [], "rejected": []}
    for _ in range(B):
        prompt = [1] + torch.randint(2, VOCAB, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist()
        for side in rows:
            completion = torch.randint(2, VOCAB, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
            rows[side].append((prompt, completion))
    batch = {}
    for side, pairs in rows.items():
        length = max(len(p) + len(c) for p, c in pairs)
        ids = torch.full((B, length), PAD)
        mask = torch.zeros((B, length), dtype=torch.long)
        labels = torch.full((B, length), -100)
        for i, (p, c) in enumerate(pairs):
            ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            mask[i, : len(p) + len(c)] = 1
            labels[i, len(p): len(p) + len(c)] = torch.tensor(c)
        batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"], batch[f"{side}_labels"] = ids, mask, labels
    return batch, rows


class _FakeModel:
    """Returns fixed random logits for the concatenated [chosen; rejected] batch TRL builds."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits

    def __call__(self, input_ids, attention_mask=None, use_cache=False, **kwargs):
        assert input_ids.shape == self.logits.shape[:2], (input_ids.shape, self.logits.shape)
        return SimpleNamespace(logits=self.logits)


def _logits(batch, dtype: torch.dtype, seed: int = 2) -> torch.Tensor:
    length = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2 * B, length, VOCAB, generator=g, dtype=torch.float64) * 2.0).to(dtype).requires_grad_(True)


def _engine_sums(logits: torch.Tensor, rows) -> dict[str, torch.Tensor]:
    """The per-sample quantities the engine hands the loss, computed from the token rows: sums over
    each completion's tokens of log p(token) and of the vocabulary-mean logit (at the position that
    predicts the token), the counts, and the NLL of the whole chosen sequence (ORPO's)."""
    out = {key: [] for key in ("chosen_logps_sum", "rejected_logps_sum", "chosen_num_tokens", "rejected_num_tokens",
                               "chosen_logit_sum", "rejected_logit_sum", "chosen_full_nll_sum",
                               "chosen_full_nll_tokens")}
    for offset, side in ((0, "chosen"), (B, "rejected")):
        for i, (prompt, completion) in enumerate(rows[side]):
            seq = torch.tensor(prompt + completion)
            logp = torch.log_softmax(logits[offset + i, : len(seq) - 1], -1)
            token_logp = logp.gather(-1, seq[1:, None]).squeeze(-1)  # position t-1 predicts token t
            completion_logp = token_logp[len(prompt) - 1:]
            out[f"{side}_logps_sum"].append(completion_logp.sum())
            out[f"{side}_num_tokens"].append(torch.tensor(len(completion)))
            out[f"{side}_logit_sum"].append(logits[offset + i, len(prompt) - 1: len(seq) - 1].detach().mean(-1).sum())
            if side == "chosen":
                out["chosen_full_nll_sum"].append(-token_logp.sum())
                out["chosen_full_nll_tokens"].append(torch.tensor(len(seq) - 1))
    return {key: torch.stack(values) for key, values in out.items()}


def _part(sums: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    return {key: value[start:stop] for key, value in sums.items()}


def _exact_logit_means(logits: torch.Tensor, batch) -> tuple[float, float]:
    """The vocabulary-mean logit averaged over every completion token of the batch (our logits/*),
    from the padded tensors: the position before each labelled token."""
    means = []
    for offset, side in ((0, "chosen"), (B, "rejected")):
        labels = batch[f"{side}_labels"]
        mask = (labels[:, 1:] != -100).float()
        row_means = logits[offset: offset + B, : labels.shape[1] - 1].detach().mean(-1)
        means.append(float((row_means * mask).sum() / mask.sum()))
    return means[0], means[1]


def _splits():
    start = 0
    for size in SPLIT:
        yield start, start + size
        start += size


@pytest.mark.parametrize("name", CPO_SPECS)
def test_cpo_batch_loss_metrics_and_gradient_match_trl(name):
    trl = _trl()
    spec = CPO_SPECS[name]
    batch, rows = _token_batch()
    # float64 logits: TRL 1.16's CPO computes in the logits' dtype, so both sides compute the same
    # numbers to rounding (float32 is the per-sample test's).
    trl_logits = _logits(batch, torch.float64)
    trl_loss, trl_metrics = _trl_cpo(trl, spec).get_batch_loss_metrics(_FakeModel(trl_logits), batch)
    trl_loss.backward()

    logits = _logits(batch, torch.float64)
    sums = _engine_sums(logits, rows)
    n, t = B, int(sums["chosen_num_tokens"].sum())
    assert t == int((batch["chosen_labels"] != -100).sum())
    args = dict(spec=spec, num_samples_global=n, chosen_tokens_global=t)
    keys = ("chosen_logps_sum", "rejected_logps_sum", "chosen_num_tokens", "rejected_num_tokens")
    # The loss: per-sample totals of two microbatches, summed and divided by N.
    loss = sum(cpo_losses(**{k: v for k, v in _part(sums, a, z).items() if k in keys}, **args).total.sum()
               for a, z in _splits()) / n
    _close(loss, trl_loss, what="loss")
    loss.backward()
    _close(logits.grad, trl_logits.grad, what="d loss / d logits", rtol=1e-5, atol=1e-7)

    metric_keys = keys + ("chosen_logit_sum", "rejected_logit_sum")
    vectors = [cpo_metric_sum_vector(**{k: v for k, v in _part(sums, a, z).items() if k in metric_keys}, **args)
               for a, z in [(0, B), *_splits()]]
    assert all(v.dtype == torch.float64 and v.shape == (len(CPO_SUM_KEYS),) for v in vectors)
    whole = cpo.finalize(dict(zip(CPO_SUM_KEYS, vectors[0].tolist())), spec)
    split = cpo.finalize(dict(zip(CPO_SUM_KEYS, (vectors[1] + vectors[2]).tolist())), spec)
    assert set(whole) == set(trl_metrics) | {"loss"}
    for key in whole:
        _close(split[key], whole[key], what=f"{key} split vs whole", rtol=1e-12)
    _close(whole["loss"], trl_loss, what="loss metric")
    for key, value in trl_metrics.items():
        if not key.startswith("logits/"):
            _close(whole[key], value, what=key)
    # logits/*: the exact token mean over the completions (TRL averages the whole padded tensor).
    chosen_mean, rejected_mean = _exact_logit_means(logits, batch)
    _close(whole["logits/chosen"], chosen_mean, what="logits/chosen", rtol=1e-6)
    _close(whole["logits/rejected"], rejected_mean, what="logits/rejected", rtol=1e-6)
    if spec.effective_cpo_alpha == 0:
        assert whole["nll_loss"] == trl_metrics["nll_loss"] == 0.0
    else:
        assert whole["nll_loss"] > 0


def test_orpo_batch_loss_metrics_and_gradient_match_trl():
    trl = _trl()
    spec = OrpoSpec(beta=0.3)
    batch, rows = _token_batch()
    # float32 logits: TRL 1.16's ORPO casts the log-probs to float32 whatever the logits' dtype.
    trl_logits = _logits(batch, torch.float32)
    trl_loss, trl_metrics = _trl_orpo(trl, spec).get_batch_loss_metrics(_FakeModel(trl_logits), batch)
    trl_loss.backward()

    logits = _logits(batch, torch.float32)
    sums = _engine_sums(logits, rows)
    sums["chosen_nll_sum"], sums["chosen_nll_num_tokens"] = sums.pop("chosen_full_nll_sum"), sums.pop(
        "chosen_full_nll_tokens")
    n, t = B, int(sums["chosen_nll_num_tokens"].sum())
    # ORPO's NLL covers prompt and completion: every attended chosen token but the first.
    assert t == int(batch["chosen_attention_mask"].sum()) - B
    args = dict(spec=spec, num_samples_global=n, nll_tokens_global=t)
    keys = ("chosen_logps_sum", "rejected_logps_sum", "chosen_num_tokens", "rejected_num_tokens", "chosen_nll_sum")
    loss = sum(orpo_losses(**{k: v for k, v in _part(sums, a, z).items() if k in keys}, **args).total.sum()
               for a, z in _splits()) / n
    _close(loss, trl_loss, what="loss")
    loss.backward()
    _close(logits.grad, trl_logits.grad, what="d loss / d logits", rtol=1e-5, atol=1e-7)

    vectors = [orpo_metric_sum_vector(**{k: v.detach() for k, v in _part(sums, a, z).items()}, **args)
               for a, z in [(0, B), *_splits()]]
    assert all(v.dtype == torch.float64 and v.shape == (len(ORPO_SUM_KEYS),) for v in vectors)
    whole = orpo.finalize(dict(zip(ORPO_SUM_KEYS, vectors[0].tolist())), spec)
    split = orpo.finalize(dict(zip(ORPO_SUM_KEYS, (vectors[1] + vectors[2]).tolist())), spec)
    assert set(whole) == set(trl_metrics) | {"loss"}
    for key in whole:
        _close(split[key], whole[key], what=f"{key} split vs whole", rtol=1e-12)
    _close(whole["loss"], trl_loss, what="loss metric")
    for key, value in trl_metrics.items():
        if not key.startswith("logits/"):
            _close(whole[key], value, what=key)
    chosen_mean, rejected_mean = _exact_logit_means(logits, batch)
    _close(whole["logits/chosen"], chosen_mean, what="logits/chosen", rtol=1e-6)
    _close(whole["logits/rejected"], rejected_mean, what="logits/rejected", rtol=1e-6)


def test_split_sums_give_the_whole_batch_metrics_without_trl():
    """Microbatch split invariance of every finalized metric, and the loss as mean + weight·token-mean NLL,
    from per-sample data alone (runs where TRL is not installed)."""
    chosen, rejected, chosen_n, rejected_n = _sample_sums(seed=3)
    chosen_logits, rejected_logits = torch.randn(B) * chosen_n, torch.randn(B) * rejected_n
    nll = torch.rand(B) * 20 + 1
    t = int(chosen_n.sum())
    for spec in CPO_SPECS.values():
        per = dict(chosen_logps_sum=chosen, rejected_logps_sum=rejected, chosen_num_tokens=chosen_n,
                   rejected_num_tokens=rejected_n, chosen_nll_sum=nll)
        args = dict(spec=spec, num_samples_global=B, chosen_tokens_global=t)
        out = cpo_losses(**per, **args)
        _close(out.total.double().mean(),
               out.losses.double().mean() + spec.effective_cpo_alpha * nll.double().sum() / t, what="cpo total")
        per.update(chosen_logit_sum=chosen_logits, rejected_logit_sum=rejected_logits)
        whole = cpo_metric_sum_vector(**per, **args)
        parts = sum(cpo_metric_sum_vector(**{k: v[a:z] for k, v in per.items()}, **args) for a, z in _splits())
        one, two = (cpo.finalize(dict(zip(CPO_SUM_KEYS, v.tolist())), spec) for v in (whole, parts))
        for key in one:
            _close(two[key], one[key], what=f"cpo {key}", rtol=1e-12)
        _close(one["logits/chosen"], chosen_logits.double().sum() / t, what="logits/chosen", rtol=1e-12)
        _close(one["nll_loss"], nll.double().sum() / t if spec.effective_cpo_alpha else 0.0, what="nll", rtol=1e-12)
    nll_n = chosen_n + 3
    per = dict(chosen_logps_sum=chosen, rejected_logps_sum=rejected, chosen_num_tokens=chosen_n,
               rejected_num_tokens=rejected_n, chosen_nll_sum=nll)
    args = dict(spec=OrpoSpec(), num_samples_global=B, nll_tokens_global=int(nll_n.sum()))
    out = orpo_losses(**per, **args)
    _close(out.total.double().mean(), out.losses.double().mean() + nll.double().sum() / nll_n.sum(), what="orpo")
    per.update(chosen_nll_num_tokens=nll_n, chosen_logit_sum=chosen_logits, rejected_logit_sum=rejected_logits)
    whole = orpo_metric_sum_vector(**per, **args)
    parts = sum(orpo_metric_sum_vector(**{k: v[a:z] for k, v in per.items()}, **args) for a, z in _splits())
    one, two = (orpo.finalize(dict(zip(ORPO_SUM_KEYS, v.tolist())), OrpoSpec()) for v in (whole, parts))
    for key in one:
        _close(two[key], one[key], what=f"orpo {key}", rtol=1e-12)
    _close(one["nll_loss"], nll.double().sum() / nll_n.sum(), what="orpo nll_loss", rtol=1e-12)


# --------------------------------------------------------------------------- specs
def test_spec_defaults_and_loss_types_are_trl_1_16s():
    trl = _trl()
    defaults = {f.name: f.default for f in dataclasses.fields(trl.CPOConfig)}
    spec = CpoSpec()
    for ours, theirs in (("cpo_loss_type", "loss_type"), ("beta", "beta"), ("label_smoothing", "label_smoothing"),
                         ("cpo_alpha", "cpo_alpha"), ("simpo_gamma", "simpo_gamma"), ("alpha", "alpha")):
        assert getattr(spec, ours) == defaults[theirs], ours
    choices = next(f for f in dataclasses.fields(trl.CPOConfig) if f.name == "loss_type").metadata["choices"]
    assert tuple(choices) == CPO_LOSS_TYPES
    assert OrpoSpec().beta == {f.name: f.default for f in dataclasses.fields(trl.ORPOConfig)}["beta"]
    assert _trl_cpo_options(trl, CpoSpec(cpo_loss_type="alphapo")) == ("simpo", 0.0)


@pytest.mark.parametrize("kwargs, field", [
    ({"cpo_loss_type": "kto_pair"}, "loss_type"),  # the flag: --loss-type
    ({"cpo_loss_type": "dpo"}, "loss_type"),
    ({"beta": 0.0}, "beta"),
    ({"beta": float("nan")}, "beta"),
    ({"label_smoothing": 0.5}, "label_smoothing"),
    ({"label_smoothing": -0.1}, "label_smoothing"),
    ({"cpo_loss_type": "hinge", "label_smoothing": 0.1}, "label_smoothing"),
    ({"cpo_loss_type": "ipo", "label_smoothing": 0.1}, "label_smoothing"),
    ({"cpo_alpha": -1.0}, "cpo_alpha"),
    ({"cpo_alpha": float("inf")}, "cpo_alpha"),
    ({"cpo_loss_type": "alphapo", "cpo_alpha": 0.5}, "cpo_alpha"),
    ({"simpo_gamma": float("nan")}, "simpo_gamma"),
    ({"alpha": float("inf")}, "alpha"),
])
def test_cpo_spec_validate_names_the_field_in_one_line(kwargs, field):
    with pytest.raises(ValueError) as info:
        CpoSpec(**kwargs).validate()
    message = str(info.value)
    assert message.startswith(f"{field}: ") and "\n" not in message, message


@pytest.mark.parametrize("kwargs", [{"cpo_loss_type": name} for name in CPO_LOSS_TYPES] + [
    {"cpo_loss_type": "simpo", "label_smoothing": 0.2}, {"cpo_loss_type": "alphapo", "cpo_alpha": 0.0},
    {"cpo_alpha": 0.0, "alpha": -1.0, "simpo_gamma": -0.5}])
def test_cpo_spec_validate_accepts(kwargs):
    CpoSpec(**kwargs).validate()


@pytest.mark.parametrize("beta", [0.0, -0.1, float("nan"), float("inf")])
def test_orpo_spec_validate_names_the_field_in_one_line(beta):
    with pytest.raises(ValueError) as info:
        OrpoSpec(beta=beta).validate()
    message = str(info.value)
    assert message.startswith("beta: ") and "\n" not in message, message
    OrpoSpec(beta=0.5).validate()


def test_shape_and_count_errors():
    chosen, rejected, chosen_n, rejected_n = _sample_sums()
    per = dict(chosen_logps_sum=chosen, rejected_logps_sum=rejected[:3], chosen_num_tokens=chosen_n,
               rejected_num_tokens=rejected_n)
    with pytest.raises(ValueError, match="^rejected_logps_sum: expected shape"):
        cpo_losses(**per, spec=CpoSpec(), num_samples_global=B, chosen_tokens_global=10)
    per["rejected_logps_sum"] = rejected
    with pytest.raises(ValueError, match="^chosen_tokens_global: "):
        cpo_losses(**per, spec=CpoSpec(), num_samples_global=B, chosen_tokens_global=0)
    with pytest.raises(ValueError, match="^nll_tokens_global: "):
        orpo_losses(**per, chosen_nll_sum=-chosen, spec=OrpoSpec(), num_samples_global=B, nll_tokens_global=0)
    with pytest.raises(ValueError, match="^sums: missing keys"):
        cpo.finalize({"num_samples": 1.0}, CpoSpec())
