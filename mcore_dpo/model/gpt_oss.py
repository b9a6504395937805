"""GPT-OSS (checkpoint_convert/families/gpt_oss.py) on megatron-core's local layer spec.

megatron-core 0.16.1 has most of it: the attention sinks (`softmax_type="learnable"`: the sink
logit of each head joins the softmax and is dropped after it, as HF's eager attention does), the
biases, the clamped SwiGLU with its offset, the softmax top-k router with its bias. What it cannot
express, as small modules of ours:
- YaRN RoPE on the local spec (GPTModel's own YaRN is multi-latent attention's, with rounded
  correction ranges): the inverse frequencies are set to HF's (`rope_inv_freq`, `truncate` as the
  config says), followed by a 1 (`adapt_model`), so megatron-core's table is [f, p, f, p], where p
  is each token's position; each layer rotates by [f, f] and windows by p (`split_rope`). HF's
  cos/sin scale (attention_factor) is the family's softmax scale (attention_factor^2 / sqrt(d)).
- Sliding layers: megatron-core's local attention with `window_size` replaces the mask it is
  given (padding, packed rows) by a plain sliding-window one built on "cuda" (`SinkCoreAttention`
  keeps the mask it is given). `WindowedSelfAttention` adds the window to that mask by position
  (gemma3.window_mask): a token does not see tokens `sliding_window` or more positions before it,
  so packed rows and rows whose branches restart their positions are windowed as their sequences
  alone would be.
- The experts' output bias at expert-tp 1 without expert parallelism (tp 1, ep 1): megatron-core's
  expert MLP adds it in place to fc2's output, which there comes through a no-op tensor-parallel
  reduce that returns its input as a view, and autograd refuses the in-place add ("Output 0 of
  _ReduceFromModelParallelRegion is a view"). `adapt_model` marks the expert linears as doing
  their own communication (`explicit_expert_comm`, as megatron-core's shared experts do for
  overlap), which skips the region functions; on one expert-tp rank they only return their input.
- The sinks are split over tp by heads but not marked `tensor_model_parallel` by megatron-core;
  `SinkCoreAttention` marks them (`mark_sinks_split`), or the gradient norm counted them on tp
  rank 0 only.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention

from checkpoint_convert.families.base import ModelSpec
from checkpoint_convert.families.gpt_oss import rope_inv_freq
from mcore_dpo.model.gemma3 import is_local, window_mask


def split_rope(emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE angles [..., d] and the positions [...] from the table [..., 2 (d/2 + 1)] = [f, p, f, p]."""
    half = emb.shape[-1] // 2 - 1
    both = emb.unflatten(-1, (2, half + 1))
    return both[..., :half].flatten(-2), both[..., 0, half]


class SinkCoreAttention(DotProductAttention):
    """megatron-core's local attention (the sink as its learnable softmax offset), with the mask it
    is given (the window is in it).

    The offset holds one sink per local head, so it is split over tp like the heads, but
    megatron-core 0.16.1 does not mark it `tensor_model_parallel` (only its sharded_state_dict
    says axis 0). Unmarked, the gradient norm would count it on tp rank 0 only, as if it were
    replicated like a norm, and drop the sinks of the other tp ranks' heads
    (`optim.adamw.params_once`); it is marked here as a column-split parameter."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale_mask_softmax.window_size = None
        mark_sinks_split(self)


def mark_sinks_split(attention: torch.nn.Module) -> None:
    """Marks `attention`'s learnable softmax offset (the sinks of its local heads) as split over
    tp along dim 0, as megatron-core marks a column-parallel weight (SinkCoreAttention)."""
    offset = getattr(attention, "softmax_offset", None)
    if isinstance(offset, torch.nn.Parameter) and not getattr(offset, "tensor_model_parallel", False):
        for attribute in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(offset, attribute):
                delattr(offset, attribute)
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        set_tensor_model_parallel_attributes(offset, True, 0, 1)


class WindowedSelfAttention(SelfAttention):
    """SelfAttention with the angles of the [f, p, f, p] table and, on a sliding layer, the window."""

    def __init__(self, config, submodules, layer_number: int, *args, **kwargs):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.window = config.window_size[0] + 1 if is_local(config, layer_number) else None

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        if attention_mask is None:
            raise ValueError("GPT-OSS: the attention needs the mask it is given (the window is added to it)")
        rotary_pos_emb, positions = split_rope(rotary_pos_emb)
        if self.window is not None:
            attention_mask = attention_mask | window_mask(positions, window=self.window)
        return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)


def with_sink_attention(block_spec):
    """A copy of a local MoE block spec whose layers attend with the modules above."""
    block_spec = copy.deepcopy(block_spec)
    for layer in block_spec.layer_specs:
        attention = layer.submodules.self_attention
        attention.module = WindowedSelfAttention
        attention.submodules.core_attention = SinkCoreAttention
    return block_spec


def inv_freq(spec: ModelSpec) -> torch.Tensor:
    """[HF's inverse frequencies (d/2); 1]: the last one gives each token's position."""
    return torch.cat([rope_inv_freq(spec), torch.ones(1)])


def adapt_model(model: torch.nn.Module, spec: ModelSpec) -> None:
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is not None:
        rope.inv_freq = inv_freq(spec).to(rope.inv_freq.device)
    for module in model.modules():
        # Already True at expert-tp > 1 or ep > 1; where False, the regions it skips are identities.
        if getattr(module, "is_expert", False) and hasattr(module, "explicit_expert_comm"):
            module.explicit_expert_comm = True
