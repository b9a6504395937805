"""The rank files of a Megatron checkpoint directory (io.py's format): where each rank's file
lives, what it records about itself, and which experts it holds.

    tp{t}_pp{p}/model.safetensors, or tp{t}_pp{p}_ep{e}/model.safetensors with experts split

Each rank file records its (tp, pp, ep) rank in its header's metadata (`shard_metadata`), and
the directory's metadata the checksums of its rank files (`read_checksums`; integrity.py): a
file copied over another's is refused by name (`check_rank_record`), a changed one by its
checksum. With ep > 1, expert e of E lives on ep rank e // (E/ep) as local expert e % (E/ep).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from checkpoint_convert.families.base import ConversionError, ModelSpec
from checkpoint_convert.integrity import HASH, IntegrityError
from checkpoint_convert.mapping import expert_tp_size, mcore_shard_shapes


def shard_relpath(*, tp_rank: int, pp_rank: int, ep: int = 1, ep_rank: int = 0) -> str:
    """One rank's file; the ep rank is part of the name only when the experts are split (ep > 1)."""
    if ep > 1:
        return f"tp{tp_rank}_pp{pp_rank}_ep{ep_rank}/model.safetensors"
    return f"tp{tp_rank}_pp{pp_rank}/model.safetensors"


def shard_relpaths(*, tp: int, pp: int, ep: int = 1) -> list[str]:
    """Every rank file of a tp x pp x ep directory."""
    return [shard_relpath(tp_rank=t, pp_rank=p, ep=ep, ep_rank=e) for p in range(pp) for t in range(tp) for e in range(ep)]


RANK_KEYS = ("tp_rank", "pp_rank", "ep_rank")


def shard_metadata(*, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> dict[str, str]:
    """The safetensors header metadata of a rank file: the rank it belongs to, recorded so that
    a file copied over another's is refused by name (`check_rank_record`)."""
    return {"format": "pt", "tp_rank": str(tp_rank), "pp_rank": str(pp_rank), "ep_rank": str(ep_rank)}


def check_rank_record(path: Path, metadata: Mapping[str, str], *, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> None:
    """A rank file's recorded rank must be the rank of the path it was opened as (a file
    without a record, written before records, passes)."""
    if not any(key in metadata for key in RANK_KEYS):
        return
    expected = (str(tp_rank), str(pp_rank), str(ep_rank))
    recorded = tuple(metadata.get(key) for key in RANK_KEYS)
    if recorded != expected:
        def ranks(values: tuple) -> str:
            return f"(tp {values[0]}, pp {values[1]}, ep {values[2]})"
        raise IntegrityError(path, f"holds the shard of rank {ranks(recorded)}, not of its path's rank {ranks(expected)} "
                                   "(a rank file copied over another?)")


def read_checksums(path: Path, raw: dict) -> dict[str, dict] | None:
    """The `checksums` field of a meta JSON: relative path -> {"bytes", "xxh3_64"} of every rank
    file; None when the directory was written before checksums were recorded."""
    checksums = raw.get("checksums")
    if checksums is None:
        return None
    if not isinstance(checksums, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get(HASH), str) for e in checksums.values()):
        raise ConversionError(f"{path}: field 'checksums' must map file names to {{'bytes': int, '{HASH}': str}}")
    return checksums


_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def is_local_expert(name: str) -> bool:
    """Whether `name` is a tensor of one expert (`...local_experts.N...`)."""
    return _LOCAL_EXPERT.search(name) is not None


def expert_rank_name(name: str, *, num_experts: int, ep: int) -> tuple[int, str] | None:
    """(ep rank, name there) of a tensor of expert e named by its global index: rank e // (E/ep)
    holds it as local expert e % (E/ep). None for a tensor that is not an expert's."""
    match = _LOCAL_EXPERT.search(name)
    if match is None:
        return None
    per_rank = num_experts // ep
    expert = int(match.group(1))
    return expert // per_rank, f"{name[: match.start()]}.local_experts.{expert % per_rank}.{name[match.end():]}"


def global_expert_name(name: str, *, num_experts: int, ep: int, ep_rank: int) -> str:
    """The inverse: a local expert's tensor on ep rank ep_rank under its global index."""
    match = _LOCAL_EXPERT.search(name)
    if match is None:
        return name
    expert = ep_rank * (num_experts // ep) + int(match.group(1))
    return f"{name[: match.start()]}.local_experts.{expert}.{name[match.end():]}"


def ep_shard_shapes(spec: ModelSpec, *, tp: int, pp: int, pp_rank: int, ep: int, layer_spec: str, divisor: int) -> list[
        dict[str, tuple[int, ...]]]:
    """Name -> shape of each ep rank's file of one (tp rank, stage), in streaming order: the
    stage's tensors with the experts of that rank under their local index."""
    shapes = mcore_shard_shapes(spec, tp=tp, pp=pp, pp_rank=pp_rank, layer_spec=layer_spec, divisor=divisor)
    if ep == 1:
        return [shapes]
    # The experts are split over expert tp (mapping.expert_tp_size: whole on their rank at ep > 1).
    etp = expert_tp_size(tp=tp, ep=ep)
    expert_shapes = mcore_shard_shapes(spec, tp=etp, pp=pp, pp_rank=pp_rank, layer_spec=layer_spec, divisor=divisor)
    shapes = {name: expert_shapes[name] if _LOCAL_EXPERT.search(name) else shape for name, shape in shapes.items()}
    ranks: list[dict[str, tuple[int, ...]]] = [{} for _ in range(ep)]
    for name, shape in shapes.items():
        owner = expert_rank_name(name, num_experts=spec.num_experts, ep=ep)
        if owner is None:
            for rank in ranks:
                rank[name] = shape
        else:
            ranks[owner[0]][owner[1]] = shape
    return ranks
