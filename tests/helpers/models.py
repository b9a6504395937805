"""Tiny Hugging Face models, built locally (never downloaded), and the HF directories they are
saved as.

- The converter's variants (`llama_gqa_untied`, `llama_tied`, `llama3_rope_scaled`, `mistral_mha`,
  `qwen2_bias_tied`; `FAMILY_VARIANTS`): seed-1234 weights around 1 for norms.
- The parity models (`make_model`, `write_models`, `qwen3`, `qwen3_moe`, `mixtral`): small weights
  (`small_init`) so that two steps of training stay well conditioned; policy and reference differ.
- `TINY_FAMILIES`: one model of every family at transformers' own initialisation (the key maps).

`save_hf` writes a model as an HF directory (config.json + safetensors, optionally sharded with an
index, + a word-level tokenizer); `hub_tensors` is what `save_pretrained` writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import (
    LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen2Config,
    Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM,
)  # fmt: skip

# Not a multiple of 128 * tp: exercises vocabulary padding and trimming, and padded vocabulary
# columns must stay out of the softmax.
VOCAB_SIZE = 100
PAD = 0
_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)


def llama_gqa_untied() -> LlamaForCausalLM:
    config = LlamaConfig(**_COMMON, num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    return _init(LlamaForCausalLM(config))


def llama_tied() -> LlamaForCausalLM:
    config = LlamaConfig(**_COMMON, num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True)
    return _init(LlamaForCausalLM(config))


def llama3_rope_scaled() -> LlamaForCausalLM:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    config = LlamaConfig(**_COMMON, num_attention_heads=8, num_key_value_heads=4, rope_parameters=rope)
    return _init(LlamaForCausalLM(config))


def mistral_mha() -> MistralForCausalLM:
    config = MistralConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=4, head_dim=8, sliding_window=None)
    return _init(MistralForCausalLM(config))


def qwen2_bias_tied() -> Qwen2ForCausalLM:
    config = Qwen2Config(**_COMMON, num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True)
    return _init(Qwen2ForCausalLM(config))


FAMILY_VARIANTS = {
    "llama_gqa_untied": llama_gqa_untied,
    "llama_tied": llama_tied,
    "llama3_rope_scaled": llama3_rope_scaled,
    "mistral_mha": mistral_mha,
    "qwen2_bias_tied": qwen2_bias_tied,
}


def _init(model: torch.nn.Module) -> torch.nn.Module:
    """Random weights everywhere, norms and biases included, so a swapped tensor cannot hide."""
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for _, param in model.named_parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2 + (1.0 if param.dim() == 1 else 0.0))
    return model.eval()


def hf_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors an HF checkpoint of this model holds (tied lm_head dropped, as transformers saves)."""
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def save_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB_SIZE)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(directory))


def save_pretrained_with_tokenizer(model: torch.nn.Module, directory: Path) -> Path:
    """`model` as transformers' own save_pretrained writes it, with the tiny tokenizer: what a
    download from the hub holds (the family tests' `hub_dir`)."""
    model.save_pretrained(str(directory))
    save_tokenizer(directory)
    return directory


