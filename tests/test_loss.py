"""Tests for mcore_dpo.objective.loss: each loss type against a scalar re-implementation, gradients, split invariance."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mcore_dpo.objective.loss import METRIC_SUM_KEYS, PairLogps, finalize_metrics, metric_sums, pair_losses
from mcore_dpo.objective.loss_spec import LOSS_TYPES, SORTED_TYPES, LossSpec

# Types with a per-pair formula; aot and aot_unpaired sort over the batch (tests/test_loss_options.py).
PER_PAIR_TYPES = tuple(t for t in LOSS_TYPES if t not in SORTED_TYPES)

# ---------------------------------------------------------------------------
# Scalar reference, written from the loss table in ARCHITECTURE.md with `math`.


def _log_sigmoid(x: float) -> float:
    # log(1 / (1 + e^-x)), in the branch where the exponential cannot overflow.
    if x >= 0:
        return -math.log1p(math.exp(-x))
    return x - math.log1p(math.exp(x))


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def _reference_loss(
    loss_type: str,
    *,
    c: float,
    r: float,
    c0: float,
    r0: float,
    lc: float,
    lr: float,
    nll: float,
    beta: float,
    eps: float,
    tau: float,
    num_pairs: int,
    chosen_tokens: int,
) -> float:
    up, um = c - c0, r - r0
    z = beta * (up - um)
    if loss_type == "sigmoid":
        return -_log_sigmoid(z)
    if loss_type == "cdpo":
        return -(1 - eps) * _log_sigmoid(z) - eps * _log_sigmoid(-z)
    if loss_type == "hinge":
        return max(0.0, 1 - z)
    if loss_type == "ipo":
        return (up / lc - um / lr - 1 / (2 * beta)) ** 2
    if loss_type == "robust":
        return (-(1 - eps) * _log_sigmoid(z) + eps * _log_sigmoid(-z)) / (1 - 2 * eps)
    if loss_type == "exo_pair":
        return _sigmoid(z) * (_log_sigmoid(z) - math.log(1 - eps)) + _sigmoid(-z) * (
            _log_sigmoid(-z) - math.log(eps)
        )
    if loss_type == "nca_pair":
        return -_log_sigmoid(beta * up) - 0.5 * _log_sigmoid(-beta * up) - 0.5 * _log_sigmoid(-beta * um)
    if loss_type == "bco_pair":
        return -_log_sigmoid(beta * up) - _log_sigmoid(-beta * um)
    if loss_type == "sppo_hard":
        return (up - 1 / (2 * beta)) ** 2 + (um + 1 / (2 * beta)) ** 2
    if loss_type == "apo_zero":
        return 1 - _sigmoid(beta * up) + _sigmoid(beta * um)
    if loss_type == "apo_down":
        return _sigmoid(beta * up) + 1 - _sigmoid(z)
    if loss_type == "discopop":
        g = _sigmoid(z / tau)
        # g·e^(-z) = e^(log g - z); e^(-z) on its own overflows a float for z < -709.
        return (1 - g) * (-_log_sigmoid(z)) + math.exp(_log_sigmoid(z / tau) - z)
    if loss_type == "sigmoid_norm":
        return -_log_sigmoid(beta * (c / lc - r / lr - (c0 / lc - r0 / lr)))
    if loss_type == "sft":
        return nll * num_pairs / chosen_tokens
    raise AssertionError(loss_type)


def _spec_for(loss_type: str, **overrides) -> LossSpec:
    eps = {"cdpo": 0.1, "robust": 0.2, "exo_pair": 1e-3}.get(loss_type, 0.0)
    fields = {"loss_types": (loss_type,), "loss_weights": (1.0,), "beta": 0.1, "label_smoothing": eps}
    fields.update(overrides)
    return LossSpec(**fields)


# ---------------------------------------------------------------------------
# Inputs


def _random_logps(
    num_pairs: int, *, seed: int, margin_scale: float = 30.0, requires_grad: bool = False
) -> PairLogps:
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float64
    chosen_tokens = torch.randint(1, 40, (num_pairs,), generator=gen)
    rejected_tokens = torch.randint(1, 40, (num_pairs,), generator=gen)
    ref_chosen = -chosen_tokens * (0.5 + torch.rand(num_pairs, generator=gen, dtype=dtype))
    ref_rejected = -rejected_tokens * (0.5 + torch.rand(num_pairs, generator=gen, dtype=dtype))
    chosen = ref_chosen + margin_scale * torch.randn(num_pairs, generator=gen, dtype=dtype)
    rejected = ref_rejected + margin_scale * torch.randn(num_pairs, generator=gen, dtype=dtype)
    logps = PairLogps(
        chosen_logps=chosen,
        rejected_logps=rejected,
        ref_chosen_logps=ref_chosen,
        ref_rejected_logps=ref_rejected,
        chosen_num_tokens=chosen_tokens,
        rejected_num_tokens=rejected_tokens,
        chosen_logit_sum=chosen_tokens * torch.randn(num_pairs, generator=gen, dtype=dtype),
        rejected_logit_sum=rejected_tokens * torch.randn(num_pairs, generator=gen, dtype=dtype),
        # Not -chosen so that a mix-up between the two inputs would show.
        chosen_nll_sum=-chosen + torch.rand(num_pairs, generator=gen, dtype=dtype),
    )
    if requires_grad:
        for name in ("chosen_logps", "rejected_logps", "chosen_nll_sum"):
            setattr(logps, name, getattr(logps, name).detach().requires_grad_(True))
    return logps


def _slice(logps: PairLogps, start: int, stop: int) -> PairLogps:
    return PairLogps(
        **{
            f.name: (None if getattr(logps, f.name) is None else getattr(logps, f.name)[start:stop])
            for f in dataclasses.fields(logps)
        }
    )


def _reference_losses(logps: PairLogps, *, spec: LossSpec, num_pairs: int, chosen_tokens: int) -> list[float]:
    out = []
    for i in range(logps.chosen_logps.numel()):
        c0 = 0.0 if spec.reference_free else float(logps.ref_chosen_logps[i])
        r0 = 0.0 if spec.reference_free else float(logps.ref_rejected_logps[i])
        total = 0.0
        for loss_type, weight in zip(spec.loss_types, spec.loss_weights):
            total += weight * _reference_loss(
                loss_type,
                c=float(logps.chosen_logps[i]),
                r=float(logps.rejected_logps[i]),
                c0=c0,
                r0=r0,
                lc=float(logps.chosen_num_tokens[i]),
                lr=float(logps.rejected_num_tokens[i]),
                nll=float(logps.chosen_nll_sum[i]),
                beta=spec.beta,
                eps=spec.label_smoothing,
                tau=spec.discopop_tau,
                num_pairs=num_pairs,
                chosen_tokens=chosen_tokens,
            )
        out.append(total)
    return out


# ---------------------------------------------------------------------------
# Values


@pytest.mark.parametrize("loss_type", PER_PAIR_TYPES)
@pytest.mark.parametrize("beta", [0.05, 0.5, 3.0])
def test_matches_scalar_reference(loss_type: str, beta: float) -> None:
    logps = _random_logps(32, seed=100 * LOSS_TYPES.index(loss_type) + int(beta * 100))
    spec = _spec_for(loss_type, beta=beta, discopop_tau=0.05 if beta < 1 else 0.3)
    got = pair_losses(logps, spec=spec, num_pairs_global=100, chosen_tokens_global=777)
    want = _reference_losses(logps, spec=spec, num_pairs=100, chosen_tokens=777)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("loss_type", PER_PAIR_TYPES)
def test_large_margins_are_finite_and_match(loss_type: str) -> None:
    # βΔ up to about ±600 (where a naive e^(-βΔ) or log(σ) would overflow/underflow) and beyond.
    logps = _random_logps(16, seed=7, margin_scale=3000.0)
    spec = _spec_for(loss_type, beta=0.1)
    got = pair_losses(logps, spec=spec, num_pairs_global=16, chosen_tokens_global=300)
    assert torch.isfinite(got).all()
    want = _reference_losses(logps, spec=spec, num_pairs=16, chosen_tokens=300)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-10, atol=1e-12)

    extreme = _random_logps(4, seed=8)
    big = torch.tensor([1e6, -1e6, 1e4, -1e4], dtype=torch.float64)
    extreme.chosen_logps = (extreme.ref_chosen_logps + big).requires_grad_(True)
    extreme.rejected_logps = (extreme.ref_rejected_logps - big).requires_grad_(True)
    extreme.chosen_nll_sum = None  # sft then differentiates through chosen_logps
    losses = pair_losses(extreme, spec=spec, num_pairs_global=4, chosen_tokens_global=50)
    assert torch.isfinite(losses).all(), losses
    losses.sum().backward()
    for grad in (extreme.chosen_logps.grad, extreme.rejected_logps.grad):
        assert grad is None or torch.isfinite(grad).all()


def test_large_margin_asymptotes() -> None:
    # At βΔ = ±1e4: sigmoid ≈ max(0, -βΔ); discopop at βΔ << 0 is dominated by its logistic part.
    logps = _random_logps(2, seed=9)
    big = torch.tensor([1e5, -1e5], dtype=torch.float64)
    logps.chosen_logps = logps.ref_chosen_logps + big
    logps.rejected_logps = logps.ref_rejected_logps.clone()
    for loss_type in ("sigmoid", "discopop"):
        losses = pair_losses(logps, spec=_spec_for(loss_type, beta=0.1), num_pairs_global=2, chosen_tokens_global=10)
        torch.testing.assert_close(losses, torch.tensor([0.0, 1e4], dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_all_loss_types_are_covered() -> None:
    assert set(LOSS_TYPES) == {
        "sigmoid", "hinge", "ipo", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard",
        "apo_zero", "apo_down", "discopop", "sigmoid_norm", "sft", "cdpo", "aot", "aot_unpaired",
    }  # fmt: skip


def test_loss_types_differ() -> None:
    # Guards against a dispatcher that silently falls back to one formula for every type.
    logps = _random_logps(8, seed=3)
    seen = {}
    for loss_type in LOSS_TYPES:
        losses = pair_losses(logps, spec=_spec_for(loss_type), num_pairs_global=8, chosen_tokens_global=100)
        seen[loss_type] = tuple(round(v, 9) for v in losses.tolist())
    assert len(set(seen.values())) == len(LOSS_TYPES), seen


# ---------------------------------------------------------------------------
# Gradients


@pytest.mark.parametrize("loss_type", PER_PAIR_TYPES)
def test_gradcheck(loss_type: str) -> None:
    logps = _random_logps(5, seed=11, margin_scale=8.0)
    spec = _spec_for(loss_type, beta=0.3, discopop_tau=0.5)
    if loss_type == "hinge":
        # Keep away from the kink at βΔ = 1, where the derivative jumps.
        margin = spec.beta * (logps.chosen_logps - logps.ref_chosen_logps - logps.rejected_logps + logps.ref_rejected_logps)
        assert (margin - 1).abs().min() > 1e-3

    def fn(chosen: torch.Tensor, rejected: torch.Tensor, nll: torch.Tensor) -> torch.Tensor:
        inputs = dataclasses.replace(logps, chosen_logps=chosen, rejected_logps=rejected, chosen_nll_sum=nll)
        return pair_losses(inputs, spec=spec, num_pairs_global=7, chosen_tokens_global=90)

    args = tuple(
        t.detach().clone().requires_grad_(True)
        for t in (logps.chosen_logps, logps.rejected_logps, logps.chosen_nll_sum)
    )
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-7, rtol=1e-6)


def test_no_gradient_reaches_the_reference() -> None:
    logps = _random_logps(6, seed=12)
    logps.ref_chosen_logps = logps.ref_chosen_logps.clone().requires_grad_(True)
    logps.ref_rejected_logps = logps.ref_rejected_logps.clone().requires_grad_(True)
    logps.chosen_logps = logps.chosen_logps.clone().requires_grad_(True)
    spec = LossSpec(loss_types=("sigmoid", "ipo"), loss_weights=(1.0, 0.5))
    pair_losses(logps, spec=spec, num_pairs_global=6, chosen_tokens_global=60).sum().backward()
    assert logps.chosen_logps.grad is not None and logps.chosen_logps.grad.abs().sum() > 0
    assert logps.ref_chosen_logps.grad is None
    assert logps.ref_rejected_logps.grad is None


# ---------------------------------------------------------------------------
# Combinations and special cases


def test_weighted_combination_is_weighted_sum() -> None:
    logps = _random_logps(10, seed=13)
    kwargs = {"num_pairs_global": 10, "chosen_tokens_global": 123}
    types, weights = ("sigmoid", "bco_pair", "sft"), (0.7, 0.2, 1.3)
    combined = pair_losses(logps, spec=LossSpec(loss_types=types, loss_weights=weights), **kwargs)
    expected = sum(
        w * pair_losses(logps, spec=LossSpec(loss_types=(t,), loss_weights=(1.0,)), **kwargs)
        for t, w in zip(types, weights)
    )
    torch.testing.assert_close(combined, expected, rtol=1e-12, atol=1e-12)
    want = _reference_losses(
        logps, spec=LossSpec(loss_types=types, loss_weights=weights), num_pairs=10, chosen_tokens=123
    )
    torch.testing.assert_close(combined, torch.tensor(want, dtype=torch.float64), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_reference_free_equals_zero_reference(loss_type: str) -> None:
    logps = _random_logps(8, seed=14)
    zero_ref = dataclasses.replace(
        logps,
        ref_chosen_logps=torch.zeros_like(logps.ref_chosen_logps),
        ref_rejected_logps=torch.zeros_like(logps.ref_rejected_logps),
    )
    kwargs = {"num_pairs_global": 8, "chosen_tokens_global": 80}
    free = pair_losses(logps, spec=_spec_for(loss_type, reference_free=True), **kwargs)
    zeroed = pair_losses(zero_ref, spec=_spec_for(loss_type), **kwargs)
    torch.testing.assert_close(free, zeroed, rtol=0, atol=0)
    if loss_type != "sft":
        with_ref = pair_losses(logps, spec=_spec_for(loss_type), **kwargs)
        assert not torch.allclose(free, with_ref)
    free_metrics = finalize_metrics(
        metric_sums(logps, spec=_spec_for(loss_type, reference_free=True), **kwargs), spec=_spec_for(loss_type)
    )
    assert free_metrics["rewards/chosen"] == pytest.approx(0.1 * logps.chosen_logps.mean().item(), rel=1e-12)


@pytest.mark.parametrize("smoothed", ["cdpo", "robust"])
def test_smoothing_zero_equals_sigmoid(smoothed: str) -> None:
    logps = _random_logps(12, seed=15, margin_scale=100.0)
    kwargs = {"num_pairs_global": 12, "chosen_tokens_global": 100}
    sigmoid = pair_losses(logps, spec=LossSpec(loss_types=("sigmoid",)), **kwargs)
    other = pair_losses(logps, spec=LossSpec(loss_types=(smoothed,), label_smoothing=0.0), **kwargs)
    torch.testing.assert_close(other, sigmoid, rtol=1e-14, atol=1e-14)
    smoothed_losses = pair_losses(logps, spec=LossSpec(loss_types=(smoothed,), label_smoothing=0.1), **kwargs)
    assert not torch.allclose(smoothed_losses, sigmoid)


def test_sft_is_global_token_mean_nll() -> None:
    logps = _random_logps(9, seed=16)
    num_tokens = int(logps.chosen_num_tokens.sum())
    losses = pair_losses(logps, spec=LossSpec(loss_types=("sft",)), num_pairs_global=9, chosen_tokens_global=num_tokens)
    assert (losses.sum() / 9).item() == pytest.approx(logps.chosen_nll_sum.sum().item() / num_tokens, rel=1e-12)
    # Without an explicit NLL the chosen log-probs stand in for it.
    implicit = dataclasses.replace(logps, chosen_nll_sum=None)
    losses = pair_losses(implicit, spec=LossSpec(loss_types=("sft",)), num_pairs_global=9, chosen_tokens_global=num_tokens)
    assert (losses.sum() / 9).item() == pytest.approx(-logps.chosen_logps.sum().item() / num_tokens, rel=1e-12)


def test_lower_precision_inputs_are_computed_in_float32() -> None:
    logps = _random_logps(4, seed=17)
    half = PairLogps(
        **{f.name: getattr(logps, f.name).to(torch.bfloat16) for f in dataclasses.fields(logps)
           if getattr(logps, f.name) is not None}
    )
    losses = pair_losses(half, spec=LossSpec(), num_pairs_global=4, chosen_tokens_global=40)
    assert losses.dtype == torch.float32


# ---------------------------------------------------------------------------
# Split invariance (microbatches and data-parallel ranks)

_SPLITS = [[9], [4, 5], [1, 3, 2, 3], [1] * 9]


@pytest.mark.parametrize(
    "spec",
    [
        LossSpec(),
        LossSpec(loss_types=("ipo", "sft"), loss_weights=(1.0, 0.5), beta=0.4),
        LossSpec(loss_types=("exo_pair", "discopop", "sft"), loss_weights=(0.3, 1.0, 2.0), label_smoothing=0.01),
        LossSpec(loss_types=("robust", "apo_down"), loss_weights=(1.0, 1.0), label_smoothing=0.2, reference_free=True),
    ],
    ids=["sigmoid", "ipo+sft", "exo+discopop+sft", "robust+apo_down_ref_free"],
)
def test_split_invariance(spec: LossSpec) -> None:
    num_pairs = 9
    base = _random_logps(num_pairs, seed=18)
    chosen_tokens = int(base.chosen_num_tokens.sum())
    kwargs = {"spec": spec, "num_pairs_global": num_pairs, "chosen_tokens_global": chosen_tokens}

    results = []
    for sizes in _SPLITS:
        logps = _random_logps(num_pairs, seed=18, requires_grad=True)
        total_loss = 0.0
        sums = dict.fromkeys(METRIC_SUM_KEYS, 0.0)
        start = 0
        for size in sizes:
            part = _slice(logps, start, start + size)
            start += size
            loss = pair_losses(part, **kwargs).sum() / num_pairs
            loss.backward()  # gradients accumulate in the leaves, like microbatches and DP all-reduce
            total_loss += loss.item()
            for key, value in metric_sums(part, **kwargs).items():
                sums[key] += value
        grads = (logps.chosen_logps.grad, logps.rejected_logps.grad, logps.chosen_nll_sum.grad)
        results.append((total_loss, grads, finalize_metrics(sums, spec=spec)))

    whole_loss, whole_grads, whole_metrics = results[0]
    for loss, grads, metrics in results[1:]:
        assert loss == pytest.approx(whole_loss, rel=1e-12, abs=1e-12)
        for got, want in zip(grads, whole_grads):
            if want is None:
                assert got is None
            else:
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        assert metrics.keys() == whole_metrics.keys()
        for key in metrics:
            assert metrics[key] == pytest.approx(whole_metrics[key], rel=1e-12, abs=1e-12), key
    # The metric "loss" is the same number the optimiser saw.
    assert whole_metrics["loss"] == pytest.approx(whole_loss, rel=1e-12)


# ---------------------------------------------------------------------------
# Metrics


def test_metrics_match_definitions() -> None:
    logps = _random_logps(7, seed=19)
    # Pair 0 has exactly equal log-ratios, which must count as not accurate (strict inequality).
    logps.ref_rejected_logps[0] = logps.ref_chosen_logps[0]
    logps.rejected_logps[0] = logps.chosen_logps[0]
    spec = LossSpec(loss_types=("sigmoid", "sft"), loss_weights=(1.0, 0.25), beta=0.2)
    num_tokens = int(logps.chosen_num_tokens.sum())
    sums = metric_sums(logps, spec=spec, num_pairs_global=7, chosen_tokens_global=num_tokens)
    assert set(sums) == set(METRIC_SUM_KEYS)
    assert all(isinstance(v, float) for v in sums.values())
    metrics = finalize_metrics(sums, spec=spec)

    c, r = logps.chosen_logps.tolist(), logps.rejected_logps.tolist()
    c0, r0 = logps.ref_chosen_logps.tolist(), logps.ref_rejected_logps.tolist()
    up = [a - b for a, b in zip(c, c0)]
    um = [a - b for a, b in zip(r, r0)]
    losses = _reference_losses(logps, spec=spec, num_pairs=7, chosen_tokens=num_tokens)
    expected = {
        "loss": sum(losses) / 7,
        "rewards/chosen": sum(0.2 * u for u in up) / 7,
        "rewards/rejected": sum(0.2 * u for u in um) / 7,
        "rewards/accuracies": sum(1.0 for a, b in zip(up, um) if a > b) / 7,
        "rewards/margins": sum(0.2 * (a - b) for a, b in zip(up, um)) / 7,
        "logps/chosen": sum(c) / 7,
        "logps/rejected": sum(r) / 7,
        "logits/chosen": logps.chosen_logit_sum.sum().item() / num_tokens,
        "logits/rejected": logps.rejected_logit_sum.sum().item() / logps.rejected_num_tokens.sum().item(),
        "nll_loss": logps.chosen_nll_sum.sum().item() / num_tokens,
    }
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    tie = metric_sums(_slice(logps, 0, 1), spec=spec, num_pairs_global=7, chosen_tokens_global=num_tokens)
    assert tie["accuracy_sum"] == 0.0

    no_sft = finalize_metrics(sums, spec=LossSpec())
    assert "nll_loss" not in no_sft


def test_finalize_rejects_bad_sums() -> None:
    with pytest.raises(ValueError, match="sums: missing keys"):
        finalize_metrics({"num_pairs": 1.0}, spec=LossSpec())
    with pytest.raises(ValueError, match="num_pairs"):
        finalize_metrics(dict.fromkeys(METRIC_SUM_KEYS, 0.0), spec=LossSpec())


# ---------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize(
    "fields, field_name, phrase",
    [
        ({"loss_types": ("dpo",)}, "loss_types", "unknown loss type 'dpo'"),
        ({"loss_types": ()}, "loss_types", "at least one"),
        ({"loss_types": ("sigmoid", "sigmoid"), "loss_weights": (1.0, 1.0)}, "loss_types", "more than once"),
        ({"loss_types": ("sigmoid", "ipo"), "loss_weights": (1.0,)}, "loss_weights", "2"),
        ({"loss_weights": (-1.0,)}, "loss_weights", ">= 0"),
        ({"loss_weights": (float("nan"),)}, "loss_weights", "finite"),
        ({"loss_types": ("sigmoid", "sft"), "loss_weights": (0.0, 0.0)}, "loss_weights", "all weights are 0"),
        ({"beta": 0.0}, "beta", "> 0"),
        ({"beta": -0.1}, "beta", "> 0"),
        ({"loss_types": ("cdpo",), "label_smoothing": -0.1}, "label_smoothing", "[0, 0.5)"),
        ({"loss_types": ("robust",), "label_smoothing": 0.5}, "label_smoothing", "[0, 0.5)"),
        ({"loss_types": ("exo_pair",), "label_smoothing": 0.0}, "label_smoothing", "0.001"),
        ({"loss_types": ("sigmoid",), "label_smoothing": 0.1}, "label_smoothing", "use cdpo"),
        ({"loss_types": ("discopop",), "discopop_tau": 0.0}, "discopop_tau", "> 0"),
    ],
)
def test_validate_errors(fields: dict, field_name: str, phrase: str) -> None:
    spec = LossSpec(**fields)
    with pytest.raises(ValueError) as info:
        spec.validate()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{field_name}:"), message
    assert phrase in message, message
    # The loss refuses the spec too, rather than training something else.
    with pytest.raises(ValueError):
        pair_losses(_random_logps(2, seed=0), spec=spec, num_pairs_global=2, chosen_tokens_global=10)


def test_valid_specs_pass() -> None:
    for loss_type in LOSS_TYPES:
        _spec_for(loss_type).validate()
    LossSpec(loss_types=("sigmoid", "exo_pair"), loss_weights=(1.0, 0.0), label_smoothing=1e-3).validate()


def test_needs_reference() -> None:
    assert LossSpec().needs_reference
    assert not LossSpec(reference_free=True).needs_reference
    # sft alone does not read the reference, but the rewards/* metrics do.
    assert LossSpec(loss_types=("sft",)).needs_reference
    assert not LossSpec(loss_types=("sft",), reference_free=True).needs_reference
    assert LossSpec(loss_types=("sft", "ipo"), loss_weights=(1.0, 1.0)).needs_reference


def test_bad_call_arguments() -> None:
    logps = _random_logps(3, seed=20)
    with pytest.raises(ValueError, match="num_pairs_global"):
        pair_losses(logps, spec=LossSpec(), num_pairs_global=0, chosen_tokens_global=10)
    with pytest.raises(ValueError, match="chosen_tokens_global"):
        pair_losses(logps, spec=LossSpec(), num_pairs_global=3, chosen_tokens_global=0)
    mismatched = dataclasses.replace(logps, rejected_logps=logps.rejected_logps[:2])
    with pytest.raises(ValueError, match="rejected_logps"):
        pair_losses(mismatched, spec=LossSpec(), num_pairs_global=3, chosen_tokens_global=10)


def test_random_seed_helper_is_deterministic() -> None:
    # The split test relies on rebuilding identical inputs from a seed.
    a, b = _random_logps(5, seed=21), _random_logps(5, seed=21)
    for f in dataclasses.fields(a):
        if getattr(a, f.name) is None:
            assert getattr(b, f.name) is None
        else:
            assert torch.equal(getattr(a, f.name), getattr(b, f.name))
