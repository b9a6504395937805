"""A restricted unpickler for the pickles inside torch_dist checkpoints.

A torch_dist directory holds three kinds of pickle: `.metadata` (torch.distributed.checkpoint
`Metadata`, a plain pickle), `common.pt` (a `torch.save` archive with Megatron's `args`
Namespace, `checkpoint_version`, `iteration`; from megatron-core 0.19 the same dict is the
`common_state` object inside the `.distcp` files instead) and, inside the `.distcp` files, one
`torch.save` archive per tensor chunk (plus `_extra_state` / `rng_state` objects, which this
package never reads). The stock readers unpickle them without restriction, so a crafted
checkpoint could run code on load.

Every pickle this package reads goes through `SafeUnpickler`: `find_class` resolves only the
globals listed in `ALLOWED_GLOBALS` (the checkpoint metadata dataclasses, `argparse.Namespace`,
torch's tensor rebuild function, dtypes, `torch.Size`) and refuses anything else with one line
naming the file and the class. Enum members that Megatron-LM keeps in its args (e.g.
`AttnBackend.auto`) become inert `EnumStandIn` records, so no Megatron module is imported.
`torch.load` is only ever called with this unpickler as its pickle module.
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import pickle
import types
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoint_convert.families.base import ConversionError

_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
)  # fmt: skip
_DCP = "torch.distributed.checkpoint"
# (module, name) -> the object find_class returns. Nothing here runs code beyond building data.
ALLOWED_GLOBALS: dict[tuple[str, str], object] = {
    ("argparse", "Namespace"): argparse.Namespace,
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    ("pathlib", "PosixPath"): Path,
    ("pathlib", "PurePosixPath"): Path,
    ("torch", "Size"): torch.Size,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    **{("torch", name): getattr(torch, name) for name in _DTYPE_NAMES if hasattr(torch, name)},
}
# torch.distributed.checkpoint classes: resolved lazily (importing the package is slow).
_DCP_CLASSES = {
    f"{_DCP}.metadata": (
        "Metadata", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "MetadataIndex", "_MEM_FORMAT_ENCODING",
    ),
    f"{_DCP}.filesystem": ("_StorageInfo",),
    f"{_DCP}.planner": ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"),
}  # fmt: skip
# Megatron enums that appear in saved args; kept as inert records, never imported.
_ENUM_MODULE_PREFIX = "megatron."
_ENUM_MODULE_SUFFIX = ".enums"


class RefusedPickle(ConversionError):
    """A pickle asked for a global outside the allow-list."""


@dataclass(frozen=True)
class EnumStandIn:
    """What a Megatron enum member in saved args unpickles to: its class path and value."""

    cls: str
    value: object


def _enum_factory(path: str):
    return lambda value: EnumStandIn(path, value)


def _resolve(module: str, name: str, *, source: str) -> object:
    if (module, name) in ALLOWED_GLOBALS:
        return ALLOWED_GLOBALS[(module, name)]
    if name in _DCP_CLASSES.get(module, ()):
        import importlib

        return getattr(importlib.import_module(module), name)
    if module.startswith(_ENUM_MODULE_PREFIX) and module.endswith(_ENUM_MODULE_SUFFIX) and name.isidentifier():
        return _enum_factory(f"{module}.{name}")
    raise RefusedPickle(f"{source}: refusing to unpickle '{module}.{name}' (not an allowed checkpoint class)")


class SafeUnpickler(pickle.Unpickler):
    """pickle.Unpickler whose find_class only returns allow-listed globals."""

    source = "pickle"  # the file named in errors; set per file by `_unpickler_for`

    def find_class(self, module: str, name: str) -> object:
        return _resolve(module, name, source=self.source)


def _unpickler_for(source: str) -> type[SafeUnpickler]:
    return type("SafeUnpickler", (SafeUnpickler,), {"source": source})


def _bad_pickle(source: str, error: BaseException) -> ConversionError:
    detail = str(error).splitlines()[0] if str(error) else type(error).__name__
    return ConversionError(f"{source}: not a readable checkpoint pickle ({detail})")


def load_pickle(data: bytes, *, source: str) -> object:
    """Unpickle `data` (read from the file named `source`) through the allow-list."""
    try:
        return _unpickler_for(source)(io.BytesIO(data)).load()
    except RefusedPickle:
        raise
    except Exception as error:  # truncated or corrupt bytes: one line, no traceback
        raise _bad_pickle(source, error) from None


def load_pickle_file(path: str | os.PathLike) -> object:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ConversionError(f"{path}: cannot read ({error.strerror or error})") from None
    return load_pickle(data, source=str(path))


def torch_load(stream: io.IOBase | bytes, *, source: str) -> object:
    """torch.load of a torch.save archive with the allow-listed unpickler (tensors on the CPU)."""
    unpickler = _unpickler_for(source)
    module = types.SimpleNamespace(
        __name__="checkpoint_convert.safe_pickle",
        Unpickler=unpickler,
        load=lambda file, **kwargs: unpickler(file, **kwargs).load(),
    )
    if isinstance(stream, (bytes, bytearray, memoryview)):
        stream = io.BytesIO(stream)
    try:
        # weights_only=False only because pickle_module is our allow-list unpickler: every class
        # the archive names goes through it, and anything not on the list is refused.
        return torch.load(stream, map_location="cpu", weights_only=False, pickle_module=module)
    except RefusedPickle:
        raise
    except Exception as error:
        raise _bad_pickle(source, error) from None


def torch_load_file(path: str | os.PathLike) -> object:
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"{path}: file is missing")
    with open(path, "rb") as stream:
        return torch_load(stream, source=str(path))
