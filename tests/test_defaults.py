"""Tests for mcore_dpo.driver.defaults and the shipped assets: reproducible, small, and learnable by DPO
(where it starts here; the learning itself in tests/test_train_cli.py's default run)."""
from __future__ import annotations

import copy
import filecmp
import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, LlamaForCausalLM

from mcore_dpo.driver import defaults
from mcore_dpo.data.pairs import Microbatch, collate, load_pairs, padded_seq_len

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return defaults.ensure_default_model(str(tmp_path_factory.mktemp("cache")))


def _read_bytes(directory: str) -> dict[str, bytes]:
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


def test_shipped_assets_exist_and_are_small():
    for path in (defaults.DEFAULT_TRAIN_DATA, defaults.DEFAULT_EVAL_DATA, defaults.DEFAULT_TOKENIZER_DIR):
        assert os.path.exists(path), path
    total_bytes = sum(
        os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(defaults.ASSETS_DIR) for name in names
    )
    assert total_bytes < 1_000_000


def test_asset_script_reproduces_the_committed_assets(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("make_default_assets", os.path.join(REPO_ROOT, "scripts", "make_default_assets.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr("sys.argv", ["make_default_assets.py", "--out-dir", str(tmp_path)])
    script.main()
    comparison = filecmp.dircmp(str(tmp_path), defaults.ASSETS_DIR)
    assert not comparison.left_only and not comparison.right_only
    assert _read_bytes(str(tmp_path / "tokenizer")) == _read_bytes(defaults.DEFAULT_TOKENIZER_DIR)
    for name in ("prefs_train.jsonl", "prefs_eval.jsonl"):
        assert (tmp_path / name).read_bytes() == open(os.path.join(defaults.ASSETS_DIR, name), "rb").read()


def test_eval_pairs_are_held_out():
    import json

    def keys(path: str) -> set[tuple[str, str]]:
        rows = [json.loads(line) for line in open(path)]
        return {(row["prompt"], row["chosen"]) for row in rows}

    train, held_out = keys(defaults.DEFAULT_TRAIN_DATA), keys(defaults.DEFAULT_EVAL_DATA)
    assert len(held_out) == 200 and not train & held_out


def test_default_tokenizer_covers_the_data():
    tokenizer = AutoTokenizer.from_pretrained(defaults.DEFAULT_TOKENIZER_DIR)
    pairs, stats = load_pairs(defaults.DEFAULT_TRAIN_DATA, tokenizer=tokenizer, max_length=64)
    assert stats.num_pairs == stats.num_rows == 2000
    assert all(tokenizer.unk_token_id not in p.prompt_ids + p.chosen_ids + p.rejected_ids for p in pairs)
    assert tokenizer.chat_template and tokenizer.pad_token_id != tokenizer.eos_token_id


def test_default_model_architecture(model_dir):
    model = LlamaForCausalLM.from_pretrained(model_dir)
    config = model.config
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (64, 4, 8)
    assert config.num_key_value_heads == 4 and config.intermediate_size == 128 and config.hidden_act == "silu"
    assert config.vocab_size == len(tokenizer) and not config.tie_word_embeddings
    assert config.max_position_embeddings >= 256
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert os.path.exists(os.path.join(model_dir, "model.safetensors"))


def test_default_model_is_byte_identical_across_builds(model_dir, tmp_path):
    other_dir = defaults.ensure_default_model(str(tmp_path))
    assert other_dir == os.path.join(str(tmp_path), defaults.DEFAULT_MODEL_NAME)
    assert _read_bytes(other_dir) == _read_bytes(model_dir)


def test_default_model_build_leaves_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    defaults.ensure_default_model(str(tmp_path))
    assert torch.equal(torch.rand(3), expected)


def test_cache_dir_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(defaults.CACHE_ENV_VAR, str(tmp_path / "env_cache"))
    assert defaults.ensure_default_model() == str(tmp_path / "env_cache" / defaults.DEFAULT_MODEL_NAME)


def test_losing_the_creation_race_uses_the_winners_copy(tmp_path, monkeypatch):
    build = defaults._build_model
    winner_dir = os.path.join(str(tmp_path), defaults.DEFAULT_MODEL_NAME)

    def build_while_another_process_finishes_first(out_dir: str) -> None:
        build(out_dir)
        os.makedirs(winner_dir)
        build(winner_dir)
        open(os.path.join(winner_dir, "winner"), "w").close()

    monkeypatch.setattr(defaults, "_build_model", build_while_another_process_finishes_first)
    assert defaults.ensure_default_model(str(tmp_path)) == winner_dir
    assert os.path.exists(os.path.join(winner_dir, "winner"))
    assert os.listdir(str(tmp_path)) == [defaults.DEFAULT_MODEL_NAME]  # no temp dir left behind
    # Later calls reuse the directory without building.
    monkeypatch.setattr(defaults, "_build_model", lambda out_dir: pytest.fail("rebuilt an existing model"))
    assert defaults.ensure_default_model(str(tmp_path)) == winner_dir


# ----------------------------------------------------------------------------- learnability
# Where DPO starts on the default assets; that 120 steps of it take the held-out reward accuracy
# to >= 0.9 is tests/test_train_cli.py's test_default_run_learns_and_writes_everything (the same
# model, data and recipe, through the engine).


def _completion_logps(model: LlamaForCausalLM, batch: Microbatch) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=batch.tokens).logits
    token_logps = torch.gather(F.log_softmax(logits, dim=-1), 2, batch.labels.unsqueeze(-1)).squeeze(-1)
    summed = (token_logps * batch.loss_mask).sum(dim=-1)
    num_pairs = summed.shape[0] // 2
    return summed[:num_pairs], summed[num_pairs:]


def test_the_random_default_model_has_no_taste_for_the_chosen_answers(model_dir):
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = LlamaForCausalLM.from_pretrained(model_dir)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    eval_pairs, _ = load_pairs(defaults.DEFAULT_EVAL_DATA, tokenizer=tokenizer, max_length=64)
    eval_batch = collate(eval_pairs, pad_token_id=tokenizer.pad_token_id, seq_len=padded_seq_len(eval_pairs))
    with torch.no_grad():
        chosen, rejected = _completion_logps(policy, eval_batch)
        ref_chosen, ref_rejected = _completion_logps(reference, eval_batch)
    start_margins, start_preference = (chosen - ref_chosen) - (rejected - ref_rejected), chosen - rejected
    assert torch.all(start_margins == 0)  # policy == reference: every pair a tie
    # The random model has no built-in taste for the chosen answers.
    assert 0.3 < (start_preference > 0).float().mean().item() < 0.7
