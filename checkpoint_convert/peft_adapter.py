"""LoRA adapters: the PEFT <-> megatron-core mapping, and PEFT adapter directories on disk.

PEFT puts one adapter (A: [r, in], B: [out, r]) on each Hugging Face projection. megatron-core
fuses q/k/v into `linear_qkv` and gate/up into `linear_fc1`; the engine keeps one A/B pair per
HF projection on those fused linears (`mcore_dpo.lora`), so the mapping is exact: no A is shared
between projections. Tensor-parallel splits:

    column-parallel (qkv, fc1): A whole on every tp rank, B split on its output dim (dim 0);
                                q/k/v's B rows split by whole query groups, like the fused weight
    row-parallel (proj, fc2):   A split on its input dim (dim 1), B whole on every tp rank

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

from checkpoint_convert.mapping import ConversionError, ModelSpec, stage_layers

TARGETS = ("qkv", "proj", "fc1", "fc2")
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
PEFT_MODULE_TO_TARGET = {hf.rsplit(".", 1)[1]: t for t, (_, _, parts) in TARGET_MAP.items() for _, hf in parts}
ADAPTER_MODULE = "adapter"  # the adapter's submodule name under a megatron-core linear


@dataclass(frozen=True)
class LoraShape:
    """What fixes the adapters' tensors: rank, scaling alpha and the targeted linears."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def peft_name(layer: int, hf_module: str, ab: str) -> str:
    """PEFT's saved key (no adapter name) of lora_A / lora_B of one projection."""
    return f"base_model.model.model.layers.{layer}.{hf_module}.lora_{ab}.weight"


def mcore_adapter_name(local_layer: int, target: str, part: str, ab: str) -> str:
    """The adapter parameter's name in the stage model (`named_parameters()`)."""
    linear = TARGET_MAP[target][0]
    return f"decoder.layers.{local_layer}.{linear}.{ADAPTER_MODULE}.lora_{ab}_{part}"


def part_features(spec: ModelSpec, target: str, part: str) -> tuple[int, int]:
    """(in_features, out_features) of one HF projection (whole, not split)."""
    q_out = spec.num_heads * spec.head_dim
    kv_out = spec.num_query_groups * spec.head_dim
    h, ffn = spec.hidden_size, spec.intermediate_size
    return {
        ("qkv", "q"): (h, q_out), ("qkv", "k"): (h, kv_out), ("qkv", "v"): (h, kv_out),
        ("proj", "o"): (q_out, h), ("fc1", "gate"): (h, ffn), ("fc1", "up"): (h, ffn), ("fc2", "down"): (ffn, h),
    }[(target, part)]


def adapter_entries(spec: ModelSpec, lora: LoraShape, *, pp: int, pp_rank: int
                    ) -> Iterator[tuple[str, str, str, str, int]]:
    """(megatron name, PEFT name, "A"|"B", "column"|"row", global layer) of every adapter tensor
    on one pipeline stage, in a fixed order."""
    for local, layer in enumerate(stage_layers(spec.num_layers, pp=pp, pp_rank=pp_rank)):
        for target in TARGETS:
            if target not in lora.targets:
                continue
            _, parallel, parts = TARGET_MAP[target]
            for part, hf_module in parts:
                for ab in ("A", "B"):
                    yield mcore_adapter_name(local, target, part, ab), peft_name(layer, hf_module, ab), ab, parallel, layer


def _split_dim(ab: str, parallel: str) -> int | None:
    """The dim a tensor is split on over tp ranks, None when every rank holds it whole."""
    if parallel == "column":
        return 0 if ab == "B" else None
    return 1 if ab == "A" else None


def peft_to_shard(get: Callable[[str], torch.Tensor], *, spec: ModelSpec, lora: LoraShape, tp: int, tp_rank: int,
                  pp: int, pp_rank: int) -> dict[str, torch.Tensor]:
    """One (tp_rank, pp_rank)'s adapter tensors (megatron names) from whole PEFT-named tensors.
    B of q/k/v splits into equal row chunks: whole query groups per rank, as the fused weight."""
    shard = {}
    for name, peft, ab, parallel, _ in adapter_entries(spec, lora, pp=pp, pp_rank=pp_rank):
        value = get(peft)
        dim = _split_dim(ab, parallel)
        if dim is not None:
            value = value.chunk(tp, dim=dim)[tp_rank]
        shard[name] = value.contiguous().clone()
    return shard


def shards_to_peft(shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]], *, spec: ModelSpec,
                   lora: LoraShape, tp: int, pp: int) -> dict[str, torch.Tensor]:
    """Whole PEFT-named tensors from every (tp_rank, pp_rank)'s adapter shard."""
    out = {}
    for pp_rank in range(pp):
        for name, peft, ab, parallel, _ in adapter_entries(spec, lora, pp=pp, pp_rank=pp_rank):
            dim = _split_dim(ab, parallel)
            try:
                pieces = [shards[(t, pp_rank)][name] for t in (range(tp) if dim is not None else (0,))]
            except KeyError:
                raise ConversionError(f"adapter shard of pp rank {pp_rank}: tensor '{name}' is missing") from None
            out[peft] = torch.cat(pieces, dim=dim) if dim is not None else pieces[0]
    return out


