"""The objective contract (objective/contract.py): DPO on it equals the loss functions it wraps,
runs its loss once per microbatch, gives the same loss and metrics for any split of the batch
(with aot's whole-batch pass), reference tables hold one column per sequence, and the executor's
context is written by its constructor and the executor only."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mcore_dpo.objective import dpo, loss, registry
from mcore_dpo.objective.contract import BatchTotals
from mcore_dpo.objective.logprobs import SequenceLogps, pair_logps, table_rows
from mcore_dpo.objective.loss_spec import LossSpec
from mcore_dpo.objective.step_loss import StepLoss
from mcore_dpo.rank.metrics import whole_batch_prepass

SPECS = {
    "sigmoid": LossSpec(),
    "ipo+sft": LossSpec(loss_types=("ipo", "sft"), loss_weights=(1.0, 0.5)),
    "reference_free": LossSpec(loss_types=("sigmoid_norm",), reference_free=True),
    "aot": LossSpec(loss_types=("aot", "sigmoid"), loss_weights=(1.0, 0.3), label_smoothing=0.1),
    "aot_unpaired": LossSpec(loss_types=("aot_unpaired",)),
}


def _rows(n: int, *, seed: int) -> tuple[SequenceLogps, torch.Tensor]:
    """Policy sums of n pairs as a microbatch's rows (chosen rows, then rejected), and the reference's."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 20, (2 * n,), generator=gen)
    reference = -tokens * (0.5 + torch.rand(2 * n, generator=gen))
    policy = (reference + 3 * torch.randn(2 * n, generator=gen)).requires_grad_(True)
    return SequenceLogps(logp_sum=policy, num_tokens=tokens, logit_sum=torch.randn(2 * n, generator=gen)), reference


def _mesh():
    return SimpleNamespace(layout=SimpleNamespace(dp=1), is_last_stage=True, returns_result=True)


@pytest.mark.parametrize("name", list(SPECS))
def test_dpo_microbatch_equals_the_loss_functions(name):
    spec = SPECS[name]
    objective = dpo.DpoObjective(spec)
    logps, reference = _rows(6, seed=1)
    reference = None if spec.reference_free else reference
    totals = BatchTotals(num_samples=6, chosen_tokens=int(logps.num_tokens[:6].sum()))
    prepass = None
    if objective.needs_prepass:
        prepass = whole_batch_prepass([(logps, reference, list(range(6)))], objective=objective, num_samples=6,
                                      mesh=_mesh(), device=torch.device("cpu"))
    got_loss, got_sums = objective.microbatch(logps, reference, positions=list(range(6)), totals=totals,
                                              prepass=prepass)
    pairs = dataclasses.replace(pair_logps(logps, reference, b=6, positions=list(range(6))), pair_index=None)
    kwargs = dict(spec=spec, num_pairs_global=6, chosen_tokens_global=totals.chosen_tokens)
    want_loss = loss.pair_losses(pairs, **kwargs).sum() / 6  # the whole batch: sorts it itself
    assert torch.equal(got_loss, want_loss)
    assert torch.equal(got_sums, loss.metric_sum_vector(pairs, **kwargs))
    assert objective.finalize(dict(zip(objective.metric_keys, got_sums.tolist()))) == \
        loss.finalize_metrics(loss.metric_sums(pairs, **kwargs), spec=spec)


