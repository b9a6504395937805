"""Parity of packed sequences (--packing) with token-balanced microbatches.

At (tp, pp, dp) = (1,1,1), (2,2,1), (1,2,2) one set of gloo ranks trains the same two global
batches four times, packing on and off, each with and without --prefix-sharing (each pair's
prompt computed once for both completions). The reference is interleaved, so at pp 2 the first step
carries the next batch's reference forwards out and the second carries them in, with a
different microbatch count; at dp 2 the two replicas run different counts in the second step;
at tp 2 the packed jobs are also sequence-parallel. Checked:
- each job against a single-process Hugging Face reference that runs every sequence alone,
  unpadded (TRL's formulas from tests/helpers/reference.py): every metric, every gradient of every rank,
  the weights after the second AdamW step;
- each job against the padded one: every metric and every gradient within 1e-5 relative;
- evaluation after the second step, packed too (`EVAL_PAIRS` held-out pairs, not a multiple of
  the global batch): against the reference's metrics over every pair alone, and against the
  padded evaluation, within 1e-5 relative.
The data has a pair that fills a microbatch exactly (32 of 32 tokens, no padding), a pair
alone in its microbatch (30 tokens), and small pairs packed several to a row.
"""

from __future__ import annotations

import json

import pytest
import torch

from mcore_dpo.data.pairs import TokenizedPair
from mcore_dpo.data.packing import pair_tokens, plan_packed_step
from tests.helpers import reference as hf_reference
from tests.helpers.models import VOCAB_SIZE
from tests.helpers.parity import ADAM_EPS, BETA, CLIP, LR, METRICS, WD, check_metrics, check_tensors
from tests.helpers.ranks import load_rank_tensors, run_ranks
from tests.helpers.reference import RTOL, assert_close, reference_run

MAX_LENGTH = 16
BUDGET = 2 * MAX_LENGTH  # the smallest budget --max-length 16 allows
GLOBAL_BATCH = 8
LAYOUTS = [(1, 1, 1), (2, 2, 1), (1, 2, 2)]
EVAL_PAIRS = 6  # the first batch's first six: the pair that fills a row and the one alone among them


def _pairs() -> list[list[TokenizedPair]]:
    gen = torch.Generator().manual_seed(11)
    line = iter(range(1, 1000))

    def ids(n: int) -> tuple[int, ...]:
        return tuple(int(x) for x in torch.randint(3, VOCAB_SIZE, (n,), generator=gen))

    def pair(lp: int, lc: int, lr: int) -> TokenizedPair:
        # BOS + lp - 1 prompt tokens; completions end with EOS.
        return TokenizedPair(prompt_ids=(1,) + ids(lp - 1), chosen_ids=ids(lc - 1) + (2,),
                             rejected_ids=ids(lr - 1) + (2,), source_line=next(line))

    def small() -> TokenizedPair:
        lp, lc, lr = (int(x) for x in torch.randint(2, 5, (3,), generator=gen))
        return pair(lp, lc, lr)

    full = pair(8, 8, 8)  # 2*8 + 8 + 8 = 32 tokens: fills a microbatch exactly
    alone = pair(7, 8, 8)  # 30 tokens: no other pair (>= 8 tokens) fits beside it
    first = [small(), full, small(), small(), alone, small(), small(), small()]
    # 15, 16, 18, 15, 17, 15, 14, 15 tokens: 4 microbatches at dp 1; at dp 2, 3 on one rank and 2
    # on the other (each dp replica runs its own plan).
    second = [pair(4, 3, 4), pair(4, 4, 4), pair(5, 4, 4), pair(3, 5, 4), pair(4, 4, 5), pair(4, 2, 5), pair(3, 4, 4),
              pair(5, 2, 3)]
    return [first, second]


def _completion_sums_alone(model, pairs: list[TokenizedPair]):
    """reference._completion_sums, with every sequence run on its own: no padding, no mask."""
    sums, counts, logit_sums = [], [], []
    for prompt_of, completion_of in ((lambda p: p.prompt_ids, lambda p: p.chosen_ids),
                                     (lambda p: p.prompt_ids, lambda p: p.rejected_ids)):
        for p in pairs:
            prompt, completion = prompt_of(p), completion_of(p)
            ids = torch.tensor([prompt + completion])
            logits = model(input_ids=ids).logits.float()[0, :-1]
            mask = torch.zeros(ids.shape[1] - 1)
            mask[len(prompt) - 1:] = 1
            logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            sums.append((logp * mask).sum())
            counts.append(mask.sum())
            logit_sums.append((logits.detach().mean(-1) * mask).sum())
    return torch.stack(sums), torch.stack(counts), torch.stack(logit_sums)


@pytest.fixture(scope="module")
def reference(parity_models):
    policy_dir, ref_dir = parity_models["llama"]
    original = hf_reference._completion_sums
    hf_reference._completion_sums = _completion_sums_alone
    try:
        return reference_run(policy_dir=policy_dir, ref_dir=ref_dir, batches=_pairs(), loss_type="sigmoid", beta=BETA,
                             label_smoothing=0.0, reference_free=False, lr=LR, clip_grad=CLIP, weight_decay=WD,
                             adam_eps=ADAM_EPS, eval_pairs=_pairs()[0][:EVAL_PAIRS])
    finally:
        hf_reference._completion_sums = original


