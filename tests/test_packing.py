"""Packing without processes: the token-balanced split, the packed row, per-segment sums, the
block-diagonal mask, plans whose microbatch count changes from step to step, token metrics,
and the refusals of --packing on the command line."""

from __future__ import annotations

import random

import pytest
import torch

from mcore_dpo.config import ConfigError
from mcore_dpo.data.pairs import TokenizedPair, collate
from mcore_dpo.objective.logprobs import ld_weights, segment_sums
from mcore_dpo.model.builder import causal_mask, segment_mask
from mcore_dpo.data.microbatches import RowLayout
from mcore_dpo.data.packing import (_first_fit_decreasing, balance_ranks, collate_packed, pair_tokens, plan_packed_step, split_microbatches)
from mcore_dpo.pipeline.plan import OpKind
from mcore_dpo.pipeline.check import validate_plan
from mcore_dpo.pipeline.schedule import build_plan
from mcore_dpo.train import main


def _pair(lp: int, lc: int, lr: int, *, line: int = 1, seed: int = 0) -> TokenizedPair:
    rng = random.Random(seed * 1000 + line)
    ids = lambda n: tuple(rng.randrange(3, 100) for _ in range(n))  # noqa: E731
    return TokenizedPair(prompt_ids=(1,) + ids(lp - 1), chosen_ids=ids(lc), rejected_ids=ids(lr), source_line=line)


def _random_pairs(n: int, *, seed: int, longest: int = 64) -> list[TokenizedPair]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        lp = rng.randint(1, longest // 2)
        out.append(_pair(lp, rng.randint(1, longest - lp), rng.randint(1, longest - lp), line=i + 1, seed=seed))
    return out


# ----------------------------------------------------------------------------- the split


def test_balance_ranks_is_a_balanced_partition():
    pairs = _random_pairs(256, seed=3)
    costs = [pair_tokens(p) for p in pairs]
    for dp in (1, 2, 3, 8):
        ranks = balance_ranks(costs, num_ranks=dp)
        assert sorted(i for r in ranks for i in r) == list(range(len(costs)))
        totals = [sum(costs[i] for i in r) for r in ranks]
        assert min(totals) > 0
        # Greedy LPT: the spread is at most one item, a small share of a rank's total here.
        assert (max(totals) - min(totals)) / max(totals) <= 0.02, totals
        assert ranks == balance_ranks(costs, num_ranks=dp)  # deterministic


def test_balance_ranks_gives_every_rank_a_pair_and_refuses_too_few():
    assert balance_ranks([100, 1, 1], num_ranks=3) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="cannot give each"):
        balance_ranks([5], num_ranks=2)


