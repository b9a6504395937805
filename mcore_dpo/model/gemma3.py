"""Gemma 3 (checkpoint_convert/families/gemma3.py) on megatron-core's local layer spec.

What megatron-core 0.16.1's local spec cannot express, as small modules of ours:
- `GemmaRMSNorm`: HF's norm scales by (1 + w) in fp32 (megatron-core's zero-centred gamma exists
  for Transformer Engine's norms only; its torch norm refuses it). The checkpoint keeps w.
- Sandwich norms: a transformer layer has no norm after its attention or its MLP, so
  `GemmaSelfAttention` and `GemmaMLP` norm their own output (`post_layernorm`), before the
  residual add. LoRA's updates (hooks on linear_proj and linear_fc2) come before that norm.
- Two RoPE bases: GPTModel computes one table for all layers. Its inverse frequencies are set to
  [global (d/2); local (d/2); 1] (as HF computes them), so megatron-core's own table (with its
  caching, and the trainer's indexing of it by position for rows of segments) is
  [g, l, p, g, l, p], where p is each token's position, exactly. Each layer takes its kind's
  angles [g, g] or [l, l] and the positions (`layer_rope`).
- Local layers: megatron-core's `window_size` / `window_attn_skip_freq` say which layers are
  local (the family sets them), but its local attention then replaces the mask it is given
  (padding, packed rows) with a plain sliding-window one, built on "cuda" (`GemmaCoreAttention`
  keeps megatron-core's attention without that). `GemmaSelfAttention` adds the window to the
  mask it is given: a token does not see tokens W or more positions before it (HF's window), by
  positions, so packed rows and rows whose branches restart their positions are windowed as
  their sequences alone would be.
- Embedding scale and final logit cap: forward hooks (`adapt_model`), the scale rounded to the
  weights' dtype first, as HF does.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.utils import is_layer_window_attention

from checkpoint_convert.families.base import ModelSpec

class GemmaRMSNorm(torch.nn.Module):
    """x / rms(x) * (1 + w), computed in fp32 and cast back (HF's Gemma3RMSNorm, op for op).
    Built as megatron-core builds its norms; the weight is marked `sequence_parallel` under
    sequence parallelism (its gradient then covers this rank's tokens and is summed over tp)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


def is_local(config, layer_number: int) -> bool:
    """Whether global layer `layer_number` (1-based) is a local (sliding-window) layer."""
    return is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)


def layer_rope(emb: torch.Tensor, *, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer kind's RoPE angles [..., d] and the positions [...] from the table
    [..., 2 (d + 1)] = [g, l, p, g, l, p]."""
    d = emb.shape[-1] // 2 - 1
    both = emb.unflatten(-1, (2, d + 1))
    angles = both[..., :d].unflatten(-1, (2, d // 2)).select(-2, int(local)).flatten(-2)
    return angles, both[..., 0, d]


def window_mask(positions: torch.Tensor, *, window: int) -> torch.Tensor:
    """[rows or 1, 1, s, s] bool, True where a key is `window` or more positions before the query
    (`positions` [s, rows or 1, 1], as the RoPE table holds them)."""
    p = positions[..., 0].t()
    return ((p[:, :, None] - p[:, None, :]) >= window)[:, None]


class GemmaCoreAttention(DotProductAttention):
    """megatron-core's local attention, with the mask it is given (the window is in it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale_mask_softmax.window_size = None


class GemmaSelfAttention(SelfAttention):
    """SelfAttention with its layer kind's RoPE, the window on a local layer, and a norm of its
    output."""

    def __init__(self, config, submodules, layer_number: int, *args, **kwargs):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.local = is_local(config, layer_number)
        self.window = config.window_size[0] + 1 if self.local else None
        self.post_layernorm = GemmaRMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        if attention_mask is None:
            raise ValueError("Gemma 3: the attention needs the mask it is given (the window is added to it)")
        rotary_pos_emb, positions = layer_rope(rotary_pos_emb, local=self.local)
        if self.window is not None:
            attention_mask = attention_mask | window_mask(positions, window=self.window)
        output, bias = super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)
        return self.post_layernorm(output), bias


class GemmaMLP(MLP):
    """The GeGLU MLP with a norm of its output."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.post_layernorm = GemmaRMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, hidden_states, *args, **kwargs):
        output, bias = super().forward(hidden_states, *args, **kwargs)
        return self.post_layernorm(output), bias


def block_spec(config, *, pp_rank: int, vp_stage: int | None = None):
    """This stage's block spec (of its model chunk `vp_stage`, --vpp): megatron-core's local layer
    (q/k norms on) with the modules above."""
    layer = copy.deepcopy(gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True))
    layer.submodules.input_layernorm = GemmaRMSNorm
    layer.submodules.pre_mlp_layernorm = GemmaRMSNorm
    attention = layer.submodules.self_attention
    attention.module = GemmaSelfAttention
    attention.submodules.core_attention = GemmaCoreAttention
    attention.submodules.q_layernorm = GemmaRMSNorm
    attention.submodules.k_layernorm = GemmaRMSNorm
    layer.submodules.mlp.module = GemmaMLP
    num_layers = get_num_layers_to_build(config, pp_rank=pp_rank, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=GemmaRMSNorm)


def inv_freq(spec: ModelSpec) -> torch.Tensor:
    """[global; local; 1] RoPE inverse frequencies (d/2 each, as HF computes them: default, or
    divided by the linear factor), the last one giving each token's position."""
    d = spec.head_dim
    parts = []
    for theta, factor in zip((spec.rope_theta, spec.rope_local_theta), spec.rope_linear_factors):
        part = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        parts.append(part / factor if factor != 1.0 else part)
    return torch.cat(parts + [torch.ones(1)])


def embedding_scale(spec: ModelSpec, *, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) rounded to the weights' dtype, as HF's scaled embedding multiplies by it."""
    return torch.tensor(spec.hidden_size ** 0.5).to(dtype).item()


def adapt_model(model: torch.nn.Module, spec: ModelSpec, *, dtype: torch.dtype) -> None:
    """What a built GPTModel chunk of Gemma 3 needs beyond its layers: the two-kind RoPE table,
    the embedding scaled by sqrt(hidden_size) and the final logits capped."""
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is not None:
        rope.inv_freq = inv_freq(spec).to(rope.inv_freq.device)
    if model.pre_process:
        scale = embedding_scale(spec, dtype=dtype)
        model.embedding.word_embeddings.register_forward_hook(lambda _m, _a, out: out * scale)
    if model.post_process and spec.final_logit_softcapping:
        cap = spec.final_logit_softcapping

        def softcap(_module, _args, output):
            logits, bias = output
            return torch.tanh(logits / cap) * cap, bias

        model.output_layer.register_forward_hook(softcap)
