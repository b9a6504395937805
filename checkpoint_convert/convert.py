"""The conversions behind the CLI: hf-to-mcore, mcore-to-hf, reshard.

Each streams: tensors are read one at a time from memory-mapped files and written one
rank shard (or one HF shard) at a time, into a temporary directory that replaces the
target only when everything has been written.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from checkpoint_convert.io import (
    HF_FILES_DIR,
    INDEX_FILE,
    META_FILE,
    FORMAT_VERSION,
    McoreMeta,
    atomic_output_dir,
    meta_json,
    open_hf_dir,
    open_mcore_dir,
    shard_relpath,
)
from checkpoint_convert.mapping import (
    DTYPES,
    ConversionError,
    ModelSpec,
    check_layout,
    hf_tensor_shapes,
    hf_to_mcore_shard,
    mcore_to_hf,
)

DTYPE_FLAGS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size_bytes(text: str) -> int:
    """'5GB' -> 5_000_000_000 (decimal units like transformers; KiB/MiB/GiB are binary)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise ConversionError(f"--max-shard-size: cannot parse {text!r} (examples: 5GB, 500MB, 2GiB)")
    size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])
    if size <= 0:
        raise ConversionError(f"--max-shard-size: must be positive, got {text!r}")
    return size


def write_mcore_shard(directory: Path, *, tp_rank: int, pp_rank: int, shard: dict[str, torch.Tensor]) -> None:
    """Write one rank's tensors (used by the converter and by the trainer's checkpointer)."""
    path = directory / shard_relpath(tp_rank=tp_rank, pp_rank=pp_rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in shard.items()}, str(path), metadata={"format": "pt"})


def write_mcore_meta(directory: Path, *, meta: McoreMeta, aux_files: Iterable[Path]) -> None:
    """Write the meta JSON and hf_files/ (source config.json + tokenizer/generation files)."""
    (directory / META_FILE).write_text(json.dumps(meta_json(meta), indent=2) + "\n")
    hf_files = directory / HF_FILES_DIR
    hf_files.mkdir(parents=True, exist_ok=True)
    (hf_files / "config.json").write_text(json.dumps(meta.hf_config, indent=2) + "\n")
    for path in aux_files:
        if path.name != "config.json":
            shutil.copy2(path, hf_files / path.name)


def _write_mcore(
    tmp: Path,
    *,
    spec: ModelSpec,
    hf_config: dict,
    get: Callable[[str], torch.Tensor],
    tp: int,
    pp: int,
    dtype: str,
    layer_spec: str,
    divisor: int,
    aux_files: Iterable[Path],
    log: Callable[[str], None],
) -> None:
    torch_dtype = DTYPES[dtype]

    def get_cast(name: str) -> torch.Tensor:
        return get(name).to(torch_dtype)

    for pp_rank in range(pp):
        for tp_rank in range(tp):
            shard = hf_to_mcore_shard(
                spec, tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank, get=get_cast, layer_spec=layer_spec, divisor=divisor
            )
            write_mcore_shard(tmp, tp_rank=tp_rank, pp_rank=pp_rank, shard=shard)
            log(f"wrote {shard_relpath(tp_rank=tp_rank, pp_rank=pp_rank)} ({len(shard)} tensors)")
            del shard
    meta = McoreMeta(
        spec=spec, tp=tp, pp=pp, dtype=dtype, layer_spec=layer_spec, vocab_divisor=divisor,
        hf_config=hf_config, format_version=FORMAT_VERSION,
    )  # fmt: skip
    write_mcore_meta(tmp, meta=meta, aux_files=aux_files)


def hf_to_mcore(
    hf_dir: str | Path,
    out: str | Path,
    *,
    tp: int,
    pp: int,
    dtype: str | None = None,
    layer_spec: str = "local",
    divisor: int = 128,
    overwrite: bool = False,
    log: Callable[[str], None] = print,
) -> None:
    """Convert an HF directory into a Megatron checkpoint sharded tp x pp."""
    source = open_hf_dir(hf_dir)
    check_layout(source.spec, tp=tp, pp=pp, source=str(source.dir / "config.json"), divisor=divisor)
    target_dtype = DTYPE_FLAGS[dtype] if dtype else source.spec.torch_dtype
    with atomic_output_dir(out, overwrite=overwrite, inputs=(source.dir,)) as tmp:
        _write_mcore(
            tmp, spec=source.spec, hf_config=source.config, get=source.get, tp=tp, pp=pp, dtype=target_dtype,
            layer_spec=layer_spec, divisor=divisor, aux_files=source.aux_files(), log=log,
        )  # fmt: skip
    log(f"hf-to-mcore: {source.dir} -> {out} (tp={tp} pp={pp} dtype={target_dtype})")


