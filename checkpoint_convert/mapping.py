"""The Hugging Face <-> megatron-core parameter mapping: the single source of truth.

Pure functions only (no file I/O, no torch.distributed). Both the converter CLI and the
trainer's model builder use this module, so a checkpoint converted offline and one
converted on the fly at model build time are identical.

Each family (`checkpoint_convert/families/`) has one literal, templated key map: megatron-core
name template -> (how the tensor is split across tensor-parallel ranks, Hugging Face name
templates). This module holds what all families share: stage layout, names, shapes, the walk
over a stage's entries, and the split of HF tensors into a stage's shards (HF -> megatron).
The way back, shards gathered into HF tensors, is checkpoint_convert/gather.py, built on the
same entries and splits.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping

import torch

from checkpoint_convert.families import family_of
from checkpoint_convert.families.base import ConversionError, ModelSpec

LAYER_SPECS = ("local", "te")

# Experts stored stacked (GPT-OSS: one HF tensor [E, ...] per projection, as transformers holds
# them): the key map names expert e's slice `<stored name>@{expert}`; the files hold the stack.
STACKED = "@"
# Split kinds of such slices, each the HF form of a megatron-core kind (`canonical_tensors`):
#   fc1_interleaved  [h, 2I] (or a bias [2I]) with gate and up interleaved on the last dim
#                    (even: gate, odd: up), the input dim first: megatron-core's fc1
#   row_transposed   [I, h], the input dim first: megatron-core's row-parallel fc2
CANONICAL_KIND = {"fc1_interleaved": "fc1", "row_transposed": "row"}


def stacked_source(name: str) -> tuple[str, int] | None:
    """(stored stacked tensor, expert) of a slice name `<stored>@<expert>`; None for any other name."""
    stored, sep, expert = name.rpartition(STACKED)
    return (stored, int(expert)) if sep and expert.isdigit() else None


def stacked_reader(get: Callable[[str], torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """get(name), where an expert's slice of a stacked tensor (mapping.STACKED) is read from its
    stack, the last stack read kept (the entries of one stack come one after the other)."""
    cache: dict[str, torch.Tensor] = {}

    def get_hf(name: str) -> torch.Tensor:
        source = stacked_source(name)
        if source is None:
            return get(name)
        if source[0] not in cache:
            cache.clear()
            cache[source[0]] = get(source[0])
        return cache[source[0]][source[1]]

    return get_hf


def canonical_tensors(kind: str, tensors: list[torch.Tensor]) -> tuple[str, list[torch.Tensor]]:
    """An entry's HF tensors in the form of its megatron-core kind: an interleaved gate/up slice
    as (gate [I, h], up [I, h]) (or a bias's halves), a transposed fc2 slice as [h, I]."""
    if kind == "fc1_interleaved":
        (whole,) = tensors
        gate, up = whole[..., 0::2], whole[..., 1::2]
        return "fc1", [gate.t().contiguous(), up.t().contiguous()] if whole.dim() == 2 else [gate.contiguous(), up.contiguous()]
    if kind == "row_transposed":
        return "row", [tensors[0].t().contiguous()]
    return kind, tensors


def hf_form(kind: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The inverse of `canonical_tensors`: (gate, up) interleaved back (and transposed), [h, I] transposed."""
    if kind == "fc1_interleaved":
        gate, up = tensors
        whole = torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])
        return [whole.t().contiguous() if whole.dim() == 2 else whole]
    if kind == "row_transposed":
        return [tensors[0].t().contiguous()]
    return tensors


def _canonical_shapes(kind: str, shapes: list[tuple[int, ...]]) -> tuple[str, list[tuple[int, ...]]]:
    if kind == "fc1_interleaved":
        shape = shapes[0]
        half = (shape[-1] // 2, *shape[:-1])
        return "fc1", [half, half]
    if kind == "row_transposed":
        return "row", [tuple(reversed(shapes[0]))]
    return kind, shapes


def hf_shape(shapes: Mapping[str, tuple[int, ...]], name: str) -> tuple[int, ...]:
    """The shape of HF tensor `name` (a stacked slice: its stored tensor's, less the expert dim)."""
    source = stacked_source(name)
    return shapes[name] if source is None else tuple(shapes[source[0]][1:])

# The stages' own entries (the per-layer ones are each family's `layer_keys`).
# Order matters: it is the order tensors are streamed in (embedding, layers, head).
_FIRST_STAGE_KEYS = {"embedding.word_embeddings.weight": ("vocab", ("model.embed_tokens.weight",))}
# A reward model (spec.num_labels > 0, families/__init__.py) has no output_layer: its score head
# `score.weight` [num_labels, h] is whole on every tp rank of the last stage (a few rows, not split),
# under the HF name, as a module `score` of the model would name it.
_LAST_STAGE_KEYS = {
    "decoder.final_layernorm.weight": ("replicated", ("model.norm.weight",)),
    "output_layer.weight": ("vocab", ("lm_head.weight",)),
    "score.weight": ("replicated", ("score.weight",)),
}
# Transformer Engine fuses the pre-attention norm into linear_qkv, and a dense layer's pre-MLP
# norm into linear_fc1. A mixture-of-experts layer keeps its pre-MLP norm as a module of its
# own: the router and every expert read the normed input (megatron-core's TE layer spec).
TE_RENAMES = {".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight"}
TE_DENSE_MLP_RENAMES = {".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight"}


# ---------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------


def padded_vocab_size(vocab_size: int, *, tp: int, divisor: int = 128) -> int:
    """Vocabulary rounded up to a multiple of divisor * tp (megatron's rule)."""
    multiple = divisor * tp
    return math.ceil(vocab_size / multiple) * multiple


def check_layout(spec: ModelSpec, *, tp: int, pp: int, ep: int = 1, source: str = "config.json", divisor: int = 128,
                 vpp: int = 1) -> None:
    """Raise ConversionError unless the model can be split tp x pp (and its experts over ep), each
    pipeline rank holding `vpp` model chunks (virtual pipeline stages, `chunk_layers`)."""
    if tp < 1 or pp < 1 or ep < 1 or vpp < 1:
        raise ConversionError(f"layout: tp, pp, ep and vpp must be >= 1, got tp={tp} pp={pp} ep={ep} vpp={vpp}")
    if vpp > 1 and pp == 1:
        raise ConversionError(f"--vpp {vpp} needs pipeline parallelism (pp >= 2), got pp 1")
    if vpp > 1:
        chunk_layers(spec.num_layers, pp=pp, pp_rank=0, vpp=vpp, chunk=0)  # one line unless the chunks are equal
    if ep > 1 and not spec.num_experts:
        raise ConversionError(f"{source}: ep={ep} asks for expert parallelism, but {spec.architecture} has no experts")
    if spec.num_experts % ep:
        raise ConversionError(f"{source}: the expert count ({spec.num_experts}) is not divisible by ep={ep}")
    for field, value in (
        ("num_attention_heads", spec.num_heads),
        ("num_key_value_heads", spec.num_query_groups),
        ("intermediate_size", spec.intermediate_size),
        ("padded vocab_size", padded_vocab_size(spec.vocab_size, tp=tp, divisor=divisor)),
        *((("moe_intermediate_size", spec.moe_intermediate_size),) if spec.num_experts else ()),
        *getattr(family_of(spec), "tp_sizes", lambda _spec: {})(spec).items(),
    ):
        if value % tp:
            raise ConversionError(f"{source}: field '{field}' ({value}) is not divisible by tp={tp}")
    if pp > spec.num_layers:
        raise ConversionError(f"{source}: field 'num_hidden_layers' ({spec.num_layers}) is smaller than pp={pp}")


def stage_layers(num_layers: int, *, pp: int, pp_rank: int) -> range:
    """Global layer numbers held by pipeline stage pp_rank; earlier stages take the extra layers."""
    base, extra = divmod(num_layers, pp)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def chunk_layers(num_layers: int, *, pp: int, pp_rank: int, vpp: int, chunk: int) -> range:
    """Global layer numbers held by model chunk `chunk` of pipeline stage pp_rank under --vpp:
    the (chunk*pp + pp_rank)-th of pp*vpp equal slices, as Megatron-LM assigns them (its
    layer offset vp_stage * num_layers/vpp + pp_rank * num_layers/(pp*vpp))."""
    if num_layers % (pp * vpp):
        raise ConversionError(f"--vpp {vpp}: the layer count ({num_layers}) must be a multiple of pp x vpp "
                              f"({pp} x {vpp} = {pp * vpp}): every model chunk holds as many layers")
    size = num_layers // (pp * vpp)
    start = (chunk * pp + pp_rank) * size
    return range(start, start + size)


def mcore_name(template: str, *, layer: int | None, layer_spec: str, moe_layer: bool = False) -> str:
    """The parameter name of an entry in a model of `layer_spec` (local layer number `layer`;
    `moe_layer`: the layer's MLP is a mixture of experts)."""
    name = template.format(layer=layer) if layer is not None else template
    if layer_spec == "te":
        renames = TE_RENAMES if moe_layer else {**TE_RENAMES, **TE_DENSE_MLP_RENAMES}
        for old, new in renames.items():
            if name.endswith(old):
                name = name[: -len(old)] + new
    elif layer_spec != "local":
        raise ConversionError(f"layer_spec must be one of {LAYER_SPECS}, got {layer_spec!r}")
    return name


# Grouped GEMM experts (megatron-core's TEGroupedMLP, `moe_grouped_gemm`): one Transformer Engine
# GroupedLinear per projection holds every local expert's weight as `weight{i}`, of the same
# shape and layout as the sequential experts' `local_experts.{i}.linear_fc*.weight` (fc1
# [gate_i; up_i] rows of this expert-tp rank, fc2 split on its input dim). Shards, checkpoints and
# optimizer state always use the sequential names; these two functions translate at the live
# model's boundary (`mcore_dpo.model.builder`).
_SEQUENTIAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_GROUPED_EXPERT = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


def grouped_expert_name(name: str) -> str:
    """A parameter name as the grouped-GEMM experts spell it: `...mlp.experts.local_experts.{i}.
    linear_fc1.weight` -> `...mlp.experts.linear_fc1.weight{i}` (every other name unchanged)."""
    match = _SEQUENTIAL_EXPERT.search(name)
    if match is None:
        return name
    return f"{name[: match.start()]}.mlp.experts.{match.group(2)}.weight{match.group(1)}"


def sequential_expert_name(name: str) -> str:
    """The inverse of `grouped_expert_name`: the name shards and checkpoints use (every name that
    is not a grouped expert weight, sequential experts' included, unchanged)."""
    match = _GROUPED_EXPERT.search(name)
    if match is None:
        return name
    return f"{name[: match.start()]}.mlp.experts.local_experts.{match.group(2)}.{match.group(1)}.weight"


def _has_output_layer(spec: ModelSpec, *, pp: int) -> bool:
    # A reward model has its score head instead. Tied embeddings with pp > 1: megatron keeps a
    # copy of the embedding on the last stage.
    if spec.num_labels:
        return False
    return not spec.tie_word_embeddings or pp > 1


# ---------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------


def hf_tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this spec holds, with its shape, in streaming order."""
    h = spec.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    family = family_of(spec)
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        if hasattr(family, "attention_hf_shapes"):  # an attention of its own (multi-latent attention)
            shapes.update(family.attention_hf_shapes(spec, layer=layer))
        else:
            shapes.update(_qkv_attention_shapes(spec, layer=layer))
        if spec.is_moe_layer(layer):
            shapes.update(family.moe_hf_shapes(spec, layer=layer))
        else:
            shapes[p + "mlp.gate_proj.weight"] = (spec.intermediate_size, h)
            shapes[p + "mlp.up_proj.weight"] = (spec.intermediate_size, h)
            shapes[p + "mlp.down_proj.weight"] = (h, spec.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if spec.num_labels:
        shapes["score.weight"] = (spec.num_labels, h)
    elif not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


def _qkv_attention_shapes(spec: ModelSpec, *, layer: int) -> dict[str, tuple[int, ...]]:
    """A q/k/v attention layer's HF tensors and its two norms, in streaming order."""
    h, d = spec.hidden_size, spec.head_dim
    q_rows, kv_rows = spec.num_heads * d, spec.num_query_groups * d
    p = f"model.layers.{layer}."
    shapes: dict[str, tuple[int, ...]] = {}
    shapes[p + "input_layernorm.weight"] = (h,)
    shapes[p + "self_attn.q_proj.weight"] = (q_rows, h)
    shapes[p + "self_attn.k_proj.weight"] = (kv_rows, h)
    shapes[p + "self_attn.v_proj.weight"] = (kv_rows, h)
    if spec.qkv_bias:
        shapes[p + "self_attn.q_proj.bias"] = (q_rows,)
        shapes[p + "self_attn.k_proj.bias"] = (kv_rows,)
        shapes[p + "self_attn.v_proj.bias"] = (kv_rows,)
    shapes[p + "self_attn.o_proj.weight"] = (h, q_rows)
    if spec.qk_layernorm:
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        shapes[p + "self_attn.k_norm.weight"] = (d,)
    shapes[p + "post_attention_layernorm.weight"] = (h,)
    return shapes


def hf_tensor_names(spec: ModelSpec) -> list[str]:
    """The exact key set of an HF checkpoint of this spec (lm_head absent when tied; a reward
    model's score.weight in its place)."""
    return list(hf_tensor_shapes(spec))


_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def expert_tp_size(*, tp: int, ep: int) -> int:
    """Over how many tensor-parallel ranks each expert is split (megatron-core's
    `expert_tensor_parallel_size`). Experts split over ep > 1 ranks are whole on their rank (1):
    a stage's expert-parallel groups are then carved from its tp x dp ranks. Without expert
    parallelism they are split over tp like a dense MLP (megatron-core's default)."""
    return 1 if ep > 1 else tp


def is_expert_entry(template: str) -> bool:
    return _EXPERT.search(template) is not None


def expert_home(name: str, *, num_experts: int, ep: int) -> tuple[int, str] | None:
    """Where an expert entry lives under expert parallelism: (the ep rank holding it, its name
    there with the local expert index); ep rank r holds experts [r * E/ep, (r + 1) * E/ep).
    None for a name that is not an expert's, or at ep 1."""
    match = _EXPERT.search(name)
    if match is None or ep == 1:
        return None
    per_rank = num_experts // ep
    expert = int(match.group(1))
    return expert // per_rank, name[: match.start()] + f".local_experts.{expert % per_rank}." + name[match.end():]


def _local_expert(template: str, *, num_experts: int, ep: int, ep_rank: int) -> str | None:
    """An expert entry's template on expert-parallel rank ep_rank, or None for another rank's expert."""
    home = expert_home(template, num_experts=num_experts, ep=ep)
    if home is None:
        return template
    return home[1] if home[0] == ep_rank else None


def mcore_entries(
    spec: ModelSpec, *, pp: int, pp_rank: int, ep: int = 1, ep_rank: int = 0
) -> Iterator[tuple[str, str, tuple[str, ...], int | None, int | None]]:
    """(mcore template, split kind, HF templates, local layer, global layer) for one stage (and
    expert-parallel rank), in order."""
    family = family_of(spec)
    if pp_rank == 0:
        for template, (kind, hf) in _FIRST_STAGE_KEYS.items():
            yield template, kind, hf, None, None
    layers = stage_layers(spec.num_layers, pp=pp, pp_rank=pp_rank)
    for local, global_layer in enumerate(layers):
        for template, (kind, hf) in family.layer_keys(spec, layer=global_layer).items():
            template = _local_expert(template, num_experts=spec.num_experts, ep=ep, ep_rank=ep_rank)
            if template is not None:
                yield template, kind, hf, local, global_layer
    if pp_rank == pp - 1:
        for template, (kind, hf) in _LAST_STAGE_KEYS.items():
            if template == "output_layer.weight":
                if not _has_output_layer(spec, pp=pp):
                    continue
                if spec.tie_word_embeddings:
                    hf = ("model.embed_tokens.weight",)
            if template == "score.weight" and not spec.num_labels:
                continue
            yield template, kind, hf, None, None


def mcore_shard_shapes(
    spec: ModelSpec, *, tp: int, pp: int, pp_rank: int, layer_spec: str = "local", divisor: int = 128
) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor one tp rank of stage pp_rank holds (same for all tp ranks)."""
    hf_shapes = hf_tensor_shapes(spec)
    if spec.tie_word_embeddings:
        hf_shapes["lm_head.weight"] = hf_shapes["model.embed_tokens.weight"]
    vocab = padded_vocab_size(spec.vocab_size, tp=tp, divisor=divisor)
    shapes = {}
    for template, kind, hf, local, global_layer in mcore_entries(spec, pp=pp, pp_rank=pp_rank):
        name = mcore_name(template, layer=local, layer_spec=layer_spec, moe_layer=spec.is_moe_layer(global_layer))
        kind, hf_shapes_of = _canonical_shapes(kind, [hf_shape(hf_shapes, t.format(layer=global_layer)) for t in hf])
        first = hf_shapes_of[0]
        if kind == "replicated":
            shape = first
        elif kind == "vocab":
            shape = (vocab // tp, first[1])
        elif kind == "qkv":
            rows = sum(shape[0] for shape in hf_shapes_of) // tp
            shape = (rows,) + first[1:]
        elif kind == "fc1":
            shape = (2 * first[0] // tp,) + first[1:]
        elif kind == "column":
            shape = (first[0] // tp,) + first[1:]
        elif kind == "row":
            shape = (first[0], first[1] // tp)
        else:
            raise AssertionError(kind)
        shapes[name] = shape
    return shapes


# ---------------------------------------------------------------------------------------
# HF -> megatron
# ---------------------------------------------------------------------------------------


# A reader's part of one HF tensor: get_part(name, dim, start, stop) is get(name) narrowed to
# [start, stop) on dim, as a fresh tensor; a reader with a file behind it reads only those bytes.
GetPart = Callable[[str, int, int, int], torch.Tensor]


def qkv_group_rows(spec: ModelSpec) -> tuple[int, int, int]:
    """Rows of q, k and v per query group (r query heads, one k head, one v head)."""
    d = spec.head_dim
    return (spec.num_heads // spec.num_query_groups * d, d, d)


def entry_slices(
    spec: ModelSpec, *, kind: str, shapes: list[tuple[int, ...]], tp: int, tp_rank: int
) -> list[tuple[int, int, int]]:
    """(dim, start, stop) of each HF tensor of a non-vocabulary entry (shapes in the key map's
    order: q, k, v or gate, up) that tp rank tp_rank's part is made of: qkv by whole query
    groups, fc1's gate and up by rows, a row-parallel weight by columns, a replicated one whole."""
    if kind == "replicated":
        return [(0, 0, shapes[0][0])]
    if kind == "qkv":
        per_rank = spec.num_query_groups // tp
        return [(0, tp_rank * per_rank * rows, (tp_rank + 1) * per_rank * rows) for rows in qkv_group_rows(spec)]
    if kind in ("fc1", "column"):
        return [(0, tp_rank * shape[0] // tp, (tp_rank + 1) * shape[0] // tp) for shape in shapes]
    if kind == "row":
        return [(1, tp_rank * shapes[0][1] // tp, (tp_rank + 1) * shapes[0][1] // tp)]
    raise AssertionError(kind)


def join_parts(spec: ModelSpec, *, kind: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """One tp rank's tensor from the parts `entry_slices` names: q, k and v fused group by group
    ([q_g; k_g; v_g] for each of the rank's groups), fc1 as [gate part; up part]."""
    if kind in ("replicated", "row", "column"):
        return parts[0]
    if kind == "qkv":
        q_rows, d, _ = qkv_group_rows(spec)
        q, k, v = parts
        groups, tail = k.shape[0] // d, q.shape[1:]  # tail: (hidden,) for weights, () for biases
        fused = torch.cat([q.reshape(groups, q_rows, *tail), k.reshape(groups, d, *tail), v.reshape(groups, d, *tail)], dim=1)
        return fused.reshape(groups * (q_rows + 2 * d), *tail)
    if kind == "fc1":
        return torch.cat(parts, dim=0)
    raise AssertionError(kind)


def hf_to_mcore_shard(
    spec: ModelSpec,
    *,
    tp: int,
    tp_rank: int,
    pp: int,
    pp_rank: int,
    get: Callable[[str], torch.Tensor],
    get_part: GetPart | None = None,
    layer_spec: str = "local",
    divisor: int = 128,
    ep: int = 1,
    ep_rank: int = 0,
) -> dict[str, torch.Tensor]:
    """The parameters of one (tp_rank, pp_rank, ep_rank) GPTModel chunk, named as its
    named_parameters() (experts by their local index on ep_rank, split over
    `expert_tp_size(tp, ep)` ranks: whole when ep > 1).

    Each HF tensor is asked for only in the part this rank holds (`get_part`, see GetPart: its
    vocabulary rows, its query groups' q/k/v rows, its gate/up rows, its columns of a
    row-parallel weight; replicated tensors and an ep rank's whole experts in full). Without
    `get_part` the parts are cut from `get(hf_name)`, the whole HF tensor. Each result is a
    fresh contiguous tensor, so memory holds one shard plus the tensor in flight.
    """
    check_layout(spec, tp=tp, pp=pp, ep=ep, divisor=divisor)
    if get_part is None:
        def get_part(name: str, dim: int, start: int, stop: int) -> torch.Tensor:
            return get(name).narrow(dim, start, stop - start)
    vocab = padded_vocab_size(spec.vocab_size, tp=tp, divisor=divisor)
    hf_shapes = hf_tensor_shapes(spec)
    shard: dict[str, torch.Tensor] = {}
    etp = expert_tp_size(tp=tp, ep=ep)
    for template, kind, hf, local, global_layer in mcore_entries(spec, pp=pp, pp_rank=pp_rank, ep=ep, ep_rank=ep_rank):
        name = mcore_name(template, layer=local, layer_spec=layer_spec, moe_layer=spec.is_moe_layer(global_layer))
        hf_names = [t.format(layer=global_layer) for t in hf]
        if kind == "vocab":  # the rank's rows of the padded vocabulary: source rows, then zero rows
            rows = vocab // tp
            start, stop = min(tp_rank * rows, spec.vocab_size), min((tp_rank + 1) * rows, spec.vocab_size)
            real = get_part(hf_names[0], 0, start, stop)
            out = torch.cat([real, real.new_zeros(rows - (stop - start), *real.shape[1:])], dim=0)
        elif kind in CANONICAL_KIND:  # an expert's slice of a stacked tensor: read whole, then split
            split_tp, split_rank = (etp, tp_rank % etp) if is_expert_entry(template) else (tp, tp_rank)
            slices = []
            for n in hf_names:
                stored, expert = stacked_source(n)
                slices.append(get_part(stored, 0, expert, expert + 1)[0])
            canonical, tensors = canonical_tensors(kind, slices)
            out = split_entry(spec, kind=canonical, tensors=tensors, tp=split_tp, tp_rank=split_rank)
        else:  # an expert is split over the expert tp ranks only
            split_tp, split_rank = (etp, tp_rank % etp) if is_expert_entry(template) else (tp, tp_rank)
            parts = []
            for n, where in zip(hf_names, entry_slices(spec, kind=kind, shapes=[hf_shape(hf_shapes, n) for n in hf_names],
                                                        tp=split_tp, tp_rank=split_rank)):
                source = stacked_source(n)
                if source is None:
                    parts.append(get_part(n, *where))
                else:  # a slice of a stacked tensor (the expert's biases)
                    parts.append(get_part(source[0], 0, source[1], source[1] + 1)[0].narrow(where[0], where[1], where[2] - where[1]))
            out = join_parts(spec, kind=kind, parts=parts)
        shard[name] = out.contiguous().clone()
    return shard


def split_entry(spec: ModelSpec, *, kind: str, tensors: list[torch.Tensor], tp: int, tp_rank: int) -> torch.Tensor:
    """One tp rank's part of a non-vocabulary entry, from the entry's HF tensors (in the order
    of the key map: q, k, v or gate, up). The vocabulary kind is padded and split by rows."""
    kind, tensors = canonical_tensors(kind, tensors)
    slices = entry_slices(spec, kind=kind, shapes=[tuple(t.shape) for t in tensors], tp=tp, tp_rank=tp_rank)
    return join_parts(spec, kind=kind, parts=[t.narrow(dim, a, b - a) for t, (dim, a, b) in zip(tensors, slices)])
