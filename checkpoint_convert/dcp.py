"""torch.distributed.checkpoint files, as megatron-core's torch_dist backend lays them out,
read and written one chunk at a time without torch.distributed.

    metadata.json      {"sharded_backend": "torch_dist", ...}   (megatron-core's format marker)
    .metadata          pickled torch.distributed.checkpoint Metadata: per key the global size,
                       dtype and chunks (offsets, sizes); per chunk the file, byte offset, length
    __{r}_{i}.distcp   chunks, each a torch.save archive of one tensor, or pickled bytes
    common.pt          torch.save of everything that is not sharded (written by the caller;
                       megatron-core 0.19 and later store it as an object instead, see torch_dist.py)

A tensor is stored as chunks of its global shape; a reader may ask for any region and gets
it assembled from the chunks that overlap it. Every pickle goes through `safe_pickle`.
Reads keep the most recently loaded chunk, so walking a region in row blocks loads each
chunk once.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoint_convert.families.base import ConversionError
from checkpoint_convert.safe_pickle import load_pickle_file, torch_load

METADATA_JSON = "metadata.json"
METADATA_PICKLE = ".metadata"
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}


def is_dcp_dir(directory: str | os.PathLike) -> bool:
    path = Path(directory) / METADATA_JSON
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError, AttributeError):
        return False


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype


class DcpWriter:
    """Declare tensors, append their chunks (any order, one file per writer rank), finish."""

    def __init__(self, directory: Path) -> None:
        from torch.distributed.checkpoint import metadata as md

        self._md = md
        self.dir = Path(directory)
        self._files: dict[str, io.BufferedWriter] = {}
        self._tensors: dict[str, object] = {}
        self._objects: dict[str, object] = {}
        self._storage: dict[object, object] = {}

    def declare(self, key: str, *, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        md = self._md
        self._tensors[key] = md.TensorStorageMetadata(
            properties=md.TensorProperties(dtype=dtype), size=torch.Size(shape), chunks=[]
        )

    def _append(self, file: str, write) -> tuple[int, int]:
        handle = self._files.get(file)
        if handle is None:
            handle = self._files[file] = open(self.dir / file, "wb")
        start = handle.tell()
        write(handle)
        return start, handle.tell() - start

    def write_chunk(self, key: str, tensor: torch.Tensor, *, offsets: tuple[int, ...], file: str) -> None:
        """Append one chunk of tensor `key` at `offsets` of its global shape."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        meta = self._tensors[key]
        if tensor.dtype != meta.properties.dtype or len(offsets) != len(meta.size):
            raise ValueError(f"{key}: chunk {tensor.dtype} {list(tensor.shape)} does not fit {meta}")
        if any(o + s > g for o, s, g in zip(offsets, tensor.shape, meta.size)):
            raise ValueError(f"{key}: chunk at {offsets} of shape {list(tensor.shape)} exceeds {list(meta.size)}")
        # torch.save writes a view's whole storage: store exactly the chunk's elements.
        data = tensor.detach().contiguous()
        if data.untyped_storage().nbytes() != data.numel() * data.element_size():
            data = data.clone()
        start, length = self._append(file, lambda handle: torch.save(data, handle))
        index = self._md.MetadataIndex(key, torch.Size(offsets), len(meta.chunks))
        meta.chunks.append(self._md.ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(data.shape)))
        self._storage[index] = _StorageInfo(relative_path=file, offset=start, length=length)

    def write_object(self, key: str, value: object, *, file: str) -> None:
        """A non-tensor entry (megatron-core's ShardedObject), stored as torch.save bytes."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        start, length = self._append(file, lambda handle: torch.save(value, handle))
        self._objects[key] = self._md.BytesStorageMetadata()
        self._storage[self._md.MetadataIndex(key)] = _StorageInfo(relative_path=file, offset=start, length=length)

    def finish(self) -> None:
        for handle in self._files.values():
            handle.close()
        for key, meta in self._tensors.items():
            covered = sum(math.prod(c.sizes) for c in meta.chunks)
            if covered != math.prod(meta.size):
                raise ValueError(f"{key}: chunks cover {covered} of {math.prod(meta.size)} elements")
        metadata = self._md.Metadata(state_dict_metadata={**self._tensors, **self._objects}, storage_data=self._storage)
        with open(self.dir / METADATA_PICKLE, "wb") as handle:
            pickle.dump(metadata, handle)
        (self.dir / METADATA_JSON).write_text(json.dumps(BACKEND))

    def abort(self) -> None:
        for handle in self._files.values():
            handle.close()


def _check(condition: bool, source: str, problem: str) -> None:
    if not condition:
        raise ConversionError(f"{source}: {problem}")


def _int_tuple(value: object) -> tuple[int, ...] | None:
    if isinstance(value, (tuple, list)) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return tuple(value)
    return None


class DcpReader:
    """A validated torch_dist directory; read(key, offsets, sizes) returns a region of one tensor."""

    def __init__(self, directory: str | os.PathLike) -> None:
        from torch.distributed.checkpoint import metadata as md
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        self.dir = Path(directory)
        marker = self.dir / METADATA_JSON
        _check(is_dcp_dir(self.dir), str(marker), "missing, or its 'sharded_backend' is not 'torch_dist'")
        source = str(self.dir / METADATA_PICKLE)
        _check((self.dir / METADATA_PICKLE).is_file(), source, "file is missing")
        metadata = load_pickle_file(self.dir / METADATA_PICKLE)
        _check(isinstance(metadata, md.Metadata), source, f"expected a checkpoint Metadata, got {type(metadata).__name__}")
        entries, storage = metadata.state_dict_metadata, metadata.storage_data
        _check(isinstance(entries, dict) and isinstance(storage, dict), source, "state_dict_metadata/storage_data are not dicts")
        sizes = {}
        self.tensors: dict[str, TensorInfo] = {}
        self.objects: dict[str, object] = {}  # key -> storage entry of a non-tensor object
        self._chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], str, int, int]]] = {}
        by_key: dict[str, dict[tuple[int, ...], object]] = {}
        for index, info in storage.items():
            _check(isinstance(index, md.MetadataIndex) and isinstance(info, _StorageInfo), source, "malformed storage_data")
            by_key.setdefault(index.fqn, {})[_int_tuple(index.offset) if index.offset is not None else ()] = info
        for key, entry in entries.items():
            _check(isinstance(key, str), source, f"key {key!r} is not a string")
            if isinstance(entry, md.BytesStorageMetadata):
                # Only read on request (read_object), but a cut-off object still means a cut-off file.
                info = by_key.get(key, {}).get(())
                _check(info is not None, source, f"object '{key}' has no storage entry")
                self._check_extent(info, label=f"object '{key}'", sizes=sizes, source=source)
                self.objects[key] = info
                continue
            _check(isinstance(entry, md.TensorStorageMetadata), source, f"tensor '{key}': malformed entry")
            shape = _int_tuple(entry.size)
            dtype = getattr(entry.properties, "dtype", None)
            _check(shape is not None and isinstance(dtype, torch.dtype), source, f"tensor '{key}': bad size or dtype")
            chunks = []
            for chunk in entry.chunks:
                offsets, extent = _int_tuple(chunk.offsets), _int_tuple(chunk.sizes)
                _check(
                    offsets is not None and extent is not None and len(offsets) == len(shape) == len(extent)
                    and all(o + s <= g for o, s, g in zip(offsets, extent, shape)),
                    source, f"tensor '{key}': chunk {chunk} lies outside {list(shape)}",
                )  # fmt: skip
                info = by_key.get(key, {}).get(offsets)
                _check(info is not None, source, f"tensor '{key}': chunk at {list(offsets)} has no storage entry")
                self._check_extent(info, label=f"tensor '{key}' chunk at {list(offsets)}", sizes=sizes, source=source)
                chunks.append((offsets, extent, info.relative_path, info.offset, info.length))
            covered = sum(math.prod(c[1]) for c in chunks)
            _check(covered == math.prod(shape), source, f"tensor '{key}': chunks cover {covered} of {math.prod(shape)} elements")
            self.tensors[key] = TensorInfo(shape=shape, dtype=dtype)
            self._chunks[key] = chunks
        self._cached: tuple[tuple, torch.Tensor] | None = None
        self.bytes_read = 0  # bytes of the tensor chunks loaded so far (objects and metadata not counted)

    def _check_extent(self, info: object, *, label: str, sizes: dict[str, int], source: str) -> None:
        """The storage entry names a file in this directory and lies within it."""
        name = info.relative_path
        _check(
            isinstance(name, str) and "/" not in name and name not in ("", ".", ".."),
            source, f"{label}: storage file {name!r} is not a file name in this directory",
        )  # fmt: skip
        path = self.dir / name
        if name not in sizes:
            _check(path.is_file(), str(path), "file is missing (named in .metadata)")
            sizes[name] = path.stat().st_size
        _check(
            isinstance(info.offset, int) and isinstance(info.length, int) and 0 <= info.offset
            and info.offset + info.length <= sizes[name],
            str(path), f"truncated: {label} ends past the end of the file",
        )  # fmt: skip
        _check(not getattr(info, "transform_descriptors", None), str(path), f"{label}: compressed entries are not supported")

    def _load_chunk(self, key: str, chunk: tuple) -> torch.Tensor:
        offsets, extent, file, start, length = chunk
        if self._cached is not None and self._cached[0] == (key, offsets):
            return self._cached[1]
        self._cached = None  # drop the previous chunk before reading the next
        path = self.dir / file
        tensor = self._load_stored(path, start, length, label=f"tensor '{key}' chunk at {list(offsets)}")
        self.bytes_read += length
        _check(
            isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == extent and tensor.dtype == self.tensors[key].dtype,
            str(path), f"tensor '{key}' chunk at {list(offsets)} is not a {self.tensors[key].dtype} tensor of shape {list(extent)}",
        )  # fmt: skip
        self._cached = ((key, offsets), tensor)
        return tensor

    def read_object(self, key: str) -> object:
        """A non-tensor entry (megatron-core's ShardedObject: torch.save bytes), through safe_pickle."""
        info = self.objects[key]
        return self._load_stored(self.dir / info.relative_path, info.offset, info.length, label=f"object '{key}'")

    @staticmethod
    def _load_stored(path: Path, start: int, length: int, *, label: str) -> object:
        """The torch.save bytes [start, start + length) of a .distcp file, through safe_pickle."""
        with open(path, "rb") as handle:
            handle.seek(start)
            data = handle.read(length)
        _check(len(data) == length, str(path), f"truncated: {label}")
        return torch_load(data, source=f"{path} ({label})")

    def read(self, key: str, *, offsets: tuple[int, ...] | None = None, sizes: tuple[int, ...] | None = None) -> torch.Tensor:
        """The region [offsets, offsets + sizes) of tensor `key` (default: the whole tensor)."""
        info = self.tensors[key]
        offsets = offsets or (0,) * len(info.shape)
        sizes = sizes or tuple(g - o for g, o in zip(info.shape, offsets))
        out = torch.empty(sizes, dtype=info.dtype)
        if not math.prod(sizes):
            return out
        covered = 0
        for chunk in self._chunks[key]:
            lo = [max(a, c) for a, c in zip(offsets, chunk[0])]
            hi = [min(a + s, c + e) for a, s, c, e in zip(offsets, sizes, chunk[0], chunk[1])]
            if any(h <= low for h, low in zip(hi, lo)):
                continue
            tensor = self._load_chunk(key, chunk)
            src = tensor[tuple(slice(low - c, h - c) for low, h, c in zip(lo, hi, chunk[0]))]
            out[tuple(slice(low - a, h - a) for low, h, a in zip(lo, hi, offsets))] = src
            covered += math.prod(h - low for low, h in zip(lo, hi))
        if covered != math.prod(sizes):
            raise ConversionError(f"{self.dir}: tensor '{key}': region at {list(offsets)} of {list(sizes)} is not fully stored")
        return out
