"""Formula parity of the TRL 1.16 loss types and options added to mcore_dpo.objective.loss / logprobs:
aot, aot_unpaired (sorted over the global batch, for any split), f-divergences, WPO weights,
LD-DPO weights, and the reward metrics of reference-free runs.

Each reference below is written here from TRL 1.16's `DPOTrainer._compute_loss` as plain
torch on the whole batch (torch.sort and autograd through it, as TRL does)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from mcore_dpo.objective.logprobs import ld_weights, log_sum_sq_probs
from mcore_dpo.objective.loss import METRIC_SUM_KEYS, PairLogps, batch_sort, finalize_metrics, metric_sums, pair_losses
from mcore_dpo.objective.loss_spec import LossSpec


def _logps(n: int, *, seed: int, scale: float = 5.0) -> PairLogps:
    gen = torch.Generator().manual_seed(seed)
    d = torch.float64
    lc = torch.randint(1, 30, (n,), generator=gen)
    lr = torch.randint(1, 30, (n,), generator=gen)
    c0 = -lc * (0.5 + torch.rand(n, generator=gen, dtype=d))
    r0 = -lr * (0.5 + torch.rand(n, generator=gen, dtype=d))
    return PairLogps(
        chosen_logps=(c0 + scale * torch.randn(n, generator=gen, dtype=d)).requires_grad_(True),
        rejected_logps=(r0 + scale * torch.randn(n, generator=gen, dtype=d)).requires_grad_(True),
        ref_chosen_logps=c0,
        ref_rejected_logps=r0,
        chosen_num_tokens=lc,
        rejected_num_tokens=lr,
        chosen_logit_sum=torch.randn(n, generator=gen, dtype=d),
        rejected_logit_sum=torch.randn(n, generator=gen, dtype=d),
        chosen_wpo_log_weight=-torch.rand(n, generator=gen, dtype=d),
        rejected_wpo_log_weight=-torch.rand(n, generator=gen, dtype=d),
    )


def _fresh(logps: PairLogps) -> PairLogps:
    return dataclasses.replace(
        logps,
        chosen_logps=logps.chosen_logps.detach().clone().requires_grad_(True),
        rejected_logps=logps.rejected_logps.detach().clone().requires_grad_(True),
    )


# ----------------------------------------------------------------------------- aot


def _trl_aot(c, r, c0, r0, *, beta: float, eps: float, unpaired: bool) -> torch.Tensor:
    """TRL 1.16 aot / aot_unpaired on one batch: mean over sorted positions."""
    if unpaired:
        delta = torch.sort(c - c0, dim=0)[0] - torch.sort(r - r0, dim=0)[0]
    else:
        delta = torch.sort(c - r, dim=0)[0] - torch.sort(c0 - r0, dim=0)[0]
    return (-F.logsigmoid(beta * delta) * (1 - eps) - F.logsigmoid(-beta * delta) * eps).mean()


@pytest.mark.parametrize("loss_type", ["aot", "aot_unpaired"])
@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_aot_whole_batch_matches_trl(loss_type: str, eps: float) -> None:
    logps = _logps(11, seed=1)
    spec = LossSpec(loss_types=(loss_type,), beta=0.3, label_smoothing=eps)
    ours = pair_losses(logps, spec=spec, num_pairs_global=11, chosen_tokens_global=50).sum() / 11
    ours.backward()
    ref = _fresh(logps)
    want = _trl_aot(ref.chosen_logps, ref.rejected_logps, ref.ref_chosen_logps, ref.ref_rejected_logps,
                    beta=0.3, eps=eps, unpaired=loss_type == "aot_unpaired")
    want.backward()
    assert ours.item() == pytest.approx(want.item(), rel=1e-12)
    torch.testing.assert_close(logps.chosen_logps.grad, ref.chosen_logps.grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(logps.rejected_logps.grad, ref.rejected_logps.grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("loss_type", ["aot", "aot_unpaired"])
def test_aot_is_split_independent(loss_type: str) -> None:
    """Microbatches and dp ranks hold arbitrary subsets of the global batch; with the BatchSort
    of the whole batch the summed loss, gradients and metrics equal the whole-batch ones."""
    n = 12
    whole = _logps(n, seed=2)
    spec = LossSpec(loss_types=(loss_type, "sigmoid"), loss_weights=(1.0, 0.5), beta=0.2, label_smoothing=0.1)
    kwargs = {"spec": spec, "num_pairs_global": n, "chosen_tokens_global": 80}
    want = _trl_aot(whole.chosen_logps, whole.rejected_logps, whole.ref_chosen_logps, whole.ref_rejected_logps,
                    beta=0.2, eps=0.1, unpaired=loss_type == "aot_unpaired")
    want = want + 0.5 * (-F.logsigmoid(0.2 * ((whole.chosen_logps - whole.ref_chosen_logps)
                                              - (whole.rejected_logps - whole.ref_rejected_logps)))).mean()
    want.backward()
    whole_metrics = finalize_metrics(metric_sums(_fresh(whole), **kwargs), spec=spec)
    # Two "dp ranks" of three microbatches each, in a scrambled order of positions.
    order = torch.randperm(n, generator=torch.Generator().manual_seed(3))
    for split in ([order[:2], order[2:6], order[6:7], order[7:]], [order]):
        logps = _fresh(whole)
        sort = batch_sort(logps, spec=spec)
        total = 0.0
        sums = dict.fromkeys(METRIC_SUM_KEYS, 0.0)
        for idx in split:
            part = PairLogps(**{f.name: (None if getattr(logps, f.name) is None else getattr(logps, f.name)[idx])
                                for f in dataclasses.fields(logps)})
            part.pair_index = idx
            loss = pair_losses(part, sort=sort, **kwargs).sum() / n
            loss.backward()
            total += loss.item()
            for key, value in metric_sums(part, sort=sort, **kwargs).items():
                sums[key] += value
        assert total == pytest.approx(want.item(), rel=1e-12)
        torch.testing.assert_close(logps.chosen_logps.grad, whole.chosen_logps.grad, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(logps.rejected_logps.grad, whole.rejected_logps.grad, rtol=1e-12, atol=1e-15)
        metrics = finalize_metrics(sums, spec=spec)
        for key, value in whole_metrics.items():
            assert metrics[key] == pytest.approx(value, rel=1e-12, abs=1e-14), key


def test_aot_ties_break_by_batch_position() -> None:
    # Equal log-ratios: the stable sort gives the earlier pair the lower rank, for any split.
    logps = _logps(4, seed=4)
    with torch.no_grad():
        logps.chosen_logps[2] = logps.chosen_logps[0] + 0.0
        logps.rejected_logps[2] = logps.rejected_logps[0] + 0.0
    sort = batch_sort(logps, spec=LossSpec(loss_types=("aot",)))
    assert sort.logratio_rank[0] + 1 == sort.logratio_rank[2]


def test_aot_without_sort_refuses_a_microbatch() -> None:
    logps = _logps(4, seed=5)
    with pytest.raises(ValueError, match="sort: aot"):
        pair_losses(logps, spec=LossSpec(loss_types=("aot",)), num_pairs_global=8, chosen_tokens_global=10)


def test_aot_with_one_pair_is_cdpo() -> None:
    logps = _logps(1, seed=6)
    kwargs = {"num_pairs_global": 1, "chosen_tokens_global": 5}
    aot = pair_losses(logps, spec=LossSpec(loss_types=("aot",), label_smoothing=0.1), **kwargs)
    cdpo = pair_losses(logps, spec=LossSpec(loss_types=("cdpo",), label_smoothing=0.1), **kwargs)
    torch.testing.assert_close(aot, cdpo, rtol=1e-14, atol=0)


# ----------------------------------------------------------------------------- f-divergence


def _score(u: torch.Tensor, kind: str, alpha: float) -> torch.Tensor:
    if kind == "reverse_kl" or (kind == "alpha_divergence" and abs(alpha - 1) < 1e-6):
        return u
    if kind == "forward_kl":
        return 1 - torch.exp(-u)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(u)
    return (torch.exp(torch.clamp((alpha - 1) * u, max=80.0)) - 1) / (alpha - 1)


def _trl_f_loss(logps: PairLogps, loss_type: str, kind: str, *, beta: float, alpha: float, eps: float) -> torch.Tensor:
    sc = _score(logps.chosen_logps - logps.ref_chosen_logps, kind, alpha)
    sr = _score(logps.rejected_logps - logps.ref_rejected_logps, kind, alpha)
    z = beta * (sc - sr)
    lc, lr = logps.chosen_num_tokens.double(), logps.rejected_num_tokens.double()
    if loss_type == "sigmoid":
        return -F.logsigmoid(z)
    if loss_type == "hinge":
        return torch.relu(1 - z)
    if loss_type == "ipo":
        return (sc / lc - sr / lr - 1 / (2 * beta)) ** 2
    if loss_type == "sigmoid_norm":
        return -F.logsigmoid(beta * (sc / lc - sr / lr))
    if loss_type == "robust":
        return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    if loss_type == "exo_pair":
        return torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps)) + torch.sigmoid(-z) * (
            F.logsigmoid(-z) - math.log(eps))
    if loss_type == "discopop":
        g = torch.sigmoid(z / 0.05)
        return -F.logsigmoid(z) * (1 - g) + torch.exp(-z) * g
    raise AssertionError(loss_type)


@pytest.mark.parametrize("kind, alpha", [("forward_kl", 0.5), ("js_divergence", 0.5), ("alpha_divergence", 0.3),
                                         ("alpha_divergence", 1.7), ("alpha_divergence", 1.0)])
@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "sigmoid_norm", "robust", "exo_pair", "discopop"])
def test_f_divergence_matches_trl(kind: str, alpha: float, loss_type: str) -> None:
    logps = _logps(9, seed=7, scale=1.0)
    eps = {"robust": 0.2, "exo_pair": 0.01}.get(loss_type, 0.0)
    spec = LossSpec(loss_types=(loss_type,), beta=0.4, label_smoothing=eps, f_divergence_type=kind,
                    f_alpha_divergence_coef=alpha)
    ours = pair_losses(logps, spec=spec, num_pairs_global=9, chosen_tokens_global=40)
    ours.sum().backward()
    ref = _fresh(logps)
    want = _trl_f_loss(ref, loss_type, kind, beta=0.4, alpha=alpha, eps=eps)
    want.sum().backward()
    torch.testing.assert_close(ours, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(logps.chosen_logps.grad, ref.chosen_logps.grad, rtol=1e-10, atol=1e-14)
    if kind != "reverse_kl" and not (kind == "alpha_divergence" and alpha == 1.0):
        plain = pair_losses(_fresh(logps), spec=dataclasses.replace(spec, f_divergence_type="reverse_kl"),
                            num_pairs_global=9, chosen_tokens_global=40)
        assert not torch.allclose(ours, plain)


def test_alpha_divergence_clamp_and_rewards() -> None:
    logps = _logps(3, seed=8)
    with torch.no_grad():
        logps.chosen_logps[0] = logps.ref_chosen_logps[0] - 500.0  # (α-1)u = 250 > 80: clamped
    spec = LossSpec(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.5)
    losses = pair_losses(logps, spec=spec, num_pairs_global=3, chosen_tokens_global=9)
    assert torch.isfinite(losses).all()
    # The reward metrics stay β·u, whatever the f-divergence (as TRL 1.16 logs them).
    metrics = finalize_metrics(metric_sums(logps, spec=spec, num_pairs_global=3, chosen_tokens_global=9), spec=spec)
    u = (logps.chosen_logps - logps.ref_chosen_logps).detach()
    assert metrics["rewards/chosen"] == pytest.approx(0.1 * u.mean().item(), rel=1e-12)


@pytest.mark.parametrize("loss_type", ["nca_pair", "bco_pair", "sppo_hard", "aot", "aot_unpaired", "apo_zero",
                                       "apo_down"])
def test_f_divergence_refused_where_undefined(loss_type: str) -> None:
    with pytest.raises(ValueError, match=f"^f_divergence_type: js_divergence is not defined for {loss_type}"):
        LossSpec(loss_types=(loss_type,), f_divergence_type="js_divergence").validate()
    with pytest.raises(ValueError, match="^f_divergence_type: unknown 'kl'"):
        LossSpec(f_divergence_type="kl").validate()


# ----------------------------------------------------------------------------- WPO


@pytest.mark.parametrize("types", [("sigmoid",), ("ipo", "hinge"), ("robust", "apo_zero")])
def test_wpo_weights_multiply_each_loss(types: tuple[str, ...]) -> None:
    logps = _logps(7, seed=9, scale=1.0)
    weights = tuple(0.5 + i for i in range(len(types)))
    eps = 0.1 if "robust" in types else 0.0
    base = LossSpec(loss_types=types, loss_weights=weights, label_smoothing=eps, beta=0.5)
    weighted = dataclasses.replace(base, use_weighting=True)
    ours = pair_losses(logps, spec=weighted, num_pairs_global=7, chosen_tokens_global=30)
    ours.sum().backward()
    ref = _fresh(logps)
    w = torch.exp(ref.chosen_wpo_log_weight) * torch.exp(ref.rejected_wpo_log_weight)
    want = sum(wt * pair_losses(ref, spec=dataclasses.replace(base, loss_types=(t,), loss_weights=(1.0,),
                                                             label_smoothing=eps if t == "robust" else 0.0),
                                num_pairs_global=7, chosen_tokens_global=30) * w
               for t, wt in zip(types, weights))
    want.sum().backward()  # the weights are constants: the gradient is the weighted one
    torch.testing.assert_close(ours, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(logps.chosen_logps.grad, ref.chosen_logps.grad, rtol=1e-12, atol=1e-14)


def test_wpo_refusals() -> None:
    for types in (("aot",), ("sigmoid", "sft")):
        with pytest.raises(ValueError, match="^use_weighting: not defined for"):
            LossSpec(loss_types=types, loss_weights=(1.0,) * len(types), use_weighting=True).validate()
    missing = dataclasses.replace(_logps(2, seed=10), chosen_wpo_log_weight=None)
    with pytest.raises(ValueError, match="wpo_log_weight"):
        pair_losses(missing, spec=LossSpec(use_weighting=True), num_pairs_global=2, chosen_tokens_global=4)


def test_log_sum_sq_probs_and_padded_vocabulary() -> None:
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(2, 5, 13, generator=gen)
    got = log_sum_sq_probs(logits, vocab_size=10, tp_rank=0, tp_group=None)  # 3 padded columns
    p = torch.softmax(logits[..., :10].double(), -1)
    torch.testing.assert_close(got.double(), torch.log((p * p).sum(-1)), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- LD-DPO


def test_ld_weights_match_trl() -> None:
    # Two pairs: rows [chosen0, chosen1, rejected0, rejected1]; prompt then completion then padding.
    mask = torch.tensor([
        [0, 0, 1, 1, 1, 1, 0],   # chosen0: 4 tokens
        [0, 1, 1, 0, 0, 0, 0],   # chosen1: 2 tokens
        [0, 0, 1, 1, 0, 0, 0],   # rejected0: 2 tokens -> shared 2
        [0, 1, 1, 1, 1, 1, 0],   # rejected1: 5 tokens -> shared 2
    ])
    a = 0.3
    got = ld_weights(mask, ld_alpha=a)
    # TRL 1.16: comp_pos = cumsum(mask); shared = 1 <= pos <= min(L+, L-); tail = pos > min(L+, L-).
    pos = mask.cumsum(1)
    shared = torch.tensor([2, 2, 2, 2]).unsqueeze(1)
    want = ((pos > 0) & (pos <= shared)).float() + a * (pos > shared).float()
    torch.testing.assert_close(got, want * mask)  # TRL's per-token log-probs are 0 off the completion
    assert torch.equal(ld_weights(mask, ld_alpha=1.0), mask.float())
    with pytest.raises(ValueError, match="loss_mask"):
        ld_weights(mask[:3], ld_alpha=a)


# ----------------------------------------------------------------------------- metrics


def test_reference_free_logs_no_rewards() -> None:
    logps = _logps(4, seed=12)
    spec = LossSpec(reference_free=True)
    metrics = finalize_metrics(metric_sums(logps, spec=spec, num_pairs_global=4, chosen_tokens_global=9), spec=spec)
    assert not [k for k in metrics if k.startswith("rewards/")]
    assert {"loss", "logps/chosen", "logps/rejected", "logits/chosen"} <= metrics.keys()
