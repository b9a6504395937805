"""The data-parallel-sharded optimizer (ZeRO stage 1), for CPU (gloo) and GPU (NCCL) alike.

megatron-core's DistributedDataParallel, built with `use_distributed_optimizer=True`, lays
every parameter and its gradient out in flat buffers cut into buckets, each bucket padded to a
multiple of the dp size. Its `finish_grad_sync` reduce-scatters each bucket's gradients, so dp
rank r ends up with the reduced gradients of the r-th 1/dp of every bucket; its
`start_param_sync` all-gathers each bucket's parameters from the same 1/dp slices. This module
owns exactly those slices: for each parameter, the piece that falls into this rank's slice
gets an fp32 master copy (a view of the parameter itself when it is fp32) and AdamW moments.

Semantics are the replicated optimizer's (`optim.CpuOptimizer`): AdamW with decoupled weight
decay on parameters of >= 2 dims only, clipping by the global gradient norm (each logical
parameter element counted once: dp slices are disjoint, tp-replicated parameters count on tp
rank 0, the tied copy of the embedding on the last stage is skipped), fp32 masters for bf16 and
fp16 parameters. Only elementwise collectives are used (reduce-scatter, all-gather, all-reduce),
which gloo and NCCL both run, so the CPU tests run the code a GPU runs.

Checkpoints: `master_weights()` / `moments()` return whole tensors per parameter name on dp
rank 0 (None elsewhere), gathered one parameter at a time; `load_moments` takes whole tensors
and keeps this rank's pieces, so a checkpoint written at one dp size loads at any other.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore_dpo.optim.adamw import build_adamw, clip_coefficient, clip_in_place, squared_sum, step_count

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Piece:
    """The elements [lo, hi) of the flattened parameter `name` that this rank owns within the
    parameter's data-parallel group (its DDP buffer's: the dp group, or for experts at ep > 1
    the expert-data-parallel group)."""

    name: str
    lo: int
    hi: int


def owned_range(*, param_start: int, param_end: int, bucket_offset: int, bucket_numel: int, dp_rank: int,
                dp_size: int) -> tuple[int, int]:
    """[lo, hi) within a parameter (flattened) that dp rank `dp_rank` owns; empty when lo >= hi.
    `param_start`/`param_end` and `bucket_offset` are positions in the flat buffer; each bucket is
    split into dp_size equal contiguous slices."""
    if bucket_numel % dp_size:
        raise ValueError(f"bucket of {bucket_numel} elements is not divisible by dp={dp_size}")
    size = bucket_numel // dp_size
    shard_lo = bucket_offset + dp_rank * size
    shard_hi = shard_lo + size
    lo, hi = max(param_start, shard_lo), min(param_end, shard_hi)
    return (lo - param_start, hi - param_start) if lo < hi else (0, 0)


def _buffers(ddp_model: torch.nn.Module) -> list:
    """DDP's dense buffers (sharded over dp) and expert buffers (over expert dp at ep > 1)."""
    return list(ddp_model.buffers) + list(getattr(ddp_model, "expert_parallel_buffers", []))


def _rank_and_size(group: object) -> tuple[int, int]:
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def data_parallel_groups(ddp_model: torch.nn.Module) -> dict[torch.nn.Parameter, object]:
    """Each parameter's data-parallel group (its DDP buffer's)."""
    return {param: buffer.data_parallel_group for buffer in _buffers(ddp_model) for param in buffer.param_index_map}


