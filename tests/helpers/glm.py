"""Tiny GLM-4.5 models (transformers' own Glm4MoeConfig / Glm4MoeForCausalLM, fp32), saved as HF
directories; their DPO runs are checked by `moe_parity.check_expert_bias_job`.

`glm4_moe(seed=...)`: 3 layers (layer 0 dense, layers 1-2 MoE), hidden 32, 4 heads in 2 query
groups of head_dim 16, partial RoPE over the first 8 dims of each head (partial_rotary_factor
0.5: the rotated and the passed-through halves both matter), q/k/v biases, per-head q/k norms
(GLM-4.5; `use_qk_norm=False` is GLM-4.5-Air), 4 routed experts in 2 groups (top 2 from the
best group), one shared expert, a routed scale of 2.5, and a random router bias (so the choice
differs from the unbiased one)."""

from __future__ import annotations

from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

from tests.helpers.models import PAD, VOCAB_SIZE, small_init, with_router_biases

CONFIG = dict(
    vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, attention_bias=True,
    use_qk_norm=True, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
    routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=128,
    rms_norm_eps=1e-5, rope_theta=10000.0, num_nextn_predict_layers=0, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=PAD,
)


# The family's model at transformers' own initialisation, for the key-map tests of every family
# (GLM-4.5-Air's attention: no q/k norms).
TINY = {"glm4_moe": lambda: Glm4MoeForCausalLM(Glm4MoeConfig(**{**CONFIG, "use_qk_norm": False}))}


def glm4_moe(*, seed: int, **overrides) -> Glm4MoeForCausalLM:
    """The tiny model at `small_init` weights (norms and biases near 1, matrices 0.25 N(0, 1)),
    its router biases 0.1 N(0, 1)."""
    return with_router_biases(small_init(Glm4MoeForCausalLM(Glm4MoeConfig(**{**CONFIG, **overrides})), seed).float().eval(), seed)
