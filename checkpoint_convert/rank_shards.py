"""One rank file of a Megatron checkpoint directory (io.McoreCheckpoint) as a mapping of its
tensors, each read on access, and the ep files of one (tp rank, stage) seen as one ep-1 shard."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from checkpoint_convert.families.base import ModelSpec
from checkpoint_convert.gather import tp_part_of_whole_expert
from checkpoint_convert.integrity import verify_file
from checkpoint_convert.mapping import expert_tp_size, mcore_entries, mcore_name
from checkpoint_convert.rank_files import global_expert_name, is_local_expert
from checkpoint_convert.safetensors_stream import SafetensorsReader, narrowed_box


class LazyShard(Mapping):
    """One rank's tensors, each read on access into a fresh tensor. `checksum`: the file's
    recorded entry, checked (integrity.verify_file) before the first tensor is read."""

    def __init__(self, path: Path, handle: SafetensorsReader, *, checksum: dict | None = None) -> None:
        self._path, self._handle, self._checksum = path, handle, checksum
        self._names = list(handle.keys())

    def _reader(self) -> SafetensorsReader:
        if self._checksum is not None:
            verify_file(self._path, self._checksum)
            self._checksum = None
        return self._handle

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._reader().read(name)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor `name` without reading the rest."""
        return self._reader().read(name, rows=(start, stop))

    def shape(self, name: str) -> tuple[int, ...]:
        return self._handle.shape(name)

    def part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Tensor `name` narrowed to [start, stop) on dim, reading only those bytes."""
        offsets, sizes = narrowed_box(self._handle.shape(name), dim, start, stop)
        return self._reader().read_box(name, offsets=offsets, sizes=sizes)

    @property
    def bytes_read(self) -> int:
        return self._handle.bytes_read

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class ExpertParallelShard(Mapping):
    """The ep files of one (tp rank, stage) seen as one ep-1 shard: experts under their global
    index, every other tensor from ep rank 0 (the ranks hold the same copy)."""

    def __init__(
        self, ranks: list[LazyShard], *, spec: ModelSpec, tp: int, tp_rank: int, pp: int, pp_rank: int, layer_spec: str
    ) -> None:
        num_experts = spec.num_experts
        self._spec, self._tp, self._tp_rank, self._ranks = spec, tp, tp_rank, ranks
        self._whole_experts = expert_tp_size(tp=tp, ep=len(ranks)) != tp
        self._kinds = {mcore_name(t, layer=local, layer_spec=layer_spec, moe_layer=spec.is_moe_layer(layer)): kind
                       for t, kind, _, local, layer in mcore_entries(spec, pp=pp, pp_rank=pp_rank)}
        self._where: dict[str, tuple[LazyShard, str]] = {}
        for ep_rank, shard in enumerate(ranks):
            for name in shard:
                full = global_expert_name(name, num_experts=num_experts, ep=len(ranks), ep_rank=ep_rank)
                if full == name and ep_rank > 0:
                    continue
                self._where[full] = (shard, name)

    def __getitem__(self, name: str) -> torch.Tensor:
        shard, local = self._where[name]
        if not (self._whole_experts and is_local_expert(name)):
            return shard[local]
        return tp_part_of_whole_expert(self._spec, kind=self._kinds[name], whole=shard[local], tp=self._tp,
                                       tp_rank=self._tp_rank)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        shard, local = self._where[name]
        return shard.get_rows(local, start, stop)

    def part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """self[name] narrowed to [start, stop) on dim. A whole expert's tp part is read as its
        rows (fc1: this rank's gate rows, then its up rows) or columns (fc2) of the whole."""
        shard, local = self._where[name]
        if not (self._whole_experts and is_local_expert(name)):
            return shard.part(local, dim, start, stop)
        kind, whole = self._kinds[name], shard.shape(local)
        if kind == "row" and dim == 1:
            first = self._tp_rank * whole[1] // self._tp
            return shard.part(local, 1, first + start, first + stop)
        if kind == "fc1" and dim == 0:
            half, rows = whole[0] // 2, whole[0] // 2 // self._tp
            blocks = []
            for i in (0, 1):  # the gate rows, then the up rows of this tp rank
                lo, hi = max(start, i * rows), min(stop, (i + 1) * rows)
                if lo < hi:
                    first = i * half + self._tp_rank * rows - i * rows
                    blocks.append(shard.part(local, 0, first + lo, first + hi))
            if not blocks:
                return shard.part(local, 0, 0, 0)
            return torch.cat(blocks, dim=0) if len(blocks) > 1 else blocks[0]
        return self[name].narrow(dim, start, stop - start).clone()

    @property
    def bytes_read(self) -> int:
        return sum(shard.bytes_read for shard in self._ranks)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)
