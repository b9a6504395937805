"""Tests for mcore_dpo.objective.kto against TRL 1.16's own code: `KTOTrainer._compute_loss`
(on a stand-in trainer and a stand-in model whose log-probs are set per sample), for the loss,
its gradient, the KL estimate and the logged metrics; `unpair_preference_dataset` and
`KTOTrainer._prepare_dataset` for the unpaired order and the KL completions."""
from __future__ import annotations

import types
import zlib
from collections import defaultdict

import pytest
import torch

from mcore_dpo.objective.kto import (
    KTO_LOSS_TYPES,
    METRIC_SUM_KEYS,
    KtoSpec,
    SampleLogps,
    finalize_metrics,
    kl_columns,
    kl_completion_index,
    kl_estimate,
    kl_logratios,
    metric_sum_vector,
    metric_sums,
    sample_losses,
    unpair,
)

RTOL, ATOL = 1e-6, 1e-7
PROMPT_LEN = 3
COMPLETION_TOKEN = 100  # sample i's completion tokens are COMPLETION_TOKEN + i

LABEL_MIXES = {
    "mixed": [True, False, True, True, False, False],
    "all_desirable": [True] * 6,
    "all_undesirable": [False] * 6,
}
WEIGHTS = [(1.0, 1.0), (1.33, 0.75), (0.0, 2.0)]


# --------------------------------------------------------------------------- TRL 1.16 on stand-ins


def _trl_step(spec: KtoSpec, *, logps, ref_logps, kl_logps, ref_kl_logps, labels, lengths, mean_logits):
    """One call of TRL 1.16's `KTOTrainer._compute_loss` on one process, reference log-probs
    precomputed. Returns (loss, d loss / d logps, logged metrics, the collated batch)."""
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference, KTOTrainer

    n = len(labels)
    needs_kl = spec.loss_type != "apo_zero_unpaired"
    completions = [[COMPLETION_TOKEN + i] * lengths[i] for i in range(n)]
    kl_completions = [completions[-1]] + completions[:-1]
    examples = []
    for i in range(n):
        example = {"prompt_ids": [i, 5, 6], "completion_ids": completions[i], "label": labels[i],
                   "ref_logps": float(ref_logps[i])}
        if needs_kl:
            example["KL_completion_ids"] = kl_completions[i]
            example["ref_KL_logps"] = float(ref_kl_logps[i])
        examples.append(example)
    batch = DataCollatorForUnpairedPreference(pad_token_id=0)(examples)

    leaf = logps.clone().requires_grad_(True)

    def model(*, input_ids, attention_mask, labels, fused_lm_head, use_cache=False):
        # The sample is told by the prompt's first token, main or KL sequence by the completion's owner.
        sample = input_ids[:, 0]
        main = input_ids[:, PROMPT_LEN] - COMPLETION_TOKEN == sample
        values = torch.where(main, leaf[sample], kl_logps[sample])
        rows, width = input_ids.shape
        log_probs = torch.cat([values[:, None], torch.zeros(rows, width - 2)], dim=1)
        return types.SimpleNamespace(log_probs=log_probs, entropy=torch.zeros(rows, width - 1),
                                     mean_logits=mean_logits[sample, : width - 1])

    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x),
        calculate_KL=needs_kl, aux_loss_enabled=False, precompute_ref_logps=True,
        beta=spec.beta, loss_type=spec.loss_type,
        desirable_weight=spec.desirable_weight, undesirable_weight=spec.undesirable_weight,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
    )
    trainer._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, trainer)
    loss = KTOTrainer._compute_loss(trainer, model, batch, False)
    loss.backward()
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    return loss.detach(), leaf.grad, metrics, batch


def _case(labels, *, kl_shift: float, seed: int):
    gen = torch.Generator().manual_seed(seed)
    n = len(labels)
    lengths = [1 + int(x) for x in torch.randint(0, 4, (n,), generator=gen)]
    return dict(
        logps=-3.0 * torch.rand(n, generator=gen) - 1.0,
        ref_logps=-3.0 * torch.rand(n, generator=gen) - 1.0,
        kl_logps=-3.0 * torch.rand(n, generator=gen) - 1.0 + kl_shift,
        ref_kl_logps=-3.0 * torch.rand(n, generator=gen) - 1.0,
        labels=list(labels),
        lengths=lengths,
        mean_logits=torch.randn(n, PROMPT_LEN + 5, generator=gen),
    )