def reshard(
    mcore_dir: str | Path,
    out: str | Path,
    *,
    tp: int,
    pp: int,
    overwrite: bool = False,
    log: Callable[[str], None] = print,
) -> None:
    """Re-split a Megatron checkpoint for a new tp x pp by going through HF names."""
    source = open_mcore_dir(mcore_dir)
    meta = source.meta
    check_layout(meta.spec, tp=tp, pp=pp, source=str(source.dir / META_FILE), divisor=meta.vocab_divisor)
    aux = sorted(p for p in source.hf_files_dir.iterdir() if p.is_file()) if source.hf_files_dir.is_dir() else []
    view = source.hf_view()
    with atomic_output_dir(out, overwrite=overwrite, inputs=(source.dir,)) as tmp:
        _write_mcore(
            tmp, spec=meta.spec, hf_config=meta.hf_config, get=view.get, tp=tp, pp=pp, dtype=meta.dtype,
            layer_spec=meta.layer_spec, divisor=meta.vocab_divisor, aux_files=aux, log=log,
        )  # fmt: skip
    log(f"reshard: {source.dir} (tp={meta.tp} pp={meta.pp}) -> {out} (tp={tp} pp={pp})")


def _plan_hf_shards(spec: ModelSpec, *, dtype: torch.dtype, max_shard_bytes: int) -> list[list[str]]:
    element_bytes = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    used = 0
    for name, shape in hf_tensor_shapes(spec).items():
        size = element_bytes * torch.Size(shape).numel()
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _export_config(hf_config: dict, *, dtype: str) -> dict:
    config = dict(hf_config)
    # transformers 5 writes "dtype", older versions "torch_dtype": keep whichever the source used.
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    for key in keys:
        config[key] = dtype
    return config


def mcore_to_hf_dir(
    mcore_dir: str | Path,
    out: str | Path,
    *,
    max_shard_bytes: int = 5 * 10**9,
    overwrite: bool = False,
    log: Callable[[str], None] = print,
) -> None:
    """Export a Megatron checkpoint as an HF directory (sharded safetensors + index)."""
    source = open_mcore_dir(mcore_dir)
    meta = source.meta
    torch_dtype = DTYPES[meta.dtype]
    plan = _plan_hf_shards(meta.spec, dtype=torch_dtype, max_shard_bytes=max_shard_bytes)
    files = [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    file_of = {name: files[i] for i, names in enumerate(plan) for name in names}
    stream = mcore_to_hf(meta.spec, tp=meta.tp, pp=meta.pp, get_shard=source.shard_view, layer_spec=meta.layer_spec)
    with atomic_output_dir(out, overwrite=overwrite, inputs=(source.dir,)) as tmp:
        total_bytes = 0
        pending: dict[str, torch.Tensor] = {}
        shard_index = 0
        for name, tensor in stream:
            pending[name] = tensor
            total_bytes += tensor.numel() * tensor.element_size()
            if len(pending) == len(plan[shard_index]):
                save_file(pending, str(tmp / files[shard_index]), metadata={"format": "pt"})
                log(f"wrote {files[shard_index]} ({len(pending)} tensors)")
                pending = {}
                shard_index += 1
        index = {"metadata": {"total_size": total_bytes}, "weight_map": file_of}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        if source.hf_files_dir.is_dir():
            for path in sorted(source.hf_files_dir.iterdir()):
                if path.is_file() and path.name != "config.json":
                    shutil.copy2(path, tmp / path.name)
        config = _export_config(meta.hf_config, dtype=meta.dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    log(f"mcore-to-hf: {source.dir} (tp={meta.tp} pp={meta.pp}) -> {out} ({len(files)} shard(s))")
