"""Megatron's own checkpoint format: megatron-core dist_checkpointing (torch_dist backend)
inside Megatron-LM's directory layout. Megatron-LM, Megatron-Bridge and ms-swift read and
write it.

    latest_checkpointed_iteration.txt     "release" (or the iteration number)
    release/ (or iter_0000100/)
        metadata.json, .metadata, __{rank}_0.distcp   dist_checkpointing files (see dcp.py)
        common.pt       {"args": Namespace(...), "checkpoint_version": 3.0, "iteration": 0}
                        (megatron-core 0.19 and later write no common.pt: the same dict is the
                        object `common_state/shard_0_1` inside the .distcp files, see below)
        hf_files/       config.json + tokenizer/generation files of the source model
                        (written by this package; others' checkpoints lack it)

Tensors are stored by megatron-core's sharded keys in their global shape, whatever tp/pp
wrote them: `embedding.word_embeddings.weight` [padded vocab, h], the layer tensors stacked
with a leading layer dim (`decoder.layers.self_attention.linear_qkv.weight` [L, ...]; older
writers use per-layer keys `decoder.layers.N....`, also read), norms under the Transformer
Engine names (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`), fc1 as
[gate; up] over the whole intermediate size, qkv fused group by group over all groups.

Experts (megatron-core 0.16's SequentialMLP and TEGroupedMLP save the same keys): each layer's
local experts go under `mlp.experts.experts.linear_fc1.weight` / `linear_fc2.weight` with a
global expert axis right after the layer axis ([L, E, 2 f, h] stacked, [E, 2 f, h] per layer),
fc1 [gate; up] per expert; the router is `mlp.router.weight` [E, h]. A list `--moe-layer-freq`
(dense layers among the MoE ones) makes megatron-core save every layer under per-layer keys. A
MoE layer's pre-MLP norm is `mlp.linear_fc1.layer_norm_weight` in the local spec (which renames
it in every layer) but `pre_mlp_layernorm.weight` in the Transformer Engine spec (which fuses it
only into a dense fc1); both are read, and both written (megatron-core's loader ignores the
one a model does not ask for). Multi-latent attention renames nothing in the local spec (no
linear_qkv: `input_layernorm.weight`, `self_attention.q_layernorm.weight`, ...), while the TE spec
fuses the latent norms into their up projections and a dense layer's pre-MLP norm into its fc1;
the writer stores each such norm under both names (`_sharded_names`), and every linear's (empty)
extra state, the MLA projections' and the shared experts' included, as megatron-core's strict
loader asks for them. Writing stacks the layers when every layer is MoE (as an int
`--moe-layer-freq` makes megatron-core do) and uses per-layer keys otherwise, experts split over
the expert tp of (tp, ep). Checkpoints saved with the `singleton_local_shards` metadata (expert
index in the key, fc1 split into `weight_w` / `weight_v`) are not read (one line says so).

The common (non-tensor) state: megatron-core up to 0.18 writes it to `common.pt` (torch.save
of the dict). From 0.19, `dist_checkpointing.save` adds it to the sharded state instead, as a
ShardedObject with key "common_state", global shape (1,) and offset (0,), saved by the main
replica (rank 0): in `.metadata` an object entry `common_state/shard_0_1`, whose bytes in a
.distcp file are torch.save([dict]) like every ShardedObject's. Its loader reads common.pt when
present, else that object; `read_common_state` does the same, both through safe_pickle.

Reading presents the checkpoint as one tp1 pp1 shard (`shard_view(0, 0)`, local-spec names),
so the converter's HF view, mcore-to-hf and reshard need nothing format-specific. Writing
streams: one mapping entry at a time, each tp rank's part stored as its own chunk (vocabulary
tensors in row blocks), so memory holds one entry, never a stage.

Over 500 lines: the whole torch_dist format in both directions (the common.pt fields,
the sharded tensors' layout and its metadata), which the converter and the trainer share.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import torch

from checkpoint_convert.dcp import DcpReader, DcpWriter, is_dcp_dir
from checkpoint_convert.families import spec_from_hf_config
from checkpoint_convert.families.base import DTYPES, ConversionError, ModelSpec, moe_layer_freq
from checkpoint_convert.io import FORMAT_VERSION, HF_FILES_DIR, HFView, McoreMeta, read_json
from checkpoint_convert.safetensors_stream import narrowed_box
from checkpoint_convert.mapping import (
    canonical_tensors,
    expert_tp_size,
    is_expert_entry,
    mcore_entries,
    padded_vocab_size,
    split_entry,
    stacked_reader,
    stage_layers,
)
from checkpoint_convert.megatron_args import checkpoint_args, hf_config_from_args, layout_from_args
from checkpoint_convert.safe_pickle import torch_load_file

FORMAT = "torch_dist"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
COMMON_FILE = "common.pt"
COMMON_OBJECT = "common_state/shard_0_1"  # megatron-core 0.19+: the common state's object key
CHECKPOINT_VERSION = 3.0
RELEASE_DIR = "release"
# Vocabulary tensors are stored in chunks of at most this many bytes (one read block each).
VOCAB_CHUNK_BYTES = 4 * 2**20
# Local-spec layer names -> the names megatron-core's sharded state dict saves them under, one
# per layer spec: (the local spec's, the Transformer Engine spec's). The local spec renames a
# layer's two norms to the fused names the TE spec's layer-norm linears give them; the TE spec
# keeps a MoE layer's pre-MLP norm unfused (its experts take no norm).
_SHARDED_LAYER_NAMES = {
    "input_layernorm.weight": ("self_attention.linear_qkv.layer_norm_weight",) * 2,
    "pre_mlp_layernorm.weight": ("mlp.linear_fc1.layer_norm_weight",) * 2,
}
_MOE_SHARDED_LAYER_NAMES = {
    **_SHARDED_LAYER_NAMES,
    "pre_mlp_layernorm.weight": ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
}
# With multi-latent attention the local spec renames nothing (it has no linear_qkv), and the TE
# spec fuses the q and kv latent norms into their up projections and a dense layer's pre-MLP
# norm into its fc1 (its input norm stays a norm: the down projections are plain linears).
_MLA_SHARDED_LAYER_NAMES = {
    "self_attention.q_layernorm.weight": ("self_attention.q_layernorm.weight", "self_attention.linear_q_up_proj.layer_norm_weight"),
    "self_attention.kv_layernorm.weight": ("self_attention.kv_layernorm.weight", "self_attention.linear_kv_up_proj.layer_norm_weight"),
    "pre_mlp_layernorm.weight": ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
}
_MLA_MOE_SHARDED_LAYER_NAMES = {**_MLA_SHARDED_LAYER_NAMES, "pre_mlp_layernorm.weight": ("pre_mlp_layernorm.weight",) * 2}
# Local expert e of a layer -> megatron-core's sharded name, whose leading axis (after the layer
# axis) is the global expert index.
_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)")
_EXPERTS_KEY = "mlp.experts.experts."
_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
_MLA_LINEARS = ("self_attention.linear_kv_down_proj", "self_attention.linear_kv_up_proj", "self_attention.linear_proj")
_SHARED_EXPERT_LINEARS = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
# Keys a model reader ignores: optimizer state and rng/rerun objects ride along in training checkpoints.
_NON_MODEL_PREFIXES = ("optimizer.", "rng_state", "rerun_state_machine")


# ---------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------


def iteration_dir(directory: str | os.PathLike) -> Path:
    """The dist_checkpointing directory: DIR itself, or the one DIR's tracker file names."""
    directory = Path(directory)
    if is_dcp_dir(directory):
        return directory
    tracker = directory / TRACKER_FILE
    if not tracker.is_file():
        raise ConversionError(f"{directory}: neither a torch_dist checkpoint (metadata.json) nor a Megatron save directory ({TRACKER_FILE})")
    text = tracker.read_text().strip()
    if text == "release":
        name = RELEASE_DIR
    elif text.isdigit():
        name = f"iter_{int(text):07d}"
    else:
        raise ConversionError(f"{tracker}: expected 'release' or an iteration number, got {text[:40]!r}")
    if not is_dcp_dir(directory / name):
        raise ConversionError(f"{directory / name}: not a torch_dist checkpoint (metadata.json missing or not torch_dist)")
    return directory / name