def initial_adapter(spec: ModelSpec, lora: LoraShape, *, seed: int, dtype: torch.dtype = torch.float32
                    ) -> dict[str, torch.Tensor]:
    """A fresh adapter, PEFT-named and whole, as PEFT initialises one: A Kaiming-uniform with
    a = sqrt(5) over its whole input dim (bound 1/sqrt(in_features)), B zero. Each A has a
    generator of its own (seed, layer, projection), so every layout starts from the same adapter."""
    out = {}
    for index, (_, peft, ab, _, layer) in enumerate(adapter_entries(spec, lora, pp=1, pp_rank=0)):
        target = PEFT_MODULE_TO_TARGET[peft.split(".")[-3]]
        fan_in, fan_out = part_features(spec, target, _part_of(peft))
        if ab == "B":
            out[peft] = torch.zeros(fan_out, lora.rank, dtype=dtype)
            continue
        gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
        bound = 1.0 / math.sqrt(fan_in)
        out[peft] = (torch.rand(lora.rank, fan_in, generator=gen, dtype=torch.float64) * 2 - 1).mul_(bound).to(dtype)
    return out


def _part_of(peft: str) -> str:
    module = peft.split(".")[-3]
    target = PEFT_MODULE_TO_TARGET[module]
    return next(part for part, hf in TARGET_MAP[target][2] if hf.endswith(module))


# --------------------------------------------------------------------------- PEFT directories
def adapter_config(lora: LoraShape, *, dropout: float, base_model: str | None) -> dict:
    """adapter_config.json of a plain LoRA adapter for a causal LM."""
    modules = sorted(hf.rsplit(".", 1)[1] for t in lora.targets for _, hf in TARGET_MAP[t][2])
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
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


def lora_shape_of(directory: str | Path) -> tuple[LoraShape, float]:
    """The LoRA shape and dropout an adapter directory declares; only plain LoRA on the four
    projection groups is accepted (no DoRA, rsLoRA, biases, per-module ranks or saved modules)."""
    path = Path(directory) / ADAPTER_CONFIG
    config = read_adapter_config(directory)
    if config.get("peft_type") != "LORA":
        raise ConversionError(f"{path}: field 'peft_type' is {config.get('peft_type')!r}; only LORA adapters load")
    for field, plain in (("use_dora", False), ("use_rslora", False), ("bias", "none"), ("fan_in_fan_out", False)):
        if config.get(field, plain) not in (plain, None):
            raise ConversionError(f"{path}: field '{field}' is {config[field]!r}; only {plain!r} is supported")
    for field in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if config.get(field):
            raise ConversionError(f"{path}: field '{field}' is set; only a uniform adapter on every layer loads")
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise ConversionError(f"{path}: field 'r' must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise ConversionError(f"{path}: field 'lora_alpha' must be a positive number, got {alpha!r}")
    modules = config.get("target_modules")
    if isinstance(modules, str) or not isinstance(modules, list):
        raise ConversionError(f"{path}: field 'target_modules' must list module names, got {modules!r}")
    unknown = sorted(set(modules) - set(PEFT_MODULE_TO_TARGET))
    if unknown:
        raise ConversionError(f"{path}: field 'target_modules' names {unknown[0]!r}; supported: "
                              f"{', '.join(sorted(PEFT_MODULE_TO_TARGET))}")
    targets = []
    for target in TARGETS:
        wanted = {hf.rsplit(".", 1)[1] for _, hf in TARGET_MAP[target][2]}
        have = wanted & set(modules)
        if have and have != wanted:
            raise ConversionError(f"{path}: field 'target_modules' has {sorted(have)} without {sorted(wanted - have)}; "
                                  "the fused linears take all of their projections")
        if have:
            targets.append(target)
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
            expected = {peft: (ab, layer) for _, peft, ab, _, layer in adapter_entries(spec, lora, pp=1, pp_rank=0)}
            extra = sorted(set(found) - set(expected))
            missing = sorted(set(expected) - set(found))
            if extra:
                raise ConversionError(f"{path}: tensor '{extra[0]}' has no place in a rank-{lora.rank} adapter of "
                                      f"this base ({spec.num_layers} layers); the adapter was made for another base")
            if missing:
                raise ConversionError(f"{path}: tensor '{missing[0]}' is missing")
            out = {}
            for peft, (ab, _) in expected.items():
                value = fh.get_tensor(found[peft])
                target = PEFT_MODULE_TO_TARGET[peft.split(".")[-3]]
                fan_in, fan_out = part_features(spec, target, _part_of(peft))
                want = (lora.rank, fan_in) if ab == "A" else (fan_out, lora.rank)
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


def join_shard_files(directory: str | Path, *, spec: ModelSpec, lora: LoraShape, tp: int, pp: int
                     ) -> dict[str, torch.Tensor]:
    """Whole PEFT-named tensors from the `tp{t}_pp{p}.safetensors` adapter shards in `directory`."""
    from safetensors.torch import load_file

    shards = {}
    for t in range(tp):
        for p in range(pp):
            path = Path(directory) / f"tp{t}_pp{p}.safetensors"
            if not path.is_file():
                raise ConversionError(f"{path}: adapter shard missing")
            shards[(t, p)] = load_file(str(path))
    return shards_to_peft(shards, spec=spec, lora=lora, tp=tp, pp=pp)
