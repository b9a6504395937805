"""Safetensors read and written one tensor at a time, without memory maps.

The file format: an 8-byte little-endian header length N, N bytes of JSON
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}),
then the tensor bytes; offsets count from the end of the header.

Why not `safetensors.safe_open`: it memory-maps the file, and every page a conversion
touches then counts in the process's resident memory until the map is closed, so a
conversion's RSS grows with the checkpoint. Here each read is an `os.pread` into a fresh
buffer that the caller owns, and the writer appends bytes with plain writes, so resident
memory holds only the tensors in flight (the kernel page cache is not charged to us).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from checkpoint_convert.families.base import ConversionError
from checkpoint_convert.integrity import HASH, write_sidecar

# Safetensors dtype code -> torch dtype (and back).
DTYPE_CODES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
TORCH_TO_CODE: dict[torch.dtype, str] = {v: k for k, v in DTYPE_CODES.items()}
# The reference implementation refuses larger headers; so do we, before allocating one.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# Reads of large tensors go in pieces so that one syscall never has to move gigabytes.
_READ_CHUNK_BYTES = 64 * 1024 * 1024

if sys.byteorder != "little":  # the format is little-endian; we copy bytes verbatim
    raise ImportError("checkpoint_convert.safetensors_stream needs a little-endian machine")


def narrowed_box(shape: tuple[int, ...], dim: int, start: int, stop: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of a tensor of `shape` narrowed to [start, stop) on `dim`."""
    if not 0 <= dim < len(shape) or not 0 <= start <= stop <= shape[dim]:
        raise ValueError(f"[{start}, {stop}) on dim {dim} is outside a tensor of shape {list(shape)}")
    offsets = tuple(start if d == dim else 0 for d in range(len(shape)))
    sizes = tuple(stop - start if d == dim else size for d, size in enumerate(shape))
    return offsets, sizes


def _element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class TensorInfo:
    name: str
    code: str  # safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # absolute byte offset of the first element in the file
    end: int  # absolute byte offset one past the last element

    @property
    def dtype(self) -> torch.dtype:
        return DTYPE_CODES[self.code]


def _bad(path: Path, problem: str) -> ConversionError:
    # Same wording as the rest of the package, so callers and tests see one kind of message.
    return ConversionError(f"{path}: not a readable safetensors file ({problem})")


