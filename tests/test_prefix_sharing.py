"""Shared-prompt rows (--prefix-sharing) without processes: the layout of a pair, the mask, the
positions, and that a Hugging Face model run on the shared rows (its 4D mask and position ids)
gives every completion token the log-prob it has when chosen and rejected run as two separate
sequences; the token metrics; the Transformer Engine spec's switch to arbitrary masks; the flags
through the real parser and their refusals."""

from __future__ import annotations

import random

import pytest
import torch

from mcore_dpo.command_line import resolve
from mcore_dpo.data.microbatches import RowLayout
from mcore_dpo.data.packing import collate_packed, pair_tokens, plan_packed_step
from mcore_dpo.data.pairs import TokenizedPair, collate
from mcore_dpo.data.prefix_sharing import collate_shared, shared_pair_tokens, shared_seq_len
from mcore_dpo.model.builder import segment_mask
from mcore_dpo.objective.logprobs import ld_weights, segment_sums
from mcore_dpo.train import main


def _pair(lp: int, lc: int, lr: int, *, line: int = 1, seed: int = 0) -> TokenizedPair:
    rng = random.Random(seed * 1000 + line)
    ids = lambda n: tuple(rng.randrange(3, 100) for _ in range(n))  # noqa: E731
    return TokenizedPair(prompt_ids=(1,) + ids(lp - 1), chosen_ids=ids(lc), rejected_ids=ids(lr), source_line=line)


PAIRS = [_pair(5, 3, 4, line=1), _pair(1, 2, 2, line=2), _pair(7, 1, 5, line=3), _pair(3, 6, 2, line=4)]


def test_a_shared_pair_is_body_then_two_branches():
    pair = TokenizedPair(prompt_ids=(1, 11, 12), chosen_ids=(21, 22), rejected_ids=(31, 32, 33), source_line=1)
    mb = collate_shared([pair], pad_token_id=0, seq_len=16)
    assert shared_pair_tokens(pair) == 9 == pair_tokens(pair) - len(pair.prompt_ids) + 1
    assert mb.tokens[0, :9].tolist() == [1, 11, 12, 21, 22, 12, 31, 32, 33]
    # The prompt's last token heads each branch at the same position; rejected restarts there.
    assert mb.position_ids[0, :9].tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 5]
    assert mb.labels[0, :8].tolist() == [11, 12, 21, 22, 0, 31, 32, 33]
    assert mb.loss_mask[0, :9].tolist() == [0, 0, 1, 1, 0, 1, 1, 1, 0]
    assert mb.segment_ids[0, :9].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert mb.shared_prompt[0, :9].tolist() == [True, True] + [False] * 7
    assert (mb.segment_ids[0, 9:] == 2).all() and mb.loss_mask[0, 9:].sum() == 0
    assert mb.num_sequences == 2 and mb.num_positions == 7  # positions 0..6: the pads' 0..6 too
    allowed = ~segment_mask(mb.segment_ids, shared_prompt=mb.shared_prompt, num_sequences=2)[0, 0]
    # rejected's tokens see the body and their own earlier tokens, never chosen's
    assert allowed[6].nonzero().flatten().tolist() == [0, 1, 5, 6]
    assert allowed[4].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert allowed.any(-1).all()  # every position (padding too) sees at least itself