def _job(layout, parity_models, *, packing: bool, prefix_sharing: bool = False) -> dict:
    tp, pp, dp = layout
    policy_dir, ref_dir = parity_models["llama"]
    batches = _pairs()
    config = dict(model=str(policy_dir), ref_model=str(ref_dir), tp=tp, pp=pp, dp=dp, micro_batch_size=2,
                  global_batch_size=GLOBAL_BATCH, max_steps=2, max_length=MAX_LENGTH, ref_mode="interleaved", lr=LR,
                  adam_eps=ADAM_EPS, timeout_s=60.0, clip_grad=CLIP, weight_decay=WD, loss_type="sigmoid", beta=BETA,
                  prefix_sharing=prefix_sharing)
    if packing:
        config.update(packing=True, max_tokens_per_microbatch=BUDGET)
        # At tp 2 the packed rows also run sequence-parallel: [W/tp, 1, h] between the linears.
        config.update(sequence_parallel=tp > 1)
    return {"key": ("llama", "interleaved", "sigmoid"), "config": config, "batches": batches,
            "batch_ids": [list(range(k * GLOBAL_BATCH, (k + 1) * GLOBAL_BATCH)) for k in range(2)],
            "all_pairs": batches[0] + batches[1], "eval_pairs": batches[0][:EVAL_PAIRS]}


def test_the_data_covers_the_edge_cases():
    first, second = _pairs()
    assert all(len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) <= MAX_LENGTH for p in first + second)
    split = plan_packed_step(first, dp=1, max_tokens=BUDGET)[0]
    totals = [sum(pair_tokens(first[i]) for i in mb) for mb in split]
    assert [1] in split and totals[split.index([1])] == BUDGET  # fills its row exactly
    assert [4] in split and totals[split.index([4])] == 30  # alone in its row
    assert any(len(mb) >= 2 for mb in split)  # pairs share a row
    # The two steps have different microbatch counts, on one rank and on each of two; at dp 2
    # the ranks' counts differ in the second step.
    assert [len(plan_packed_step(b, dp=1, max_tokens=BUDGET)[0]) for b in (first, second)] == [5, 4]
    assert [[len(mbs) for mbs in plan_packed_step(b, dp=2, max_tokens=BUDGET)] for b in (first, second)] == [[3, 3],
                                                                                                          [3, 2]]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"tp{l[0]}-pp{l[1]}-dp{l[2]}")
def test_packing_parity(layout, parity_models, reference, tmp_path):
    # packed, padded, and each with --prefix-sharing (every prompt computed once for both completions)
    variants = [(True, False), (False, False), (True, True), (False, True)]
    jobs = [_job(layout, parity_models, packing=packing, prefix_sharing=shared) for packing, shared in variants]
    run_ranks(world_size=layout[0] * layout[1] * layout[2], jobs=jobs, out_dir=tmp_path)
    results = [json.loads((tmp_path / f"job{j}_metrics.json").read_text()) for j in range(len(jobs))]
    eval_names = tuple(n for n in METRICS if n != "grad_norm")
    for j, (packing, shared) in enumerate(variants):
        what = (f"{'packed' if packing else 'padded'}{' prefix-shared' if shared else ''} "
                f"at tp{layout[0]} pp{layout[1]} dp{layout[2]}")
        check_tensors(tmp_path, j, jobs[j], layout, reference, what, RTOL)
        ours = results[j]
        assert len(ours) == 3  # two steps, then the evaluation
        for step, (m, ref) in enumerate(zip(ours, reference["metrics"]), start=1):
            check_metrics(m, ref, names=METRICS, prefix="", what=f"{what} step {step}", rtol=RTOL)
        check_metrics(ours[2], reference["eval"], names=eval_names, prefix="eval/", what=f"{what} evaluation",
                      rtol=RTOL)
        if j == 1:  # the padded job is the baseline the others are compared with
            continue
        base = results[1]
        for name in eval_names:
            assert_close(torch.tensor(ours[2][f"eval/{name}"]), torch.tensor(base[2][f"eval/{name}"]),
                         what=f"{what} eval/{name} vs padded")
        for step, (on, off) in enumerate(zip(ours[:2], base[:2]), start=1):
            for name in METRICS:
                assert_close(torch.tensor(on[name]), torch.tensor(off[name]), what=f"{what} step {step} {name} vs padded")
            assert on["tokens/real"] == off["tokens/real"]
            assert on["tokens/padded"] < off["tokens/padded"] or not packing
        for step in (1, 2):
            on, off = (load_rank_tensors(tmp_path, k, f"grads{step}", layout=layout) for k in (j, 1))
            for rank, shard in on.items():
                for name, value in shard.items():
                    assert_close(value, off[rank][name], what=f"{what} step {step} grad {name} {rank} vs padded")
    # Sharing places fewer positions (padding aside) than the same rows unshared: the prompt once.
    placed = lambda m: round(m["tokens/padded"] * (1 - m["padding_fraction"]))  # noqa: E731
    for step in (0, 1):
        for shared, unshared in ((2, 0), (3, 1)):
            assert placed(results[shared][step]) < placed(results[unshared][step]) == results[unshared][step]["tokens/real"]
