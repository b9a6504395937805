"""The conversions behind the CLI: hf-to-mcore, mcore-to-hf, reshard.

Each streams: every output file's header is written first (names and shapes are known
from the spec), then tensors are appended one mapping entry at a time (q/k/v, gate/up and
their fused result), and the vocabulary-sized tensors move in row blocks. Memory holds
one entry, never a shard or the model. hf-to-mcore and reshard write the tp ranks of a
stage side by side (with ep > 1, every ep rank's file of each: an expert's tensor goes to
the rank that holds it, every other tensor to all of them), so each source tensor is read once. Output goes into a temporary
directory that replaces the target only when everything has been written.

Every rank file written records its rank in its header, and the directory's metadata the
checksums of its rank files (`write_mcore_meta`, once they are all written). mcore-to-hf and
reshard refuse a source rank file whose record or checksum differs (io.McoreCheckpoint: the
record on open, the checksum before the file's first tensor is read), in one line naming it;
the target is then left as it was.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from checkpoint_convert.io import (
    HF_FILES_DIR,
    INDEX_FILE,
    META_FILE,
    FORMAT_VERSION,
    McoreMeta,
    meta_json,
    open_hf_dir,
)
from checkpoint_convert.rank_files import ep_shard_shapes, expert_rank_name, shard_metadata, shard_relpath, shard_relpaths
from checkpoint_convert.durable import atomic_output_dir
from checkpoint_convert.integrity import written_entry
from checkpoint_convert.families import family_of
from checkpoint_convert.families.base import DTYPES, ConversionError, ModelSpec
from checkpoint_convert.gather import entry_blocks, hf_entry_index
from checkpoint_convert.mapping import (
    mcore_entries,
    mcore_name,
    check_layout,
    expert_tp_size,
    hf_tensor_shapes,
    padded_vocab_size,
    split_entry,
    stacked_reader,
)
from checkpoint_convert.mcore_dir import open_mcore_dir
from checkpoint_convert.names import DTYPE_HELP, canonical_dtype
from checkpoint_convert.safetensors_stream import SafetensorsWriter, write_tensors

# Checkpoint formats: this package's safetensors per rank, and megatron-core's torch_dist
# inside Megatron-LM's layout (checkpoint_convert.torch_dist). See docs/BENCHMARKS.md for
# why safetensors stays the default.
FORMATS = ("safetensors", "torch_dist")
DEFAULT_FORMAT = "safetensors"
# Vocabulary-sized tensors are copied in row blocks of at most this many bytes.
ROW_BLOCK_BYTES = 4 * 2**20
GetTensor = Callable[[str], torch.Tensor]
GetRows = Callable[[str, int, int], torch.Tensor]  # (HF name, first row, row after the last)
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


def checkpoint_format(source: object) -> str:
    """The format name of an opened Megatron checkpoint."""
    return getattr(source, "format", "safetensors")


def carried_files(paths: Iterable[Path], *, trust_remote_code: bool, command: str) -> list[Path]:
    """The config/tokenizer files a conversion copies into its output, checked before anything
    is written: tokenizer.json must load as training loads it and every other JSON file must
    parse (else one line naming the file). Custom code (*.py: the modules an `auto_map` names) is
    copied only with trust_remote_code, as the trainer's own export does; else it is left out,
    saying so in one line on stderr."""
    paths = sorted(paths)
    for path in paths:
        if path.suffix == ".json":
            _check_json_file(path)
    code = [p.name for p in paths if p.suffix == ".py"]
    if code and not trust_remote_code:
        print(f"{command}: left out custom code {', '.join(code)}; pass --trust-remote-code to copy it",
              file=sys.stderr)
    return [p for p in paths if trust_remote_code or p.suffix != ".py"]


def _check_json_file(path: Path) -> None:
    try:
        json.loads(path.read_bytes())
    except OSError as error:
        raise ConversionError(f"{path}: cannot read it ({error.strerror or error})") from None
    except ValueError as error:  # bad JSON or bad UTF-8
        raise ConversionError(f"{path}: not valid JSON ({error}); training could not load it") from None
    if path.name != "tokenizer.json":
        return
    try:
        from tokenizers import Tokenizer  # installed with transformers
    except ImportError:
        return
    try:
        Tokenizer.from_file(str(path))
    except Exception as error:  # the tokenizers library raises plain Exception
        detail = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ConversionError(f"{path}: the tokenizers library cannot load it ({detail}); training could not "
                              "either") from None


def write_mcore_shard(
    directory: Path, *, tp_rank: int, pp_rank: int, shard: dict[str, torch.Tensor], ep: int = 1, ep_rank: int = 0
) -> None:
    """Write one rank's tensors (used by the converter and by the trainer's checkpointer), its
    rank recorded in the header; with ep > 1, `shard` holds ep rank ep_rank's experts under
    their local index."""
    path = directory / shard_relpath(tp_rank=tp_rank, pp_rank=pp_rank, ep=ep, ep_rank=ep_rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_tensors(path, {k: v.detach() for k, v in shard.items()},
                  metadata=shard_metadata(tp_rank=tp_rank, pp_rank=pp_rank, ep_rank=ep_rank), record_checksum=True)


def write_mcore_meta(directory: Path, *, meta: McoreMeta, aux_files: Iterable[Path]) -> None:
    """Write hf_files/ (source config.json + tokenizer/generation files) and the meta JSON with
    the checksum of every rank file: called once all of them are written (by this process or by
    the trainer's ranks), it takes the checksum each writer computed as it wrote
    (integrity.written_entry), reading a file only when its writer left none."""
    hf_files = directory / HF_FILES_DIR
    hf_files.mkdir(parents=True, exist_ok=True)
    (hf_files / "config.json").write_text(json.dumps(meta.hf_config, indent=2) + "\n")
    for path in aux_files:
        if path.name != "config.json":
            shutil.copy2(path, hf_files / path.name)
    checksums = {}
    for rel in shard_relpaths(tp=meta.tp, pp=meta.pp, ep=meta.ep):
        if not (directory / rel).is_file():
            raise ConversionError(f"{directory / rel}: file is missing (every rank file is written before the metadata)")
        checksums[rel] = written_entry(directory / rel)
    (directory / META_FILE).write_text(json.dumps({**meta_json(meta), "checksums": checksums}, indent=2) + "\n")


def _row_blocks(start: int, stop: int, *, row_bytes: int) -> Iterator[tuple[int, int]]:
    step = max(1, ROW_BLOCK_BYTES // max(row_bytes, 1))
    for first in range(start, stop, step):
        yield first, min(first + step, stop)


def _write_vocab_rank(
    writer: SafetensorsWriter,
    *,
    name: str,
    hf_name: str,
    get_rows: GetRows,
    first_row: int,
    rows_per_rank: int,
    spec: ModelSpec,
    dtype: torch.dtype,
) -> None:
    """One tp rank's rows of a padded vocabulary tensor: source rows, then zero rows."""
    row_bytes = spec.hidden_size * torch.empty((), dtype=dtype).element_size()
    real_stop = min(first_row + rows_per_rank, spec.vocab_size)
    for lo, hi in _row_blocks(first_row, real_stop, row_bytes=row_bytes):
        writer.write_rows(name, get_rows(hf_name, lo, hi).to(dtype))
    for lo, hi in _row_blocks(max(first_row, real_stop), first_row + rows_per_rank, row_bytes=row_bytes):
        writer.write_rows(name, torch.zeros((hi - lo, spec.hidden_size), dtype=dtype))


def _write_mcore(
    tmp: Path,
    *,
    spec: ModelSpec,
    hf_config: dict,
    get: GetTensor,
    get_rows: GetRows,
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
    """The directory a tp x pp (x ep) run writes; with vpp > 1 model chunks per pipeline rank, one
    file per chunk: a plain directory of pp x vpp stages, chunk c of rank s as stage c*pp + s
    (io.py), whose meta records the layout (`virtual_pipeline`)."""
    torch_dtype = DTYPES[dtype]
    rows_per_rank = padded_vocab_size(spec.vocab_size, tp=tp, divisor=divisor) // tp
    get = stacked_reader(get)  # an expert's slice of a stacked tensor (GPT-OSS) from its stack
    pp *= vpp  # the stage files: Megatron-LM's chunk c of rank s holds the layers of stage c*pp + s
    for pp_rank in range(pp):
        per_ep_rank = ep_shard_shapes(spec, tp=tp, pp=pp, pp_rank=pp_rank, ep=ep, layer_spec=layer_spec, divisor=divisor)
        with contextlib.ExitStack() as stack:
            writers: list[list[SafetensorsWriter]] = []  # [tp_rank][ep_rank]
            for tp_rank in range(tp):
                writers.append([])
                for ep_rank, shapes in enumerate(per_ep_rank):
                    declared = [(name, torch_dtype, shape) for name, shape in shapes.items()]
                    path = tmp / shard_relpath(tp_rank=tp_rank, pp_rank=pp_rank, ep=ep, ep_rank=ep_rank)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    metadata = shard_metadata(tp_rank=tp_rank, pp_rank=pp_rank, ep_rank=ep_rank)
                    writers[-1].append(stack.enter_context(SafetensorsWriter(path, tensors=declared, metadata=metadata,
                                                                                  record_checksum=True)))
            for template, kind, hf, local, global_layer in mcore_entries(spec, pp=pp, pp_rank=pp_rank):
                name = mcore_name(template, layer=local, layer_spec=layer_spec, moe_layer=spec.is_moe_layer(global_layer))
                hf_names = [t.format(layer=global_layer) for t in hf]
                owner = expert_rank_name(name, num_experts=spec.num_experts, ep=ep) if ep > 1 else None
                # (ep rank, name there) for each file that holds the entry: its expert's rank, or all.
                targets = [owner] if owner is not None else [(r, name) for r in range(ep)]
                if kind == "vocab":
                    for tp_rank in range(tp):
                        for ep_rank, target in targets:
                            _write_vocab_rank(
                                writers[tp_rank][ep_rank], name=target, hf_name=hf_names[0], get_rows=get_rows,
                                first_row=tp_rank * rows_per_rank, rows_per_rank=rows_per_rank, spec=spec,
                                dtype=torch_dtype,
                            )  # fmt: skip
                    continue
                # Cast after splitting: the same values, and no full-size copy in the new dtype.
                tensors = [get(n) for n in hf_names]
                # An expert is split over expert tp (mapping.expert_tp_size: whole on its rank at ep > 1).
                split_tp = expert_tp_size(tp=tp, ep=ep) if owner is not None else tp
                for tp_rank in range(tp):
                    part = split_entry(spec, kind=kind, tensors=tensors, tp=split_tp, tp_rank=tp_rank % split_tp)
                    part = part.to(torch_dtype)
                    for ep_rank, target in targets:
                        writers[tp_rank][ep_rank].write(target, part)
        for tp_rank in range(tp):
            for ep_rank, shapes in enumerate(per_ep_rank):
                log(f"wrote {shard_relpath(tp_rank=tp_rank, pp_rank=pp_rank, ep=ep, ep_rank=ep_rank)} ({len(shapes)} tensors)")
    meta = McoreMeta(
        spec=spec, tp=tp, pp=pp, dtype=dtype, layer_spec=layer_spec, vocab_divisor=divisor,
        hf_config=hf_config, format_version=FORMAT_VERSION, ep=ep, vpp=vpp,
    )  # fmt: skip
    write_mcore_meta(tmp, meta=meta, aux_files=aux_files)


def _writer(fmt: str, *, ep: int = 1, vpp: int = 1) -> Callable[..., None]:
    """The checkpoint writer of a format; all take the same keyword arguments as _write_mcore
    plus ep and vpp, the expert-parallel size and model chunks per pipeline rank of the layout written)."""
    if fmt == "safetensors":
        return functools.partial(_write_mcore, ep=ep, vpp=vpp)
    if fmt == "torch_dist":
        from checkpoint_convert.torch_dist import write_checkpoint

        return functools.partial(write_checkpoint, ep=ep, vpp=vpp)
    raise ConversionError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")


def hf_to_mcore(
    hf_dir: str | Path,
    out: str | Path,
    *,
    tp: int,
    pp: int,
    ep: int = 1,
    vpp: int = 1,
    dtype: str | None = None,
    layer_spec: str = "local",
    divisor: int = 128,
    overwrite: bool = False,
    fmt: str = DEFAULT_FORMAT,
    trust_remote_code: bool = False,
    log: Callable[[str], None] = print,
) -> None:
    """Convert an HF directory into a Megatron checkpoint sharded tp x pp, its experts over ep,
    `vpp` model chunks per pipeline rank (format `fmt`), stored in `dtype` (either spelling,
    bfloat16 or bf16; None: the source's); custom code travels only with trust_remote_code
    (`carried_files`)."""
    source = open_hf_dir(hf_dir)
    check_layout(source.spec, tp=tp, pp=pp, ep=ep, source=str(source.dir / "config.json"), divisor=divisor, vpp=vpp)
    target_dtype = canonical_dtype(dtype) if dtype else source.spec.torch_dtype
    if target_dtype not in DTYPES:
        raise ConversionError(f"dtype: {dtype!r} is not {DTYPE_HELP}")
    aux = carried_files(source.aux_files(), trust_remote_code=trust_remote_code, command="hf-to-mcore")
    write = _writer(fmt, ep=ep, vpp=vpp)
    with atomic_output_dir(out, overwrite=overwrite, inputs=(source.dir,)) as tmp:
        write(
            tmp, spec=source.spec, hf_config=source.config, get=source.get, get_rows=source.get_rows, tp=tp, pp=pp,
            dtype=target_dtype,
            layer_spec=layer_spec, divisor=divisor, aux_files=aux, log=log,
        )  # fmt: skip
    log(f"hf-to-mcore: {source.dir} -> {out} ({fmt}, tp={tp} pp={pp}{_vpp_text(vpp)} ep={ep} dtype={target_dtype})")


def reshard(
    mcore_dir: str | Path,
    out: str | Path,
    *,
    tp: int,
    pp: int,
    ep: int = 1,
    vpp: int = 1,
    overwrite: bool = False,
    fmt: str | None = None,
    hf_config_dir: str | Path | None = None,
    trust_remote_code: bool = False,
    log: Callable[[str], None] = print,
) -> None:
    """Re-split a Megatron checkpoint for a new tp x pp x ep (`vpp` model chunks per pipeline
    rank) by going through HF names (each expert read from the ep rank that holds it); the output
    format is `fmt`, by default the input's; custom code travels only with trust_remote_code
    (`carried_files`)."""
    source = open_mcore_dir(mcore_dir, hf_config_dir=hf_config_dir)
    meta = source.meta
    fmt = fmt or checkpoint_format(source)
    check_layout(meta.spec, tp=tp, pp=pp, ep=ep, source=str(source.dir), divisor=meta.vocab_divisor, vpp=vpp)
    write = _writer(fmt, ep=ep, vpp=vpp)
    aux = carried_files(_hf_files(source), trust_remote_code=trust_remote_code, command="reshard")
    view = source.hf_view()
    with atomic_output_dir(out, overwrite=overwrite, inputs=(getattr(source, "root", source.dir),)) as tmp:
        write(
            tmp, spec=meta.spec, hf_config=meta.hf_config, get=view.get, get_rows=view.get_rows, tp=tp, pp=pp,
            dtype=meta.dtype,
            layer_spec=meta.layer_spec, divisor=meta.vocab_divisor, aux_files=aux, log=log,
        )  # fmt: skip
    log(f"reshard: {source.dir} ({meta.layout_text()}) -> {out} ({fmt}, tp={tp} pp={pp}{_vpp_text(vpp)} ep={ep})")


def _vpp_text(vpp: int) -> str:
    return f" vpp={vpp}" if vpp > 1 else ""


def _hf_files(source: object) -> list[Path]:
    """The files in a Megatron checkpoint's hf_files/ (none when it has no such folder)."""
    folder = source.hf_files_dir
    return sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []


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


class _ShardedWriter:
    """HF tensors in hf_tensor_names order, routed into the planned shard files in turn."""

    def __init__(
        self,
        directory: Path,
        *,
        files: list[str],
        plan: list[list[str]],
        shapes: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        log: Callable[[str], None],
    ) -> None:
        self._dir, self._files, self._plan, self._shapes, self._dtype, self._log = directory, files, plan, shapes, dtype, log
        self._file_index = {name: i for i, names in enumerate(plan) for name in names}
        self._current: SafetensorsWriter | None = None
        self._current_index = -1
        self._started: set[str] = set()

    def written(self, name: str) -> bool:
        return name in self._started

    def _writer_for(self, name: str) -> SafetensorsWriter:
        self._started.add(name)
        target = self._file_index[name]
        while self._current_index < target:
            self._finish_current()
            self._current_index += 1
            names = self._plan[self._current_index]
            declared = [(n, self._dtype, self._shapes[n]) for n in names]
            path = self._dir / self._files[self._current_index]
            self._current = SafetensorsWriter(path, tensors=declared, metadata={"format": "pt"})
        return self._current

    def _finish_current(self) -> None:
        if self._current is not None:
            self._current.close()
            self._log(f"wrote {self._files[self._current_index]} ({len(self._plan[self._current_index])} tensors)")
            self._current = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self._writer_for(name).write(name, tensor)

    def write_rows(self, name: str, rows: torch.Tensor) -> None:
        self._writer_for(name).write_rows(name, rows)

    def close(self) -> None:
        self._finish_current()

    def abort(self) -> None:
        if self._current is not None:
            self._current.abort()


def _write_hf_entry(writer: _ShardedWriter, *, spec: ModelSpec, kind: str, hf_names: list[str], parts: list[torch.Tensor]) -> None:
    """An entry's HF tensors from its tp parts, block by block (no whole tensor is built)."""
    if kind == "replicated":
        writer.write(hf_names[0], parts[0])
        return
    for i, block in entry_blocks(spec, kind=kind, parts=parts):
        writer.write_rows(hf_names[i], block)


def mcore_to_hf_dir(
    mcore_dir: str | Path,
    out: str | Path,
    *,
    max_shard_bytes: int = 5 * 10**9,
    overwrite: bool = False,
    hf_config_dir: str | Path | None = None,
    trust_remote_code: bool = False,
    log: Callable[[str], None] = print,
) -> None:
    """Export a Megatron checkpoint (either format) as an HF directory (sharded safetensors + index);
    custom code travels only with trust_remote_code (`carried_files`)."""
    source = open_mcore_dir(mcore_dir, hf_config_dir=hf_config_dir)
    meta = source.meta
    aux = carried_files(_hf_files(source), trust_remote_code=trust_remote_code, command="mcore-to-hf")
    torch_dtype = DTYPES[meta.dtype]
    plan = _plan_hf_shards(meta.spec, dtype=torch_dtype, max_shard_bytes=max_shard_bytes)
    files = [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    file_of = {name: files[i] for i, names in enumerate(plan) for name in names}
    shapes = hf_tensor_shapes(meta.spec)
    element_bytes = torch.empty((), dtype=torch_dtype).element_size()
    total_bytes = sum(element_bytes * torch.Size(shape).numel() for shape in shapes.values())
    view = source.hf_view()
    index = hf_entry_index(meta.spec, pp=meta.pp)
    with atomic_output_dir(out, overwrite=overwrite, inputs=(getattr(source, "root", source.dir),)) as tmp:
        writer = _ShardedWriter(tmp, files=files, plan=plan, shapes=shapes, dtype=torch_dtype, log=log)
        try:
            for name in hf_tensor_shapes(meta.spec):
                if writer.written(name):
                    continue  # a sibling (k, v, up) written with the first tensor of its entry
                if name not in index:  # experts stacked in one tensor (GPT-OSS): gathered expert by expert
                    writer.write(name, view.get(name))
                    continue
                template, kind, hf_names, pp_rank, local, moe_layer = index[name]
                if kind == "vocab":
                    row_bytes = element_bytes * meta.spec.hidden_size
                    for lo, hi in _row_blocks(0, meta.spec.vocab_size, row_bytes=row_bytes):
                        writer.write_rows(name, view.get_rows(name, lo, hi))
                    continue
                shard_name = mcore_name(template, layer=local, layer_spec=meta.layer_spec, moe_layer=moe_layer)
                ranks = range(1) if kind == "replicated" else range(meta.tp)
                parts = [source.shard_view(tp_rank, pp_rank)[shard_name] for tp_rank in ranks]
                _write_hf_entry(writer, spec=meta.spec, kind=kind, hf_names=hf_names, parts=parts)
        except BaseException:
            writer.abort()
            raise
        writer.close()
        index = {"metadata": {"total_size": total_bytes}, "weight_map": file_of}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        for path in aux:
            if path.name != "config.json":
                shutil.copy2(path, tmp / path.name)
        config = _export_config(meta.hf_config, dtype=meta.dtype)
        config = getattr(family_of(meta.spec), "export_config", lambda c: c)(config)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    log(f"mcore-to-hf: {source.dir} ({meta.layout_text()}) -> {out} "
        f"({len(files)} shard(s))")