def _ours(spec: KtoSpec, case, batch, *, splits):
    """The engine's side: KL columns and metric sums added over microbatches `splits` (lists of
    sample positions), the loss over the global N. Returns (loss, gradient, metrics, kl)."""
    n = len(case["labels"])
    shift_mask = batch["completion_mask"][:, 1:].to(torch.float32)
    num_tokens = shift_mask.sum(1)
    logit_sum = (case["mean_logits"][:, : shift_mask.shape[1]] * shift_mask).sum(1)
    kl = None
    if spec.needs_kl:
        columns = sum(kl_columns(case["kl_logps"][idx], case["ref_kl_logps"][idx]) for idx in splits)
        kl = kl_estimate(columns[0], columns[1])
    leaf = case["logps"].clone().requires_grad_(True)
    label = torch.tensor(case["labels"])
    total, sums = None, torch.zeros(len(METRIC_SUM_KEYS), dtype=torch.float64)
    for idx in splits:
        mb = SampleLogps(logps=leaf[idx], ref_logps=case["ref_logps"][idx], label=label[idx],
                         num_tokens=num_tokens[idx], logit_sum=logit_sum[idx])
        part = sample_losses(mb, spec=spec, kl=kl).sum() / n
        total = part if total is None else total + part
        sums += metric_sum_vector(mb, spec=spec, kl=kl)
    total.backward()
    metrics = finalize_metrics(dict(zip(METRIC_SUM_KEYS, sums.tolist())), spec=spec)
    return total.detach(), leaf.grad, metrics, kl


SPLITS = [[0, 1], [2, 3, 4, 5]]  # two microbatches of unequal sizes


@pytest.mark.parametrize("loss_type", KTO_LOSS_TYPES)
@pytest.mark.parametrize("weights", WEIGHTS, ids=lambda w: f"w{w[0]}-{w[1]}")
@pytest.mark.parametrize("mix", list(LABEL_MIXES))
@pytest.mark.parametrize("kl_shift", [2.0, -2.0], ids=["kl_positive", "kl_clamped"])
def test_loss_gradient_and_metrics_match_trl(loss_type, weights, mix, kl_shift):
    spec = KtoSpec(loss_type=loss_type, beta=0.7, desirable_weight=weights[0], undesirable_weight=weights[1])
    seed = zlib.crc32(repr((loss_type, weights, mix, kl_shift)).encode())
    case = _case(LABEL_MIXES[mix], kl_shift=kl_shift, seed=seed)
    trl_loss, trl_grad, trl_metrics, batch = _trl_step(spec, **case)
    loss, grad, metrics, kl = _ours(spec, case, batch, splits=SPLITS)

    torch.testing.assert_close(loss, trl_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad, trl_grad, rtol=RTOL, atol=ATOL)
    # Every metric TRL 1.16 logs from the loss; entropy and num_tokens are not this module's.
    expected = {key: value for key, value in trl_metrics.items() if key not in ("entropy", "num_tokens")}
    expected["loss"] = trl_loss.item()
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=RTOL, abs=ATOL), key
    if spec.needs_kl:
        assert float(kl) == pytest.approx(trl_metrics["kl"], rel=RTOL, abs=ATOL)
        assert (float(kl) > 0) == (kl_shift > 0)  # both branches of the clamp are exercised
    else:
        assert metrics["kl"] == 0.0