def ddp_pieces(ddp_model: torch.nn.Module, named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> list[Piece]:
    """This rank's pieces of `named_params`, read from megatron-core DDP's buffer layout: each
    buffer's buckets are cut over that buffer's data-parallel group."""
    where = {}
    for buffer in _buffers(ddp_model):
        rank, size = _rank_and_size(buffer.data_parallel_group)
        for param, (start, end, bucket_id) in buffer.param_index_map.items():
            bucket = buffer.buckets[bucket_id]
            where[param] = (start, end, bucket.offset, bucket.grad_data.numel(), rank, size)
    pieces = []
    for name, param in named_params:
        start, end, offset, numel, rank, size = where[param]
        lo, hi = owned_range(param_start=start, param_end=end, bucket_offset=offset, bucket_numel=numel,
                             dp_rank=rank, dp_size=size)
        if lo < hi:
            pieces.append(Piece(name=name, lo=lo, hi=hi))
    return pieces


class ShardedOptimizer:
    """ZeRO-1 AdamW over megatron-core DDP built with use_distributed_optimizer=True.

    step(): gradients are already reduce-scattered (DDP's finish_grad_sync); clip by the global
    norm computed from the slices, AdamW on this rank's fp32 masters, write the updated pieces
    into the parameters, then all-gather the parameters (DDP's start_param_sync)."""

    def __init__(self, *, ddp_model: torch.nn.Module, named_params: list[tuple[str, torch.nn.Parameter]],
                 params_once: list[torch.nn.Parameter], dp_group: object, dp_rank: int, dp_size: int,
                 betas: tuple[float, float], eps: float, weight_decay: float, clip_grad: float, fused: bool = False):
        self.ddp_model = ddp_model
        self.dp_group, self.dp_rank, self.dp_size = dp_group, dp_rank, dp_size
        groups = data_parallel_groups(ddp_model)
        self.group_of = {n: groups[p] for n, p in named_params}  # dp, or expert dp for experts at ep > 1
        dp_ranks = dist.get_process_group_ranks(dp_group)
        self._all_over_dp = all(dist.get_process_group_ranks(g) == dp_ranks for g in set(self.group_of.values()))
        self.clip_grad = clip_grad
        self.names = [n for n, _ in named_params]
        self.params = dict(named_params)
        once = {id(p) for p in params_once}
        self.pieces = ddp_pieces(ddp_model, named_params)
        self.counts_in_norm = [id(self.params[pc.name]) in once for pc in self.pieces]
        self.masters: list[torch.nn.Parameter] = []
        for pc in self.pieces:
            flat = self._param_piece(pc)
            # fp32 parameters are updated in place (the master is a view of the parameter).
            master = flat if flat.dtype == torch.float32 else flat.detach().float().clone()
            self.masters.append(torch.nn.Parameter(master))
        # Decay follows the shape of the whole parameter, not of its 1-D piece.
        decayed = [m for pc, m in zip(self.pieces, self.masters) if self.params[pc.name].dim() >= 2]
        plain = [m for pc, m in zip(self.pieces, self.masters) if self.params[pc.name].dim() < 2]
        self.fused = fused
        self.last_clip = 1.0  # the clip coefficient of the last step (its gradients are scaled by it)
        self.optimizer = build_adamw(
            [{"params": decayed, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}],
            betas=betas, eps=eps, fused=fused,
        )  # fmt: skip

    def _param_piece(self, pc: Piece) -> torch.Tensor:
        return self.params[pc.name].data.view(-1)[pc.lo : pc.hi]

    def _grad_piece(self, pc: Piece) -> torch.Tensor:
        return self.params[pc.name].main_grad.view(-1)[pc.lo : pc.hi]

    def grad_norm(self) -> float:
        """Global L2 norm of the reduced gradients, from every rank's slices."""
        device = next(iter(self.params.values())).device
        total = torch.zeros((), dtype=torch.float64, device=device)
        for pc, counts in zip(self.pieces, self.counts_in_norm):
            if counts:
                total += squared_sum(self._grad_piece(pc))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)  # every rank of the group: dp slices x model-parallel pieces
        return float(total.sqrt())

    def step(self, *, lr: float) -> float:
        grad_norm = self.grad_norm()
        clip = clip_coefficient(grad_norm, max_norm=self.clip_grad)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for pc, master in zip(self.pieces, self.masters):
            master.grad = clip_in_place(self._grad_piece(pc), clip, dtype=master.dtype)
        self.last_clip = clip
        self.optimizer.step()
        with torch.no_grad():
            for pc, master in zip(self.pieces, self.masters):
                master.grad = None
                piece = self._param_piece(pc)
                if piece.data_ptr() != master.data_ptr():
                    piece.copy_(master)
        self.ddp_model.start_param_sync(force_sync=True)
        return grad_norm

    # ------------------------------------------------------------------ memory
    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: fp32 masters that are copies, and moments."""
        total = 0
        for pc, master in zip(self.pieces, self.masters):
            if self._param_piece(pc).data_ptr() != master.data_ptr():
                total += master.numel() * master.element_size()
            state = self.optimizer.state.get(master, {})
            total += sum(state[k].numel() * state[k].element_size() for k in MOMENT_KEYS if k in state)
        return total

    # ------------------------------------------------------------------ checkpoints
    def _gather(self, value_of, *, everywhere: bool = False) -> dict[str, torch.Tensor] | None:
        """Whole fp32 tensors per parameter name, one parameter at a time, each over its own
        data-parallel group: on dp rank 0, on the CPU (None elsewhere; ep 1 only, where every
        group is the dp group), or with `everywhere` on every rank, on its device. The pieces
        are disjoint: a sum over the group of the int32 bit patterns (zeros elsewhere) rebuilds
        each tensor bit for bit (a float sum would turn -0.0 into +0.0)."""
        if not everywhere and not self._all_over_dp:
            raise RuntimeError("experts sharded over expert dp are not gathered on dp rank 0; use whole_state")
        mine = {pc.name: (pc, value_of(i)) for i, pc in enumerate(self.pieces)}
        out: dict[str, torch.Tensor] | None = {} if everywhere or self.dp_rank == 0 else None
        for name in self.names:
            param, group = self.params[name], self.group_of[name]
            sharded = dist.get_world_size(group=group) > 1
            if everywhere and not sharded:  # a group of one: the rank's own tensor, not copied
                out[name] = mine[name][1].view(param.shape)
                continue
            full = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
            if name in mine:
                pc, value = mine[name]
                full[pc.lo : pc.hi] = value
            if sharded:
                if everywhere:
                    dist.all_reduce(full.view(torch.int32), group=group)
                else:
                    dist.reduce(full.view(torch.int32), dst=dist.get_global_rank(group, 0), group=group)
            if out is not None:
                out[name] = full.view(param.shape) if everywhere else full.view(param.shape).to("cpu", copy=True)
        return out

    def whole_state(self, kind: str) -> dict[str, torch.Tensor]:
        """`checkpoint_tensors`' tensors, whole, on every rank's device (ep > 1 checkpoints: any
        rank holding a file's tensors may write it). A collective over each data-parallel group;
        until released it holds one kind of the state of this rank's sharded parameters whole, in
        fp32 (a parameter its group does not shard, such as the experts at expert dp 1, is not
        copied)."""
        if kind == "model":
            return self._gather(lambda i: self.masters[i].detach().float(), everywhere=True)
        return self._gather(lambda i: self._moment(i, kind), everywhere=True)

    def checkpoint_tensors(self, kind: str, *, dp_rank: int) -> dict[str, torch.Tensor] | None:
        """"model" (the fp32 masters) or a moment name, whole per parameter name, on dp rank 0;
        None on other dp ranks. Every dp rank must call it (it gathers)."""
        assert dp_rank == self.dp_rank
        if kind == "model":
            return self.master_weights()
        return self._gather(lambda i: self._moment(i, kind))

    def _moment(self, i: int, key: str) -> torch.Tensor:
        state = self.optimizer.state.get(self.masters[i])
        return state[key].detach().float() if state else torch.zeros_like(self.masters[i], dtype=torch.float32)

    def master_weights(self) -> dict[str, torch.Tensor] | None:
        """The fp32 weights the optimizer updates, whole, on dp rank 0 (None on other dp ranks)."""
        return self._gather(lambda i: self.masters[i].detach().float())

    def moments(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """{"exp_avg": {name: tensor}, "exp_avg_sq": {...}}, whole, on dp rank 0 (zeros before step 1)."""
        out = {key: self._gather(lambda i, key=key: self._moment(i, key)) for key in MOMENT_KEYS}
        return out if self.dp_rank == 0 else None

    def load_moments(self, moments: dict[str, dict[str, torch.Tensor]], *, masters: dict[str, torch.Tensor],
                     step: int) -> None:
        """Restore this rank's pieces of the fp32 masters and AdamW moments from whole tensors
        (written at any dp size), then make the parameters equal to the masters."""
        with torch.no_grad():
            for pc, master in zip(self.pieces, self.masters):
                master.data.copy_(masters[pc.name].reshape(-1)[pc.lo : pc.hi].to(master.device, torch.float32))
                self.optimizer.state[master] = {
                    "step": step_count(step, like=master, fused=self.fused),
                    **{k: moments[k][pc.name].reshape(-1)[pc.lo : pc.hi].to(master.device, torch.float32).clone()
                       for k in MOMENT_KEYS},
                }
                piece = self._param_piece(pc)
                if piece.data_ptr() != master.data_ptr():
                    piece.copy_(master)
        self.ddp_model.start_param_sync(force_sync=True)

    def gather_grads(self) -> None:
        """Make every parameter's main_grad hold the reduced gradient (after finish_grad_sync each
        rank holds only its slices): all-gather each bucket's gradient slices over its buffer's
        data-parallel group. For tests."""
        for buffer in _buffers(self.ddp_model):
            group = buffer.data_parallel_group
            rank, size = _rank_and_size(group)
            if size == 1:
                continue
            for bucket in buffer.buckets:
                part = bucket.grad_data.numel() // size
                mine = bucket.grad_data[rank * part : (rank + 1) * part].clone()
                dist.all_gather_into_tensor(bucket.grad_data, mine, group=group)