@pytest.mark.parametrize("name", ["sigmoid", "aot", "aot_unpaired"])
def test_any_split_gives_the_whole_batch_loss_and_metrics(name):
    """Three microbatches of 2, 1 and 3 pairs through StepLoss (as the last stage calls it) give
    the whole batch's loss, gradient and metrics; aot through the whole-batch pass."""
    objective = dpo.DpoObjective(SPECS[name])
    logps, reference = _rows(6, seed=2)
    whole, _ = objective.microbatch(logps, reference, positions=list(range(6)),
                                    totals=objective.totals(_pairs(logps, 6)),
                                    prepass=_prepass(objective, [(logps, reference, list(range(6)))]))
    (want_grad,) = torch.autograd.grad(whole, logps.logp_sum)
    groups = [[4, 0], [5], [1, 3, 2]]
    parts = [(_select(logps, g, 6), _pick(reference, g, 6), g) for g in groups]
    computed = {(0, mb): SequenceLogps(logp_sum=ref, num_tokens=p.num_tokens, logit_sum=p.logit_sum)
                for mb, (p, ref, _) in enumerate(parts)}
    reference_source = SimpleNamespace(rows=lambda positions, pair_ids, given, stored: stored.logp_sum)
    step = StepLoss(objective=objective, samples=_pairs(logps, 6), groups=groups, dp=1, reference=reference_source,
                    computed=computed, prepass=_prepass(objective, parts), device=torch.device("cpu"))
    total = sum(step(mb, p) for mb, (p, _, _) in enumerate(parts))
    (grad,) = torch.autograd.grad(total, logps.logp_sum)
    torch.testing.assert_close(total, whole, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-7)
    _, sums = objective.microbatch(logps, reference, positions=list(range(6)), totals=step.totals,
                                   prepass=_prepass(objective, [(logps, reference, list(range(6)))]))
    got, want = (objective.finalize(dict(zip(objective.metric_keys, s.tolist()))) for s in (step.sums, sums))
    assert got.keys() == want.keys() and all(got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-9) for k in got)


def test_the_loss_runs_once_per_microbatch(monkeypatch):
    calls = []
    original = loss.pair_losses

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(loss, "pair_losses", counted)
    monkeypatch.setattr(dpo, "pair_losses", counted)
    objective = dpo.DpoObjective(LossSpec(loss_types=("sigmoid", "sft"), loss_weights=(1.0, 1.0)))
    logps, reference = _rows(4, seed=3)
    objective.microbatch(logps, reference, positions=[0, 1, 2, 3], totals=BatchTotals(4, 10))
    assert len(calls) == 1


def test_reference_tables_hold_one_column_per_sequence():
    table = torch.arange(12.0).view(4, 3)  # 4 samples of 3 sequences
    rows = table_rows(table, [2, 0], device=torch.device("cpu"))
    assert rows.tolist() == [6.0, 0.0, 7.0, 1.0, 8.0, 2.0]  # every sample's first sequence, then the second, ...


def test_the_registry_builds_dpo_and_names_the_choices():
    config = SimpleNamespace(objective="dpo", loss_spec=lambda: LossSpec(loss_types=("ipo",)))
    built = registry.build(config)
    assert isinstance(built, dpo.DpoObjective) and built.spec.loss_types == ("ipo",)
    assert built.shape.sequences == ("chosen", "rejected") and built.needs_reference and not built.needs_prepass
    with pytest.raises(ValueError, match=r"^objective: unknown 'nope'; choose from dpo"):
        registry.build(SimpleNamespace(objective="nope"))


def test_the_stage_context_is_written_by_its_constructor_and_the_executor_only():
    """No module but the executor assigns a StageContext field after construction."""
    root = Path(__file__).resolve().parents[1] / "mcore_dpo"
    assignment = re.compile(r"\bctx\.[a-z_]+\s*=[^=]")
    found = [f"{path.relative_to(root)}:{n}" for path in root.rglob("*.py") if path.name != "executor.py"
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if assignment.search(line) and "ctx.save_for_backward" not in line]
    # autograd Function contexts (`ctx` of a torch.autograd.Function) are not the StageContext
    found = [place for place in found if not place.startswith(("parallel/context_parallel.py", "rank/moe_step.py"))]
    assert found == []


# ----------------------------------------------------------------------------- helpers


def _pairs(logps: SequenceLogps, n: int) -> list:
    return [SimpleNamespace(chosen_ids=[0] * int(t)) for t in logps.num_tokens[:n]]


def _select(logps: SequenceLogps, ids: list[int], n: int) -> SequenceLogps:
    rows = ids + [i + n for i in ids]
    return SequenceLogps(logp_sum=logps.logp_sum[rows], num_tokens=logps.num_tokens[rows],
                         logit_sum=logps.logit_sum[rows])


