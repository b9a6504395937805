"""Checkpoints and the policy export of a policy rank: what each rank writes into a checkpoint
directory (weights and AdamW moments through the optimizer, the moving reference, RNG states),
how a resume reads them back (resharded through HF names when the layout changed), and the
shards of the final export. The directory layout and its atomic commit are checkpoint.py's.

`PolicyCheckpointing` is a part of `worker.PolicyWorker`: it uses the worker's config, spec,
layout, mesh, models and optimizer.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from checkpoint_convert.convert import write_mcore_shard
from checkpoint_convert.mapping import hf_to_mcore_shard
from checkpoint_convert.peft_adapter import ADAPTER_WEIGHTS
from mcore_dpo import checkpoint_torch_dist, hooks, lora
from mcore_dpo.checkpoint import ADAPTER_DIRS, LORA_SHARDS, MOMENTS, read_state
from mcore_dpo.model import layer_spec_name, open_weights


class PolicyCheckpointing:
    """Checkpoint save/load and export shards; mixed into PolicyWorker."""

    def policy_shard(self) -> dict[str, torch.Tensor] | None:
        """This rank's policy parameters on the CPU in the run's dtype (megatron-core keeps some
        norms in fp32 whatever the dtype); dp rank 0 only, others return None."""
        if self.mesh.dp_rank != 0:
            return None
        if self.config.lora:  # the base with the adapters merged in
            return lora.merged_weights(self.policy.module, dtype=self.dtype)
        return {n: p.detach().to("cpu", self.dtype, copy=True) for n, p in self.policy.module.named_parameters()}

    def adapter_shard(self) -> dict[str, torch.Tensor] | None:
        """This rank's adapter parameters (megatron names) on the CPU in the run's dtype; dp rank 0 only."""
        if self.mesh.dp_rank != 0:
            return None
        return {n: p.detach().to("cpu", self.dtype, copy=True) for n, p in lora.adapter_parameters(self.policy.module).items()}

    def write_adapter(self, directory: str) -> None:
        """dp rank 0 of each (tp, pp) writes its adapter shard as tp{t}_pp{p}.safetensors."""
        shard = self.adapter_shard()
        if shard is not None:
            _write_adapter_shard(Path(directory), shard, tp_rank=self.mesh.tp_rank, pp_rank=self.mesh.pp_rank)

    def write_policy(self, directory: str) -> None:
        """dp rank 0 of each (tp, pp) writes its shard of the policy weights (checkpoint_convert
        format; with ep > 1 every expert of the stage, gathered, under its global index)."""
        if self.layout.ep > 1:
            local = {n: p.detach().to("cpu", self.dtype, copy=True) for n, p in self.policy.module.named_parameters()}
            shard = self._whole_over_ep(local)
        else:
            shard = self.policy_shard()
        if shard is not None:
            write_mcore_shard(Path(directory), tp_rank=self.mesh.tp_rank, pp_rank=self.mesh.pp_rank, shard=shard)

    def save_checkpoint(self, directory: str, *, step: int) -> None:
        """Weights and AdamW moments (dp rank 0 of each (tp, pp); with ep > 1 it gathers every
        expert of its stage first), and every rank's RNG states."""
        hooks.fire("save_checkpoint", step=step, rank=self.rank, output_dir=self.config.output_dir)
        root = Path(directory)
        if self.config.save_format == "torch_dist":  # model and optimizer in Megatron-LM's format
            checkpoint_torch_dist.save(root, config=self.config, spec=self.spec, layout=self.layout,
                                       model=self.policy.module, optimizer=self.optimizer, dp_rank=self.mesh.dp_rank,
                                       step=step, platform=self.platform)  # fmt: skip
        # The optimizer's fp32 master weights (exact resume also for bf16/fp16 parameters) and
        # moments, one kind at a time. Every dp rank takes part (the sharded optimizer gathers
        # its slices to dp rank 0); dp rank 0 writes.
        kinds = () if self.config.save_format == "torch_dist" else ("model",) + tuple(f"optim/{m}" for m in MOMENTS)
        for kind in kinds:
            shard = self._checkpoint_tensors(kind.removeprefix("optim/"))
            if shard is not None and self.config.lora:  # the driver joins them into PEFT files
                _write_adapter_shard(root / LORA_SHARDS / kind, shard, tp_rank=self.mesh.tp_rank, pp_rank=self.mesh.pp_rank)
            elif shard is not None:
                write_mcore_shard(root / kind, tp_rank=self.mesh.tp_rank, pp_rank=self.mesh.pp_rank, shard=shard)
            del shard
        if self.config.sync_ref_model and self.reference is not None and (self.mesh.dp_rank == 0 or self.layout.ep > 1):
            # TR-DPO has moved the reference away from its source; fp32 holds any dtype exactly.
            shard = {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in self.reference.named_parameters()}
            shard = self._whole_over_ep(shard) if self.layout.ep > 1 else shard
            if shard is not None:
                write_mcore_shard(root / "reference", tp_rank=self.mesh.tp_rank, pp_rank=self.mesh.pp_rank, shard=shard)
        rng = {"torch": torch.get_rng_state()}
        if self.platform.is_cuda:
            rng["cuda"] = torch.cuda.get_rng_state(self.platform.device)
        (root / "rng").mkdir(parents=True, exist_ok=True)
        save_file(rng, str(root / "rng" / f"rank{self.rank}.safetensors"))

    def _load_checkpoint(self, directory: str) -> None:
        """Master weights and AdamW moments (resharded through HF names when the layout changed)
        and RNG states."""
        state = read_state(Path(directory))
        torch_dist = checkpoint_torch_dist.is_torch_dist_checkpoint(directory)
        shards = {}
        for kind in ("model",) + tuple(f"optim/{m}" for m in MOMENTS):
            if self.config.lora:  # whole PEFT-named tensors: any layout takes its pieces
                shards[kind] = self._adapter_shard_of(load_file(str(Path(directory) / ADAPTER_DIRS[kind] / ADAPTER_WEIGHTS)))
                continue
            shards[kind] = hf_to_mcore_shard(
                self.spec,
                tp=self.layout.tp,
                tp_rank=self.mesh.tp_rank,
                pp=self.layout.pp,
                pp_rank=self.mesh.pp_rank,
                get=(checkpoint_torch_dist.open_part(directory, kind.removeprefix("optim/")) if torch_dist
                     else open_weights(os.path.join(directory, kind))).get,
                layer_spec=layer_spec_name(use_te=self.use_te),
                ep=self.layout.ep,
                ep_rank=self.mesh.ep_rank,
            )
        if self.config.lora:  # the adapters were filled from their start; fp32 masters are the parameters
            lora.load_shard(self.policy.module, shards["model"])
        moments = {m: shards[f"optim/{m}"] for m in MOMENTS}
        self.optimizer.load_moments(moments, masters=shards["model"], step=int(state["step"]))
        rng_file = Path(directory) / "rng" / f"rank{self.rank}.safetensors"
        if rng_file.is_file():  # absent when the layout changed: fresh RNG is fine (no dropout)
            rng = load_file(str(rng_file))
            torch.set_rng_state(rng["torch"])
            if self.platform.is_cuda and "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"], self.platform.device)

    def _checkpoint_tensors(self, kind: str) -> dict[str, torch.Tensor] | None:
        """The optimizer's "model" (fp32 masters) or moment tensors of this (tp, pp) stage, whole,
        on dp rank 0 (None elsewhere); with ep > 1 every expert of the stage under its global index."""
        if self.layout.ep == 1:
            return self.optimizer.checkpoint_tensors(kind, dp_rank=self.mesh.dp_rank)
        # The replicated optimizer (the dp-sharded one is refused with ep > 1): every dp rank holds
        # the whole state of its own parameters, its ep share of the experts among them.
        return self._whole_over_ep(self.optimizer.checkpoint_tensors(kind, dp_rank=0))

    def _whole_over_ep(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Expert parallelism: this rank's tensors (the dense ones and its local experts), from
        every dp rank; on dp rank 0 the dense ones and every expert of the stage, each under its
        global index (the layout of ep 1, which checkpoint_convert reads and any ep loads); None
        elsewhere. The dp group holds every ep rank (megatron-core carves the expert groups from
        it); dp rank 0 takes each ep rank's experts from the first dp rank of that ep rank."""
        mesh, dp = self.mesh, self.layout.dp
        ep_of: list[int] = [0] * dp
        dist.all_gather_object(ep_of, mesh.ep_rank, group=mesh.dp_group)
        source = {}  # ep rank -> the first dp rank holding its experts
        for d, r in enumerate(ep_of):
            source.setdefault(r, d)
        if sorted(source) != list(range(self.layout.ep)):
            raise RuntimeError(f"the dp group holds ep ranks {sorted(source)}, not all {self.layout.ep}: "
                               "this expert layout cannot be gathered for a checkpoint")
        per_rank = self.spec.num_experts // self.layout.ep
        out = {n: t for n, t in local.items() if not _EXPERT.search(n)} if mesh.dp_rank == 0 else None
        dst = dist.get_global_rank(mesh.dp_group, 0)
        for name in sorted(n for n in local if _EXPERT.search(n)):  # the same names on every ep rank
            tensor = local[name].contiguous().to(self.platform.device)
            parts = [torch.empty_like(tensor) for _ in range(dp)] if mesh.dp_rank == 0 else None
            dist.gather(tensor, parts, dst=dst, group=mesh.dp_group)
            if out is not None:
                for r, d in source.items():
                    out[_global_expert_name(name, ep_rank=r, per_rank=per_rank)] = parts[d].to("cpu")
        return out


_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def _global_expert_name(name: str, *, ep_rank: int, per_rank: int) -> str:
    """A local expert's parameter name on expert-parallel rank `ep_rank` (which holds experts
    [ep_rank * per_rank, (ep_rank + 1) * per_rank)) with the expert's global index."""
    match = _EXPERT.search(name)
    expert = ep_rank * per_rank + int(match.group(1))
    return f"{name[: match.start()]}.local_experts.{expert}.{name[match.end():]}"


def _write_adapter_shard(directory: Path, shard: dict[str, torch.Tensor], *, tp_rank: int, pp_rank: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in shard.items()}, str(directory / f"tp{tp_rank}_pp{pp_rank}.safetensors"))
