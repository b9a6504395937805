"""Checkpoints and the policy export of a policy rank: its part of a checkpoint in the run's
format (`checkpoint.formats`: what each format writes and reads), the services the formats use
(one kind of optimizer state as shards, the ep layout's files, this rank's shard of whole
tensors), the RNG states every format keeps, and the shards of the final export. The directory
layout and its atomic commit are checkpoint/layout.py's.

`Checkpointer` is given the rank, the policy, its optimizer and the reference source at
construction; the worker calls it.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from checkpoint_convert.convert import write_mcore_shard
from checkpoint_convert.rank_files import shard_metadata, shard_relpath
from checkpoint_convert.mapping import hf_to_mcore_shard
from checkpoint_convert.safetensors_stream import SafetensorsWriter
from mcore_dpo import hooks
from mcore_dpo.checkpoint import formats
from mcore_dpo.checkpoint.expert_files import file_jobs
from mcore_dpo.checkpoint.layout import KINDS, MOMENTS, read_state
from mcore_dpo.model import lora
from mcore_dpo.model.builder import layer_spec_name, live_names, shard_names
from mcore_dpo.model.chunks import rank_shard, stage_files


class Checkpointer:
    """Checkpoint save and load, and the export shards, of one policy rank. `rank`: the
    worker's rank (`worker.Rank`: config, spec, layout, mesh, platform, dtype); `policy`: the
    DDP-wrapped policy; `optimizer`: its optimizer; `reference`: the reference source (TR-DPO's
    moving reference is saved)."""

    def __init__(self, *, rank, policy: torch.nn.Module, optimizer, reference):
        self.rank, self.policy, self.optimizer, self.reference = rank, policy, optimizer, reference
        self._stage_rank_map: dict[tuple[int, int], int] | None = None

    def policy_shard(self) -> dict[str, torch.Tensor] | None:
        """This rank's policy parameters on the CPU in the run's dtype (megatron-core keeps some
        norms in fp32 whatever the dtype); dp rank 0 only, others return None."""
        if not self.rank.mesh.holds_replica_copy:
            return None
        if self.rank.config.lora:  # the base with the adapters merged in
            return lora.merged_weights(self.policy.module, dtype=self.rank.dtype)
        return shard_names({n: p.detach().to("cpu", self.rank.dtype, copy=True) for n, p in self.policy.module.named_parameters()})

    def adapter_shard(self) -> dict[str, torch.Tensor] | None:
        """This rank's adapter parameters (megatron names) on the CPU in the run's dtype, with the
        modules trained whole (a reward model's score head); dp rank 0 only."""
        if not self.rank.mesh.holds_replica_copy:
            return None
        return {n: p.detach().to("cpu", self.rank.dtype, copy=True) for n, p in lora.trained_parameters(self.policy.module).items()}

    def write_adapter(self, directory: str) -> None:
        """dp rank 0 of each (tp, pp) writes its adapter shard as tp{t}_pp{p}.safetensors."""
        shard = self.adapter_shard()
        if shard is not None:
            self.write_shard(Path(directory), shard, adapter=True)

    def write_policy(self, directory: str) -> None:
        """dp rank 0 of each (tp, pp) writes its shard of the policy weights (checkpoint_convert
        format; with ep > 1 its ep layout, each file written where its experts are: see
        `write_expert_parallel`)."""
        if self.rank.layout.ep > 1:
            params = shard_names({n: p.detach() for n, p in self.policy.module.named_parameters()})
            self.write_expert_parallel(Path(directory), params, dtype=self.rank.dtype)
            return
        shard = self.policy_shard()
        if shard is not None:
            self.write_shard(Path(directory), shard)

    def save_checkpoint(self, directory: str, *, step: int) -> None:
        """This rank's part of the checkpoint of `step` in the run's format (`checkpoint.formats`),
        and its RNG states."""
        hooks.fire("save_checkpoint", step=step, rank=self.rank.rank, output_dir=self.rank.config.output_dir)
        root = Path(directory)
        formats.for_run(self.rank.config).write(self, root, step=step)
        rng = {"torch": torch.get_rng_state()}
        if self.rank.platform.is_cuda:
            rng["cuda"] = torch.cuda.get_rng_state(self.rank.platform.device)
        (root / "rng").mkdir(parents=True, exist_ok=True)
        save_file(rng, str(root / "rng" / f"rank{self.rank.rank}.safetensors"))

    def write_state(self, directory: Path, kind: str, *, adapter: bool = False) -> None:
        """One kind of the optimizer's state ("model": the fp32 masters, or a moment) as shards
        under `directory`: dp rank 0 of each (tp, pp) writes (every dp rank takes part: the
        sharded optimizer gathers its slices); with ep > 1 the ep layout, each file written where
        its experts are. `adapter`: LoRA shards named as the driver joins them into PEFT files."""
        rank = self.rank
        if rank.layout.ep > 1:
            # Every rank's whole state of its own parameters, its ep rank's experts among them
            # (the replicated optimizer holds it; the sharded one gathers it over dp / expert dp).
            state = {**shard_names(self.optimizer.whole_state(kind)), **self.held_not_trained(kind)}
            self.write_expert_parallel(directory, state, dtype=torch.float32)
            return
        shard = self.optimizer.checkpoint_tensors(kind, dp_rank=rank.mesh.dp_cp_rank)  # cp: dp x cp
        if shard is None:
            return
        shard = shard_names(shard)
        if not adapter:
            shard.update(self.held_not_trained(kind))
        self.write_shard(directory, shard, adapter=adapter)

    def write_shard(self, directory: Path, shard: dict[str, torch.Tensor], *, adapter: bool = False) -> None:
        """This rank's tensors as checkpoint_convert's rank files (`adapter`: LoRA shards named as
        the driver joins them into PEFT files): its (tp, pp) file, or with model chunks (--vpp)
        one file per chunk, as the virtual stage it is (model/chunks.py)."""
        mesh = self.rank.mesh
        for pp_rank, part in stage_files(shard, layout=self.rank.layout, pp_rank=mesh.pp_rank):
            if adapter:
                _write_adapter_shard(directory, part, tp_rank=mesh.tp_rank, pp_rank=pp_rank)
            else:
                write_mcore_shard(directory, tp_rank=mesh.tp_rank, pp_rank=pp_rank, shard=part)

    def held_not_trained(self, kind: str) -> dict[str, torch.Tensor]:
        """The policy's parameters that the optimizer does not hold, as one kind of state: the
        routers' expert bias (DeepSeek-V3's and GLM-4.5's e_score_correction_bias: loaded, never
        trained, model/builder.py), which megatron-core keeps outside the optimizer. "model"
        gives their values (fp32 holds any dtype exactly), a moment zeros (AdamW never steps
        them). So every kind of a checkpoint holds every tensor of the model, as the converter
        reads it, and a resumed policy, built from the checkpoint's weights, holds the bias it
        had (the optimizer takes only its own parameters' state). Empty for a LoRA run, whose
        checkpoint holds the adapters only (the base, the bias among it, is the run's --model)."""
        if self.rank.config.lora:
            return {}
        held = {n: p.detach() for n, p in self.policy.module.named_parameters() if not p.requires_grad}
        return shard_names({n: p.to("cpu", torch.float32, copy=True) if kind == "model"
                            else torch.zeros(p.shape, dtype=torch.float32) for n, p in held.items()})

    def rank_shard(self, source) -> dict[str, torch.Tensor]:
        """This rank's shard, under megatron names, of whole HF-named tensors in `source` (its
        `get` and `get_part`: only this rank's rows and columns are read)."""
        rank = self.rank
        return rank_shard(lambda pp, pp_rank: hf_to_mcore_shard(
            rank.spec, tp=rank.layout.tp, tp_rank=rank.mesh.tp_rank, pp=pp, pp_rank=pp_rank, get=source.get,
            get_part=source.get_part, layer_spec=layer_spec_name(use_te=rank.use_te), ep=rank.layout.ep,
            ep_rank=rank.mesh.ep_rank), layout=rank.layout, pp_rank=rank.mesh.pp_rank)

    def load(self, directory: str) -> None:
        """Master weights and AdamW moments, in the checkpoint's own format (resharded when the
        layout changed), and RNG states."""
        state = read_state(Path(directory))
        fmt = formats.of_checkpoint(directory, self.rank.config)
        shards = {kind: fmt.read(directory, kind, part=self) for kind in KINDS}
        if self.rank.config.lora:  # the adapters were filled from their start; fp32 masters are the parameters
            lora.load_shard(self.policy.module, shards["model"], saved=True)
        # The optimizer keys its state by the live parameter names (grouped experts' differ).
        live = {kind: live_names(self.policy.module, shard) for kind, shard in shards.items()}
        moments = {m: live[f"optim/{m}"] for m in MOMENTS}
        self.optimizer.load_moments(moments, masters=live["model"], step=int(state["step"]))
        rng_file = Path(directory) / "rng" / f"rank{self.rank.rank}.safetensors"
        if rng_file.is_file():  # absent when the layout changed: fresh RNG is fine (no dropout)
            rng = load_file(str(rng_file))
            torch.set_rng_state(rng["torch"])
            if self.rank.platform.is_cuda and "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"], self.rank.platform.device)

    def write_expert_parallel(self, directory: Path, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype) -> None:
        """Expert parallelism: this stage's files of checkpoint_convert's ep layout
        (`tp{t}_pp{p}_ep{e}`), as `expert_files.file_jobs` assigns them, each tensor stored in
        `dtype`. `tensors` are this rank's own, where they live (its dense part and its ep rank's
        experts under their local index; the same names, shapes and order on every rank of the
        stage but for the dense parts' tp split). Each is copied to the CPU only when written. A
        writer that does not hold the file's experts receives them from their sender one tensor
        at a time, in that order, and streams each into the file: no rank holds more than its
        own tensors and one other. A collective over the world: every rank goes through the same
        jobs in the same order, so the sends and receives pair up."""
        mesh, device = self.rank.mesh, self.rank.platform.device
        me = (mesh.tp_rank, mesh.dp_rank)
        world = self._stage_ranks()
        # With model chunks (--vpp) each chunk's files, as its virtual stage's (model/chunks.py).
        for pp_rank, part in stage_files(tensors, layout=self.rank.layout, pp_rank=mesh.pp_rank):
            for job in file_jobs(self.rank.layout):
                if job.writer == me:
                    path = directory / shard_relpath(tp_rank=job.tp_rank, pp_rank=pp_rank, ep=self.rank.layout.ep,
                                                     ep_rank=job.ep_rank)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    declared = [(n, dtype, tuple(t.shape)) for n, t in part.items()]
                    metadata = shard_metadata(tp_rank=job.tp_rank, pp_rank=pp_rank, ep_rank=job.ep_rank)
                    with SafetensorsWriter(path, tensors=declared, metadata=metadata, record_checksum=True) as writer:
                        for name, tensor in part.items():
                            if job.source is not None and _EXPERT.search(name):
                                tensor = torch.empty(tensor.shape, dtype=dtype, device=device)
                                dist.recv(tensor, src=world[job.source])
                            writer.write(name, tensor.to("cpu", dtype, copy=True))
                elif job.source == me:
                    for name, tensor in part.items():
                        if _EXPERT.search(name):
                            dist.send(tensor.to(device, dtype).contiguous(), dst=world[job.writer])

    def _stage_ranks(self) -> dict[tuple[int, int], int]:
        """(tp rank, dp rank) -> global rank of this rank's pipeline stage; a collective over
        the world the first time."""
        if self._stage_rank_map is None:
            mesh = self.rank.mesh
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, (mesh.pp_rank, mesh.tp_rank, mesh.dp_rank, mesh.rank))
            self._stage_rank_map = {(t, d): r for p, t, d, r in every if p == mesh.pp_rank}
        return self._stage_rank_map


_EXPERT = re.compile(r"\.local_experts\.\d+\.")


def _write_adapter_shard(directory: Path, shard: dict[str, torch.Tensor], *, tp_rank: int, pp_rank: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in shard.items()}, str(directory / f"tp{tp_rank}_pp{pp_rank}.safetensors"))
