"""Multi-latent attention (DeepSeek-V3) on megatron-core's local layer spec.

megatron-core 0.16.1's MLASelfAttention builds its core attention with the q/k and v head sizes
(`k_channels`, `v_channels`), which its local `DotProductAttention` does not take (only the
Transformer Engine attention does). The local class's forward already works from the tensors'
own head sizes, with the softmax scale MLA passes, and returns [s, b, heads/tp * kv_channels]:
with `kv_channels` = v_head_dim (the builder sets it) that is the attention output. So the local
spec's core attention is this subclass, which takes and drops the two sizes.

The local spec's down projections are column-parallel linears whose outputs MLA gathers over tp.
There the rotary key part, used by every head, gets on each tp rank only its own heads' share of
its gradient, and nothing sums the shares (megatron-core's Transformer Engine spec replicates the
down projections instead). Here they are replicated too (megatron-core's plain `Linear`): under
sequence parallelism (always on for these MoE models at tp > 1) MLA then all-gathers the rotary
key part, whose backward sums its gradient over tp, and the weights, marked sequence-parallel,
get their gradients summed over tp with the norms' (builder.allreduce_sequence_parallel_grads).

Without Transformer Engine, megatron-core 0.16.1's extension module exports placeholders (not
classes) under the Transformer Engine names, and its MLA module, whose import of them succeeds,
then calls isinstance with one and fails: its `HAVE_TE` is set from the extension module's own.
"""

from __future__ import annotations

import copy

from megatron.core.extensions import transformer_engine as _te
from megatron.core.post_training.modelopt.layers import Linear
from megatron.core.transformer import multi_latent_attention as _mla
from megatron.core.transformer.dot_product_attention import DotProductAttention

if not _te.HAVE_TE:
    _mla.HAVE_TE = False


class LatentDotProductAttention(DotProductAttention):
    """DotProductAttention that accepts (and does not need) MLA's k_channels and v_channels."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None and v_channels != self.hidden_size_per_attention_head:
            raise ValueError(f"multi-latent attention: kv_channels must be v_head_dim ({v_channels}), "
                             f"got {self.hidden_size_per_attention_head}")


def with_latent_core_attention(block_spec):
    """A copy of a local block spec whose layers' core attention is LatentDotProductAttention and
    whose down projections are replicated linears."""
    block_spec = copy.deepcopy(block_spec)
    for layer_spec in block_spec.layer_specs:
        attention = layer_spec.submodules.self_attention.submodules
        attention.core_attention = LatentDotProductAttention
        attention.linear_q_down_proj = Linear
        attention.linear_kv_down_proj = Linear
    return block_spec