@pytest.mark.parametrize("loss_type", KTO_LOSS_TYPES)
def test_rewards_are_beta_logratios_and_denominator_is_the_plain_count(loss_type):
    # Hand-written: with the weights 3 and 0.5 a weighted denominator would give another loss.
    spec = KtoSpec(loss_type=loss_type, beta=0.5, desirable_weight=3.0, undesirable_weight=0.5)
    logps = SampleLogps(logps=torch.tensor([-1.0, -2.0, -4.0]), ref_logps=torch.tensor([-2.0, -2.5, -3.0]),
                        label=torch.tensor([True, True, False]))
    kl = torch.tensor(0.25)
    u = torch.tensor([1.0, 0.5, -1.0])
    if loss_type == "kto":
        per = torch.cat([3.0 * (1 - torch.sigmoid(0.5 * (u[:2] - 0.25))),
                         0.5 * (1 - torch.sigmoid(0.5 * (0.25 - u[2:])))])
    else:
        per = torch.cat([3.0 * (1 - torch.sigmoid(0.5 * u[:2])), 0.5 * torch.sigmoid(0.5 * u[2:])])
    torch.testing.assert_close(sample_losses(logps, spec=spec, kl=kl), per)
    metrics = finalize_metrics(metric_sums(logps, spec=spec, kl=kl), spec=spec)
    assert metrics["loss"] == pytest.approx(per.sum().item() / 3)
    assert metrics["rewards/chosen"] == pytest.approx(0.5 * 0.75)
    assert metrics["rewards/rejected"] == pytest.approx(-0.5)
    assert metrics["rewards/margins"] == pytest.approx(0.375 + 0.5)
    assert metrics["logps/chosen"] == pytest.approx(-1.5)
    assert metrics["logps/rejected"] == pytest.approx(-4.0)
    assert metrics["kl"] == (0.25 if loss_type == "kto" else 0.0)
    assert "logits/chosen" not in metrics  # no token counts given


def test_two_microbatches_add_up_to_one():
    spec = KtoSpec(beta=0.3, desirable_weight=1.2, undesirable_weight=0.8)
    gen = torch.Generator().manual_seed(3)
    n = 7
    whole = SampleLogps(logps=torch.randn(n, generator=gen) - 5, ref_logps=torch.randn(n, generator=gen) - 5,
                        label=torch.tensor([True, False, False, True, True, False, True]),
                        num_tokens=torch.randint(1, 9, (n,), generator=gen), logit_sum=torch.randn(n, generator=gen))
    kl = kl_estimate(*kl_columns(torch.randn(n, generator=gen) + 1, torch.randn(n, generator=gen)))
    parts = [slice(0, 3), slice(3, n)]
    split = sum(metric_sum_vector(SampleLogps(**{k: getattr(whole, k)[p] for k in
                                                 ("logps", "ref_logps", "label", "num_tokens", "logit_sum")}),
                                  spec=spec, kl=kl) for p in parts)
    one = metric_sum_vector(whole, spec=spec, kl=kl)
    assert one.dtype == torch.float64
    torch.testing.assert_close(split, one)
    a = finalize_metrics(dict(zip(METRIC_SUM_KEYS, split.tolist())), spec=spec)
    b = finalize_metrics(dict(zip(METRIC_SUM_KEYS, one.tolist())), spec=spec)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == pytest.approx(b[key], rel=1e-12), key
    assert a["logits/chosen"] == pytest.approx(
        whole.logit_sum[whole.label].sum().item() / whole.num_tokens[whole.label].sum().item())


def test_kl_estimate_is_the_clamped_detached_mean():
    q = torch.tensor([-1.0, -2.0, -3.0, -4.0], requires_grad=True)
    q0 = torch.tensor([-2.0, -2.0, -2.0, -2.0])
    ratios = kl_logratios(q, q0)
    assert not ratios.requires_grad
    torch.testing.assert_close(ratios, torch.tensor([1.0, 0.0, -1.0, -2.0]))
    columns = kl_columns(q[:1], q0[:1]) + kl_columns(q[1:], q0[1:])
    assert columns.dtype == torch.float64 and columns.tolist() == [-2.0, 4.0]
    assert float(kl_estimate(columns[0], columns[1])) == 0.0  # mean -0.5, clamped
    assert float(kl_estimate(3.0, 4)) == 0.75
    assert kl_estimate(torch.tensor(1.0, requires_grad=True), 2).requires_grad is False
    with pytest.raises(ValueError, match=r"^count:"):
        kl_estimate(1.0, 0)