def is_torch_dist_dir(directory: str | os.PathLike) -> bool:
    directory = Path(directory)
    return is_dcp_dir(directory) or (directory / TRACKER_FILE).is_file()


def read_common_state(directory: Path, reader: DcpReader) -> tuple[dict, str]:
    """(the common state dict, where it was read): common.pt when present, else megatron-core
    0.19's `common_state` object. Both through the restricted unpickler."""
    path = directory / COMMON_FILE
    if path.is_file():
        common, source = torch_load_file(path), str(path)
    elif COMMON_OBJECT in reader.objects:
        stored = reader.read_object(COMMON_OBJECT)
        source = f"{directory}: object '{COMMON_OBJECT}'"
        if not (isinstance(stored, list) and len(stored) == 1):
            raise ConversionError(f"{source}: expected a one-element list, got {type(stored).__name__}")
        common = stored[0]
    else:
        raise ConversionError(f"{directory}: no common state ({COMMON_FILE} is missing and .metadata has no '{COMMON_OBJECT}' object)")
    if not isinstance(common, dict):
        raise ConversionError(f"{source}: expected a dict, got {type(common).__name__}")
    return common, source


def _layer_key(name: str) -> tuple[int, str] | None:
    match = _LAYER_NAME.fullmatch(name)
    return (int(match.group(1)), match.group(2)) if match else None


