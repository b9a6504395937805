"""Tiny Hugging Face models for the checkpoint_convert tests, built locally (never downloaded).

Each factory returns a randomly initialised transformers model; `save_hf` writes it as an HF
directory (config.json + safetensors, optionally sharded with an index, + a word-level tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB_SIZE = 100  # deliberately not a multiple of 128 * tp: exercises padding and trimming
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