def _pick(reference: torch.Tensor, ids: list[int], n: int) -> torch.Tensor:
    return reference[ids + [i + n for i in ids]]


def _prepass(objective, parts):
    if not objective.needs_prepass:
        return None
    return whole_batch_prepass(parts, objective=objective, num_samples=6, mesh=_mesh(), device=torch.device("cpu"))


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_whole_sequence_sums_cover_every_token_but_the_first(packing):
    """ORPO's NLL (Objective.whole_sequence): the summed log-probs over each sequence's prompt and
    completion, every token but the first, on padded and packed rows, equal a row-by-row sum."""
    from mcore_dpo.data.microbatches import RowLayout
    from mcore_dpo.objective.logprobs import segment_sums, whole_sequence_mask
    from tests.helpers.data import make_pairs

    pairs = make_pairs(5, seed=4)
    layout = RowLayout(packing=packing, prefix_sharing=False, pad_token_id=0, multiple=1, max_tokens=10_000)
    (micro,) = layout.microbatches(pairs, [list(range(5))])
    logp = -torch.rand(micro.labels.shape, generator=torch.Generator().manual_seed(0))
    mask = whole_sequence_mask(micro.loss_mask, segment_ids=micro.segment_ids, num_sequences=micro.num_sequences)
    got = segment_sums(logp * mask, segment_ids=micro.segment_ids, num_sequences=micro.num_sequences)
    counts = segment_sums(mask, segment_ids=micro.segment_ids, num_sequences=micro.num_sequences)
    sequences = [p.prompt_ids + p.chosen_ids for p in pairs] + [p.prompt_ids + p.rejected_ids for p in pairs]
    assert counts.tolist() == [len(s) - 1 for s in sequences]
    # each sequence's labels: its tokens from the second on, at the positions that predict them
    for j, sequence in enumerate(sequences):
        in_sequence = micro.segment_ids == j if packing else torch.arange(micro.labels.shape[0]).view(-1, 1) == j
        picked = (mask > 0) & in_sequence
        assert micro.labels[picked].tolist() == list(sequence[1:])
        assert got[j] == pytest.approx(float(logp[picked].sum()), abs=1e-6)


@pytest.mark.parametrize("argv, reference", [([], True), (["--objective", "cpo"], False), (["--objective", "orpo"], False)])
def test_the_memory_estimate_counts_a_reference_only_where_the_objective_runs_one(argv, reference):
    """The command line's config drives the estimate (tools/memory_estimate.py): a reference-free
    objective resolves to --ref-mode none, whose bytes per parameter hold no reference copy (its
    runs log memory/reference_params_peak_bytes 0: tests/test_cpo_parity.py)."""
    from mcore_dpo.command_line import resolve
    from mcore_dpo.tools.memory_estimate import (OPTIMIZER_BYTES_PER_PARAM, POLICY_BYTES_PER_PARAM,
                                                  REFERENCE_BYTES_PER_PARAM, bytes_per_param)

    config, _ = resolve(argv)
    assert registry.OBJECTIVES[config.objective].reference is reference
    expected = POLICY_BYTES_PER_PARAM + OPTIMIZER_BYTES_PER_PARAM / 2 + (REFERENCE_BYTES_PER_PARAM if reference else 0)
    assert bytes_per_param(ref_mode=config.ref_mode, optimizer_shards=2) == expected


def test_no_module_branches_on_an_objective_other_than_the_default():
    """Adding an objective touches its module and the registry, not `if objective == ...` in the
    engine: every objective's name but the default's is a string literal only in those two."""
    package = Path(registry.__file__).resolve().parents[1]
    for name, entry in registry.OBJECTIVES.items():
        if name == "dpo":
            continue
        own = {package / "objective" / "registry.py", package / (entry.module.split(".", 1)[1].replace(".", "/") + ".py")}
        literal = re.compile(rf"[\"']{re.escape(name)}[\"']")
        found = {path for path in package.rglob("*.py") if literal.search(path.read_text(encoding="utf-8"))}
        assert found <= own, (name, sorted(str(p.relative_to(package)) for p in found - own))
        assert found & own, name  # the test reads the tree it means to
