"""The default checkpoint format: checkpoint_convert's Megatron shards. Each kind of state (the
fp32 master weights in `model/`, AdamW's moments in `optim/exp_avg/` and `optim/exp_avg_sq/`,
and TR-DPO's moving reference in `reference/`) is a Megatron directory of its own, with the
model's metadata, which any tp/pp/ep layout reads back (resharded through HF names). Each holds
every tensor of the model: the routers' expert bias, which the optimizer does not train, is
written as it is in `model/` and as zeros in the moments (`Checkpointer.held_not_trained`).
Each rank file records its rank, and each directory's metadata the checksums of its rank files
(checkpoint_convert.convert.write_mcore_meta, on the driver once every rank has written)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from checkpoint_convert.convert import write_mcore_meta
from mcore_dpo.checkpoint.layout import KINDS
from mcore_dpo.model.builder import open_weights, shard_names


class Shards:
    name = "safetensors"

    def write(self, part, root: Path, *, step: int) -> None:
        """The optimizer's fp32 master weights (exact resume also for bf16/fp16 parameters) and
        moments, one kind at a time. Every dp rank takes part (the sharded optimizer gathers its
        slices to dp rank 0); dp rank 0 writes (at ep > 1: the ranks `expert_files.file_jobs`
        names). Then TR-DPO's moving reference, in fp32, which holds any dtype exactly."""
        rank = part.rank
        for kind in KINDS:
            part.write_state(root / kind, kind.removeprefix("optim/"))
        reference = part.reference.model
        if rank.config.sync_ref_model and reference is not None:
            params = shard_names({n: p.detach() for n, p in reference.named_parameters()})
            if rank.layout.ep > 1:
                part.write_expert_parallel(root / "reference", params, dtype=torch.float32)
            elif rank.mesh.holds_replica_copy:
                part.write_shard(root / "reference", {n: p.to("cpu", torch.float32, copy=True) for n, p in params.items()})

    def finish(self, tmp: Path, *, config, spec, meta, aux) -> None:
        for kind in KINDS + (("reference",) if config.sync_ref_model else ()):
            write_mcore_meta(tmp / kind, meta=meta, aux_files=aux)

    def policy_weights(self, directory: str | Path) -> str | None:
        return os.path.join(directory, "model")

    def moving_reference(self, directory: str | Path) -> str | None:
        path = os.path.join(directory, "reference")
        return path if os.path.isdir(path) else None

    def read(self, directory: str | Path, kind: str, *, part) -> dict[str, torch.Tensor]:
        # The driver checked every file against the checkpoint's manifest before resuming from it
        # (layout.resume_point): the checksums are not read again here, the rank records are.
        return part.rank_shard(open_weights(os.path.join(directory, kind), verify_checksums=False))
