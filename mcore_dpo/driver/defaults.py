"""The assets shipped with the package and the tiny default model built from them.

Nothing here downloads: the tokenizer and the preference data live in mcore_dpo/assets/
(rebuilt by scripts/make_default_assets.py), and the model is a random-initialised
Llama created on first use:

    from mcore_dpo.driver.defaults import ensure_default_model
    model_dir = ensure_default_model()   # HF checkpoint dir: config, safetensors, tokenizer
"""
from __future__ import annotations

import os
import shutil
import tempfile

ASSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")  # mcore_dpo/assets
DEFAULT_TOKENIZER_DIR = os.path.join(ASSETS_DIR, "tokenizer")
DEFAULT_TRAIN_DATA = os.path.join(ASSETS_DIR, "prefs_train.jsonl")
DEFAULT_EVAL_DATA = os.path.join(ASSETS_DIR, "prefs_eval.jsonl")

# Bump the version in the name whenever the architecture, seed or tokenizer changes, so
# stale caches are never mistaken for the new model.
DEFAULT_MODEL_NAME = "tiny-llama-v2"
DEFAULT_MODEL_SEED = 20240601
CACHE_ENV_VAR = "MCORE_DPO_CACHE"


def default_cache_dir() -> str:
    """$MCORE_DPO_CACHE if set, else ~/.cache/mcore_dpo."""
    return os.environ.get(CACHE_ENV_VAR) or os.path.join(os.path.expanduser("~"), ".cache", "mcore_dpo")


def default_data_cache() -> str:
    """Where the token stores go without --data-cache: $MCORE_DPO_CACHE/data."""
    return os.path.join(default_cache_dir(), "data")


def _build_model(out_dir: str) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER_DIR)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        # 8 heads in 4 query groups (GQA): tp 1, 2, 4 and 8 all divide them.
        num_attention_heads=8,
        num_key_value_heads=4,
        hidden_act="silu",
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    # fork_rng keeps the caller's global RNG state untouched by the fixed seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(DEFAULT_MODEL_SEED)
        model = LlamaForCausalLM(config).to(torch.float32)
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-off write of a 1 MB file needs no progress bar
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(out_dir)


def ensure_default_model(cache_dir: str | None = None) -> str:
    """Directory of the tiny default HF model, created under cache_dir on first use.

    cache_dir is the cache root (default: default_cache_dir()); the model lives in
    <cache_dir>/tiny-llama-v2. Safe to call from many processes at once: each builds in
    a private temp dir and renames it into place; the loser of the race uses the winner's.
    """
    root = os.path.abspath(cache_dir if cache_dir is not None else default_cache_dir())
    model_dir = os.path.join(root, DEFAULT_MODEL_NAME)
    if os.path.isdir(model_dir):
        return model_dir
    os.makedirs(root, exist_ok=True)
    staging_dir = tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=root)
    os.chmod(staging_dir, 0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        _build_model(staging_dir)
        try:
            os.rename(staging_dir, model_dir)
        except OSError:
            # Another process renamed its copy first; theirs is complete, as renames are atomic.
            if not os.path.isdir(model_dir):
                raise
    finally:
        if os.path.isdir(staging_dir):
            shutil.rmtree(staging_dir, ignore_errors=True)
    return model_dir