def _sharded_names(spec: ModelSpec, suffix: str, *, moe_layer: bool) -> tuple[str, ...]:
    """The names megatron-core saves the local-spec layer tensor `suffix` under, one per layer
    spec that names it differently, the local spec's first."""
    if spec.multi_latent_attention:
        names = _MLA_MOE_SHARDED_LAYER_NAMES if moe_layer else _MLA_SHARDED_LAYER_NAMES
    else:
        names = _MOE_SHARDED_LAYER_NAMES if moe_layer else _SHARDED_LAYER_NAMES
    return tuple(dict.fromkeys(names.get(suffix, (suffix,))))


def _sharded_candidates(spec: ModelSpec, suffix: str, *, moe_layer: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(sharded name within a layer, indices into its leading axes after the layer axis) under
    which megatron-core may have saved the local-spec layer tensor `suffix`, most usual first:
    its names in the two layer specs, then its own (other writers' variant)."""
    expert = _LOCAL_EXPERT.fullmatch(suffix)
    if expert is not None:
        return [(_EXPERTS_KEY + expert.group(2), (int(expert.group(1)),))]
    return [(name, ()) for name in dict.fromkeys(_sharded_names(spec, suffix, moe_layer=moe_layer) + (suffix,))]


def _written_suffixes(spec: ModelSpec, suffix: str, *, moe_layer: bool) -> list[tuple[str, tuple[int, ...]]]:
    """The sharded names the writer stores a local-spec layer tensor under: its name in each layer
    spec (megatron-core's loader ignores the one a model does not ask for)."""
    expert = _LOCAL_EXPERT.fullmatch(suffix)
    if expert is not None:
        return [(_EXPERTS_KEY + expert.group(2), (int(expert.group(1)),))]
    return [(name, ()) for name in _sharded_names(spec, suffix, moe_layer=moe_layer)]


# ---------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------


class _GlobalShard(Mapping):
    """The checkpoint as one tp1 pp1 GPTModel's tensors, local-spec names, read on access."""

    def __init__(self, checkpoint: TorchDistCheckpoint, names: dict[str, tuple[int, ...]]) -> None:
        self._ckpt, self._names = checkpoint, names

    def locations(self, name: str) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
        """Every stored place of `name`: (key, indices into the key's leading axes, the sizes
        of those axes): the layer axis of the stacked layout, the global expert axis."""
        reader, prefix = self._ckpt.reader, self._ckpt.key_prefix
        layer = _layer_key(name)
        if layer is None:
            return [(prefix + name, (), ())]
        index, suffix = layer
        spec = self._ckpt.spec
        found = []
        for candidate, lead in _sharded_candidates(spec, suffix, moe_layer=spec.is_moe_layer(index)):
            sizes = (spec.num_experts,) * len(lead)
            if f"{prefix}decoder.layers.{candidate}" in reader.tensors:
                found.append((f"{prefix}decoder.layers.{candidate}", (index,) + lead, (spec.num_layers,) + sizes))
            elif f"{prefix}decoder.layers.{index}.{candidate}" in reader.tensors:
                found.append((f"{prefix}decoder.layers.{index}.{candidate}", lead, sizes))
        return found

    def _locate(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(stored key, indices into its leading axes) of the first place `name` is stored."""
        found = self.locations(name)
        if not found:
            if any(key.endswith(".weight_w") for key in self._ckpt.reader.tensors):
                raise ConversionError(f"{self._ckpt.dir}: saved with megatron-core's singleton_local_shards layout "
                                      "(fc1 split into weight_w / weight_v), which is not read")
            layer = _layer_key(name)
            spec = self._ckpt.spec
            looked = _sharded_candidates(spec, layer[1], moe_layer=spec.is_moe_layer(layer[0]))[0][0] if layer else name
            raise ConversionError(f"{self._ckpt.dir}: tensor for '{name}' is missing (looked for decoder.layers.{looked})")
        return found[0][:2]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        key, lead = self._locate(name)
        shape = self._names[name]
        if not lead:
            return self._ckpt.reader.read(key)
        return self._ckpt.reader.read(key, offsets=lead + (0,) * len(shape), sizes=(1,) * len(lead) + shape).reshape(shape)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        key, _ = self._locate(name)
        return self._ckpt.reader.read(key, offsets=(start, 0), sizes=(stop - start, self._names[name][1]))

    def part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """self[name] narrowed to [start, stop) on dim, loading only the chunks that hold it."""
        key, lead = self._locate(name)
        offsets, sizes = narrowed_box(self._names[name], dim, start, stop)
        region = self._ckpt.reader.read(key, offsets=lead + offsets, sizes=(1,) * len(lead) + sizes)
        return region.reshape(sizes)

    @property
    def bytes_read(self) -> int:
        return self._ckpt.reader.bytes_read

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


class TorchDistCheckpoint:
    """A validated torch_dist checkpoint, seen as one tp1 pp1 shard (see the module docstring).

    The model comes from hf_files/config.json when this package wrote the checkpoint, else
    from `hf_config_dir`/config.json when given, else from the common state's args.
    """

    format = FORMAT

    def __init__(self, directory: str | os.PathLike, *, hf_config_dir: str | os.PathLike | None = None,
                 key_prefix: str | None = None) -> None:
        """key_prefix: read the tensors stored under this prefix instead of the model's, e.g.
        "optimizer.state.exp_avg." (the optimizer state of a training checkpoint, same layout)."""
        self.root = Path(directory)
        if not self.root.is_dir():
            raise ConversionError(f"{self.root}: not a directory")
        self.dir = iteration_dir(self.root)
        self.reader = DcpReader(self.dir)
        common, common_source = read_common_state(self.dir, self.reader)
        self.args = common.get("args")
        self.iteration = common.get("iteration")
        self.written_tp, self.written_pp = layout_from_args(self.args) if self.args is not None else (1, 1)
        self._part_prefix = key_prefix
        embed = self._find_prefix(key_prefix)
        rows, _ = self.reader.tensors[embed].shape
        self.padded_vocab = rows
        own = self.dir / HF_FILES_DIR / "config.json"
        if own.is_file():
            hf_config, source = read_json(own), str(own)
        elif hf_config_dir is not None:
            path = Path(hf_config_dir) / "config.json"
            hf_config, source = read_json(path), str(path)
        elif self.args is not None:
            source = common_source
            hf_config = hf_config_from_args(self.args, source=source, padded_vocab_size=rows)
        else:
            raise ConversionError(f"{common_source}: has no 'args' to describe the model; pass --hf-config DIR")
        spec = spec_from_hf_config(hf_config, source=source)
        dtype = self.reader.tensors[embed].dtype
        dtype_name = next((n for n, d in DTYPES.items() if d == dtype), None)
        if dtype_name is None:
            raise ConversionError(f"{self.dir}: tensor '{embed}' has unsupported dtype {dtype}")
        spec = replace(spec, torch_dtype=dtype_name)
        divisor = getattr(self.args, "make_vocab_size_divisible_by", None) or 128
        if rows < spec.vocab_size:
            raise ConversionError(f"{self.dir}: tensor '{embed}' has {rows} rows, fewer than vocab_size {spec.vocab_size} ({source})")
        self.meta = McoreMeta(
            spec=spec, tp=1, pp=1, dtype=dtype_name, layer_spec="local", vocab_divisor=int(divisor),
            hf_config=hf_config, format_version=FORMAT_VERSION,
        )  # fmt: skip
        self._shard = _GlobalShard(self, self._expected_names(spec, rows=rows))
        self._validate(spec)

    def _find_prefix(self, key_prefix: str | None) -> str:
        if key_prefix is not None:
            self.key_prefix = key_prefix
            key = key_prefix + "embedding.word_embeddings.weight"
            if key not in self.reader.tensors:
                raise ConversionError(f"{self.dir}: tensor '{key}' is missing")
            return key
        keys = [k for k in self.reader.tensors
                if k.endswith("embedding.word_embeddings.weight") and not k.startswith(_NON_MODEL_PREFIXES)]
        if len(keys) != 1:
            raise ConversionError(f"{self.dir}: expected one '*embedding.word_embeddings.weight' tensor, found {len(keys)}")
        self.key_prefix = keys[0][: -len("embedding.word_embeddings.weight")]
        return keys[0]

    @staticmethod
    def _expected_names(spec: ModelSpec, *, rows: int) -> dict[str, tuple[int, ...]]:
        from checkpoint_convert.mapping import mcore_shard_shapes

        shapes = mcore_shard_shapes(spec, tp=1, pp=1, pp_rank=0, layer_spec="local")
        for name in _VOCAB_KEYS:
            if name in shapes:
                shapes[name] = (rows, spec.hidden_size)
        return shapes

    def _validate(self, spec: ModelSpec) -> None:
        used = set()
        for name, shape in self._shard._names.items():
            self._shard._locate(name)  # one line when missing
            for key, _lead, lead_sizes in self._shard.locations(name):
                stored = self.reader.tensors[key]
                expected = lead_sizes + shape
                if stored.shape != expected:
                    raise ConversionError(f"{self.dir}: tensor '{key}' has shape {list(stored.shape)}, expected {list(expected)}")
                # megatron-core keeps torch norms in fp32 in a bf16/fp16 model (training checkpoints).
                fp32_norm = stored.dtype == torch.float32 and "norm" in name
                if stored.dtype != DTYPES[spec.torch_dtype] and not fp32_norm:
                    raise ConversionError(f"{self.dir}: tensor '{key}' is {stored.dtype}, the embedding is {DTYPES[spec.torch_dtype]}")
                used.add(key)
        for key in self.reader.tensors:
            if self._part_prefix and not key.startswith(self._part_prefix):
                continue  # another part of a training checkpoint (the model's, another optimizer state)
            local = key[len(self.key_prefix):] if key.startswith(self.key_prefix) else key
            if key not in used and not local.startswith(_NON_MODEL_PREFIXES):
                raise ConversionError(f"{self.dir}: tensor '{key}' is not part of a {spec.architecture} this package maps")

    @property
    def spec(self) -> ModelSpec:
        return self.meta.spec

    @property
    def hf_files_dir(self) -> Path:
        return self.dir / HF_FILES_DIR

    @property
    def bytes_read(self) -> int:
        """Bytes of the tensor chunks loaded so far (each a torch.save record, read whole)."""
        return self.reader.bytes_read

    def shard_view(self, tp_rank: int, pp_rank: int) -> _GlobalShard:
        if (tp_rank, pp_rank) != (0, 0):
            raise KeyError((tp_rank, pp_rank))
        return self._shard

    def shard(self, tp_rank: int, pp_rank: int) -> dict[str, torch.Tensor]:
        view = self.shard_view(tp_rank, pp_rank)
        return {name: view[name] for name in view}

    def hf_view(self) -> HFView:
        return HFView(self)


def open_torch_dist(directory: str | os.PathLike, *, hf_config_dir: str | os.PathLike | None = None) -> TorchDistCheckpoint:
    return TorchDistCheckpoint(directory, hf_config_dir=hf_config_dir)


# ---------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------


def stacked_layers(spec: ModelSpec) -> bool:
    """megatron-core stacks the layers on a leading axis for a dense model and for a MoE model whose
    `moe_layer_freq` is 1 (every layer MoE); dense layers among MoE ones (a list) get per-layer keys.
    The trainer's model and the args use the same `moe_layer_freq`."""
    return not spec.num_experts or moe_layer_freq(spec) == 1


def _layer_targets(spec: ModelSpec, *, layer: int, suffix: str) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(sharded key, leading indices, leading sizes) the writer stores layer `layer`'s local-spec
    tensor `suffix` under."""
    stacked = stacked_layers(spec)
    out = []
    for candidate, lead in _written_suffixes(spec, suffix, moe_layer=spec.is_moe_layer(layer)):
        sizes = (spec.num_experts,) * len(lead)
        if stacked:
            out.append((f"decoder.layers.{candidate}", (layer,) + lead, (spec.num_layers,) + sizes))
        else:
            out.append((f"decoder.layers.{layer}.{candidate}", lead, sizes))
    return out


def _global_shapes(spec: ModelSpec, *, padded: int) -> dict[str, tuple[int, ...]]:
    """Sharded key -> global shape, in the order tensors are written."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in TorchDistCheckpoint._expected_names(spec, rows=padded).items():
        layer = _layer_key(name)
        if layer is None:
            shapes[name] = shape
            continue
        for key, _lead, sizes in _layer_targets(spec, layer=layer[0], suffix=layer[1]):
            shapes[key] = sizes + shape
    return shapes


def _extra_state_keys(spec: ModelSpec, *, layer: int) -> Iterator[str]:
    """The ShardedObject keys of layer `layer`'s linears' (empty) extra state, as megatron-core
    names them: key/shard_{offsets}_{shape} over the layer axis (stacked) and the expert axis."""
    stacked = stacked_layers(spec)
    moe = spec.is_moe_layer(layer)
    if spec.multi_latent_attention:
        q = ("self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj") if spec.q_lora_rank else ("self_attention.linear_q_proj",)
        linears = q + _MLA_LINEARS
    else:
        linears = _LINEARS[:2]
    linears += (_SHARED_EXPERT_LINEARS if spec.moe_shared_intermediate_size else ()) if moe else _LINEARS[2:]
    experts = [f"{_EXPERTS_KEY}linear_fc1", f"{_EXPERTS_KEY}linear_fc2"] if moe else []
    places = [(linear, ()) for linear in linears] + [(name, (e,)) for name in experts for e in range(spec.num_experts)]
    for name, expert in places:
        offsets = ((layer,) if stacked else ()) + expert
        shape = ((spec.num_layers,) if stacked else ()) + (spec.num_experts,) * len(expert)
        offsets, shape = offsets or (0,), shape or (1,)
        key = f"decoder.layers.{name}" if stacked else f"decoder.layers.{layer}.{name}"
        yield f"{key}._extra_state/shard_{'.'.join(map(str, offsets))}_{'.'.join(map(str, shape))}"


def _chunks(*, kind: str, part: torch.Tensor, tp_rank: int, fc1_rows: int) -> Iterator[tuple[tuple[int, ...], torch.Tensor]]:
    """(offsets within one layer's (one expert's) global tensor, block) of one tp rank's part of
    an entry; fc1_rows: the gate rows of the whole fc1 (its up rows follow them)."""
    if kind == "replicated":
        if tp_rank == 0:
            yield (0,) * part.dim(), part
    elif kind in ("qkv", "column"):
        yield (tp_rank * part.shape[0],) + (0,) * (part.dim() - 1), part
    elif kind == "row":
        yield (0, tp_rank * part.shape[1]), part
    elif kind == "fc1":
        gate, up = part.chunk(2, dim=0)
        rows, tail = gate.shape[0], (0,) * (part.dim() - 1)  # tail: () for a bias
        yield (tp_rank * rows, *tail), gate
        yield (fc1_rows + tp_rank * rows, *tail), up
    else:
        raise AssertionError(kind)


def _write_vocab(
    writer: DcpWriter, *, key: str, hf_name: str, get_rows: Callable, spec: ModelSpec, dtype: torch.dtype,
    padded: int, tp: int, file_of: Callable[[int], str],
) -> None:  # fmt: skip
    rows_per_rank = padded // tp
    block = max(1, VOCAB_CHUNK_BYTES // (spec.hidden_size * torch.empty((), dtype=dtype).element_size()))
    for tp_rank in range(tp):
        first, last = tp_rank * rows_per_rank, (tp_rank + 1) * rows_per_rank
        for lo in range(first, last, block):
            hi = min(lo + block, last)
            real = min(hi, spec.vocab_size)
            rows = get_rows(hf_name, lo, real).to(dtype) if lo < real else torch.empty((0, spec.hidden_size), dtype=dtype)
            if real < hi:
                rows = torch.cat([rows, torch.zeros((hi - max(lo, real), spec.hidden_size), dtype=dtype)])
            writer.write_chunk(key, rows, offsets=(lo, 0), file=file_of(tp_rank))


def write_checkpoint(
    tmp: Path,
    *,
    spec: ModelSpec,
    hf_config: dict,
    get: Callable[[str], torch.Tensor],
    get_rows: Callable[[str, int, int], torch.Tensor],
    tp: int,
    pp: int,
    dtype: str,
    layer_spec: str,
    divisor: int,
    aux_files: Iterable[Path],
    log: Callable[[str], None],
    ep: int = 1,
    vpp: int = 1,
) -> None:
    """Write Megatron-LM's layout (release/) into tmp, laid out as tp x pp ranks would write it
    (experts split over the expert tp of (tp, ep), mapping.expert_tp_size), each pipeline rank
    with `vpp` model chunks (chunk c of rank s: the layers of stage c*pp + s of pp*vpp stages,
    its tensors in rank s's files under their global keys, as Megatron-LM's `model{c}`);
    the args record virtual_pipeline_model_parallel_size.

    layer_spec does not apply: megatron-core saves both specs under the same sharded keys (a MoE
    layer's pre-MLP norm is written under both of its names, see the module docstring)."""
    torch_dtype = DTYPES[dtype]
    padded = padded_vocab_size(spec.vocab_size, tp=tp, divisor=divisor)
    out = tmp / RELEASE_DIR
    out.mkdir(parents=True)
    writer = DcpWriter(out)
    shapes = _global_shapes(spec, padded=padded)
    for key, shape in shapes.items():
        writer.declare(key, shape=shape, dtype=torch_dtype)
    get_hf = stacked_reader(get)
    stages = pp * vpp  # virtual stages; stage v is chunk v // pp of pipeline rank v % pp
    try:
        for stage in range(stages):

            def file_of(tp_rank: int, pp_rank: int = stage % pp) -> str:
                return f"__{pp_rank * tp + tp_rank}_0.distcp"

            for template, kind, hf, local, global_layer in mcore_entries(spec, pp=stages, pp_rank=stage):
                if template == "output_layer.weight" and spec.tie_word_embeddings:
                    continue  # tied: megatron-core stores the embedding once, under its own key
                hf_names = [t.format(layer=global_layer) for t in hf]
                if kind == "vocab":
                    _write_vocab(
                        writer, key=template, hf_name=hf_names[0], get_rows=get_rows, spec=spec, dtype=torch_dtype,
                        padded=padded, tp=tp, file_of=file_of,
                    )  # fmt: skip
                    continue
                kind, tensors = canonical_tensors(kind, [get_hf(n) for n in hf_names])
                if local is None:
                    targets = [(template, (), ())]
                else:
                    targets = _layer_targets(spec, layer=global_layer, suffix=template.split("{layer}.", 1)[1])
                split_tp = expert_tp_size(tp=tp, ep=ep) if is_expert_entry(template) else tp
                for tp_rank in range(split_tp if kind != "replicated" else 1):
                    part = split_entry(spec, kind=kind, tensors=tensors, tp=split_tp, tp_rank=tp_rank).to(torch_dtype)
                    for offsets, block in _chunks(kind=kind, part=part, tp_rank=tp_rank, fc1_rows=tensors[0].shape[0]):
                        for key, lead, _sizes in targets:
                            chunk = block.reshape((1,) * len(lead) + block.shape)
                            writer.write_chunk(key, chunk, offsets=lead + offsets, file=file_of(tp_rank))
            for layer in stage_layers(spec.num_layers, pp=stages, pp_rank=stage):
                for key in _extra_state_keys(spec, layer=layer):  # megatron-core's linears save an (empty) extra state
                    # megatron-core stores a ShardedObject as the list of its replicas' data.
                    writer.write_object(key, [None], file=file_of(0))
            chunk = f" chunk {stage // pp}" if vpp > 1 else ""
            log(f"wrote {RELEASE_DIR}/ stage {stage % pp}{chunk} ({tp} tensor-parallel rank file(s))")
    except BaseException:
        writer.abort()
        raise
    writer.finish()
    args = checkpoint_args(spec, tp=tp, pp=pp, ep=ep, vpp=vpp, padded_vocab_size=padded, vocab_divisor=divisor,
                           dtype=dtype)
    torch.save({"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0}, out / COMMON_FILE)
    hf_files = out / HF_FILES_DIR
    hf_files.mkdir()
    (hf_files / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    for path in aux_files:
        if path.name != "config.json":
            shutil.copy2(path, hf_files / path.name)
    (tmp / TRACKER_FILE).write_text("release\n")
