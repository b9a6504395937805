"""The arithmetic of configs/'s header comments (`# key: value` lines before the first YAML key):
parameter counts and memory per GPU recomputed from the architecture numbers a header states,
with mcore_dpo.tools.memory_estimate (tests/test_configs.py, tests/test_guide.py)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from checkpoint_convert.mapping import padded_vocab_size
from mcore_dpo.parallel import platform as plat
from mcore_dpo.config import TrainConfig
from mcore_dpo.tools.memory_estimate import LayerShape, expert_param_count, per_gpu_bytes

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"

# Memory per GPU: mcore_dpo.tools.memory_estimate.per_gpu_bytes, the same model the headers are
# computed with (per-parameter bytes, and activations from the plan memory model with
# per-layer coefficients checked against measured tensors in tests/test_memory_estimate.py),
# with the attention implementation the header names.
GPU = plat.Platform(device=torch.device("cuda", 0), backend="nccl")  # the default the headers assume


def header_values(path: Path) -> dict[str, str]:
    """`# key: value` lines of the header comment (before the first YAML key)."""
    values: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            if line.strip():
                break
            continue
        match = re.match(r"#\s*([a-z_]+):\s*(.+)$", line)
        if match:
            values[match.group(1)] = match.group(2).strip()
    return values


def key_values(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split())


def is_moe(arch: dict[str, str]) -> bool:
    return "experts" in arch


def dense_layers(arch: dict[str, str]) -> int:
    """A MoE arch's first layers with a dense MLP of `ffn` (`dense_layers=K`: HF's
    first_k_dense_replace); 0 unless stated (every layer a MoE layer)."""
    return int(arch.get("dense_layers", 0))


def moe_layers(arch: dict[str, str]) -> int:
    return int(arch["layers"]) - dense_layers(arch) if is_moe(arch) else 0


def is_mla(arch: dict[str, str]) -> bool:
    return "kv_lora_rank" in arch


def _mla(arch: dict[str, str]) -> dict[str, int]:
    """Multi-latent attention's sizes (`q_lora_rank=null`: q_proj from the hidden state, as HF's
    config writes it); the q/k head is qk_nope_head_dim + qk_rope_head_dim, so the arch line
    states no head_dim, and every head has its own k and v (kv_heads = heads)."""
    if "head_dim" in arch:
        raise ValueError("arch: multi-latent attention states qk_nope_head_dim + qk_rope_head_dim, not head_dim")
    if arch["kv_heads"] != arch["heads"] or arch["qkv_bias"] != "false":
        raise ValueError("arch: multi-latent attention has kv_heads = heads and no q/k/v bias")
    q_lora = arch["q_lora_rank"]
    return dict(q_lora_rank=0 if q_lora == "null" else int(q_lora), kv_lora_rank=int(arch["kv_lora_rank"]),
                nope=int(arch["qk_nope_head_dim"]), rope=int(arch["qk_rope_head_dim"]), v=int(arch["v_head_dim"]))


def mla_param_count(arch: dict[str, str]) -> int:
    """One layer's multi-latent attention: q_a_proj h x q, q_a_layernorm q, q_b_proj q x n(nope +
    rope) (or q_proj h x n(nope + rope)); kv_a_proj_with_mqa h x (kv + rope), kv_a_layernorm kv,
    kv_b_proj kv x n(nope + v); o_proj n v x h."""
    hidden, heads, m = int(arch["hidden"]), int(arch["heads"]), _mla(arch)
    q_head = m["nope"] + m["rope"]
    q = (hidden * m["q_lora_rank"] + m["q_lora_rank"] + m["q_lora_rank"] * heads * q_head if m["q_lora_rank"]
         else hidden * heads * q_head)
    kv_lora = m["kv_lora_rank"]
    kv = hidden * (kv_lora + m["rope"]) + kv_lora + kv_lora * heads * (m["nope"] + m["v"])
    return q + kv + heads * m["v"] * hidden


def dense_param_count(arch: dict[str, str]) -> int:
    """Decoder-only Llama/Qwen2 layout: GQA attention, SwiGLU MLP, RMSNorm. For a MoE arch
    (every layer a MoE layer), everything but the routed experts: the MLP is the router [E, h].
    Optional keys: `dense_layers=K` (the first K layers' MLP is dense, of `ffn`), `shared_ffn=S`
    (each MoE layer's shared experts, one SwiGLU of S together: dense parameters, split over tp),
    `norms_per_layer=N` (hidden-size norms per layer, 2 unless stated; Gemma 3: 4), `qk_norm=true`
    (per-head q and k norms, head_dim each); `kv_lora_rank` and its keys: multi-latent attention
    (`mla_param_count`) in place of GQA."""
    hidden, layers, vocab = (int(arch[k]) for k in ("hidden", "layers", "vocab"))
    if is_mla(arch):
        attention, heads, head_dim = mla_param_count(arch), int(arch["heads"]), 0
    else:
        heads, kv_heads, head_dim = (int(arch[k]) for k in ("heads", "kv_heads", "head_dim"))
        attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
        if arch["qkv_bias"] == "true":
            attention += (heads + 2 * kv_heads) * head_dim
    mlp = int(arch["experts"]) * hidden if is_moe(arch) else 3 * hidden * int(arch["ffn"])
    # GPT-OSS: the o_proj bias, one sink logit per head, the router's bias.
    attention += hidden * (arch.get("o_bias") == "true") + heads * (arch.get("sinks") == "true")
    attention += 2 * head_dim * (arch.get("qk_norm") == "true")
    mlp += int(arch.get("experts", 0)) * (arch.get("router_bias") == "true")
    mlp += 3 * hidden * int(arch.get("shared_ffn", 0))
    per_layer = attention + mlp + int(arch.get("norms_per_layer", 2)) * hidden
    embeddings = vocab * hidden * (1 if arch["tied_embeddings"] == "true" else 2)
    first = dense_layers(arch) * (3 * hidden * int(arch.get("ffn", 0)) - mlp)  # dense MLPs in place of MoE ones
    return embeddings + layers * per_layer + first + hidden


def layer_shape(arch: dict[str, str], *, tp: int) -> LayerShape:
    moe = dict(experts=int(arch["experts"]), topk=int(arch["topk"]), moe_ffn=int(arch["moe_ffn"])) if is_moe(arch) else {}
    if is_moe(arch):
        moe.update(shared_ffn=int(arch.get("shared_ffn", 0)), dense_layers=dense_layers(arch))
    if is_mla(arch):
        m = _mla(arch)
        head_dim = m["nope"] + m["rope"]
        moe.update(q_lora_rank=m["q_lora_rank"], kv_lora_rank=m["kv_lora_rank"], qk_rope_head_dim=m["rope"],
                   v_head_dim=m["v"])
    else:
        head_dim = int(arch["head_dim"])
    return LayerShape(hidden=int(arch["hidden"]), heads=int(arch["heads"]), kv_heads=int(arch["kv_heads"]),
                      head_dim=head_dim, ffn=int(arch.get("ffn", 0)),
                      vocab=padded_vocab_size(int(arch["vocab"]), tp=tp), norms=int(arch.get("norms_per_layer", 2)),
                      fp32_norms=arch.get("fp32_norms") == "true", qk_norm=arch.get("qk_norm") == "true", **moe)


def expert_params(arch: dict[str, str]) -> int:
    """The routed experts' parameters (SwiGLU: 3 h x f_moe matrices each, every layer; with
    `expert_bias=true` (GPT-OSS) also the gate/up biases 2 f_moe and the down bias h)."""
    if not is_moe(arch):
        return 0
    biases = 0
    if arch.get("expert_bias") == "true":
        biases = moe_layers(arch) * int(arch["experts"]) * (2 * int(arch["moe_ffn"]) + int(arch["hidden"]))
    return expert_param_count(layer_shape(arch, tp=1), moe_layers=moe_layers(arch)) + biases


def param_count(arch: dict[str, str]) -> int:
    return dense_param_count(arch) + expert_params(arch)


def memory_gb_per_gpu(*, arch: dict[str, str], config: TrainConfig, attention: str) -> float:
    shape = layer_shape(arch, tp=config.tp)
    sequence_parallel = plat.use_sequence_parallel(GPU, requested=config.sequence_parallel, tp=config.tp)
    num_microbatches = config.global_batch_size // (config.dp * config.micro_batch_size)
    return per_gpu_bytes(shape, params=dense_param_count(arch), layers=int(arch["layers"]), tp=config.tp, pp=config.pp,
                         dp=config.dp, distributed_optimizer=config.distributed_optimizer,
                         micro_batch_size=config.micro_batch_size, num_microbatches=num_microbatches,
                         seq_len=config.max_length, ref_mode=config.ref_mode, sequence_parallel=sequence_parallel,
                         attention=attention, expert_params=expert_params(arch), ep=config.ep,
                         recompute=config.recompute, recompute_num_layers=config.recompute_num_layers,
                         cp=config.cp) / 1e9
