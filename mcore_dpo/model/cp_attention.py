"""Context-parallel core attention for megatron-core's local layer spec (--cp > 1 without
Transformer Engine: the CPU, and the fallback wherever TE is absent).

megatron-core's local `DotProductAttention` refuses context_parallel_size > 1 (only its
Transformer Engine attention runs CP, as a p2p ring). This subclass runs on any backend, gloo
included: each cp rank all-gathers the keys and values of the whole row from the cp group
(`parallel.context_parallel.gather_shared`, whose backward sums the key and value gradients of
every rank's queries back to the ranks that own those positions), puts them in position order,
and attends from its own query positions. Which keys a query may see comes with the mask the
executor hands it: [rows, 1, W/cp, W], the whole row's mask (causal, or the `segment_mask` of
packed rows) at this rank's query positions (`context_parallel.local_positions`), every key in
position order. RoPE was applied before, at each token's global position (the executor's
position ids). The scores are W/cp x W per rank: this is the all-gather scheme, exact and simple,
not the ring's memory.
"""

from __future__ import annotations

import copy

from megatron.core.transformer.dot_product_attention import DotProductAttention

from mcore_dpo.parallel.context_parallel import gather_shared


class ContextParallelDotProductAttention(DotProductAttention):
    """megatron-core's local core attention over keys and values gathered from the cp group."""

    def __init__(self, config, *args, pg_collection=None, **kwargs):
        # The local class asserts context_parallel_size == 1; it computes the same thing for one
        # rank's queries against whole-row keys (sq != sk), which is what it is given here.
        local = copy.copy(config)
        local.context_parallel_size = 1
        super().__init__(local, *args, pg_collection=pg_collection, **kwargs)
        if pg_collection is None or getattr(pg_collection, "cp", None) is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["cp"])
        self.cp_group = pg_collection.cp

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_mask is None or attention_mask.shape[-1] != key.shape[0] * self.cp_group.size():
            raise ValueError("context-parallel attention: needs the mask of this rank's queries against the whole "
                             f"row, [.., {query.shape[0]}, {key.shape[0] * self.cp_group.size()}]")
        key = gather_shared(key, dim=0, group=self.cp_group)  # [W, b, ng, hn]
        value = gather_shared(value, dim=0, group=self.cp_group)
        return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                               attention_bias=attention_bias, packed_seq_params=packed_seq_params)


def with_context_parallel_attention(layer_spec):
    """A copy of a local layer (or block) spec whose self-attention's core attention is
    ContextParallelDotProductAttention."""
    layer_spec = copy.deepcopy(layer_spec)
    for layer in getattr(layer_spec, "layer_specs", None) or [layer_spec]:
        layer.submodules.self_attention.submodules.core_attention = ContextParallelDotProductAttention
    return layer_spec