def test_apo_zero_unpaired_reads_no_kl_and_kto_needs_it():
    logps = SampleLogps(logps=torch.tensor([-1.0, -2.0]), ref_logps=torch.tensor([-1.5, -1.0]),
                        label=torch.tensor([True, False]))
    apo = KtoSpec(loss_type="apo_zero_unpaired")
    assert not apo.needs_kl and KtoSpec().needs_kl
    torch.testing.assert_close(sample_losses(logps, spec=apo), sample_losses(logps, spec=apo, kl=torch.tensor(9.0)))
    with pytest.raises(ValueError, match=r"^kl:"):
        sample_losses(logps, spec=KtoSpec())
    # The KL term moves the kto loss and carries no gradient.
    low = sample_losses(logps, spec=KtoSpec(), kl=torch.tensor(0.0))
    high = sample_losses(logps, spec=KtoSpec(), kl=torch.tensor(2.0, requires_grad=True))
    assert high[0] > low[0] and high[1] < low[1]
    assert not high.requires_grad


def test_half_inputs_are_computed_in_float32():
    logps = SampleLogps(logps=torch.tensor([-1.0, -2.0], dtype=torch.bfloat16),
                        ref_logps=torch.tensor([-1.5, -1.0], dtype=torch.bfloat16), label=torch.tensor([True, False]))
    assert sample_losses(logps, spec=KtoSpec(), kl=torch.tensor(0.1)).dtype == torch.float32


def test_bad_inputs_are_refused_by_name():
    good = dict(logps=torch.zeros(3), ref_logps=torch.zeros(3), label=torch.tensor([True, False, True]))
    with pytest.raises(ValueError, match=r"^ref_logps:"):
        sample_losses(SampleLogps(**{**good, "ref_logps": torch.zeros(2)}), spec=KtoSpec(), kl=torch.tensor(0.0))
    with pytest.raises(ValueError, match=r"^label:"):
        sample_losses(SampleLogps(**{**good, "label": torch.ones(3)}), spec=KtoSpec(), kl=torch.tensor(0.0))
    with pytest.raises(ValueError, match=r"^sums:"):
        finalize_metrics({}, spec=KtoSpec())


@pytest.mark.parametrize("field,kwargs", [
    ("loss_type", {"loss_type": "sigmoid"}),
    ("loss_type", {"loss_type": "bco"}),
    ("beta", {"beta": 0.0}),
    ("beta", {"beta": float("nan")}),
    ("desirable_weight", {"desirable_weight": -1.0}),
    ("undesirable_weight", {"undesirable_weight": float("inf")}),
    ("desirable_weight", {"desirable_weight": 0.0, "undesirable_weight": 0.0}),
])
def test_validate_names_the_field(field, kwargs):
    with pytest.raises(ValueError, match=rf"^{field}:") as info:
        KtoSpec(**kwargs).validate()
    assert "\n" not in str(info.value)


def test_defaults_are_trl_defaults():
    from trl import KTOConfig

    fields = KTOConfig.__dataclass_fields__
    spec = KtoSpec()
    spec.validate()
    for name in ("loss_type", "beta", "desirable_weight", "undesirable_weight"):
        assert getattr(spec, name) == fields[name].default, name
    assert KTO_LOSS_TYPES == tuple(fields["loss_type"].metadata["choices"])


# --------------------------------------------------------------------------- data conventions


@pytest.fixture(scope="module")
def quiet_datasets():
    import datasets

    datasets.disable_progress_bars()
    yield datasets
    datasets.enable_progress_bars()


def _paired(n: int) -> list[dict]:
    return [{"prompt": f"Question {i}?", "chosen": f" good answer {i}", "rejected": f" bad {i}",
             "source": f"s{i % 3}"} for i in range(n)]


@pytest.mark.parametrize("n,chunk_size", [(5, None), (5, 2), (1003, None)])
def test_unpair_matches_trl(quiet_datasets, n, chunk_size):
    from trl.data_utils import unpair_preference_dataset

    rows = _paired(n)
    dataset = quiet_datasets.Dataset.from_list(rows)
    kwargs = {} if chunk_size is None else {"batch_size": chunk_size}
    expected = unpair_preference_dataset(dataset, **kwargs).to_list()
    ours = unpair(rows) if chunk_size is None else unpair(rows, chunk_size=chunk_size)
    assert ours == expected
    if n == 1003:  # one chunk of 1000, then one of 3
        assert [r["label"] for r in ours[1998:2003]] == [False, False, True, True, True]


