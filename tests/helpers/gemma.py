"""Tiny Gemma 3 text models (transformers' own Gemma3TextConfig / Gemma3ForCausalLM, fp32).

`gemma3(seed=...)`: 6 layers, local (sliding window 4, shorter than the test sequences) except
layers 2 and 5 (so each stage of a pp-2 split has both kinds), hidden 32, 4 heads in 2 groups of
head_dim 16 (heads x head_dim = 64, not hidden), query_pre_attn_scalar 24 (not head_dim), a
global RoPE base 1e6 with linear factor 8 and a local base 1e4, a final logit cap of 5, tied
embeddings. Norm weights 0.1 N(0, 1) (HF scales by 1 + w), matrices 0.25 N(0, 1)."""

from __future__ import annotations

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from tests.helpers.models import PAD, VOCAB_SIZE

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
CONFIG = dict(
    vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=4, layer_types=LAYER_TYPES,
    rope_parameters=ROPE, final_logit_softcapping=5.0, max_position_embeddings=128, rms_norm_eps=1e-6,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=PAD,
)

# The family's model at transformers' own initialisation, for the key-map tests of every family.
TINY = {"gemma3_text": lambda: Gemma3ForCausalLM(Gemma3TextConfig(**CONFIG))}


def gemma3(*, seed: int, **overrides) -> Gemma3ForCausalLM:
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**CONFIG, **overrides}))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_((0.1 if p.dim() == 1 else 0.25) * torch.randn(p.shape, generator=gen))
    return model.float().eval()
