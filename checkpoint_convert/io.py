"""Lazy, validated readers for HF directories and our Megatron checkpoints, and atomic output.

HF directory: config.json, model.safetensors or shards + model.safetensors.index.json,
tokenizer files, optional generation_config.json.

Megatron checkpoint directory (this project's format, safetensors + JSON only):

    mcore_checkpoint.json        meta: format, format_version, tp, pp, ep, dtype, layer_spec,
                                 vocab_divisor, padded_vocab_size, hf_config (source config.json),
                                 checksums (each rank file's size and XXH3-64, integrity.py);
                                 virtual_pipeline {"pp": P, "vpp": N} when the directory holds
                                 the model chunks of a --pp P --vpp N layout (see below)
    hf_files/                    config.json, generation_config.json (when the source had one)
                                 and the tokenizer files, verbatim: AutoTokenizer loads from here
    tp{t}_pp{p}/model.safetensors   one file per rank, names as GPTModel.named_parameters()
                                 with sequential experts (`local_experts.{i}`; a grouped
                                 GEMM model's names are translated: mapping.sequential_expert_name);
                                 a reward model's head is `score.weight`, whole on every tp
                                 rank of the last stage, in place of output_layer (mapping.py)
    tp{t}_pp{p}_ep{e}/model.safetensors   the same with experts split over ep > 1 ranks: rank e
                                 holds experts [e*E/ep, (e+1)*E/ep) as its local experts
                                 0..E/ep-1 and a copy of every other tensor of its tp rank

Virtual pipeline stages (--vpp N at --pp P): chunk c of pipeline rank s holds what stage c*P + s
of a plain pipeline of P*N stages holds, so such a directory is a plain one of `pp` = P*N stages,
one file per chunk (tp{t}_pp{c*P+s}), which every reader reads as it reads any other; its
`virtual_pipeline` field says which layout it was written for (pp = P x vpp stages).

Each rank file records the rank it belongs to in its header's metadata (tp_rank, pp_rank,
ep_rank: `rank_files.shard_metadata`). McoreCheckpoint checks that record against the file's path when it
opens the directory (the header only: free), and the file's checksum the first time it reads a
tensor from it, so a process reads each file once more at most, just before the reads that
follow (whose pages the check has just brought into the cache); a process that only opens the
directory for its metadata reads no tensor bytes. Directories written before the checksums and
records (no `checksums` field, no record in a header) are read as before, unchecked.

Tensors are read one at a time with plain reads (safetensors_stream), never memory-mapped,
so file pages a conversion touches are not charged to its resident memory.

Every reader of the formats above with its validation, each input error a one-line message
naming the file and field; a rank file's tensors are read through rank_shards.py.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from checkpoint_convert.integrity import IntegrityError, verify_file
from checkpoint_convert.names import hub_name_hint
from checkpoint_convert.rank_shards import ExpertParallelShard, LazyShard
from checkpoint_convert.safetensors_stream import SafetensorsReader, narrowed_box
from checkpoint_convert.families import family_of, spec_from_hf_config
from checkpoint_convert.families.base import DTYPES, ConversionError, ModelSpec
from checkpoint_convert.gather import (
    gather_stacked,
    fused_hf_sources,
    hf_entry_index,
    mcore_to_hf_tensor,
    stored_group_pieces,
    stored_pieces,
    unfuse_groups,
)
from checkpoint_convert.rank_files import (
    check_rank_record,
    ep_shard_shapes,
    read_checksums,
    shard_relpath,
    shard_relpaths,
)
from checkpoint_convert.mapping import (
    LAYER_SPECS,
    STACKED,
    check_layout,
    hf_tensor_shapes,
    mcore_name,
    padded_vocab_size,
    qkv_group_rows,
)

META_FILE = "mcore_checkpoint.json"
HF_FILES_DIR = "hf_files"
FORMAT_NAME = "mcore_dpo.megatron_checkpoint"
FORMAT_VERSION = 1
INDEX_FILE = "model.safetensors.index.json"
# Optional HF buffers that older checkpoints carry; they are recomputed, never loaded.
_IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)
# Weight formats that are not copied along with the tokenizer (pickle-based or our own).
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".pkl", ".ckpt", ".h5", ".msgpack", ".gguf")


def read_json(path: Path) -> dict:
    """A JSON object from `path`; a missing file or bad JSON is a one-line ConversionError."""
    if not path.is_file():
        raise ConversionError(f"{path}: file is missing")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConversionError(f"{path}: invalid JSON ({str(error).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: expected a JSON object")
    return data


def _open_safetensors(path: Path) -> SafetensorsReader:
    if not path.is_file():
        raise ConversionError(f"{path}: file is missing")
    # The reader checks the header and that every tensor's bytes are in the file (truncation).
    return SafetensorsReader(path)


def _check_shard_name(index_path: Path, file: object) -> None:
    """A weight_map entry must be a plain file name inside the model directory: no absolute
    path, no '..', no sub-directory (a crafted index could otherwise read any file)."""
    if not isinstance(file, str) or not file or Path(file).name != file or file in (".", ".."):
        raise ConversionError(
            f"{index_path}: field 'weight_map' names {file!r}, which is not a file name inside the model directory"
        )


def _check_shapes(path: Path, handle: SafetensorsReader, names: list[str], expected: dict[str, tuple[int, ...]]) -> None:
    for name in names:
        shape = handle.shape(name)
        if shape != expected[name]:
            raise ConversionError(f"{path}: tensor '{name}' has shape {list(shape)}, expected {list(expected[name])}")


class HFCheckpoint:
    """A validated HF directory; get(name) reads one tensor, get_part(name, dim, start, stop)
    only a slice of it (get_rows: a block of its rows); bytes_read counts the tensor bytes read."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.dir = Path(directory)
        if not self.dir.exists():
            raise ConversionError(f"{self.dir}: does not exist{hub_name_hint(directory)}")
        if not self.dir.is_dir():
            raise ConversionError(f"{self.dir}: not a directory")
        self.config = read_json(self.dir / "config.json")
        self.spec = spec_from_hf_config(self.config, source=str(self.dir / "config.json"))
        index_path = self.dir / INDEX_FILE
        if index_path.exists():
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConversionError(f"{index_path}: field 'weight_map' is missing or empty")
            for file in set(weight_map.values()):
                _check_shard_name(index_path, file)
        else:
            single = self.dir / "model.safetensors"
            if not single.exists():
                raise ConversionError(f"{self.dir}: no model.safetensors or {INDEX_FILE} (only safetensors is read)")
            weight_map = None
        self._handles: dict[str, SafetensorsReader] = {}
        self._file_of: dict[str, str] = {}
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        for file in files:
            path = self.dir / file
            if not path.is_file():
                raise ConversionError(f"{index_path}: shard '{file}' named in the index is missing")
            handle = _open_safetensors(path)
            self._handles[file] = handle
            for name in handle.keys():
                if weight_map is not None and weight_map.get(name) != file:
                    raise ConversionError(f"{path}: tensor '{name}' is not listed for this file in {INDEX_FILE}")
                if name in self._file_of:
                    raise ConversionError(f"{path}: tensor '{name}' also appears in {self._file_of[name]}")
                self._file_of[name] = file
        if weight_map is not None:
            for name, file in weight_map.items():
                if name not in self._file_of:
                    raise ConversionError(f"{self.dir / file}: tensor '{name}' listed in {INDEX_FILE} is not in the file")
        expected = hf_tensor_shapes(self.spec)
        # MoE experts stored fused (transformers 5's in-memory form) are read as the hub's tensors.
        self._fused = fused_hf_sources(self.spec, stored=set(self._file_of))
        self._fused_shapes = {name: expected[name] for name in self._fused}
        fused_stored = {source for source, *_ in self._fused.values()}
        # Experts stored quantised (GPT-OSS's MXFP4 blocks and scales) are read dequantised.
        self._quantized = quantized_sources(self.spec, stored=set(self._file_of))
        fused_stored |= {name for pair in self._quantized.values() for name in pair}
        for name, (blocks, scales) in self._quantized.items():
            self._check_quantized(name, blocks, scales, expected[name])
        for name in expected:
            if name not in self._file_of and name not in self._fused and name not in self._quantized:
                raise ConversionError(f"{self.dir}: tensor '{name}' is missing")
        # Tensors a family drops on import (DeepSeek-V3's multi-token-prediction layers): one line.
        ignored = getattr(family_of(self.spec), "ignored_hf_tensor", lambda _spec, _name: False)
        dropped = {name for name in self._file_of if name not in expected and ignored(self.spec, name)}
        if dropped:
            print(f"{self.dir}: dropping {len(dropped)} tensor(s) of layers past num_hidden_layers "
                  f"({self.spec.num_layers}): multi-token-prediction layers, not part of the model's forward", file=sys.stderr)
        for name, file in self._file_of.items():
            if name in dropped:
                continue
            if name not in expected and name not in fused_stored and not name.endswith(_IGNORED_HF_SUFFIXES):
                raise ConversionError(f"{self.dir / file}: unexpected tensor '{name}' for {self.spec.architecture}")
        for file, handle in self._handles.items():
            names = [n for n in handle.keys() if n in expected]
            _check_shapes(self.dir / file, handle, names, expected)
        # The weights, not the config, decide the source dtype (configs often omit or misstate it).
        embed = "model.embed_tokens.weight"
        stored = self._handles[self._file_of[embed]].dtype_code(embed)
        dtype_name = _SAFETENSORS_DTYPES.get(stored)
        if dtype_name is None:
            raise ConversionError(f"{self._path_of(embed)}: tensor '{embed}' has unsupported dtype {stored}")
        self.spec = replace(self.spec, torch_dtype=dtype_name)

    def _path_of(self, name: str) -> Path:
        return self.dir / self._file_of[name]

    def _check_quantized(self, name: str, blocks: str, scales: str, expected: tuple[int, ...]) -> None:
        """MXFP4 blocks [E, rows, G, 16] and scales [E, rows, G] (uint8) of a tensor [E, G * 32, rows]."""
        b_shape, s_shape = self._handles[self._file_of[blocks]].shape(blocks), self._handles[self._file_of[scales]].shape(scales)
        for tensor in (blocks, scales):
            code = self._handles[self._file_of[tensor]].dtype_code(tensor)
            if code != "U8":
                raise ConversionError(f"{self._path_of(tensor)}: tensor '{tensor}' has dtype {code}; MXFP4 blocks and scales are U8")
        if len(b_shape) != 4 or b_shape[-1] != 16 or b_shape[:-1] != s_shape or (b_shape[0], b_shape[2] * 32, b_shape[1]) != expected:
            raise ConversionError(f"{self._path_of(blocks)}: tensor '{blocks}' {list(b_shape)} with '{scales}' {list(s_shape)} "
                                  f"does not dequantise to '{name}' of shape {list(expected)}")

    def _get_quantized_part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """A tensor stored as MXFP4 blocks and scales, dequantised: dim 0 (experts) narrowed on
        read, any other dim after dequantising those experts."""
        blocks, scales = self._quantized[name]
        b_handle, s_handle = self._handles[self._file_of[blocks]], self._handles[self._file_of[scales]]
        b_shape, s_shape = b_handle.shape(blocks), s_handle.shape(scales)
        first, count = (start, stop - start) if dim == 0 else (0, b_shape[0])
        b = b_handle.read_box(blocks, offsets=(first, 0, 0, 0), sizes=(count, *b_shape[1:]))
        s = s_handle.read_box(scales, offsets=(first, 0, 0), sizes=(count, *s_shape[1:]))
        family = family_of(self.spec)
        whole = family.dequantise_mxfp4(b, s, dtype=DTYPES[self.spec.torch_dtype]).transpose(-1, -2).contiguous()
        return whole if dim == 0 else whole.narrow(dim, start, stop - start).contiguous()

    @property
    def names(self) -> list[str]:
        return list(hf_tensor_shapes(self.spec))

    def get(self, name: str) -> torch.Tensor:
        if name in self._quantized and name not in self._file_of:
            return self._get_quantized_part(name, 0, 0, self.spec.num_experts)
        if name in self._fused and name not in self._file_of:
            return self._get_fused(name)
        if name not in self._file_of:
            raise ConversionError(f"{self.dir}: tensor '{name}' is missing")
        return self._handles[self._file_of[name]].read(name)

    def _get_fused(self, name: str) -> torch.Tensor:
        return self._get_fused_part(name, 0, 0, self._fused_shapes[name][0])

    def _get_fused_part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """A hub tensor held inside a fused one: `stored[expert].chunk(parts, dim=0)[part]`,
        narrowed; only the slice's bytes are read."""
        stored, expert, part, parts = self._fused[name]
        handle = self._handles[self._file_of[stored]]
        shape = handle.shape(stored)
        lead = () if expert is None else (expert,)
        if expert is not None and (len(shape) != 3 or shape[0] != self.spec.num_experts):
            raise ConversionError(f"{self._path_of(stored)}: tensor '{stored}' has shape {list(shape)}, "
                                  f"expected [{self.spec.num_experts}, ...] (one slice per expert)")
        inner = shape[len(lead):]
        chunk = -(-inner[0] // parts)  # torch.chunk's size
        first, last = min(part * chunk, inner[0]), min((part + 1) * chunk, inner[0])
        hub = (last - first, *inner[1:])
        expected = self._fused_shapes[name]
        if hub != expected:
            raise ConversionError(f"{self._path_of(stored)}: tensor '{stored}' gives '{name}' of shape {list(hub)}, expected {list(expected)}")
        offsets, sizes = narrowed_box(hub, dim, start, stop)
        offsets = lead + (first + offsets[0],) + offsets[1:]
        return handle.read_box(stored, offsets=offsets, sizes=(1,) * len(lead) + sizes).reshape(sizes)

    def get_part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Tensor `name` narrowed to [start, stop) on dim, reading only those bytes (a block of
        rows is one read, a block of columns one read per row)."""
        if name in self._quantized and name not in self._file_of:
            return self._get_quantized_part(name, dim, start, stop)
        if name in self._fused and name not in self._file_of:
            return self._get_fused_part(name, dim, start, stop)
        if name not in self._file_of:
            raise ConversionError(f"{self.dir}: tensor '{name}' is missing")
        handle = self._handles[self._file_of[name]]
        offsets, sizes = narrowed_box(handle.shape(name), dim, start, stop)
        return handle.read_box(name, offsets=offsets, sizes=sizes)

    @property
    def bytes_read(self) -> int:
        """Tensor bytes read from the files so far (headers not counted)."""
        return sum(handle.bytes_read for handle in self._handles.values())

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor `name` (one contiguous read: no whole tensor in memory)."""
        if name not in self._file_of:
            raise ConversionError(f"{self.dir}: tensor '{name}' is missing")
        return self._handles[self._file_of[name]].read(name, rows=(start, stop))

    def aux_files(self) -> list[Path]:
        """Tokenizer files, generation_config.json and other small files to carry along."""
        return sorted(
            p
            for p in self.dir.iterdir()
            if p.is_file()
            and not p.name.startswith(".")
            and p.name not in ("config.json", INDEX_FILE)
            and not p.name.endswith(_WEIGHT_SUFFIXES)
        )


def quantized_sources(spec: ModelSpec, *, stored: set[str]) -> dict[str, tuple[str, str]]:
    """HF tensor name -> (blocks, scales) for the tensors a checkpoint stores quantised (the
    family's QUANTIZED_KEYS: GPT-OSS's MXFP4 experts) instead of plain."""
    sources = {}
    for template, (blocks, scales) in getattr(family_of(spec), "QUANTIZED_KEYS", {}).items():
        for layer in spec.moe_layers:
            name = template.format(layer=layer)
            if name not in stored and blocks.format(layer=layer) in stored and scales.format(layer=layer) in stored:
                sources[name] = (blocks.format(layer=layer), scales.format(layer=layer))
    return sources


def open_hf_dir(directory: str | os.PathLike) -> HFCheckpoint:
    return HFCheckpoint(directory)


@dataclass(frozen=True)
class McoreMeta:
    spec: ModelSpec
    tp: int
    pp: int
    dtype: str  # the dtype the shards are stored in
    layer_spec: str
    vocab_divisor: int
    hf_config: dict  # the source config.json, verbatim
    format_version: int
    ep: int = 1  # expert-parallel ranks the experts are split over
    # Model chunks per pipeline rank of the layout written for (--vpp): `pp` stages are then
    # pp / vpp pipeline ranks x vpp chunks (chunk c of rank s: stage c * pp / vpp + s).
    vpp: int = 1

    @property
    def pipeline_ranks(self) -> int:
        """Pipeline ranks of the layout the directory was written for (pp without chunks)."""
        return self.pp // self.vpp

    def layout_text(self) -> str:
        """'tp=T pp=P' (plus ' vpp=N (P*N stage files)' with chunks, ' ep=E' with experts split)."""
        pipeline = f"pp={self.pipeline_ranks} vpp={self.vpp} ({self.pp} stage files)" if self.vpp > 1 else f"pp={self.pp}"
        return f"tp={self.tp} {pipeline} ep={self.ep}"


def meta_json(meta: McoreMeta) -> dict:
    return {
        "format": FORMAT_NAME,
        "format_version": meta.format_version,
        "tp": meta.tp,
        "pp": meta.pp,
        **({"ep": meta.ep} if meta.ep > 1 else {}),
        **({"virtual_pipeline": {"pp": meta.pipeline_ranks, "vpp": meta.vpp}} if meta.vpp > 1 else {}),
        "dtype": meta.dtype,
        "layer_spec": meta.layer_spec,
        "vocab_divisor": meta.vocab_divisor,
        "padded_vocab_size": padded_vocab_size(meta.spec.vocab_size, tp=meta.tp, divisor=meta.vocab_divisor),
        "hf_config": meta.hf_config,
    }


def _virtual_pipeline(raw: dict, *, source: Path) -> int:
    """The model chunks per pipeline rank the meta's `virtual_pipeline` field records (1 without
    it), checked against its `pp` (the stage files: pipeline ranks x chunks)."""
    field = raw.get("virtual_pipeline")
    if field is None:
        return 1
    ranks, vpp = (field.get("pp"), field.get("vpp")) if isinstance(field, dict) else (None, None)
    if not (isinstance(ranks, int) and isinstance(vpp, int) and ranks >= 2 and vpp >= 2 and ranks * vpp == raw["pp"]):
        raise ConversionError(f"{source}: field 'virtual_pipeline' is {field!r}; expected {{\"pp\": P, \"vpp\": N}} "
                              f"with P, N >= 2 and P x N = pp ({raw['pp']})")
    return vpp


class McoreCheckpoint:
    """A validated Megatron checkpoint directory written by this package (or the trainer).

    Each rank file's recorded rank is checked on open; its size too, and its checksum before
    the first tensor is read from it, unless `verify_checksums` is False (a caller that has
    just checked the whole directory, e.g. the trainer's driver before a resume)."""

    def __init__(self, directory: str | os.PathLike, *, verify_checksums: bool = True) -> None:
        self.dir = Path(directory)
        meta_path = self.dir / META_FILE
        if not self.dir.is_dir():
            raise ConversionError(f"{self.dir}: not a directory")
        raw = read_json(meta_path)
        if raw.get("format") != FORMAT_NAME:
            raise ConversionError(f"{meta_path}: field 'format' is {raw.get('format')!r}, expected {FORMAT_NAME!r}")
        if raw.get("format_version") != FORMAT_VERSION:
            raise ConversionError(f"{meta_path}: field 'format_version' is {raw.get('format_version')!r}, expected {FORMAT_VERSION}")
        for field in ("tp", "pp", "vocab_divisor"):
            if not isinstance(raw.get(field), int) or raw[field] < 1:
                raise ConversionError(f"{meta_path}: field '{field}' must be a positive integer")
        ep = raw.get("ep", 1)
        if not isinstance(ep, int) or ep < 1:
            raise ConversionError(f"{meta_path}: field 'ep' must be a positive integer")
        vpp = _virtual_pipeline(raw, source=meta_path)
        if raw.get("dtype") not in DTYPES:
            raise ConversionError(f"{meta_path}: field 'dtype' is {raw.get('dtype')!r}; supported: {', '.join(DTYPES)}")
        if raw.get("layer_spec") not in LAYER_SPECS:
            raise ConversionError(f"{meta_path}: field 'layer_spec' must be one of {LAYER_SPECS}")
        spec = spec_from_hf_config(raw.get("hf_config"), source=f"{meta_path}: hf_config")
        spec = replace(spec, torch_dtype=raw["dtype"])
        check_layout(spec, tp=raw["tp"], pp=raw["pp"] // vpp, ep=ep, source=f"{meta_path}: hf_config",
                     divisor=raw["vocab_divisor"], vpp=vpp)
        self.meta = McoreMeta(
            spec=spec,
            tp=raw["tp"],
            pp=raw["pp"],
            dtype=raw["dtype"],
            layer_spec=raw["layer_spec"],
            vocab_divisor=raw["vocab_divisor"],
            hf_config=raw["hf_config"],
            format_version=raw["format_version"],
            ep=ep,
            vpp=vpp,
        )
        checksums = read_checksums(meta_path, raw)
        self._shards: dict[tuple[int, int], LazyShard | ExpertParallelShard] = {}
        for pp_rank in range(self.meta.pp):
            per_ep_rank = ep_shard_shapes(
                spec, tp=self.meta.tp, pp=self.meta.pp, pp_rank=pp_rank, ep=ep,
                layer_spec=self.meta.layer_spec, divisor=self.meta.vocab_divisor,
            )  # fmt: skip
            for tp_rank in range(self.meta.tp):
                ranks = []
                for ep_rank, expected in enumerate(per_ep_rank):
                    rel = shard_relpath(tp_rank=tp_rank, pp_rank=pp_rank, ep=ep, ep_rank=ep_rank)
                    path = self.dir / rel
                    handle = _open_safetensors(path)
                    check_rank_record(path, handle.metadata, tp_rank=tp_rank, pp_rank=pp_rank, ep_rank=ep_rank)
                    names = list(handle.keys())
                    for name in expected:
                        if name not in names:
                            raise ConversionError(f"{path}: tensor '{name}' is missing")
                    for name in names:
                        if name not in expected:
                            raise ConversionError(f"{path}: unexpected tensor '{name}'")
                    _check_shapes(path, handle, names, expected)
                    if checksums is not None and rel not in checksums:
                        raise ConversionError(f"{meta_path}: field 'checksums' does not list {rel}")
                    if checksums is not None and path.stat().st_size != checksums[rel]["bytes"]:
                        verify_file(path, checksums[rel])  # the size now (free), the checksum on first read
                    checksum = checksums[rel] if checksums is not None and verify_checksums else None
                    ranks.append(LazyShard(path, handle, checksum=checksum))
                shard = ranks[0] if ep == 1 else ExpertParallelShard(
                    ranks, spec=spec, tp=self.meta.tp, tp_rank=tp_rank, pp=self.meta.pp, pp_rank=pp_rank,
                    layer_spec=self.meta.layer_spec)
                self._shards[(tp_rank, pp_rank)] = shard
        rank_files = set(shard_relpaths(tp=self.meta.tp, pp=self.meta.pp, ep=ep))
        for path in sorted(self.dir.glob("tp*_pp*/*.safetensors")) if checksums is not None else ():
            if path.relative_to(self.dir).as_posix() not in rank_files:
                raise IntegrityError(path, f"is not a rank file of the layout {meta_path} records (tp {self.meta.tp}, "
                                           f"pp {self.meta.pp}, ep {ep}): left from another layout?")

    @property
    def spec(self) -> ModelSpec:
        return self.meta.spec

    @property
    def hf_files_dir(self) -> Path:
        """config.json, generation_config.json and the tokenizer files of the source model."""
        return self.dir / HF_FILES_DIR

    @property
    def bytes_read(self) -> int:
        """Tensor bytes read from the rank files so far (headers not counted)."""
        return sum(shard.bytes_read for shard in self._shards.values())

    def shard_view(self, tp_rank: int, pp_rank: int) -> LazyShard | ExpertParallelShard:
        """Lazy mapping of one rank's tensors (with ep > 1: of its ep files together, every
        expert under its global index, as at ep 1)."""
        return self._shards[(tp_rank, pp_rank)]

    def shard(self, tp_rank: int, pp_rank: int) -> dict[str, torch.Tensor]:
        """One rank's tensors, all read, names as that stage's GPTModel.named_parameters() at
        ep 1 (every expert of the stage)."""
        view = self._shards[(tp_rank, pp_rank)]
        return {name: view[name] for name in view}

    def hf_view(self) -> HFView:
        return HFView(self)


class HFView:
    """The checkpoint seen through HF names (vocab trimmed), whatever its tp/pp.

    get(name) gathers one fused entry across the tp ranks; siblings (q/k/v, gate/up) are
    cached until asked for, so reading names in hf_tensor_names order gathers each entry once.
    get_rows(name, start, stop) reads a row block of the vocabulary tensors straight from the
    rank files that hold it, so the embedding and head never have to be whole in memory.
    get_part(name, dim, start, stop) reads the parts hf_to_mcore_shard asks for from the rank
    files that hold them, and only their bytes (a training rank at any tp reads its own part).
    """

    def __init__(self, checkpoint: McoreCheckpoint) -> None:
        self._ckpt = checkpoint
        self.spec = checkpoint.spec
        self._cache: dict[str, torch.Tensor] = {}
        self._part_cache: dict[tuple[str, int, int, int], torch.Tensor] = {}
        self._index = hf_entry_index(self.spec, pp=checkpoint.meta.pp)
        self._shapes = hf_tensor_shapes(self.spec)

    @property
    def bytes_read(self) -> int:
        return self._ckpt.bytes_read

    @property
    def names(self) -> list[str]:
        return list(hf_tensor_shapes(self.spec))

    def get(self, name: str) -> torch.Tensor:
        if name in self._cache:
            return self._cache.pop(name)
        meta = self._ckpt.meta
        tensors = mcore_to_hf_tensor(
            self.spec, name, tp=meta.tp, pp=meta.pp, get_shard=self._ckpt.shard_view, layer_spec=meta.layer_spec
        )
        self._cache = {n: t for n, t in tensors.items() if n != name}
        return tensors[name]

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of HF tensor `name` (vocabulary tensors: without gathering the rest)."""
        if name not in self._index and name in self._shapes:  # experts stacked in one tensor
            return self.get(name)[start:stop].clone()
        if name not in self._index:
            raise ConversionError(f"tensor '{name}' is not part of a {self.spec.architecture} checkpoint")
        template, kind, _, pp_rank, local, moe_layer = self._index[name]
        if kind != "vocab":
            return self.get(name)[start:stop].clone()
        if not 0 <= start <= stop <= self.spec.vocab_size:
            raise ValueError(f"tensor '{name}': rows [{start}, {stop}) outside [0, {self.spec.vocab_size}]")
        meta = self._ckpt.meta
        shard_name = mcore_name(template, layer=local, layer_spec=meta.layer_spec, moe_layer=moe_layer)
        rows_per_rank = padded_vocab_size(self.spec.vocab_size, tp=meta.tp, divisor=meta.vocab_divisor) // meta.tp
        blocks = []
        for tp_rank in range(meta.tp):
            first = tp_rank * rows_per_rank
            lo, hi = max(start, first), min(stop, first + rows_per_rank)
            if lo < hi:
                shard = self._ckpt.shard_view(tp_rank, pp_rank)
                blocks.append(shard.get_rows(shard_name, lo - first, hi - first))
        if not blocks:  # start == stop
            return torch.empty((0, self.spec.hidden_size), dtype=DTYPES[meta.dtype])
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=0)

    def get_part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """HF tensor `name` narrowed to [start, stop) on dim. The parts hf_to_mcore_shard asks
        for are read from the rank files that hold them, only their bytes: q, k and v as whole
        query groups (all three from one read of the groups' fused rows; the other two are kept
        until asked for), the rest by gather.stored_pieces. Any other part is cut from get(name).
        Experts stacked in one tensor (mapping.STACKED): the experts asked for are gathered."""
        if name not in self._index and f"{name}{STACKED}0" in self._index:
            meta = self._ckpt.meta
            experts = range(start, stop) if dim == 0 else None
            whole = gather_stacked(self.spec, name, index=self._index, tp=meta.tp, layer_spec=meta.layer_spec,
                                   get_shard=self._ckpt.shard_view, experts=experts)
            return whole if dim == 0 else whole.narrow(dim, start, stop - start).clone()
        if name not in self._index:
            raise ConversionError(f"tensor '{name}' is not part of a {self.spec.architecture} checkpoint")
        _, sizes = narrowed_box(self._shapes[name], dim, start, stop)
        if (name, dim, start, stop) in self._part_cache:
            return self._part_cache.pop((name, dim, start, stop))
        template, kind, hf_names, pp_rank, local, moe_layer = self._index[name]
        meta = self._ckpt.meta
        shard_name = mcore_name(template, layer=local, layer_spec=meta.layer_spec, moe_layer=moe_layer)
        index = hf_names.index(name)
        dtype = DTYPES[meta.dtype]
        if kind == "qkv" and dim == 0:
            groups = stored_group_pieces(self.spec, index=index, start=start, stop=stop, tp=meta.tp)
            if groups is not None:
                (g0, g1), pieces = groups
                if not pieces:
                    return torch.empty(sizes, dtype=dtype)
                fused = [self._ckpt.shard_view(t, pp_rank).part(shard_name, 0, lo, hi) for t, lo, hi in pieces]
                parts = unfuse_groups(self.spec, torch.cat(fused) if len(fused) > 1 else fused[0])
                self._part_cache = {(n, 0, g0 * rows, g1 * rows): part.clone()
                                    for n, rows, part in zip(hf_names, qkv_group_rows(self.spec), parts) if n != name}
                return parts[index].clone()
        padded = padded_vocab_size(self.spec.vocab_size, tp=meta.tp, divisor=meta.vocab_divisor)
        pieces = stored_pieces(self.spec, kind=kind, index=index, dim=dim, start=start, stop=stop,
                               size=self._shapes[name][dim], tp=meta.tp, padded_vocab=padded)
        if pieces is None:
            return self.get(name).narrow(dim, start, stop - start).clone()
        blocks = [self._ckpt.shard_view(t, pp_rank).part(shard_name, dim, lo, hi) for t, lo, hi in pieces]
        if not blocks:
            return torch.empty(sizes, dtype=dtype)
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=dim)