def test_unpair_refuses_a_row_without_its_pair():
    with pytest.raises(ValueError, match=r"^rows\[1\]:"):
        unpair([{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b"}])
    with pytest.raises(ValueError, match=r"^chunk_size:"):
        unpair([], chunk_size=0)


def test_kl_completion_index_rotates_each_chunk_by_one():
    assert kl_completion_index(4, batch_size=4) == [3, 0, 1, 2]
    assert kl_completion_index(5, batch_size=2) == [1, 0, 3, 2, 4]  # a last chunk of one keeps its own
    assert kl_completion_index(7, batch_size=3) == [2, 0, 1, 5, 3, 4, 6]
    assert kl_completion_index(0, batch_size=2) == []
    with pytest.raises(ValueError, match=r"^batch_size:"):
        kl_completion_index(4, batch_size=1)
    with pytest.raises(ValueError, match=r"^num_samples:"):
        kl_completion_index(-1, batch_size=2)


@pytest.mark.parametrize("pairs,batch_size", [(5, 4), (5, 3), (4, 8)])
def test_unpaired_order_and_kl_completions_match_trl_prepare_dataset(quiet_datasets, pairs, batch_size):
    """TRL 1.16's whole preparation of a paired text dataset (unpairing, EOS, tokenizing, KL
    completions in chunks of per_device_train_batch_size) against unpair + kl_completion_index."""
    from transformers import AutoTokenizer
    from trl.trainer.kto_trainer import KTOTrainer

    from mcore_dpo.driver.defaults import DEFAULT_TOKENIZER_DIR

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER_DIR)
    rows = _paired(pairs)
    trainer = types.SimpleNamespace(calculate_KL=True, _tokenizer=tokenizer, desirable_weight=1.0,
                                    undesirable_weight=1.0)
    args = types.SimpleNamespace(dataset_num_proc=None, max_length=1024, per_device_train_batch_size=batch_size)
    prepared = KTOTrainer._prepare_dataset(trainer, quiet_datasets.Dataset.from_list(rows), tokenizer, args,
                                           "train").to_list()

    ours = unpair(rows)
    assert len(prepared) == len(ours) == 2 * pairs
    for mine, theirs in zip(ours, prepared):
        assert (mine["prompt"], mine["completion"] + tokenizer.eos_token, mine["label"]) == (
            theirs["prompt"], theirs["completion"], theirs["label"])
    index = kl_completion_index(len(prepared), batch_size=batch_size)
    assert [row["KL_completion_ids"] for row in prepared] == [prepared[j]["completion_ids"] for j in index]
    # The rotation is per chunk: over the whole dataset as one chunk the pairing would differ.
    if batch_size < len(prepared):
        whole = kl_completion_index(len(prepared), batch_size=len(prepared))
        assert [prepared[j]["completion_ids"] for j in whole] != [row["KL_completion_ids"] for row in prepared]


# --------------------------------------------------------------------------- the token store's side (data/unpaired.py)


@pytest.mark.parametrize("n,batch_size", [(4, 4), (5, 2), (7, 3), (16, 2)])
def test_the_stores_kl_partner_is_kl_completion_index(n, batch_size):
    from mcore_dpo.data.unpaired import kl_partner

    assert [kl_partner(i, num_samples=n, kl_batch_size=batch_size) for i in range(n)] == \
        kl_completion_index(n, batch_size=batch_size)


def test_the_stores_row_stream_unpairs_as_unpair():
    from mcore_dpo.data.sources import _BadRow
    from mcore_dpo.data.unpaired import unpaired_rows

    rows = _paired(7)
    streamed = list(unpaired_rows(enumerate(rows, start=1), chunk_size=3))
    assert [row for _, row in streamed] == unpair(rows, chunk_size=3)
    assert [line for line, _ in streamed][:6] == [1, 2, 3, 1, 2, 3]  # each unpaired row keeps its line
    unpaired = [{"prompt": "a", "completion": "b", "label": True}]
    assert list(unpaired_rows([(1, unpaired[0])])) == [(1, unpaired[0])]  # unpaired rows pass as they are
    bad = list(unpaired_rows([(1, rows[0]), (2, {"prompt": "a", "chosen": "b"})]))
    assert isinstance(bad[0][1], _BadRow) and "missing key 'rejected'" in str(bad[0][1]) and bad[0][0] == 2
