"""LoRA adapters: the PEFT <-> megatron-core mapping, and PEFT adapter directories on disk.

PEFT puts one adapter (A: [r, in], B: [out, r]) on each Hugging Face projection. megatron-core
fuses q/k/v into `linear_qkv` and gate/up into `linear_fc1`; the engine keeps one A/B pair per
HF projection on those fused linears (`mcore_dpo.model.lora`), so the mapping is exact: no A is shared
between projections. Tensor-parallel splits:

    column-parallel (qkv, fc1): A whole on every tp rank, B split on its output dim (dim 0);
                                q/k/v's B rows split by whole query groups, like the fused weight
    row-parallel (proj, fc2):   A split on its input dim (dim 1), B whole on every tp rank

Multi-latent attention (DeepSeek-V3) has no fused linear: target `qkv` adapts each of its q/kv
projections (`q_a_proj`, `q_b_proj` or `q_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`), one pair on
each of megatron-core's linear_q_down_proj, linear_q_up_proj (linear_q_proj), linear_kv_down_proj
and linear_kv_up_proj (rows in HF's order: the key map copies these weights as they are). The
down projections are replicated (whole on every tp rank), the up ones column-parallel.

Mixture-of-experts layers: transformers 5 holds the experts of a layer as two fused 3-D
parameters (`mlp.experts.gate_up_proj` [E, 2I, h], `mlp.experts.down_proj` [E, h, I]), which PEFT
adapts through `target_parameters` (its `ParamWrapper`): one lora_A [r·E, in] and one lora_B
[out, r·E] per parameter, expert e's pair being A[e·r:(e+1)·r] and B[:, e::E] (PEFT reshapes B to
[out, r, E]), so W_e + scaling·B_e·A_e with scaling = alpha/r. That is one independent A/B pair
per expert, which the engine keeps on each expert's linear_fc1 (gate and up share it, as they
share the fused parameter) and linear_fc2 (`expert_fc1`, `expert_fc2`). When both are targeted
PEFT nests the two wrappers: gate_up_proj's tensors are saved under `mlp.experts.base_layer.`,
down_proj's under `mlp.experts.`. GPT-OSS stores its experts input dim first ([E, h, 2I], gate and up
interleaved on the last dim), which PEFT reads as [E, in, out] with the same A [r·E, in] and B
[out, r·E]: only the rows of gate_up's B alternate gate and up there (`interleaved_gate_up`).

A reward model's base (`*ForSequenceClassification`, spec.num_labels > 0): PEFT's
LoraConfig(task_type="SEQ_CLS") trains its score head whole beside the adapters (it adds
"classifier" and "score" to `modules_to_save`) and saves the head under the module's own name,
`base_model.model.score.weight` (in memory it is `...score.modules_to_save.default.weight`; the
saved name is what `set_peft_model_state_dict` maps back). The adapter tensors here carry that
tensor too (`saved_entries`): whole on every tp rank of the last stage, as the engine's head.

Pure functions (the key map, shard <-> whole) plus the PEFT directory reader and writer
(`adapter_config.json`, `adapter_model.safetensors`). Only safetensors and JSON are read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoint_convert.families.base import ConversionError, ModelSpec
from checkpoint_convert.mapping import stage_layers

TARGETS = ("qkv", "proj", "fc1", "fc2")  # the dense linears (fc1/fc2: the dense MLP layers only)
EXPERT_TARGETS = ("expert_fc1", "expert_fc2")  # every expert's linear_fc1 / linear_fc2 on the MoE layers
ALL_TARGETS = TARGETS + EXPERT_TARGETS
TARGET_ALIASES = {"experts": EXPERT_TARGETS}  # --lora-targets shorthand
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# target -> (megatron-core linear under a layer, column|row, ((part, HF module under the layer), ...))
TARGET_MAP: dict[str, tuple[str, str, tuple[tuple[str, str], ...]]] = {
    "qkv": ("self_attention.linear_qkv", "column",
            (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"))),
    "proj": ("self_attention.linear_proj", "row", (("o", "self_attn.o_proj"),)),
    "fc1": ("mlp.linear_fc1", "column", (("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"))),
    "fc2": ("mlp.linear_fc2", "row", (("down", "mlp.down_proj"),)),
}
# Multi-latent attention's q/kv projections (target `qkv`), in the TARGET_MAP form; the down
# projections are replicated linears (mcore_dpo/model/mla.py).
MLA_Q_LORA = (("self_attention.linear_q_down_proj", "replicated", (("q_a", "self_attn.q_a_proj"),)),
              ("self_attention.linear_q_up_proj", "column", (("q_b", "self_attn.q_b_proj"),)))
MLA_Q_PLAIN = (("self_attention.linear_q_proj", "column", (("q", "self_attn.q_proj"),)),)
MLA_KV = (("self_attention.linear_kv_down_proj", "replicated", (("kv_a", "self_attn.kv_a_proj_with_mqa"),)),
          ("self_attention.linear_kv_up_proj", "column", (("kv_b", "self_attn.kv_b_proj"),)))
# expert target -> (linear under an expert, column|row, part, HF parameter under the layer)
EXPERT_TARGET_MAP: dict[str, tuple[str, str, str, str]] = {
    "expert_fc1": ("linear_fc1", "column", "gate_up", "mlp.experts.gate_up_proj"),
    "expert_fc2": ("linear_fc2", "row", "down", "mlp.experts.down_proj"),
}
PEFT_PARAMETER_TO_TARGET = {hf.split(".", 1)[1]: t for t, (_, _, _, hf) in EXPERT_TARGET_MAP.items()}
_MODULES = [(t, part, hf) for t, (_, _, parts) in TARGET_MAP.items() for part, hf in parts]
_MODULES += [("qkv", part, hf) for _, _, parts in MLA_Q_LORA + MLA_KV for part, hf in parts]
PEFT_MODULE_TO_TARGET = {hf.rsplit(".", 1)[1]: t for t, _, hf in _MODULES}
PEFT_MODULE_TO_PART = {hf.rsplit(".", 1)[1]: part for _, part, hf in _MODULES}
ADAPTER_MODULE = "adapter"  # the adapter's submodule name under a megatron-core linear
SCORE_MODULE = "score"  # a *ForSequenceClassification's head: PEFT's modules_to_save for task_type SEQ_CLS


@dataclass(frozen=True)
class LoraShape:
    """What fixes the adapters' tensors: rank, scaling alpha and the targeted linears."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def target_names(text: str | None) -> tuple[str, ...] | None:
    """--lora-targets' names (aliases expanded) in the canonical order; None for None. Unknown
    names are kept out: `unknown_targets` reports them."""
    if text is None:
        return None
    names = set()
    for name in (t.strip() for t in text.split(",")):
        names.update(TARGET_ALIASES.get(name, (name,)))
    return tuple(t for t in ALL_TARGETS if t in names)


