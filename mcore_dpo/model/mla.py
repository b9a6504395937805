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
down projections instead). Here they are replicated too (megatron-core's plain `Linear`, with its extra state: `ReplicatedLinear`): under
sequence parallelism (always on for these MoE models at tp > 1) MLA then all-gathers the rotary
key part, whose backward sums its gradient over tp, and the weights, marked sequence-parallel,
get their gradients summed over tp with the norms' (builder.allreduce_sequence_parallel_grads).

Rows of segments (packing, shared prompts) restart RoPE positions inside a row, but MLA computes
its rotary table inside each layer for positions 0..W-1 and refuses one passed in. The model
builder computes the table at each token's position (`builder._rope_at_positions`) and hands it
to the decoder as its `rotary_pos_emb`, which every layer passes on to its attention (an input
of the layer, so a layer recomputed in the backward gets it again; full recompute is refused
for MoE models today, so that path is not exercised); `PositionedMLASelfAttention` uses it for
that call in place of its own table (its own YaRN mscale is kept).

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

from mcore_dpo.model.rope import rope_returning

if not _te.HAVE_TE:
    _mla.HAVE_TE = False


class LatentDotProductAttention(DotProductAttention):
    """DotProductAttention that accepts (and does not need) MLA's k_channels and v_channels."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None and v_channels != self.hidden_size_per_attention_head:
            raise ValueError(f"multi-latent attention: kv_channels must be v_head_dim ({v_channels}), "
                             f"got {self.hidden_size_per_attention_head}")


class ReplicatedLinear(Linear):
    """megatron-core's replicated `Linear`, with the (empty) extra state every other megatron-core
    linear saves: Megatron-LM's MLA layers (the local spec's column-parallel linears, the
    Transformer Engine spec's TELinear) ask a torch_dist checkpoint for
    `linear_q_down_proj._extra_state` and `linear_kv_down_proj._extra_state`, and a strict load
    fails without them."""

    def get_extra_state(self) -> None:
        return None

    def set_extra_state(self, state) -> None:
        """Nothing to restore."""


class PositionedMLASelfAttention(_mla.MLASelfAttention):
    """MLASelfAttention that takes a rotary table at the tokens' positions ([W, rows, 1, d], the
    `rotary_pos_emb` the decoder passes on) and rotates by it instead of by its own table for
    0..W-1; without one it is megatron-core's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # megatron-core checks the down projections' class against its own list, so they are built
        # as its `Linear` and given their extra state here.
        for name in ("linear_q_down_proj", "linear_kv_down_proj"):
            linear = getattr(self, name, None)
            if type(linear) is Linear:
                linear.__class__ = ReplicatedLinear

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        if rotary_pos_emb is None:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        with _rotary_table(self.rotary_pos_emb, rotary_pos_emb):
            return super().forward(hidden_states, attention_mask, *args, **kwargs)


def _rotary_table(rope, table):
    """`rope` (megatron-core's RotaryEmbedding, or YarnRotaryEmbedding, which also returns its
    mscale) gives `table` whatever length it is asked for."""
    own = rope(1)  # (cached): YaRN's mscale does not depend on the positions
    return rope_returning(rope, (table, own[1]) if isinstance(own, tuple) else table)


def rotary_table_at(model, position_ids, *, num_positions: int):
    """The rotary table of `model`'s MLA layers at `position_ids` [rows, W]: [W, rows, 1, d]
    (every layer's rotary embedding is the same; the first one's computes it)."""
    rope = next(m.rotary_pos_emb for m in model.modules() if isinstance(m, _mla.MLASelfAttention))
    table = rope.get_emb(num_positions)  # [L, 1, 1, d] (YaRN: with its mscale)
    table = table[0] if isinstance(table, tuple) else table
    return table[:, 0][position_ids.t()]


def with_latent_core_attention(block_spec):
    """A copy of a local block spec whose layers' attention is PositionedMLASelfAttention, with
    LatentDotProductAttention as its core attention and replicated linears as its down
    projections."""
    block_spec = copy.deepcopy(block_spec)
    for layer_spec in block_spec.layer_specs:
        layer_spec.submodules.self_attention.module = PositionedMLASelfAttention
        attention = layer_spec.submodules.self_attention.submodules
        attention.core_attention = LatentDotProductAttention
        attention.linear_q_down_proj = Linear
        attention.linear_kv_down_proj = Linear
    return block_spec