def save_hf(model: torch.nn.Module, directory: Path, *, num_shards: int = 1, dtype: torch.dtype | None = None) -> Path:
    """Write model as an HF directory; num_shards > 1 writes an index like transformers does."""
    directory.mkdir(parents=True, exist_ok=True)
    state = hf_state(model)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    config = model.config.to_dict()
    config["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(str(directory))
    save_tokenizer(directory)
    names = list(state)
    if num_shards == 1:
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return directory
    weight_map = {}
    per_shard = -(-len(names) // num_shards)
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        chunk = {n: state[n] for n in names[i * per_shard : (i + 1) * per_shard]}
        save_file(chunk, str(directory / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in chunk})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return directory


def assert_export_generates_like(original_dir: Path, exported_dir: Path, *, prompt: list[int], max_new_tokens: int) -> None:
    """The exported HF directory loads with no missing, unexpected or mismatched keys, and its
    greedy generation equals the original's."""
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(str(original_dir)).eval()
    exported, info = AutoModelForCausalLM.from_pretrained(str(exported_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tokens = torch.tensor([prompt])
    settings = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(exported.eval().generate(tokens, **settings), original.generate(tokens, **settings))


def exported_logits(mcore_dir: Path, out_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """`checkpoint_convert mcore-to-hf` of a Megatron checkpoint or save directory (its command
    line, in this process), then the exported model's fp32 logits on `tokens`."""
    from transformers import AutoModelForCausalLM

    from checkpoint_convert.__main__ import main as convert

    assert convert(["mcore-to-hf", "--mcore-dir", str(mcore_dir), "--out", str(out_dir)]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


# --------------------------------------------------------------------------- parity models
def small_init(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Norms around 1, matrices at 0.25 x N(0, 1): the parity models' weights."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.25 * torch.randn(p.shape, generator=gen))
    return model


def with_router_biases(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """`model` with its sigmoid routers' loaded biases (`e_score_correction_bias` buffers) at
    0.1 N(0, 1), so that the bias changes which experts are chosen (DeepSeek-V3, GLM-4.5)."""
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))
    return model


def make_model(family: str, seed: int) -> torch.nn.Module:
    """The dense parity model: "llama" (GQA, untied) or "qwen2" (qkv bias, tied)."""
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    else:
        raise ValueError(family)
    return small_init(model, seed).float()


def write_models(family: str, root: Path) -> tuple[Path, Path]:
    """Policy and reference with DIFFERENT weights (so u± are not zero at step 1)."""
    policy = save_hf(make_model(family, seed=1), root / f"{family}_policy")
    reference = save_hf(make_model(family, seed=2), root / f"{family}_ref")
    return policy, reference


_QWEN3_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                     rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=PAD)


def qwen3(*, tied: bool, seed: int) -> Qwen3ForCausalLM:
    """Qwen3 dense: per-head q/k RMSNorm, head_dim 16 (hidden/heads = 8), no qkv bias."""
    return small_init(Qwen3ForCausalLM(Qwen3Config(**_QWEN3_COMMON, tie_word_embeddings=tied)), seed).float().eval()


# The MoE parity models' shared config fields (two layers unless asked otherwise).
MOE_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1,
                  eos_token_id=2, pad_token_id=PAD)


def qwen3_moe(*, seed: int, num_layers: int = 2, **overrides) -> Qwen3MoeForCausalLM:
    """Qwen3-MoE, 4 experts, top 2, untied; at more than 2 layers layer 1 is dense."""
    config = Qwen3MoeConfig(**{**MOE_COMMON, "num_hidden_layers": num_layers}, intermediate_size=48,
                            moe_intermediate_size=24, head_dim=16, num_experts=4, num_experts_per_tok=2,
                            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1] if num_layers > 2 else [],
                            tie_word_embeddings=False, **overrides)
    return small_init(Qwen3MoeForCausalLM(config), seed).float().eval()


def mixtral(*, seed: int, **overrides) -> MixtralForCausalLM:
    """Mixtral, 4 experts, top 2, tied embeddings."""
    config = MixtralConfig(**MOE_COMMON, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                           tie_word_embeddings=True, **overrides)
    return small_init(MixtralForCausalLM(config), seed).float().eval()


MOE_FACTORIES = {"qwen3_moe": qwen3_moe, "mixtral": mixtral}


# --------------------------------------------------------------------------- one model per family
_FAMILY_COMMON = dict(vocab_size=100, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64)
TINY_FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**_FAMILY_COMMON, intermediate_size=64)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**_FAMILY_COMMON, intermediate_size=64, head_dim=8)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_FAMILY_COMMON, intermediate_size=64, tie_word_embeddings=True)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**_FAMILY_COMMON, intermediate_size=64, head_dim=16)),
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **_FAMILY_COMMON, intermediate_size=64, moe_intermediate_size=24, head_dim=16, num_experts=4,
        num_experts_per_tok=2, mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=True)),
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(**_FAMILY_COMMON, intermediate_size=24, num_local_experts=4,
                                                        num_experts_per_tok=2)),
}


def hub_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What save_pretrained writes (transformers 5 turns fused experts back into the hub's form)."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        return load_file(f"{directory}/model.safetensors")