def unknown_targets(text: str) -> list[str]:
    return [t for t in (t.strip() for t in text.split(",")) if t not in ALL_TARGETS and t not in TARGET_ALIASES]


def target_layout(target: str) -> tuple[str, tuple[str, ...]]:
    """(column|row, the A/B parts) of one target's linear (the q/k/v attention's for `qkv`)."""
    if target in EXPERT_TARGET_MAP:
        _, parallel, part, _ = EXPERT_TARGET_MAP[target]
        return parallel, (part,)
    _, parallel, parts = TARGET_MAP[target]
    return parallel, tuple(part for part, _ in parts)


def target_linears(spec: ModelSpec, target: str) -> tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...]:
    """The linears a dense target adapts on this base, each (megatron-core linear under a layer,
    column|row|replicated, ((part, HF module under the layer), ...)): one, but for `qkv` on
    multi-latent attention, its q and kv projections."""
    if target == "qkv" and spec.multi_latent_attention:
        return (MLA_Q_LORA if spec.q_lora_rank else MLA_Q_PLAIN) + MLA_KV
    return (TARGET_MAP[target],)


def peft_modules(spec: ModelSpec, targets: tuple[str, ...]) -> list[str]:
    """PEFT's `target_modules` of these targets on this base (the experts' are parameters)."""
    return sorted(hf.rsplit(".", 1)[1] for t in targets if t in TARGET_MAP
                  for _, _, parts in target_linears(spec, t) for _, hf in parts)


