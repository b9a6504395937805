"""The Hugging Face <-> megatron-core parameter mapping: the single source of truth.

Pure functions only (no file I/O, no torch.distributed). Both the converter CLI and the
trainer's model builder use this module, so a checkpoint converted offline and one
converted on the fly at model build time are identical.

Each family has one literal, templated key map (`KEY_MAPS`): megatron-core name template
-> (how the tensor is split across tensor-parallel ranks, Hugging Face name templates).
`{layer}` is the local layer number on the megatron side and the global one on the HF side.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch


class ConversionError(ValueError):
    """Bad input to a conversion; str() is one line naming the file/tensor/field."""


@dataclass(frozen=True)
class ModelSpec:
    architecture: str  # e.g. "LlamaForCausalLM"
    family: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int  # unpadded, as in the HF config
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_query_groups: int  # HF num_key_value_heads
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # Normalized llama3 form {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"} or None (plain RoPE).
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    torch_dtype: str  # "float32" | "bfloat16" | "float16": dtype of the source weights
    # Mistral v0.1 configs carry a sliding window; it only matters for sequences longer than it.
    sliding_window: int | None = None


FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_MODEL_TYPE_TO_ARCHITECTURE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LAYER_SPECS = ("local", "te")

# Split kinds:
#   replicated  every tp rank holds the whole tensor (norms)
#   vocab       rows padded with zeros to the padded vocabulary, then split on dim 0
#   qkv         q, k, v fused group by group (r query heads, k head, v head), whole groups per rank
#   fc1         [gate chunk i; up chunk i] on rank i
#   row         split on dim 1 (row-parallel linear input dim)
_LAYER_KEYS_LLAMA = {
    "decoder.layers.{layer}.input_layernorm.weight": ("replicated", ("model.layers.{layer}.input_layernorm.weight",)),
    "decoder.layers.{layer}.self_attention.linear_qkv.weight": (
        "qkv",
        (
            "model.layers.{layer}.self_attn.q_proj.weight",
            "model.layers.{layer}.self_attn.k_proj.weight",
            "model.layers.{layer}.self_attn.v_proj.weight",
        ),
    ),
    "decoder.layers.{layer}.self_attention.linear_proj.weight": ("row", ("model.layers.{layer}.self_attn.o_proj.weight",)),
    "decoder.layers.{layer}.pre_mlp_layernorm.weight": (
        "replicated",
        ("model.layers.{layer}.post_attention_layernorm.weight",),
    ),
    "decoder.layers.{layer}.mlp.linear_fc1.weight": (
        "fc1",
        ("model.layers.{layer}.mlp.gate_proj.weight", "model.layers.{layer}.mlp.up_proj.weight"),
    ),
    "decoder.layers.{layer}.mlp.linear_fc2.weight": ("row", ("model.layers.{layer}.mlp.down_proj.weight",)),
}
_LAYER_KEYS_QWEN2 = {
    **_LAYER_KEYS_LLAMA,
    "decoder.layers.{layer}.self_attention.linear_qkv.bias": (
        "qkv",
        (
            "model.layers.{layer}.self_attn.q_proj.bias",
            "model.layers.{layer}.self_attn.k_proj.bias",
            "model.layers.{layer}.self_attn.v_proj.bias",
        ),
    ),
}
# Order matters: it is the order tensors are streamed in (embedding, layers, head).
_FIRST_STAGE_KEYS = {"embedding.word_embeddings.weight": ("vocab", ("model.embed_tokens.weight",))}
_LAST_STAGE_KEYS = {
    "decoder.final_layernorm.weight": ("replicated", ("model.norm.weight",)),
    "output_layer.weight": ("vocab", ("lm_head.weight",)),
}
KEY_MAPS = {
    "llama": {"first": _FIRST_STAGE_KEYS, "layer": _LAYER_KEYS_LLAMA, "last": _LAST_STAGE_KEYS},
    "mistral": {"first": _FIRST_STAGE_KEYS, "layer": _LAYER_KEYS_LLAMA, "last": _LAST_STAGE_KEYS},
    "qwen2": {"first": _FIRST_STAGE_KEYS, "layer": _LAYER_KEYS_QWEN2, "last": _LAST_STAGE_KEYS},
}
# Transformer Engine fuses the pre-attention / pre-MLP norms into the following linear.
TE_RENAMES = {
    ".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
    ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight",
}


# ---------------------------------------------------------------------------------------
# Config -> spec
# ---------------------------------------------------------------------------------------


def _field(config: dict, name: str, kind: type, *, source: str, default: object = ...) -> object:
    if name not in config or config[name] is None:
        if default is ...:
            raise ConversionError(f"{source}: field '{name}' is missing")
        return default
    value = config[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConversionError(f"{source}: field '{name}' must be {kind.__name__}, got {value!r}")
    if kind in (int, float) and value <= 0:
        raise ConversionError(f"{source}: field '{name}' must be positive, got {value!r}")
    return value


def _rope_from_config(config: dict, *, source: str) -> tuple[float, dict | None]:
    """rope_theta and the normalized scaling, from either the transformers<5 form
    (rope_theta + rope_scaling) or the transformers 5 form (rope_parameters)."""
    params = config.get("rope_parameters")
    field = "rope_parameters"
    if not isinstance(params, dict) or not params:
        params = config.get("rope_scaling")
        field = "rope_scaling"
    theta = config.get("rope_theta")
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    theta = _field({"rope_theta": theta}, "rope_theta", float, source=source, default=10000.0)
    if params is None:
        return theta, None
    if not isinstance(params, dict):
        raise ConversionError(f"{source}: field '{field}' must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise ConversionError(
            f"{source}: field '{field}.rope_type' is {rope_type!r}; only 'default' and 'llama3' are supported"
        )
    scaling = {"rope_type": "llama3"}
    for key, kind in (
        ("factor", float),
        ("low_freq_factor", float),
        ("high_freq_factor", float),
        ("original_max_position_embeddings", int),
    ):
        scaling[key] = _field(params, key, kind, source=f"{source}: {field}")
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ConversionError(f"{source}: field '{field}.high_freq_factor' must exceed low_freq_factor")
    return theta, scaling


def spec_from_hf_config(config: dict, *, source: str = "config.json") -> ModelSpec:
    """Validate an HF config.json (as a dict) and extract what the model needs."""
    if not isinstance(config, dict):
        raise ConversionError(f"{source}: expected a JSON object")
    architectures = config.get("architectures")
    if architectures:
        if not isinstance(architectures, list) or len(architectures) != 1:
            raise ConversionError(f"{source}: field 'architectures' must list exactly one architecture, got {architectures!r}")
        architecture = architectures[0]
    else:
        architecture = _MODEL_TYPE_TO_ARCHITECTURE.get(config.get("model_type"), config.get("model_type"))
    if architecture not in FAMILIES:
        raise ConversionError(
            f"{source}: field 'architectures' is {architecture!r}; supported: {', '.join(sorted(FAMILIES))}"
        )
    family = FAMILIES[architecture]
    hidden_act = config.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ConversionError(f"{source}: field 'hidden_act' is {hidden_act!r}; only 'silu' is supported")
    if config.get("mlp_bias"):
        raise ConversionError(f"{source}: field 'mlp_bias' is true; MLP biases are not supported")
    if family != "qwen2" and config.get("attention_bias"):
        raise ConversionError(f"{source}: field 'attention_bias' is true; attention biases are only supported for Qwen2")
    if family == "qwen2" and config.get("use_sliding_window"):
        raise ConversionError(f"{source}: field 'use_sliding_window' is true; sliding-window attention is not supported")

    hidden_size = _field(config, "hidden_size", int, source=source)
    num_heads = _field(config, "num_attention_heads", int, source=source)
    num_query_groups = _field(config, "num_key_value_heads", int, source=source, default=num_heads)
    if num_heads % num_query_groups:
        raise ConversionError(
            f"{source}: field 'num_key_value_heads' ({num_query_groups}) must divide num_attention_heads ({num_heads})"
        )
    if "head_dim" in config and config["head_dim"] is not None:
        head_dim = _field(config, "head_dim", int, source=source)
    else:
        if hidden_size % num_heads:
            raise ConversionError(f"{source}: field 'hidden_size' ({hidden_size}) is not divisible by num_attention_heads")
        head_dim = hidden_size // num_heads
    theta, scaling = _rope_from_config(config, source=source)
    dtype = config.get("torch_dtype", config.get("dtype")) or "float32"
    if dtype not in DTYPES:
        raise ConversionError(f"{source}: field 'torch_dtype' is {dtype!r}; supported: {', '.join(DTYPES)}")
    sliding_window = config.get("sliding_window") if family == "mistral" else None
    return ModelSpec(
        architecture=architecture,
        family=family,
        vocab_size=_field(config, "vocab_size", int, source=source),
        hidden_size=hidden_size,
        intermediate_size=_field(config, "intermediate_size", int, source=source),
        num_layers=_field(config, "num_hidden_layers", int, source=source),
        num_heads=num_heads,
        num_query_groups=num_query_groups,
        head_dim=head_dim,
        rms_norm_eps=_field(config, "rms_norm_eps", float, source=source, default=1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2",
        max_position_embeddings=_field(config, "max_position_embeddings", int, source=source, default=2048),
        torch_dtype=dtype,
        sliding_window=sliding_window,
    )


# ---------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------


def padded_vocab_size(vocab_size: int, *, tp: int, divisor: int = 128) -> int:
    """Vocabulary rounded up to a multiple of divisor * tp (megatron's rule)."""
    multiple = divisor * tp
    return math.ceil(vocab_size / multiple) * multiple


def check_layout(spec: ModelSpec, *, tp: int, pp: int, source: str = "config.json", divisor: int = 128) -> None:
    """Raise ConversionError unless the model can be split tp x pp."""
    if tp < 1 or pp < 1:
        raise ConversionError(f"layout: tp and pp must be >= 1, got tp={tp} pp={pp}")
    for field, value in (
        ("num_attention_heads", spec.num_heads),
        ("num_key_value_heads", spec.num_query_groups),
        ("intermediate_size", spec.intermediate_size),
        ("padded vocab_size", padded_vocab_size(spec.vocab_size, tp=tp, divisor=divisor)),
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


def _stage_of_layer(num_layers: int, *, pp: int, layer: int) -> tuple[int, int]:
    for pp_rank in range(pp):
        layers = stage_layers(num_layers, pp=pp, pp_rank=pp_rank)
        if layer in layers:
            return pp_rank, layer - layers.start
    raise ValueError(f"layer {layer} out of range")


def mcore_name(template: str, *, layer: int | None, layer_spec: str) -> str:
    name = template.format(layer=layer) if layer is not None else template
    if layer_spec == "te":
        for old, new in TE_RENAMES.items():
            if name.endswith(old):
                name = name[: -len(old)] + new
    elif layer_spec != "local":
        raise ConversionError(f"layer_spec must be one of {LAYER_SPECS}, got {layer_spec!r}")
    return name


def _has_output_layer(spec: ModelSpec, *, pp: int) -> bool:
    # Tied embeddings with pp > 1: megatron keeps a copy of the embedding on the last stage.
    return not spec.tie_word_embeddings or pp > 1


# ---------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------


def hf_tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this spec holds, with its shape, in streaming order."""
    h, d = spec.hidden_size, spec.head_dim
    q_rows, kv_rows = spec.num_heads * d, spec.num_query_groups * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_rows, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_rows, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_rows, h)
        if spec.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_rows,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_rows,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_rows)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (spec.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (spec.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, spec.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


def hf_tensor_names(spec: ModelSpec) -> list[str]:
    """The exact key set of an HF checkpoint of this spec (lm_head absent when tied)."""
    return list(hf_tensor_shapes(spec))


def mcore_entries(spec: ModelSpec, *, pp: int, pp_rank: int) -> Iterator[tuple[str, str, tuple[str, ...], int | None, int | None]]:
    """(mcore template, split kind, HF templates, local layer, global layer) for one stage, in order."""
    key_map = KEY_MAPS[spec.family]
    if pp_rank == 0:
        for template, (kind, hf) in key_map["first"].items():
            yield template, kind, hf, None, None
    layers = stage_layers(spec.num_layers, pp=pp, pp_rank=pp_rank)
    for local, global_layer in enumerate(layers):
        for template, (kind, hf) in key_map["layer"].items():
            yield template, kind, hf, local, global_layer
    if pp_rank == pp - 1:
        for template, (kind, hf) in key_map["last"].items():
            if template == "output_layer.weight":
                if not _has_output_layer(spec, pp=pp):
                    continue
                if spec.tie_word_embeddings:
                    hf = ("model.embed_tokens.weight",)
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
        name = mcore_name(template, layer=local, layer_spec=layer_spec)
        first = hf_shapes[hf[0].format(layer=global_layer)]
        if kind == "replicated":
            shape = first
        elif kind == "vocab":
            shape = (vocab // tp, first[1])
        elif kind == "qkv":
            rows = sum(hf_shapes[t.format(layer=global_layer)][0] for t in hf) // tp
            shape = (rows,) + first[1:]
        elif kind == "fc1":
            shape = (2 * first[0] // tp, first[1])
        elif kind == "row":
            shape = (first[0], first[1] // tp)
        else:
            raise AssertionError(kind)
        shapes[name] = shape
    return shapes


# ---------------------------------------------------------------------------------------
# HF -> megatron
# ---------------------------------------------------------------------------------------


def _fuse_qkv_rank(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, tp: int, tp_rank: int) -> torch.Tensor:
    groups, d = spec.num_query_groups, spec.head_dim
    r = spec.num_heads // groups
    tail = q.shape[1:]  # (hidden,) for weights, () for biases
    q = q.reshape(groups, r * d, *tail)
    k = k.reshape(groups, d, *tail)
    v = v.reshape(groups, d, *tail)
    per_rank = groups // tp
    sel = slice(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    fused = torch.cat([q[sel], k[sel], v[sel]], dim=1)
    return fused.reshape(per_rank * (r + 2) * d, *tail)


def _pad_vocab(weight: torch.Tensor, *, vocab_padded: int) -> torch.Tensor:
    extra = vocab_padded - weight.shape[0]
    if extra == 0:
        return weight
    return torch.cat([weight, weight.new_zeros(extra, *weight.shape[1:])], dim=0)


def hf_to_mcore_shard(
    spec: ModelSpec,
    *,
    tp: int,
    tp_rank: int,
    pp: int,
    pp_rank: int,
    get: Callable[[str], torch.Tensor],
    layer_spec: str = "local",
    divisor: int = 128,
) -> dict[str, torch.Tensor]:
    """The parameters of one (tp_rank, pp_rank) GPTModel chunk, named as its named_parameters().

    `get(hf_name)` returns one HF tensor; each result is a fresh contiguous tensor (no view
    into the full HF tensor is kept), so memory holds one shard plus one HF tensor.
    """
    check_layout(spec, tp=tp, pp=pp, divisor=divisor)
    vocab = padded_vocab_size(spec.vocab_size, tp=tp, divisor=divisor)
    shard: dict[str, torch.Tensor] = {}
    for template, kind, hf, local, global_layer in mcore_entries(spec, pp=pp, pp_rank=pp_rank):
        name = mcore_name(template, layer=local, layer_spec=layer_spec)
        hf_names = [t.format(layer=global_layer) for t in hf]
        if kind == "vocab":
            out = _pad_vocab(get(hf_names[0]), vocab_padded=vocab).chunk(tp, dim=0)[tp_rank]
        else:
            out = split_entry(spec, kind=kind, tensors=[get(n) for n in hf_names], tp=tp, tp_rank=tp_rank)
        shard[name] = out.contiguous().clone()
    return shard


def split_entry(spec: ModelSpec, *, kind: str, tensors: list[torch.Tensor], tp: int, tp_rank: int) -> torch.Tensor:
    """One tp rank's part of a non-vocabulary entry, from the entry's HF tensors (in the order
    of the key map: q, k, v or gate, up). The vocabulary kind is padded and split by rows."""
    if kind == "replicated":
        return tensors[0]
    if kind == "qkv":
        q, k, v = tensors
        return _fuse_qkv_rank(spec, q, k, v, tp=tp, tp_rank=tp_rank)
    if kind == "fc1":
        gate, up = (t.chunk(tp, dim=0)[tp_rank] for t in tensors)
        return torch.cat([gate, up], dim=0)
    if kind == "row":
        return tensors[0].chunk(tp, dim=1)[tp_rank]
    raise AssertionError(kind)


# ---------------------------------------------------------------------------------------
# megatron -> HF
# ---------------------------------------------------------------------------------------


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
    blocks: list[list[torch.Tensor]] = [[] for _ in hf_names]
    for i, block in entry_blocks(spec, kind=kind, parts=parts):
        blocks[i].append(block)
    return {n: torch.cat(b, dim=0).contiguous().clone() for n, b in zip(hf_names, blocks)}


def hf_entry_index(spec: ModelSpec, *, pp: int) -> dict[str, tuple[str, str, list[str], int, int | None]]:
    """HF name -> (mcore template, kind, HF names of the entry, pp_rank, local layer)."""
    index = {}
    for pp_rank in range(pp):
        for template, kind, hf, local, global_layer in mcore_entries(spec, pp=pp, pp_rank=pp_rank):
            if template == "output_layer.weight" and spec.tie_word_embeddings:
                continue  # the first-stage embedding is the authoritative copy
            hf_names = [t.format(layer=global_layer) for t in hf]
            for hf_name in hf_names:
                index[hf_name] = (template, kind, hf_names, pp_rank, local)
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
        if hf_name not in pending:
            template, kind, hf_names, pp_rank, local = index[hf_name]
            name = mcore_name(template, layer=local, layer_spec=layer_spec)
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
    if hf_name not in index:
        raise ConversionError(f"tensor '{hf_name}' is not part of a {spec.architecture} checkpoint")
    template, kind, hf_names, pp_rank, local = index[hf_name]
    name = mcore_name(template, layer=local, layer_spec=layer_spec)
    return _gather_entry(spec, kind=kind, name=name, hf_names=hf_names, tp=tp, pp_rank=pp_rank, get_shard=get_shard)
