"""What each layer of a tiny bf16 DeepSeek-V3 stage (multi-latent attention, a dense layer, then a
MoE layer with a shared expert) saves for its backward, on two gloo ranks: at tp 1 (dp 2) and at
tp 2 with sequence parallelism (ep 2), each with and without a q latent (`q_lora_rank` null).
Autograd's saved-tensor hooks, the storages still held when the forward is done counted once per
layer, parameters and buffers left out, each storage put in the groups of the module that saved
it (`attention`: the self-attention block; `mlp`: the MLP block; `router`: the MoE router;
`expert_inputs`: the routed copies the rank's experts received, one buffer for all of them) and
in the layer's total. tests/test_configs.py checks the numbers against
mcore_dpo/tools/memory_estimate.py (the config headers' arithmetic)."""

from __future__ import annotations

import torch

from tests.helpers.saved_tensors import saved_storages, write_stage_saves

SEQ_LEN, ROWS = 16, 2
# Every width distinct, so that no term of the arithmetic can stand in for another.
OVERRIDES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
                 kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=6, v_head_dim=10, intermediate_size=48,
                 moe_intermediate_size=22)
# (name, tp, q_lora_rank); ep = tp, dp = 2 / tp.
CASES = (("tp1", 1, 24), ("tp1_plain_q", 1, None), ("tp2_sp", 2, 24), ("tp2_sp_plain_q", 2, None))


def hf_config(*, q_lora_rank: int | None) -> dict:
    from transformers import DeepseekV3Config

    from tests.helpers.deepseek import CONFIG

    return DeepseekV3Config(**{**CONFIG, **OVERRIDES, "q_lora_rank": q_lora_rank}).to_dict()


def arch_line(*, q_lora_rank: int | None) -> str:
    """The model of `hf_config` as a config header's arch line (tests/helpers/config_arithmetic.py)."""
    c = hf_config(q_lora_rank=q_lora_rank)
    return (f"hidden={c['hidden_size']} layers={c['num_hidden_layers']} heads={c['num_attention_heads']} "
            f"kv_heads={c['num_key_value_heads']} q_lora_rank={c['q_lora_rank'] or 'null'} "
            f"kv_lora_rank={c['kv_lora_rank']} qk_nope_head_dim={c['qk_nope_head_dim']} "
            f"qk_rope_head_dim={c['qk_rope_head_dim']} v_head_dim={c['v_head_dim']} ffn={c['intermediate_size']} "
            f"dense_layers={c['first_k_dense_replace']} experts={c['n_routed_experts']} "
            f"topk={c['num_experts_per_tok']} "
            f"moe_ffn={c['moe_intermediate_size']} shared_ffn={c['n_shared_experts'] * c['moe_intermediate_size']} "
            f"vocab={c['vocab_size']} tied_embeddings=false qkv_bias=false router_bias=true")


def _layer_saves(model, tokens: torch.Tensor) -> dict[str, dict[str, int]]:
    """Per layer and group, the bytes of the storages autograd saved that are still held once the
    forward is done, each storage counted once per layer (tests/helpers/saved_tensors.py)."""
    saved: dict[str, dict[str, int]] = {}
    layer_of = lambda name: name.split(".")[2] if name.startswith("decoder.layers.") else None  # noqa: E731
    for layer, inner, storage in saved_storages(model, tokens, layer_of=layer_of):
        counts = saved.setdefault(layer, dict.fromkeys(("layer", "attention", "mlp", "router", "expert_inputs"), 0))
        counts["layer"] += storage.nbytes()
        for group, marker in (("attention", ".self_attention"), ("mlp", ".mlp"), ("router", ".mlp.router")):
            if marker in inner:
                counts[group] += storage.nbytes()
        if ".local_experts." in inner and inner.endswith(".linear_fc1"):  # the rank's routed copies, one buffer
            counts["expert_inputs"] += storage.nbytes()
    return saved


def _cases() -> list[tuple]:
    """CASES as (name, tp, spec, dtype): bf16 stages of `hf_config`'s model (transformers first:
    write_stage_saves calls this before the platform adapts megatron-core)."""
    from checkpoint_convert.families import spec_from_hf_config

    return [(name, tp, spec_from_hf_config(hf_config(q_lora_rank=q)), torch.bfloat16) for name, tp, q in CASES]


def rank_main(rank: int, ports: tuple[int, int], out_dir: str) -> None:
    tokens = torch.randint(3, 100, (ROWS, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    write_stage_saves(rank, ports, out_dir, cases=_cases, tokens=tokens, measure=_layer_saves, expert_parallel=True)