def _parse_header(path: Path, *, header: dict, data_start: int, file_bytes: int) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise _bad(path, "header field '__metadata__' must map strings to strings")
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise _bad(path, f"tensor '{name}': header entry is not an object")
        code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if code not in DTYPE_CODES:
            raise _bad(path, f"tensor '{name}': unsupported dtype {code!r}")
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise _bad(path, f"tensor '{name}': shape must be a list of non-negative integers, got {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise _bad(path, f"tensor '{name}': data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
        expected_bytes = math.prod(shape) * _element_bytes(DTYPE_CODES[code])
        if offsets[1] - offsets[0] != expected_bytes:
            raise _bad(path, f"tensor '{name}': data_offsets span {offsets[1] - offsets[0]} bytes, shape {shape} of {code} needs {expected_bytes}")
        infos[name] = TensorInfo(name, code, tuple(shape), data_start + offsets[0], data_start + offsets[1])
    # The tensors must tile the data section exactly: no gaps, no overlaps, nothing past the end.
    position = data_start
    for info in sorted(infos.values(), key=lambda i: (i.begin, i.end)):
        if info.begin != position:
            kind = "overlaps the previous tensor" if info.begin < position else "leaves a gap before it"
            raise _bad(path, f"tensor '{info.name}': data_offsets {kind}")
        if info.end > file_bytes:
            raise _bad(path, f"truncated: tensor '{info.name}' ends at byte {info.end}, the file has {file_bytes}")
        position = info.end
    if position != file_bytes:
        raise _bad(path, f"{file_bytes - position} trailing bytes after the last tensor")
    return infos, metadata


class SafetensorsReader:
    """A validated safetensors file; read(name) returns one tensor in a fresh buffer."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.bytes_read = 0  # tensor bytes read so far (the header is not counted)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as error:
            raise _bad(self.path, error.strerror or str(error)) from None
        try:
            self._infos, self.metadata = self._read_header()
        except BaseException:
            self.close()
            raise

    def _read_header(self) -> tuple[dict[str, TensorInfo], dict[str, str]]:
        file_bytes = os.fstat(self._fd).st_size
        prefix = os.pread(self._fd, 8, 0)
        if len(prefix) < 8:
            raise _bad(self.path, f"file has {file_bytes} bytes, shorter than the 8-byte header length")
        header_bytes = int.from_bytes(prefix, "little")
        if header_bytes > MAX_HEADER_BYTES:
            raise _bad(self.path, f"header length {header_bytes} exceeds {MAX_HEADER_BYTES} bytes")
        if 8 + header_bytes > file_bytes:
            raise _bad(self.path, f"truncated: header of {header_bytes} bytes, the file has {file_bytes}")
        raw = self._pread_exact(header_bytes, 8)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise _bad(self.path, f"header is not valid JSON: {str(error).splitlines()[0]}") from None
        if not isinstance(header, dict):
            raise _bad(self.path, "header is not a JSON object")
        return _parse_header(self.path, header=header, data_start=8 + header_bytes, file_bytes=file_bytes)

    def _pread_exact(self, size: int, offset: int) -> bytes:
        data = os.pread(self._fd, size, offset)
        if len(data) != size:
            raise _bad(self.path, f"truncated: short read at byte {offset}")
        return data

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            self.close()

    def keys(self) -> list[str]:
        return list(self._infos)

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise ConversionError(f"{self.path}: tensor '{name}' is missing") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def dtype_code(self, name: str) -> str:
        return self.info(name).code

    def read(self, name: str, *, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `name`, or only rows [start, stop) of its first dimension (one contiguous read)."""
        shape = self.info(name).shape
        if rows is None:
            return self.read_box(name, offsets=(0,) * len(shape), sizes=shape)
        if not shape:
            raise ValueError(f"{self.path}: tensor '{name}' is a scalar; it has no rows")
        start, stop = rows
        if not 0 <= start <= stop <= shape[0]:
            raise ValueError(f"{self.path}: tensor '{name}': rows {rows} outside [0, {shape[0]}]")
        return self.read_box(name, offsets=(start,) + (0,) * (len(shape) - 1), sizes=(stop - start,) + shape[1:])

    def read_box(self, name: str, *, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The region [offsets, offsets + sizes) of tensor `name`, reading only its bytes.

        The dimensions after the last one the region cuts are whole, so the region is a run of
        contiguous pieces of the file, one per index of the dimensions before it: a row block is
        one read, a column block of a matrix one read per row."""
        info = self.info(name)
        shape = info.shape
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                o < 0 or s < 0 or o + s > g for o, s, g in zip(offsets, sizes, shape)):
            raise ValueError(f"{self.path}: tensor '{name}': region at {list(offsets)} of {list(sizes)} outside {list(shape)}")
        out = torch.empty(sizes, dtype=info.dtype)
        if not math.prod(sizes):
            return out
        flat = memoryview(out.reshape(-1).view(torch.uint8).numpy()).cast("B")
        if not shape:
            self._read_into(flat, info.begin, name=name)
            return out
        cut = max((d for d in range(len(shape)) if sizes[d] != shape[d]), default=0)
        element = _element_bytes(info.dtype)
        strides = [math.prod(shape[d + 1 :]) * element for d in range(len(shape))]
        piece = sizes[cut] * strides[cut]  # bytes of one contiguous piece
        outer = itertools.product(*(range(o, o + s) for o, s in zip(offsets[:cut], sizes[:cut])))
        for i, index in enumerate(outer):
            begin = info.begin + sum(x * stride for x, stride in zip(index, strides)) + offsets[cut] * strides[cut]
            self._read_into(flat[i * piece : (i + 1) * piece], begin, name=name)
        return out

    def _read_into(self, view: memoryview, begin: int, *, name: str) -> None:
        """Fill `view` with the file's bytes from `begin` (in pieces of at most _READ_CHUNK_BYTES)."""
        done = 0
        while done < len(view):
            try:
                got = os.preadv(self._fd, [view[done : done + _READ_CHUNK_BYTES]], begin + done)
            except OSError as error:
                raise ConversionError(f"{self.path}: tensor '{name}' unreadable ({error.strerror or error})") from None
            if got == 0:  # the file shrank after the header was checked
                raise _bad(self.path, f"truncated: tensor '{name}' ends at byte {begin + len(view)}, read stopped at {begin + done}")
            done += got
            self.bytes_read += got


class SafetensorsWriter:
    """Writes a safetensors file whose tensor list is known up front, one tensor at a time.

    The header goes first, so tensors must arrive in the declared order; a tensor may also
    arrive as consecutive row blocks (write_rows) so that a large one never sits whole in
    memory. close() checks that everything declared was written. With `record_checksum` the
    bytes are hashed as they are written and close() leaves the file's checksum entry beside it
    (integrity.write_sidecar), for the Megatron directory's metadata to take without reading
    the file back.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
        record_checksum: bool = False,
    ) -> None:
        self.path = Path(path)
        self._order: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        header: dict[str, object] = {"__metadata__": dict(metadata if metadata is not None else {"format": "pt"})}
        offset = 0
        for name, dtype, shape in tensors:
            if name in header:
                raise ValueError(f"{self.path}: tensor '{name}' declared twice")
            if dtype not in TORCH_TO_CODE:
                raise ValueError(f"{self.path}: tensor '{name}': dtype {dtype} has no safetensors code")
            shape = tuple(int(s) for s in shape)
            size = math.prod(shape) * _element_bytes(dtype)
            header[name] = {"dtype": TORCH_TO_CODE[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self._order.append((name, dtype, shape))
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
        encoded += b" " * (-len(encoded) % 8)  # keeps the data section 8-byte aligned, as the reference writer does
        self._file = open(self.path, "wb")
        self._digest = xxhash.xxh3_64() if record_checksum else None
        self._bytes = 0
        self._put(len(encoded).to_bytes(8, "little") + encoded)
        self._next = 0  # index into _order of the tensor being written
        self._rows_done = 0  # rows of that tensor written so far

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the whole tensor `name`, which must be the next one declared."""
        expected = self._expected(name)
        if tuple(tensor.shape) != expected[2] or self._rows_done:
            raise ValueError(f"{self.path}: tensor '{name}' has shape {list(tensor.shape)}, declared {list(expected[2])}")
        self._append(name, tensor, rows=expected[2][0] if expected[2] else 1)

    def write_rows(self, name: str, rows: torch.Tensor) -> None:
        """Append the next block of rows (first dimension) of tensor `name`."""
        _, _, shape = self._expected(name)
        if not shape or tuple(rows.shape[1:]) != shape[1:] or self._rows_done + rows.shape[0] > shape[0]:
            raise ValueError(
                f"{self.path}: tensor '{name}': a block of shape {list(rows.shape)} does not fit the declared"
                f" {list(shape)} after {self._rows_done} rows"
            )
        self._append(name, rows, rows=rows.shape[0])

    def _expected(self, name: str) -> tuple[str, torch.dtype, tuple[int, ...]]:
        if self._file is None:
            raise ValueError(f"{self.path}: writer is closed")
        if self._next >= len(self._order):
            raise ValueError(f"{self.path}: tensor '{name}' was not declared (all declared tensors are written)")
        expected = self._order[self._next]
        if name != expected[0]:
            raise ValueError(f"{self.path}: got tensor '{name}', expected '{expected[0]}' next")
        return expected

    def _append(self, name: str, tensor: torch.Tensor, *, rows: int) -> None:
        _, dtype, shape = self._order[self._next]
        if tensor.dtype != dtype:
            raise ValueError(f"{self.path}: tensor '{name}' has dtype {tensor.dtype}, declared {dtype}")
        flat = tensor.detach().contiguous().reshape(-1)
        if flat.numel():
            self._put(memoryview(flat.view(torch.uint8).numpy()).cast("B"))
        self._rows_done += rows
        if self._rows_done >= (shape[0] if shape else 1):
            self._next += 1
            self._rows_done = 0

    def _put(self, data) -> None:
        self._file.write(data)
        if self._digest is not None:
            self._digest.update(data)
        self._bytes += len(data)

    def close(self) -> None:
        """Finish the file; raises if declared tensors are missing (the file is then incomplete)."""
        if self._file is None:
            return
        self._file.close()
        self._file = None
        if self._next < len(self._order):
            raise ValueError(f"{self.path}: closed before tensor '{self._order[self._next][0]}' was written")
        if self._digest is not None:
            write_sidecar(self.path, {"bytes": self._bytes, HASH: self._digest.hexdigest()})

    def abort(self) -> None:
        """Close without checks (the caller discards the file)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], *, metadata: dict[str, str] | None = None,
                  record_checksum: bool = False) -> None:
    """Write a dict of tensors (in dict order) through SafetensorsWriter."""
    declared = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    with SafetensorsWriter(path, tensors=declared, metadata=metadata, record_checksum=record_checksum) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