def test_split_microbatches_fits_the_budget_with_few_microbatches():
    pairs = _random_pairs(64, seed=5)
    costs = [pair_tokens(p) for p in pairs]
    budget = 2 * 64
    mbs = split_microbatches(costs, list(range(64)), max_tokens=budget)
    assert sorted(i for mb in mbs for i in mb) == list(range(64))
    totals = [sum(costs[i] for i in mb) for mb in mbs]
    assert max(totals) <= budget
    # At most one more than first-fit-decreasing bin packing needs (<= 11/9 of the fewest, plus one);
    # never fewer than the bounds any split obeys (the total; pairs over half the budget each alone).
    lower_bound = max(-(-sum(costs) // budget), sum(c > budget // 2 for c in costs))
    assert lower_bound <= len(mbs) <= len(_first_fit_decreasing(costs, range(64), capacity=budget)) + 1
    # Short pairs (the common case): the balanced split fits in the fewest microbatches, each
    # near the mean (the pipeline's stages see even work).
    short = _random_pairs(64, seed=6, longest=16)
    costs = [pair_tokens(p) for p in short]
    mbs = split_microbatches(costs, list(range(64)), max_tokens=budget)
    totals = [sum(costs[i] for i in mb) for mb in mbs]
    assert max(totals) <= budget and len(mbs) <= -(-sum(costs) // budget) + 1
    assert min(totals) >= 0.85 * sum(totals) / len(totals), totals
    with pytest.raises(ValueError, match="more than the budget"):
        split_microbatches([10, 300], [0, 1], max_tokens=budget)


def test_a_pair_that_fills_the_budget_is_alone_and_small_pairs_share():
    pairs = [_pair(8, 8, 8, line=1), _pair(2, 2, 2, line=2), _pair(2, 3, 2, line=3), _pair(7, 8, 8, line=4)]
    groups = plan_packed_step(pairs, dp=1, max_tokens=32)[0]
    assert [0] in groups and [3] in groups and [1, 2] in groups


# ----------------------------------------------------------------------------- the packed row


def test_collate_packed_lays_sequences_end_to_end():
    pairs = [_pair(3, 2, 4, line=1), _pair(2, 3, 1, line=2)]
    mb = collate_packed(pairs, pad_token_id=0, multiple=8)
    real = sum(pair_tokens(p) for p in pairs)  # 12 + 8 = 20
    assert mb.tokens.shape == (1, 24) and mb.seq_lens == (5, 7, 5, 3, 4) and sum(mb.seq_lens) == 24
    # Layout: pair 0 chosen, pair 0 rejected, pair 1 chosen, pair 1 rejected, padding.
    assert mb.segment_ids[0].tolist() == [0] * 5 + [2] * 7 + [1] * 5 + [3] * 3 + [4] * 4
    assert mb.position_ids[0, :real].tolist() == [*range(5), *range(7), *range(5), *range(3)]
    padded = collate(pairs, pad_token_id=0, seq_len=8)
    for row in range(4):
        seg = mb.segment_ids[0] == row
        # The same tokens, labels and completion mask as the unpadded row, minus its padding.
        n = int(seg.sum())
        assert mb.tokens[0, seg].tolist() == padded.tokens[row, :n].tolist()
        assert mb.loss_mask[0, seg].tolist() == padded.loss_mask[row, :n].tolist()
        assert mb.labels[0, seg][:-1].tolist() == padded.labels[row, : n - 1].tolist()
    assert mb.loss_mask[0, real:].sum() == 0


def test_collate_packed_without_padding_when_the_row_is_full():
    mb = collate_packed([_pair(8, 8, 8)], pad_token_id=0, multiple=8)
    assert mb.tokens.shape == (1, 32) and mb.seq_lens == (16, 16) and int(mb.segment_ids.max()) == 1


def test_segment_sums_equal_row_sums_of_the_unpacked_rows():
    pairs = [_pair(3, 2, 4, line=1), _pair(2, 3, 1, line=2), _pair(4, 4, 4, line=3)]
    packed = collate_packed(pairs, pad_token_id=0, multiple=8)
    padded = collate(pairs, pad_token_id=0, seq_len=8)
    # A per-token value that depends only on the token and its place in its sequence.
    value = lambda tokens, pos: torch.sin(tokens.double() * 0.37 + pos.double())  # noqa: E731
    packed_vals = value(packed.tokens, packed.position_ids) * packed.loss_mask
    pos = torch.arange(8).expand_as(padded.tokens)
    padded_vals = value(padded.tokens, pos) * padded.loss_mask
    got = segment_sums(packed_vals, segment_ids=packed.segment_ids, num_sequences=packed.num_sequences)
    want = segment_sums(padded_vals, segment_ids=None, num_sequences=None)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_ld_weights_of_a_packed_row_equal_the_unpacked_rows():
    """LD-DPO on a packed row: each segment's weights are its unpacked row's, token for token
    (the pair's shared length taken from its two segments); the padding weighs nothing."""
    pairs = [_pair(3, 2, 4, line=1), _pair(2, 3, 1, line=2), _pair(4, 5, 3, line=3), _pair(2, 1, 1, line=4)]
    packed = collate_packed(pairs, pad_token_id=0, multiple=8)
    assert packed.tokens.shape[1] > sum(pair_tokens(p) for p in pairs)  # the row ends in padding
    padded = collate(pairs, pad_token_id=0, seq_len=9)
    for alpha in (0.0, 0.3, 1.0):
        got_w = ld_weights(packed.loss_mask, ld_alpha=alpha, segment_ids=packed.segment_ids,
                           num_sequences=packed.num_sequences)
        want_w = ld_weights(padded.loss_mask, ld_alpha=alpha)
        # each sequence's weights, token for token
        for row in range(2 * len(pairs)):
            seg = packed.segment_ids[0] == row
            n = int(seg.sum())
            assert got_w[0, seg].tolist() == want_w[row, :n].tolist(), (alpha, row)
        assert got_w[0, packed.segment_ids[0] == packed.num_sequences].sum() == 0  # padding
    with pytest.raises(ValueError, match="num_sequences"):
        ld_weights(packed.loss_mask, ld_alpha=0.5, segment_ids=packed.segment_ids, num_sequences=3)


def test_packed_mask_is_block_diagonal_causal():
    mb = collate_packed([_pair(2, 1, 2, line=1)], pad_token_id=0, multiple=8)  # segments 3, 4, pad 1
    mask = segment_mask(mb.segment_ids)[0, 0]
    allowed = ~mask
    expected = torch.zeros(8, 8, dtype=torch.bool)
    for lo, hi in ((0, 3), (3, 7), (7, 8)):
        expected[lo:hi, lo:hi] = ~causal_mask(hi - lo, device=torch.device("cpu"))[0, 0]
    assert torch.equal(allowed, expected)
    assert allowed.any(-1).all()  # every row (padding too) sees at least itself: no empty softmax


# ----------------------------------------------------------------------------- plans for variable m


@pytest.mark.parametrize("stages", [2, 4])
def test_plans_with_a_different_next_microbatch_count_validate(stages):
    for m in (1, 2, 5):
        for m_next in (1, 3, 6):
            for ref_current, carry_in, carry_out in ((True, False, True), (False, True, True), (False, True, False),
                                                     (False, False, False)):
                plan = build_plan(num_stages=stages, num_microbatches=m, num_next_microbatches=m_next,
                                  ref_mode="interleaved", ref_current=ref_current, ref_next=True, carry_in=carry_in,
                                  carry_out=carry_out)
                validate_plan(plan)  # every op once, in order, no deadlock under rendezvous transfers
                next_refs = {op.microbatch for ops in plan.stages for op in ops
                             if op.kind is OpKind.REF_FWD and op.batch == 1}
                assert next_refs == set(range(m_next)), (m, m_next, next_refs)
                assert max(op.microbatch for op in plan.stages[0] if op.kind is OpKind.FWD) == m - 1


def test_carrying_chains_across_steps_whose_microbatch_counts_change():
    """Step k carries out the next batch's last microbatches by the next batch's count; step k+1,
    built with that count, carries exactly them in (activations kept = activations sent first)."""
    counts = [3, 5, 2, 4, 1, 3]
    p = 3
    plans = []
    for k, m in enumerate(counts):
        last = k == len(counts) - 1
        plans.append(build_plan(num_stages=p, num_microbatches=m, num_next_microbatches=None if last else counts[k + 1],
                                ref_mode="interleaved", ref_current=k == 0, ref_next=not last, carry_in=k > 0,
                                carry_out=not last))
    for before, after in zip(plans, plans[1:]):
        validate_plan(after)
        for s in range(p):
            kept = [op.microbatch for op in before.stages[s] if op.kind is OpKind.KEEP_REF_ACT]
            sent_first = [op.microbatch for op in after.stages[s] if op.kind is OpKind.SEND_KEPT_REF_ACT]
            assert kept == sent_first, (s, kept, sent_first)
            left = set(range(after.num_microbatches)) - {op.microbatch for op in before.stages[s]
                                                         if op.kind is OpKind.REF_FWD and op.batch == 1}
            done_now = {op.microbatch for op in after.stages[s] if op.kind is OpKind.REF_FWD and op.batch == 0}
            assert left == done_now, (s, left, done_now)


def test_equal_counts_share_the_cached_plan():
    a = build_plan(num_stages=2, num_microbatches=4, ref_mode="interleaved", num_next_microbatches=4)
    b = build_plan(num_stages=2, num_microbatches=4, ref_mode="interleaved")
    assert a is b


# ----------------------------------------------------------------------------- metrics


def test_step_token_stats():
    pairs = [_pair(8, 8, 8, line=1), _pair(2, 2, 2, line=2), _pair(2, 3, 2, line=3), _pair(7, 8, 8, line=4)]
    real = sum(pair_tokens(p) for p in pairs)  # 32 + 8 + 9 + 30 = 79
    layout = RowLayout(packing=True, prefix_sharing=False, pad_token_id=0, multiple=8, max_tokens=32)
    packed = layout.token_stats(pairs, dp=1, micro_batch_size=2)
    assert packed == {"tokens/real": 79.0, "tokens/padded": 32.0 + 24 + 32, "padding_fraction": 1 - 79 / 88,
                      "microbatches": 3.0}
    padded = layout.padded().token_stats(pairs, dp=1, micro_batch_size=2)
    assert padded == {"tokens/real": 79.0, "tokens/padded": 8 * 16.0, "padding_fraction": 1 - 79 / 128,
                      "microbatches": 2.0}


# ----------------------------------------------------------------------------- the command line


@pytest.mark.parametrize("argv, fragment", [
    (["--packing", "--max-tokens-per-microbatch", "100"], "max_tokens_per_microbatch: 100 is below 2 x max_length = 128"),
    # packing unset (a budget asks for it): the same budget rule
    (["--max-tokens-per-microbatch", "100"], "max_tokens_per_microbatch: 100 is below 2 x max_length = 128"),
    (["--no-packing", "--max-tokens-per-microbatch", "256"], "max_tokens_per_microbatch: given with --no-packing"),
    (["--packing", "--max-tokens-per-microbatch", "128", "--dp", "4", "--global-batch-size", "2"],
     "global_batch_size: 2 pairs cannot give each of dp 4"),
    (["--packing", "--dp", "2", "--ep", "2", "--global-batch-size", "4"], "packing: cannot serve --ep 2"),
    # packing unset with a mode it does not serve falls back to padded: a budget then means nothing
    (["--ep", "2", "--dp", "2", "--no-distributed-optimizer", "--max-tokens-per-microbatch", "256"],
     "max_tokens_per_microbatch: packing is off for --ep 2"),
    # ... and the padded layout's rule applies again
    (["--ep", "2", "--dp", "2", "--no-distributed-optimizer", "--global-batch-size", "20"],
     "global_batch_size: 20 is not a multiple of dp*micro_batch_size = 2*8 (padded microbatches)"),
])
def test_bad_packing_flags_are_one_line_before_anything_starts(argv, fragment, capsys, tmp_path):
    out = tmp_path / "out"
    assert main([*argv, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and fragment in err[0], err
    assert not out.exists()


def test_packing_flags_parse_from_the_command_line():
    from mcore_dpo.command_line import resolve

    config, _ = resolve(["--packing", "--max-tokens-per-microbatch", "256", "--max-length", "128"])
    assert config.packing and config.max_tokens_per_microbatch == 256 and config.packing_budget == 256
    # --no-packing is the negation of --packing, and --no-shuffle still sets no_shuffle (not its negation)
    config, _ = resolve(["--no-packing", "--no-shuffle"])
    assert config.packing is False and not config.packed and config.no_shuffle and config.max_tokens_per_microbatch is None
    assert config.decide_packing() == (config, None)
    config, _ = resolve(["--packing", "--max-length", "100", "--micro-batch-size", "2"])
    assert config.packing and config.packing_budget == 400  # unset: 2 x micro_batch_size x max_length


def test_unset_packing_is_left_to_the_ranks_attention_with_the_padded_microbatch_as_its_budget():
    from mcore_dpo.command_line import resolve
    from mcore_dpo.parallel.platform import default_packing

    config, _ = resolve(["--micro-batch-size", "4", "--max-length", "100"])
    assert config.packing is None and config.packed  # may pack: the ranks decide
    decided, note = config.decide_packing()
    assert decided.packing is None and note is None
    # on where packed rows run in the THD layout (a GPU with Transformer Engine), off on the local
    # attention (the CPU), where a packed row's W x W scores cost more than padding
    assert default_packing(thd_attention=True) is True and default_packing(thd_attention=False) is False
    # what one padded microbatch holds at most: 4 pairs x 2 rows x 100 tokens
    assert decided.packing_budget == 2 * 4 * 100
    # an explicit budget asks for packing
    assert resolve(["--max-tokens-per-microbatch", "512"])[0].decide_packing()[0].packing is True
    # the padded rule (global batch a multiple of dp x micro batch) binds unset runs (they may run
    # padded), not packed ones
    with pytest.raises(ConfigError, match="--packing lifts this rule"):
        resolve(["--global-batch-size", "60"])
    assert resolve(["--global-batch-size", "60", "--packing"])[0].decide_packing()[0].packing is True
    from mcore_dpo.command_line import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--packing, --no-packing Packed sequences" in text and "(default: decided by the ranks' attention" in text
    assert "what one padded microbatch holds at most, so packing never widens a microbatch)" in text
    # LD-DPO is served packed (its weights per segment: `logprobs.ld_weights`)
    assert resolve(["--ld-alpha", "0.5"])[0].decide_packing()[1] is None


@pytest.mark.parametrize("argv, unserved", [
    (["--ep", "2", "--dp", "2", "--global-batch-size", "16", "--no-distributed-optimizer"], "--ep 2"),
    (["--moe-aux-loss-coef", "0.01"], "the MoE load-balancing loss"),
])
def test_modes_packing_does_not_serve_fall_back_to_padded_in_one_line(argv, unserved):
    from mcore_dpo.command_line import resolve

    config, _ = resolve(argv)
    assert not config.packed
    decided, note = config.decide_packing()
    assert decided.packing is False
    assert note.startswith(f"packing: off for {unserved}") and "padded microbatches of 8 pairs" in note
    assert "\n" not in note
    # asked for explicitly, the same modes are refused
    if unserved != "the MoE load-balancing loss":  # known once the model is read: tests/test_moe_aux.py
        with pytest.raises(ConfigError, match=f"packing: cannot serve {unserved}"):
            resolve([*argv, "--packing"])


def test_eval_microbatches_pack_each_chunk_share_by_tokens():
    from mcore_dpo.data.pairs import eval_passes
    from mcore_dpo.data.packing import eval_microbatches

    costs = [10, 30, 12, 8, 20, 6, 14]  # 7 held-out pairs, global batch 4, dp 2
    for dp_rank in (0, 1):
        passes = eval_passes(num_pairs=7, global_batch_size=4, dp=2, dp_rank=dp_rank, micro_batch_size=1)
        packed = eval_microbatches(costs, passes, max_tokens=32)
        shares = {}
        for chunk, groups in passes:
            shares.setdefault(chunk.start, []).extend(i for g in groups for i in g)
        # one pass per chunk holding exactly this rank's share of it, every microbatch within budget
        assert [sorted(i for mb in p for i in mb) for p in packed] == [sorted(v) for v in shares.values()]
        assert all(sum(costs[i] for i in mb) <= 32 for p in packed for mb in p)
    passes = eval_passes(num_pairs=7, global_batch_size=4, dp=2, dp_rank=0, micro_batch_size=1)
    # rank 0: pairs 0, 1 of the first chunk (40 tokens: two rows), pairs 4, 5 of the second (26: one row)
    assert eval_microbatches(costs, passes, max_tokens=32) == [[[0], [1]], [[4, 5]]]