def test_a_pair_without_a_prompt_is_its_two_sequences_apart():
    """A row used whole (a reward model's: no prompt) shares nothing: its chosen and its rejected
    sequence side by side, each from position 0, neither seeing the other."""
    pair = TokenizedPair(prompt_ids=(), chosen_ids=(3, 5, 6), rejected_ids=(4, 7), source_line=7)
    assert shared_pair_tokens(pair) == 5
    mb = collate_shared([pair], pad_token_id=0, seq_len=8)
    assert mb.tokens[0].tolist() == [3, 5, 6, 4, 7, 0, 0, 0]
    assert mb.segment_ids[0, :5].tolist() == [0, 0, 0, 1, 1] and mb.position_ids[0, :5].tolist() == [0, 1, 2, 0, 1]
    assert mb.loss_mask[0, :5].tolist() == [1, 1, 0, 1, 0] and not mb.shared_prompt.any()
    allowed = ~segment_mask(mb.segment_ids, shared_prompt=mb.shared_prompt, num_sequences=2)[0, 0]
    assert allowed[4].nonzero().flatten().tolist() == [3, 4]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_segment_sums_and_ld_weights_equal_the_unshared_rows(packed):
    rows = RowLayout(packing=packed, prefix_sharing=True, pad_token_id=0, multiple=8, max_tokens=64)
    plain = collate(PAIRS, pad_token_id=0, seq_len=16)
    shared = rows.microbatches(PAIRS, [list(range(len(PAIRS)))])[0]
    assert shared.tokens.shape == ((1, 48) if packed else (4, 16))  # 13 + 6 + 14 + 12 = 45 shared tokens
    values = torch.randn(plain.tokens.shape)
    # one value per predicted token: place the plain rows' values at the shared rows' tokens
    per_token = torch.zeros(shared.tokens.shape)
    b = len(PAIRS)
    for seq in range(2 * b):
        where = shared.segment_ids == seq
        mask = where & (shared.loss_mask > 0)
        per_token[mask] = values[seq][plain.loss_mask[seq] > 0]
    got = segment_sums(per_token * shared.loss_mask, segment_ids=shared.segment_ids, num_sequences=2 * b)
    want = (values * plain.loss_mask).sum(-1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for alpha in (0.5, 1.0):
        got_w = ld_weights(shared.loss_mask, ld_alpha=alpha, segment_ids=shared.segment_ids, num_sequences=2 * b)
        want_w = ld_weights(plain.loss_mask, ld_alpha=alpha)
        for seq in range(2 * b):  # each completion token's weight, in order; nothing elsewhere
            mine = shared.segment_ids == seq
            assert got_w[mine & (shared.loss_mask > 0)].tolist() == want_w[seq][plain.loss_mask[seq] > 0].tolist()
            assert got_w[mine & (shared.loss_mask == 0)].sum() == 0


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_hf_model_on_shared_rows_gives_the_separate_sequences_log_probs(hf_llama, packed):
    """The layout and the mask, checked by a model that is not ours: Hugging Face Llama run on the
    shared rows (4D mask, position ids) against each sequence run alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_llama, dtype=torch.float32).eval()
    rows = RowLayout(packing=packed, prefix_sharing=True, pad_token_id=0, multiple=8, max_tokens=64)
    mb = rows.microbatches(PAIRS, [list(range(len(PAIRS)))])[0]
    blocked = segment_mask(mb.segment_ids, shared_prompt=mb.shared_prompt, num_sequences=mb.num_sequences)
    with torch.no_grad():
        logits = model(input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=~blocked).logits
        logp = torch.log_softmax(logits.double(), -1).gather(-1, mb.labels[..., None]).squeeze(-1)
        got = segment_sums(logp * mb.loss_mask, segment_ids=mb.segment_ids, num_sequences=mb.num_sequences)
        want = []
        for completion in ("chosen_ids", "rejected_ids"):
            for p in PAIRS:
                ids = torch.tensor([p.prompt_ids + getattr(p, completion)])
                alone = torch.log_softmax(model(input_ids=ids).logits.double(), -1)[0, :-1]
                want.append(alone.gather(-1, ids[0, 1:, None]).squeeze(-1)[len(p.prompt_ids) - 1:].sum())
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-5, atol=1e-5)


def test_costs_plans_and_token_metrics_count_the_prompt_once():
    pairs = [_pair(8, 4, 4, line=1), _pair(2, 2, 2, line=2), _pair(6, 3, 5, line=3), _pair(3, 3, 3, line=4)]
    shared = RowLayout(packing=True, prefix_sharing=True, pad_token_id=0, multiple=8, max_tokens=50)
    assert [shared.cost(p) for p in pairs] == [17, 7, 15, 10]
    assert [pair_tokens(p) for p in pairs] == [24, 8, 20, 12]
    plan = shared.plan_step(pairs, dp=1)[0]
    assert plan == plan_packed_step(pairs, dp=1, max_tokens=50, cost=shared_pair_tokens)[0] == [[0, 1, 2, 3]]
    assert len(plan_packed_step(pairs, dp=1, max_tokens=50)[0]) == 2  # 64 tokens unshared
    stats = shared.token_stats(pairs, dp=1, micro_batch_size=2)
    widths = [collate_packed([pairs[i] for i in mb], pad_token_id=0, multiple=8, prefix_sharing=True).tokens.shape[1]
              for mb in plan]
    assert stats == {"tokens/real": 64.0, "tokens/padded": float(sum(widths)), "padding_fraction": 1 - 49 / sum(widths),
                     "microbatches": float(len(plan))}
    padded = shared.padded().token_stats(pairs, dp=1, micro_batch_size=2)
    assert padded == {"tokens/real": 64.0, "tokens/padded": 4.0 * shared_seq_len(pairs, multiple=8),
                      "padding_fraction": 1 - 49 / 96, "microbatches": 2.0}


def test_the_transformer_engine_spec_switches_to_arbitrary_masks():
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.enums import AttnMaskType

    from mcore_dpo.model.builder import _with_arbitrary_masks

    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    switched = _with_arbitrary_masks(spec)
    assert switched.submodules.self_attention.params["attn_mask_type"] is AttnMaskType.arbitrary
    assert spec.submodules.self_attention.params["attn_mask_type"] is AttnMaskType.causal  # a copy


# ----------------------------------------------------------------------------- the command line


def test_flags_parse_through_the_real_parser():
    assert resolve(["--prefix-sharing"])[0].prefix_sharing is True
    assert resolve(["--prefix-sharing", "--no-prefix-sharing"])[0].prefix_sharing is False
    assert resolve([])[0].prefix_sharing is False


def test_refusals(moe_models, capsys, tmp_path):
    from mcore_dpo.driver.defaults import DEFAULT_TRAIN_DATA

    # through the door: one line, exit 2, before anything starts
    policy_dir, _ = moe_models["qwen3_moe"]
    out = tmp_path / "out"
    code = main(["--model", str(policy_dir), "--data", DEFAULT_TRAIN_DATA, "--prefix-sharing", "--moe-aux-loss-coef",
                 "0.01", "--no-packing", "--output-dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "prefix_sharing: cannot serve the MoE load-balancing loss" in err[0], err
    assert not out.exists()