def interleaved_gate_up(spec: ModelSpec) -> bool:
    """Whether the HF experts' fused gate_up rows alternate gate and up (GPT-OSS: the family's key
    map reads expert fc1 as `fc1_interleaved`) rather than [gate; up]: the rows of PEFT's lora_B."""
    if not spec.moe_layers:
        return False
    from checkpoint_convert.families import family_of

    keys = family_of(spec).layer_keys(spec, layer=spec.moe_layers[0])
    entry = keys.get("decoder.layers.{layer}.mlp.experts.local_experts.0.linear_fc1.weight")
    return entry is not None and entry[0] == "fc1_interleaved"


def _gate_up_rows(value: torch.Tensor, *, to_hf: bool) -> torch.Tensor:
    """An expert's gate_up B [2I, r]: [gate; up] rows <-> rows alternating gate and up."""
    if to_hf:
        gate, up = value.chunk(2, dim=0)
        return torch.stack([gate, up], dim=1).reshape(value.shape)
    return torch.cat([value[0::2], value[1::2]], dim=0)


def peft_name(layer: int, hf_module: str, ab: str) -> str:
    """PEFT's saved key (no adapter name) of lora_A / lora_B of one projection."""
    return f"base_model.model.model.layers.{layer}.{hf_module}.lora_{ab}.weight"


def mcore_adapter_name(local_layer: int, linear: str, part: str, ab: str) -> str:
    """The adapter parameter's name in the stage model (`named_parameters()`); `linear`: the
    megatron-core linear under the layer (TARGET_MAP's, or `target_linears`')."""
    return f"decoder.layers.{local_layer}.{linear}.{ADAPTER_MODULE}.lora_{ab}_{part}"


def peft_expert_name(layer: int, target: str, ab: str, *, targets: tuple[str, ...]) -> str:
    """PEFT's saved key of the experts' lora_A / lora_B of one fused parameter (all experts in
    one tensor). PEFT wraps gate_up_proj first, so with both targeted it is the inner wrapper."""
    nested = "base_layer." if target == "expert_fc1" and "expert_fc2" in targets else ""
    return f"base_model.model.model.layers.{layer}.mlp.experts.{nested}lora_{ab}.weight"


def mcore_expert_adapter_name(local_layer: int, local_expert: int, target: str, ab: str) -> str:
    linear, _, part, _ = EXPERT_TARGET_MAP[target]
    return f"decoder.layers.{local_layer}.mlp.experts.local_experts.{local_expert}.{linear}.{ADAPTER_MODULE}.lora_{ab}_{part}"


def part_features(spec: ModelSpec, target: str, part: str) -> tuple[int, int]:
    """(in_features, out_features) of one HF projection, or of one expert (whole, not split)."""
    q_out = spec.num_heads * spec.head_dim
    kv_out = spec.num_query_groups * spec.head_dim
    h, ffn, moe = spec.hidden_size, spec.intermediate_size, spec.moe_intermediate_size
    if spec.multi_latent_attention and target in ("qkv", "proj"):
        n, rope = spec.num_heads, spec.qk_rope_head_dim
        return {
            ("qkv", "q_a"): (h, spec.q_lora_rank), ("qkv", "q_b"): (spec.q_lora_rank, q_out), ("qkv", "q"): (h, q_out),
            ("qkv", "kv_a"): (h, spec.kv_lora_rank + rope),
            ("qkv", "kv_b"): (spec.kv_lora_rank, n * (spec.head_dim - rope + spec.v_head_dim)),
            ("proj", "o"): (n * spec.v_head_dim, h),
        }[(target, part)]
    return {
        ("qkv", "q"): (h, q_out), ("qkv", "k"): (h, kv_out), ("qkv", "v"): (h, kv_out),
        ("proj", "o"): (q_out, h), ("fc1", "gate"): (h, ffn), ("fc1", "up"): (h, ffn), ("fc2", "down"): (ffn, h),
        ("expert_fc1", "gate_up"): (h, 2 * moe), ("expert_fc2", "down"): (moe, h),
    }[(target, part)]


