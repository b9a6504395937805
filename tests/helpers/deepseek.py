"""Tiny DeepSeek-V3 models (transformers' own DeepseekV3Config / DeepseekV3ForCausalLM, fp32),
saved as HF directories; their DPO runs are checked by `moe_parity.check_expert_bias_job`.

`deepseek_v3(seed=...)`: 3 layers (layer 0 dense, layers 1-2 MoE), hidden 32, 4 heads,
multi-latent attention with q and kv latents, YaRN RoPE with mscale and mscale_all_dim both set
(so the cos/sin factor and the softmax scale are not 1), 4 routed experts in 2 groups (top 2
from the best group), one shared expert, a routed scale of 2.5, and a random router bias (so the
choice differs from the unbiased one)."""

from __future__ import annotations

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from tests.helpers.models import PAD, VOCAB_SIZE, small_init, with_router_biases
from tests.helpers.moe_parity import check_expert_bias_job as check_deepseek_job  # noqa: F401 (its parity check)

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 0.7}
CONFIG = dict(
    vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
    n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
    max_position_embeddings=128, rms_norm_eps=1e-6, rope_parameters=YARN, num_nextn_predict_layers=0,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=PAD,
)


# The family's model at transformers' own initialisation, for the key-map tests of every family.
TINY = {"deepseek_v3": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(**CONFIG))}


def deepseek_v3(*, seed: int, **overrides) -> DeepseekV3ForCausalLM:
    """The tiny model at `small_init` weights (norms near 1, matrices 0.25 N(0, 1)), its router
    biases 0.1 N(0, 1)."""
    return with_router_biases(small_init(DeepseekV3ForCausalLM(DeepseekV3Config(**{**CONFIG, **overrides})), seed).float().eval(), seed)
