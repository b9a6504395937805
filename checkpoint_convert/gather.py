"""megatron -> HF: a stage's stored shards gathered back into Hugging Face tensors, the
inverse of `mapping.hf_to_mcore_shard`. Pure functions (no file I/O, no torch.distributed), read
by the converter's writers and the trainer's HF export; every name, split and shape comes from
checkpoint_convert/mapping.py, the single source of truth of both directions."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

from checkpoint_convert.families import family_of
from checkpoint_convert.families.base import ConversionError, ModelSpec
from checkpoint_convert.mapping import (
    CANONICAL_KIND,
    STACKED,
    check_layout,
    expert_home,
    expert_tp_size,
    hf_form,
    hf_tensor_names,
    mcore_entries,
    mcore_name,
    qkv_group_rows,
    split_entry,
)


def _take(shard: Mapping[str, torch.Tensor], name: str, *, tp_rank: int, pp_rank: int) -> torch.Tensor:
    try:
        return shard[name]
    except KeyError:
        raise ConversionError(f"shard tp{tp_rank}_pp{pp_rank}: tensor '{name}' is missing") from None


def entry_blocks(spec: ModelSpec, *, kind: str, parts: list[torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
    """A non-vocabulary entry's HF tensors from its tp ranks' parts, as (index into the entry's
    HF names, row block) in order: each HF tensor is its blocks concatenated along dim 0. No
    whole tensor is built, so a writer can stream the blocks."""
    if kind == "replicated":
        yield 0, parts[0]
    elif kind == "row":
        yield 0, torch.cat(parts, dim=1)
    elif kind == "column":
        for part in parts:
            yield 0, part
    elif kind == "fc1":
        for i in (0, 1):  # gate, then up: each rank holds [gate_i; up_i]
            for part in parts:
                yield i, part.chunk(2, dim=0)[i]
    elif kind == "qkv":
        groups_per_rank = spec.num_query_groups // len(parts)
        r, d = spec.num_heads // spec.num_query_groups, spec.head_dim
        for i in (0, 1, 2):  # q, k, v: each rank holds whole groups of (r q heads, k, v)
            for part in parts:
                tail = part.shape[1:]
                block = part.reshape(groups_per_rank, (r + 2) * d, *tail).split([r * d, d, d], dim=1)[i]
                yield i, block.reshape(-1, *tail)
    else:
        raise AssertionError(kind)


def stored_pieces(
    spec: ModelSpec, *, kind: str, index: int, dim: int, start: int, stop: int, size: int, tp: int, padded_vocab: int
) -> list[tuple[int, int, int]] | None:
    """Where [start, stop) on `dim` of the `index`-th HF tensor of an entry (its extent there:
    `size`) lies in the entry's tensors of a tp-way split: (tp rank, start, stop) on the same dim
    of that rank's tensor, in order; the HF part is their concatenation on `dim`. Covers the parts
    hf_to_mcore_shard asks for but q/k/v (`stored_group_pieces`): vocabulary rows (the padded
    vocabulary split by rows), gate or up rows (each rank holds [gate part; up part]), columns of
    a row-parallel weight, any part of a replicated one. None for any other part."""
    if kind == "replicated":
        return [(0, start, stop)]
    if kind == "vocab" and dim == 0:
        per_rank, offset = padded_vocab // tp, 0
    elif kind == "fc1" and dim == 0:
        per_rank = size // tp
        offset = index * per_rank
    elif kind == "column" and dim == 0:
        per_rank, offset = size // tp, 0
    elif kind == "row" and dim == 1:
        per_rank, offset = size // tp, 0
    else:
        return None
    pieces = []
    for rank in range(tp):
        lo, hi = max(start, rank * per_rank), min(stop, (rank + 1) * per_rank)
        if lo < hi:
            pieces.append((rank, offset + lo - rank * per_rank, offset + hi - rank * per_rank))
    return pieces


def stored_group_pieces(
    spec: ModelSpec, *, index: int, start: int, stop: int, tp: int
) -> tuple[tuple[int, int], list[tuple[int, int, int]]] | None:
    """Rows [start, stop) of the `index`-th of q, k, v as whole query groups [g0, g1), and where
    the fused rows of those groups lie in a tp-way split: (tp rank, start, stop) rows of that
    rank's fused qkv tensor, in order (`unfuse_groups` takes their concatenation apart). None
    unless the rows are whole groups."""
    unit, fused_rows = qkv_group_rows(spec)[index], sum(qkv_group_rows(spec))
    if start % unit or stop % unit:
        return None
    g0, g1 = start // unit, stop // unit
    per_rank = spec.num_query_groups // tp
    pieces = []
    for rank in range(tp):
        lo, hi = max(g0, rank * per_rank), min(g1, (rank + 1) * per_rank)
        if lo < hi:
            pieces.append((rank, (lo - rank * per_rank) * fused_rows, (hi - rank * per_rank) * fused_rows))
    return (g0, g1), pieces


def unfuse_groups(spec: ModelSpec, fused: torch.Tensor) -> list[torch.Tensor]:
    """q, k and v of the whole query groups that fused qkv rows ([q_g; k_g; v_g] per group) hold."""
    rows, tail = qkv_group_rows(spec), fused.shape[1:]
    parts = fused.reshape(-1, sum(rows), *tail).split(list(rows), dim=1)
    return [part.reshape(-1, *tail) for part in parts]


def _gather_entry(
    spec: ModelSpec,
    *,
    kind: str,
    name: str,
    hf_names: list[str],
    tp: int,
    pp_rank: int,
    get_shard: Callable[[int, int], Mapping[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    parts = [_take(get_shard(t, pp_rank), name, tp_rank=t, pp_rank=pp_rank) for t in range(tp)]
    if kind == "vocab":
        return {hf_names[0]: torch.cat(parts, dim=0)[: spec.vocab_size].contiguous().clone()}
    canonical = CANONICAL_KIND.get(kind, kind)
    blocks: list[list[torch.Tensor]] = [[] for _ in range(2 if canonical == "fc1" else len(hf_names))]
    for i, block in entry_blocks(spec, kind=canonical, parts=parts):
        blocks[i].append(block)
    tensors = hf_form(kind, [torch.cat(b, dim=0) for b in blocks]) if kind in CANONICAL_KIND else [torch.cat(b, dim=0) for b in blocks]
    return {n: t.contiguous().clone() for n, t in zip(hf_names, tensors)}


def gather_stacked(
    spec: ModelSpec, stored: str, *, index: dict, tp: int, layer_spec: str,
    get_shard: Callable[[int, int], Mapping[str, torch.Tensor]], experts: range | None = None,
) -> torch.Tensor:
    """A stacked HF tensor (`STACKED`), its experts' slices gathered one by one (or `experts` of them)."""
    slices = []
    for expert in experts if experts is not None else range(spec.num_experts):
        name = f"{stored}{STACKED}{expert}"
        template, kind, hf_names, pp_rank, local, moe_layer = index[name]
        mcore = mcore_name(template, layer=local, layer_spec=layer_spec, moe_layer=moe_layer)
        slices.append(_gather_entry(spec, kind=kind, name=mcore, hf_names=hf_names, tp=tp, pp_rank=pp_rank,
                                    get_shard=get_shard)[name])
    return torch.stack(slices)