def targets_present(spec: ModelSpec) -> tuple[str, ...]:
    """The targets an adapter on this base can have: the dense MLP's fc1/fc2 on a model without
    experts, the experts' on a MoE model. (On Qwen3-MoE and Mixtral under transformers 5, PEFT reads
    target_modules gate_proj/up_proj/down_proj or w1/w3/w2 as transformers 4's per-expert linears
    and moves them onto the fused expert parameters, so a dense MLP layer of a MoE model cannot be
    named in a PEFT adapter.)"""
    dense = ("fc1", "fc2") if not spec.num_experts else EXPERT_TARGETS
    return tuple(t for t in ALL_TARGETS if t in ("qkv", "proj") or t in dense)


def adapter_entries(spec: ModelSpec, lora: LoraShape, *, pp: int, pp_rank: int
                    ) -> Iterator[tuple[str, str, str, str, int]]:
    """(megatron name, PEFT name, "A"|"B", "column"|"row", global layer) of every adapter tensor
    on one pipeline stage, in a fixed order: the dense linears' (fc1/fc2 on dense MLP layers only)."""
    for local, layer in enumerate(stage_layers(spec.num_layers, pp=pp, pp_rank=pp_rank)):
        for target in TARGETS:
            if target not in lora.targets or (target in ("fc1", "fc2") and spec.is_moe_layer(layer)):
                continue
            for linear, parallel, parts in target_linears(spec, target):
                for part, hf_module in parts:
                    for ab in ("A", "B"):
                        yield mcore_adapter_name(local, linear, part, ab), peft_name(layer, hf_module, ab), ab, parallel, layer


def saved_modules(spec: ModelSpec) -> tuple[str, ...]:
    """The base's modules an adapter trains and saves whole (PEFT's `modules_to_save`): a reward
    model's score head, none for a causal LM."""
    return (SCORE_MODULE,) if spec.num_labels else ()


def saved_entries(spec: ModelSpec, *, pp: int, pp_rank: int) -> list[tuple[str, str]]:
    """(megatron name, PEFT saved key) of the saved modules' tensors on one pipeline stage: the
    score head's weight on the last stage (whole on every tp rank), as PEFT saves a SEQ_CLS
    model's modules_to_save: under the module's name, without `modules_to_save.default`."""
    if SCORE_MODULE not in saved_modules(spec) or pp_rank != pp - 1:
        return []
    return [(f"{SCORE_MODULE}.weight", f"base_model.model.{SCORE_MODULE}.weight")]


def expert_entries(spec: ModelSpec, lora: LoraShape, *, pp: int, pp_rank: int, ep: int = 1, ep_rank: int = 0
                   ) -> Iterator[tuple[str, str, str, str, int, int]]:
    """(megatron name, PEFT name, "A"|"B", "column"|"row", global layer, global expert) of every
    expert adapter tensor on one pipeline stage and expert-parallel rank (which holds experts
    [ep_rank·E/ep, (ep_rank+1)·E/ep) as its local experts 0..E/ep-1), in a fixed order."""
    per_rank = spec.num_experts // ep
    for local, layer in enumerate(stage_layers(spec.num_layers, pp=pp, pp_rank=pp_rank)):
        if not spec.is_moe_layer(layer):
            continue
        for local_expert in range(per_rank):
            for target in EXPERT_TARGETS:
                if target not in lora.targets:
                    continue
                parallel = EXPERT_TARGET_MAP[target][1]
                for ab in ("A", "B"):
                    yield (mcore_expert_adapter_name(local, local_expert, target, ab),
                           peft_expert_name(layer, target, ab, targets=lora.targets), ab, parallel, layer,
                           ep_rank * per_rank + local_expert)


def expert_piece(value: torch.Tensor, *, ab: str, expert: int, num_experts: int, rank: int) -> torch.Tensor:
    """Expert `expert`'s A [r, in] or B [out, r] from PEFT's fused A [r·E, in] or B [out, r·E]."""
    if ab == "A":
        return value[expert * rank:(expert + 1) * rank]
    return value[:, expert::num_experts]


def join_experts(pieces: list[torch.Tensor], *, ab: str) -> torch.Tensor:
    """PEFT's fused A [r·E, in] or B [out, r·E] from every expert's piece, in expert order."""
    if ab == "A":
        return torch.cat(pieces, dim=0)
    return torch.stack(pieces, dim=-1).reshape(pieces[0].shape[0], -1)


def _split_expert(value: torch.Tensor, *, target: str, ab: str, tp: int, tp_rank: int) -> torch.Tensor:
    """One tp rank's piece of an expert's A or B. linear_fc1's rows on a tp rank are
    [its gate chunk; its up chunk], so B of expert_fc1 splits each half."""
    dim = _split_dim(ab, EXPERT_TARGET_MAP[target][1])
    if dim is None or tp == 1:
        return value
    if target == "expert_fc1":
        return torch.cat([half.chunk(tp, dim=0)[tp_rank] for half in value.chunk(2, dim=0)], dim=0)
    return value.chunk(tp, dim=dim)[tp_rank]


def _join_expert(pieces: list[torch.Tensor], *, target: str, ab: str) -> torch.Tensor:
    dim = _split_dim(ab, EXPERT_TARGET_MAP[target][1])
    if dim is None or len(pieces) == 1:
        return pieces[0]
    if target == "expert_fc1":
        halves = [p.chunk(2, dim=0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(pieces, dim=dim)


def _expert_target(name: str) -> str:
    return next(t for t, (linear, *_) in EXPERT_TARGET_MAP.items() if f".{linear}.{ADAPTER_MODULE}." in name)


def _split_dim(ab: str, parallel: str) -> int | None:
    """The dim a tensor is split on over tp ranks, None when every rank holds it whole."""
    if parallel == "replicated":
        return None
    if parallel == "column":
        return 0 if ab == "B" else None
    return 1 if ab == "A" else None


def peft_to_shard(get: Callable[[str], torch.Tensor], *, spec: ModelSpec, lora: LoraShape, tp: int, tp_rank: int,
                  pp: int, pp_rank: int, ep: int = 1, ep_rank: int = 0, saved: bool = False) -> dict[str, torch.Tensor]:
    """One (tp_rank, pp_rank, ep_rank)'s adapter tensors (megatron names) from whole PEFT-named
    tensors. B of q/k/v splits into equal row chunks: whole query groups per rank, as the fused
    weight. Experts: this ep rank's experts, each its slice of PEFT's fused A/B. `saved`: the
    saved modules' tensors too (`saved_entries`: a reward model's score head, whole)."""
    shard = {}
    for name, peft in saved_entries(spec, pp=pp, pp_rank=pp_rank) if saved else ():
        shard[name] = get(peft).contiguous().clone()
    for name, peft, ab, parallel, _ in adapter_entries(spec, lora, pp=pp, pp_rank=pp_rank):
        value = get(peft)
        dim = _split_dim(ab, parallel)
        if dim is not None:
            value = value.chunk(tp, dim=dim)[tp_rank]
        shard[name] = value.contiguous().clone()
    fused: dict[str, torch.Tensor] = {}
    interleaved = interleaved_gate_up(spec)
    for name, peft, ab, _, _, expert in expert_entries(spec, lora, pp=pp, pp_rank=pp_rank, ep=ep, ep_rank=ep_rank):
        if peft not in fused:
            fused[peft] = get(peft)
        value = expert_piece(fused[peft], ab=ab, expert=expert, num_experts=spec.num_experts, rank=lora.rank)
        target = _expert_target(name)
        if interleaved and target == "expert_fc1" and ab == "B":
            value = _gate_up_rows(value, to_hf=False)
        shard[name] = _split_expert(value, target=target, ab=ab, tp=tp, tp_rank=tp_rank).contiguous().clone()
    return shard


def shards_to_peft(shards: Mapping[tuple[int, ...], Mapping[str, torch.Tensor]], *, spec: ModelSpec,
                   lora: LoraShape, tp: int, pp: int, ep: int = 1) -> dict[str, torch.Tensor]:
    """Whole PEFT-named tensors from every rank's adapter shard, keyed (tp_rank, pp_rank), or
    (tp_rank, pp_rank, ep_rank) when ep > 1 (dense adapters are taken from ep rank 0; each expert
    from the ep rank holding it, under its global index); a reward model's score head
    (`saved_entries`) from tp rank 0 of the last stage."""
    def shard(t: int, p: int, e: int = 0) -> Mapping[str, torch.Tensor]:
        return shards[(t, p, e) if ep > 1 else (t, p)]

    out = {}
    for name, peft in saved_entries(spec, pp=pp, pp_rank=pp - 1):
        if name not in shard(0, pp - 1):
            raise ConversionError(f"adapter shard of pp rank {pp - 1}: tensor '{name}' (a module the adapter "
                                  "saves whole) is missing")
        out[peft] = shard(0, pp - 1)[name]
    interleaved = interleaved_gate_up(spec)
    for pp_rank in range(pp):
        for name, peft, ab, parallel, _ in adapter_entries(spec, lora, pp=pp, pp_rank=pp_rank):
            dim = _split_dim(ab, parallel)
            try:
                pieces = [shard(t, pp_rank)[name] for t in (range(tp) if dim is not None else (0,))]
            except KeyError:
                raise ConversionError(f"adapter shard of pp rank {pp_rank}: tensor '{name}' is missing") from None
            out[peft] = torch.cat(pieces, dim=dim) if dim is not None else pieces[0]
        experts: dict[str, dict[int, torch.Tensor]] = {}
        for ep_rank in range(ep):
            for name, peft, ab, parallel, _, expert in expert_entries(spec, lora, pp=pp, pp_rank=pp_rank, ep=ep,
                                                                      ep_rank=ep_rank):
                ranks = range(tp) if _split_dim(ab, parallel) is not None else (0,)
                try:
                    pieces = [shard(t, pp_rank, ep_rank)[name] for t in ranks]
                except KeyError:
                    raise ConversionError(f"adapter shard of pp rank {pp_rank} ep rank {ep_rank}: tensor '{name}' "
                                          "is missing") from None
                target = _expert_target(name)
                value = _join_expert(pieces, target=target, ab=ab)
                if interleaved and target == "expert_fc1" and ab == "B":
                    value = _gate_up_rows(value, to_hf=True)
                experts.setdefault(peft, {})[expert] = value
        for peft, by_expert in experts.items():
            out[peft] = join_experts([by_expert[e] for e in sorted(by_expert)], ab="A" if ".lora_A." in peft else "B")
    return out


def peft_shapes(spec: ModelSpec, lora: LoraShape) -> dict[str, tuple[str, int, tuple[int, int]]]:
    """PEFT name -> ("A"|"B", in_features, whole shape) of every tensor of an adapter on this base,
    in a fixed order (the dense ones, then the experts' fused ones)."""
    out = {}
    for _, peft, ab, _, _ in adapter_entries(spec, lora, pp=1, pp_rank=0):
        module = peft.split(".")[-3]
        fan_in, fan_out = part_features(spec, PEFT_MODULE_TO_TARGET[module], PEFT_MODULE_TO_PART[module])
        out[peft] = (ab, fan_in, (lora.rank, fan_in) if ab == "A" else (fan_out, lora.rank))
    for name, peft, ab, _, _, _ in expert_entries(spec, lora, pp=1, pp_rank=0):
        if peft in out:
            continue
        target = _expert_target(name)
        fan_in, fan_out = part_features(spec, target, EXPERT_TARGET_MAP[target][2])
        stacked = lora.rank * spec.num_experts
        out[peft] = (ab, fan_in, (stacked, fan_in) if ab == "A" else (fan_out, stacked))
    return out


def initial_adapter(spec: ModelSpec, lora: LoraShape, *, seed: int, dtype: torch.dtype = torch.float32
                    ) -> dict[str, torch.Tensor]:
    """A fresh adapter, PEFT-named and whole, as PEFT initialises one: A Kaiming-uniform with
    a = sqrt(5) over its whole input dim (bound 1/sqrt(in_features)), B zero. Each A has a
    generator of its own (seed, layer, projection), so every layout starts from the same adapter.
    The experts' fused A [r·E, in] is drawn as one tensor, as PEFT does (the same bound)."""
    out = {}
    for index, (peft, (ab, fan_in, shape)) in enumerate(peft_shapes(spec, lora).items()):
        if ab == "B":
            out[peft] = torch.zeros(shape, dtype=dtype)
            continue
        gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
        bound = 1.0 / math.sqrt(fan_in)
        out[peft] = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1).mul_(bound).to(dtype)
    return out


# --------------------------------------------------------------------------- PEFT directories
def adapter_config(lora: LoraShape, *, spec: ModelSpec, dropout: float, base_model: str | None) -> dict:
    """adapter_config.json of a plain LoRA adapter on the base `spec`: for a causal LM
    (CAUSAL_LM), or for a reward model (SEQ_CLS, its score head in modules_to_save)."""
    modules = peft_modules(spec, lora.targets)
    saved = list(saved_modules(spec))
    parameters = sorted(EXPERT_TARGET_MAP[t][3] for t in lora.targets if t in EXPERT_TARGET_MAP)
    extra = {"target_parameters": parameters} if parameters else {}
    return {
        "peft_type": "LORA",
        "task_type": "SEQ_CLS" if saved else "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": dropout,
        "target_modules": modules or None,
        **extra,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": saved or None,
        "inference_mode": True,
    }


def write_adapter_dir(directory: str | Path, tensors: Mapping[str, torch.Tensor], config: dict) -> None:
    """adapter_config.json and adapter_model.safetensors into `directory` (created)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def read_adapter_config(directory: str | Path) -> dict:
    path = Path(directory) / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConversionError(f"{path}: not found (not a PEFT adapter directory)") from None
    except (OSError, json.JSONDecodeError) as error:
        raise ConversionError(f"{path}: unreadable ({error})") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path}: expected a JSON object")
    return config


def lora_shape_of(directory: str | Path, *, spec: ModelSpec) -> tuple[LoraShape, float]:
    """The LoRA shape and dropout an adapter directory declares for the base `spec`; only plain
    LoRA on the four projection groups (on multi-latent attention: its q/kv projections, all of
    them) and the experts' fused parameters is accepted (no DoRA, rsLoRA, biases, per-module
    ranks or saved modules)."""
    path = Path(directory) / ADAPTER_CONFIG
    config = read_adapter_config(directory)
    if config.get("peft_type") != "LORA":
        raise ConversionError(f"{path}: field 'peft_type' is {config.get('peft_type')!r}; only LORA adapters load")
    for field, plain in (("use_dora", False), ("use_rslora", False), ("bias", "none"), ("fan_in_fan_out", False)):
        if config.get(field, plain) not in (plain, None):
            raise ConversionError(f"{path}: field '{field}' is {config[field]!r}; only {plain!r} is supported")
    if config.get("modules_to_save"):  # e.g. a reward run's OUTPUT/adapter, its score head saved whole
        raise ConversionError(f"{path}: field 'modules_to_save' is {config['modules_to_save']!r}; only adapters "
                              "without saved modules load (a saved score head does not start a run)")
    for field in ("rank_pattern", "alpha_pattern", "layers_to_transform"):
        if config.get(field):
            raise ConversionError(f"{path}: field '{field}' is set; only a uniform adapter on every layer loads")
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise ConversionError(f"{path}: field 'r' must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise ConversionError(f"{path}: field 'lora_alpha' must be a positive number, got {alpha!r}")
    parameters = config.get("target_parameters") or []
    if not isinstance(parameters, list):
        raise ConversionError(f"{path}: field 'target_parameters' must list parameter names, got {parameters!r}")
    expert_targets = []
    for name in parameters:
        short = ".".join(str(name).split(".")[-2:])
        if short not in PEFT_PARAMETER_TO_TARGET:
            raise ConversionError(f"{path}: field 'target_parameters' names {name!r}; supported: "
                                  f"{', '.join(sorted(hf for *_, hf in EXPERT_TARGET_MAP.values()))}")
        expert_targets.append(PEFT_PARAMETER_TO_TARGET[short])
    modules = config.get("target_modules")
    if modules is None and expert_targets:
        modules = []
    if isinstance(modules, str) or not isinstance(modules, list):
        raise ConversionError(f"{path}: field 'target_modules' must list module names, got {modules!r}")
    unknown = sorted(set(modules) - set(PEFT_MODULE_TO_TARGET))
    if unknown:
        raise ConversionError(f"{path}: field 'target_modules' names {unknown[0]!r}; supported: "
                              f"{', '.join(sorted(PEFT_MODULE_TO_TARGET))}")
    targets = []
    for target in TARGETS:
        wanted = set(peft_modules(spec, (target,)))
        have = {m for m in modules if PEFT_MODULE_TO_TARGET[m] == target}
        if have - wanted:
            raise ConversionError(f"{path}: field 'target_modules' names {sorted(have - wanted)[0]!r}, which "
                                  f"{spec.architecture} does not have (its {target} projections: {', '.join(sorted(wanted))})")
        if have and have != wanted:
            why = ("LoRA adapts all of multi-latent attention's q/kv projections together"
                   if target == "qkv" and spec.multi_latent_attention else "the fused linears take all of their projections")
            raise ConversionError(f"{path}: field 'target_modules' has {sorted(have)} without {sorted(wanted - have)}; {why}")
        if have:
            targets.append(target)
    targets += [t for t in EXPERT_TARGETS if t in expert_targets]
    dropout = config.get("lora_dropout", 0.0)
    return LoraShape(rank=rank, alpha=float(alpha), targets=tuple(targets)), float(dropout or 0.0)


def read_adapter(directory: str | Path, *, spec: ModelSpec, lora: LoraShape) -> dict[str, torch.Tensor]:
    """The adapter's tensors (PEFT names, no adapter name), checked against the base `spec` and
    the `lora` shape: every expected key, no other, each of the expected shape."""
    from safetensors import safe_open

    path = Path(directory) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise ConversionError(f"{path}: not found (only safetensors adapters load)")
    try:
        with safe_open(str(path), framework="pt") as fh:
            found = {_strip_adapter_name(k): k for k in fh.keys()}
            expected = peft_shapes(spec, lora)
            extra = sorted(set(found) - set(expected))
            missing = sorted(set(expected) - set(found))
            if extra:
                raise ConversionError(f"{path}: tensor '{extra[0]}' has no place in a rank-{lora.rank} adapter of "
                                      f"this base ({spec.num_layers} layers); the adapter was made for another base")
            if missing:
                raise ConversionError(f"{path}: tensor '{missing[0]}' is missing")
            out = {}
            for peft, (_, _, want) in expected.items():
                value = fh.get_tensor(found[peft])
                if tuple(value.shape) != want:
                    raise ConversionError(f"{path}: tensor '{peft}' has shape {tuple(value.shape)}, the base "
                                          f"expects {want} at rank {lora.rank}; the adapter was made for another base or rank")
                out[peft] = value
    except ConversionError:
        raise
    except Exception as error:  # a truncated or foreign file
        raise ConversionError(f"{path}: unreadable ({str(error).splitlines()[0] if str(error) else type(error).__name__})") from None
    return out


def _strip_adapter_name(key: str) -> str:
    """PEFT saves without the adapter name; some tools keep `.default`: accept both spellings."""
    return key.replace(".lora_A.default.weight", ".lora_A.weight").replace(".lora_B.default.weight", ".lora_B.weight")


def shard_file_name(*, tp_rank: int, pp_rank: int, ep_rank: int = 0, ep: int = 1) -> str:
    """An adapter shard's file name: tp{t}_pp{p}, with _ep{e} when the experts are split (ep > 1)."""
    return f"tp{tp_rank}_pp{pp_rank}" + (f"_ep{ep_rank}" if ep > 1 else "") + ".safetensors"


def join_shard_files(directory: str | Path, *, spec: ModelSpec, lora: LoraShape, tp: int, pp: int, ep: int = 1
                     ) -> dict[str, torch.Tensor]:
    """Whole PEFT-named tensors from the adapter shards (`shard_file_name`) in `directory`."""
    from safetensors.torch import load_file

    shards = {}
    for t in range(tp):
        for p in range(pp):
            for e in range(ep):
                path = Path(directory) / shard_file_name(tp_rank=t, pp_rank=p, ep_rank=e, ep=ep)
                if not path.is_file():
                    raise ConversionError(f"{path}: adapter shard missing")
                shards[(t, p, e) if ep > 1 else (t, p)] = load_file(str(path))
    return shards_to_peft(shards, spec=spec, lora=lora, tp=tp, pp=pp, ep=ep)