def hf_entry_index(spec: ModelSpec, *, pp: int) -> dict[str, tuple[str, str, list[str], int, int | None, bool]]:
    """HF name -> (mcore template, kind, HF names of the entry, pp_rank, local layer, whether
    the layer is a mixture of experts)."""
    index = {}
    for pp_rank in range(pp):
        for template, kind, hf, local, global_layer in mcore_entries(spec, pp=pp, pp_rank=pp_rank):
            if template == "output_layer.weight" and spec.tie_word_embeddings:
                continue  # the first-stage embedding is the authoritative copy
            hf_names = [t.format(layer=global_layer) for t in hf]
            for hf_name in hf_names:
                index[hf_name] = (template, kind, hf_names, pp_rank, local, spec.is_moe_layer(global_layer))
    return index


def mcore_to_hf(
    spec: ModelSpec,
    *,
    tp: int,
    pp: int,
    get_shard: Callable[[int, int], Mapping[str, torch.Tensor]],
    layer_spec: str = "local",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (HF name, tensor) pairs, vocab trimmed, in hf_tensor_names order.

    get_shard(tp_rank, pp_rank) may be lazy: only the tensors of one entry are read at a time.
    """
    check_layout(spec, tp=tp, pp=pp)
    order = hf_tensor_names(spec)
    index = hf_entry_index(spec, pp=pp)
    pending: dict[str, torch.Tensor] = {}
    for hf_name in order:
        if hf_name not in index:  # experts stacked in one tensor
            yield hf_name, gather_stacked(spec, hf_name, index=index, tp=tp, layer_spec=layer_spec, get_shard=get_shard)
            continue
        if hf_name not in pending:
            template, kind, hf_names, pp_rank, local, moe_layer = index[hf_name]
            name = mcore_name(template, layer=local, layer_spec=layer_spec, moe_layer=moe_layer)
            pending.update(
                _gather_entry(spec, kind=kind, name=name, hf_names=hf_names, tp=tp, pp_rank=pp_rank, get_shard=get_shard)
            )
        yield hf_name, pending.pop(hf_name)


def mcore_to_hf_tensor(
    spec: ModelSpec,
    hf_name: str,
    *,
    tp: int,
    pp: int,
    get_shard: Callable[[int, int], Mapping[str, torch.Tensor]],
    layer_spec: str = "local",
) -> dict[str, torch.Tensor]:
    """The HF tensor hf_name gathered from megatron shards, together with its siblings from
    the same fused entry (q/k/v, gate/up), so a caller can cache them."""
    index = hf_entry_index(spec, pp=pp)
    if hf_name not in index and f"{hf_name}{STACKED}0" in index:
        return {hf_name: gather_stacked(spec, hf_name, index=index, tp=tp, layer_spec=layer_spec, get_shard=get_shard)}
    if hf_name not in index:
        raise ConversionError(f"tensor '{hf_name}' is not part of a {spec.architecture} checkpoint")
    template, kind, hf_names, pp_rank, local, moe_layer = index[hf_name]
    name = mcore_name(template, layer=local, layer_spec=layer_spec, moe_layer=moe_layer)
    return _gather_entry(spec, kind=kind, name=name, hf_names=hf_names, tp=tp, pp_rank=pp_rank, get_shard=get_shard)


def fused_hf_sources(spec: ModelSpec, *, stored: set[str]) -> dict[str, tuple[str, int | None, int, int]]:
    """Hub tensor name -> (stored name, expert, part, parts) for the expert tensors a checkpoint
    holds in transformers 5's in-memory form (the family's FUSED_EXPERT_KEYS: all experts in one
    tensor, gate and up stacked) or under its in-memory names (RENAMED_KEYS). The hub tensor is
    `stored[expert].chunk(parts, dim=0)[part]` (no expert index for a renamed tensor)."""
    family = family_of(spec)
    fused = getattr(family, "FUSED_EXPERT_KEYS", {})
    renamed = getattr(family, "RENAMED_KEYS", {})
    sources: dict[str, tuple[str, int | None, int, int]] = {}
    for layer in spec.moe_layers:
        for template, hubs in fused.items():
            name = template.format(layer=layer)
            if name in stored:
                for expert in range(spec.num_experts):
                    for part, hub in enumerate(hubs):
                        sources[hub.replace("{expert}", str(expert)).format(layer=layer)] = (name, expert, part, len(hubs))
        for template, hub in renamed.items():
            if template.format(layer=layer) in stored:
                sources[hub.format(layer=layer)] = (template.format(layer=layer), None, 0, 1)
    return sources


def tp_part_of_whole_expert(spec: ModelSpec, *, kind: str, whole: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """Tensor-parallel rank tp_rank's part of a whole expert tensor (expert tp 1) as the ep-1
    layout splits it over tp: fc1 by its gate and up halves, fc2 ("row") on its input dim."""
    kind = CANONICAL_KIND.get(kind, kind)
    parts = list(whole.chunk(2, dim=0)) if kind == "fc1" else [whole]
    return split_entry(spec, kind=kind, tensors=parts, tp=tp, tp_rank=tp_rank)


def expert_parallel_view(
    spec: ModelSpec, *, tp: int, pp: int, ep: int, get_shard: Callable[[int, int, int], Mapping[str, torch.Tensor]]
) -> Callable[[int, int], Mapping[str, torch.Tensor]]:
    """The (tp_rank, pp_rank) shards of the ep-1 layout, read from the shards of an
    expert-parallel one (`get_shard(tp_rank, pp_rank, ep_rank)`, as `hf_to_mcore_shard` makes
    them), so that `mcore_to_hf` gathers either. Dense tensors come from ep rank 0; expert e
    from ep rank e // (E/ep) under its local index, its tp part cut from the whole expert (expert
    tp 1) by the ep-1 rule. Lazy: a tensor is read when asked for."""
    etp = expert_tp_size(tp=tp, ep=ep)

    class _View(Mapping):
        def __init__(self, tp_rank: int, pp_rank: int):
            self.tp_rank, self.pp_rank = tp_rank, pp_rank
            self.kinds = {mcore_name(t, layer=local, layer_spec="local"): kind
                          for t, kind, _, local, _ in mcore_entries(spec, pp=pp, pp_rank=pp_rank)}

        def __getitem__(self, name: str) -> torch.Tensor:
            home = expert_home(name, num_experts=spec.num_experts, ep=ep)
            if home is None:
                return get_shard(self.tp_rank, self.pp_rank, 0)[name]
            ep_rank, local = home
            part = get_shard(self.tp_rank % etp, self.pp_rank, ep_rank)[local]
            if etp == tp:
                return part
            return tp_part_of_whole_expert(spec, kind=self.kinds[name], whole=part, tp=tp, tp_rank=self.tp_rank)

        def __iter__(self):
            return iter(self.kinds)

        def __len__(self) -> int:
            return len(self.kinds)

    return _View
