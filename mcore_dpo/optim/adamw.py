"""The optimizer step and the learning-rate schedule.

Two optimizers with the same semantics (AdamW with decoupled weight decay on matrices only --
norms and biases are not decayed --, clipping by the global gradient norm over all
model-parallel ranks, fp32 masters for bf16/fp16 parameters, the LR set per step), on CPU and
GPU alike:
- `zero.ShardedOptimizer` (--distributed-optimizer, the default): state sharded over dp ranks.
- `CpuOptimizer` (--no-distributed-optimizer): torch AdamW over megatron-core DDP's `main_grad`
  buffers, already summed over microbatches and all-reduced over dp ranks; every dp rank holds
  the whole state.
(megatron-core's own optimizers build CUDA tensors and check for CUDA tensor types, so they do
not run on a CPU; docs/DESIGN.md has the details.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from mcore_dpo.model.chunks import chunk_name


def lr_at(step: int, *, lr: float, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Learning rate for 1-based `step`: linear warmup, then constant or cosine decay to min_lr_ratio*lr."""
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        decay_steps = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    raise ValueError(f"lr_schedule: unknown schedule {schedule!r} (constant|cosine)")


def global_grad_norm(params_once: Iterable[torch.nn.Parameter], *, group: object) -> float:
    """L2 norm of all gradients of one model replica. `params_once` must list each logical
    parameter on exactly one model-parallel rank (no tp duplicates, no tied copies)."""
    params_once = list(params_once)
    device = params_once[0].main_grad.device if params_once else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for param in params_once:
        total += squared_sum(param.main_grad)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return float(total.sqrt())


# Elements squared in fp64 at once by `squared_sum`: the norm's temporaries (an fp64 copy and
# its square) stay at 16 MiB whatever the size of a gradient, instead of 16 B per element of
# the largest one.
NORM_CHUNK = 1 << 20


def squared_sum(grad: torch.Tensor) -> torch.Tensor:
    """Sum of the squares of `grad`'s elements in fp64 (a 0-dim tensor on its device), a chunk of
    NORM_CHUNK elements at a time (one chunk: the whole sum of a smaller tensor, bit for bit; an
    empty tensor: 0)."""
    flat = grad.detach().reshape(-1)
    return sum(flat[start : start + NORM_CHUNK].double().pow(2).sum() for start in range(0, flat.numel(), NORM_CHUNK))


def clip_in_place(grad: torch.Tensor, clip: float, *, dtype: torch.dtype) -> torch.Tensor:
    """`grad` scaled by the clip coefficient in place, as the optimizer's gradient of `dtype`:
    no copy when it is already of that dtype (DDP's fp32 main grads for fp32 masters), so the
    step allocates no second gradient (`clip_grad_norm_` clips in place too). The caller's
    gradient buffer then holds the clipped gradient, which the next step's zeroing clears."""
    if clip != 1.0:
        grad.mul_(clip)
    return grad if grad.dtype == dtype else grad.to(dtype)


def params_once(module: torch.nn.Module, *, spec, mesh, sharded: bool = False) -> list[torch.nn.Parameter]:
    """The trainable parameters of `module` (one stage of one model replica) that this rank
    counts in the global gradient norm, so that each logical parameter counts once:
    tp-replicated ones (norms) on tp rank 0 only; the last stage's copy of a tied embedding
    not at all. With ep > 1 the replicated optimizer counts a parameter on one of its dp (expert
    dp) copies; the sharded one (`sharded`) on every rank (its slices over those groups are
    disjoint)."""
    layout = mesh.layout
    tied_copy = spec.tie_word_embeddings and layout.pp > 1 and mesh.is_last_stage
    once = []
    for name, param in module.named_parameters():
        if not param.requires_grad:  # the frozen base of a LoRA run
            continue
        if tied_copy and chunk_name(name) == "output_layer.weight" and not mesh.is_first_stage:
            continue
        expert = not getattr(param, "allreduce", True)
        whole_expert = expert and layout.etp == 1  # not split over tp, nor repeated on its tp ranks
        if not getattr(param, "tensor_model_parallel", False) and mesh.tp_rank != 0 and not whole_expert:
            continue
        if not sharded and not mesh.counts_in_grad_norm(expert=expert):  # repeats over dp / expert dp (ep > 1)
            continue
        once.append(param)
    return once


def clip_coefficient(grad_norm: float, *, max_norm: float) -> float:
    if max_norm <= 0 or not math.isfinite(grad_norm):
        return 1.0
    return min(1.0, max_norm / (grad_norm + 1e-6))


def decay_groups(params: list[torch.nn.Parameter], *, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only; norms and biases (1-D) are not decayed."""
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def build_adamw(param_groups: list[dict], *, betas: tuple[float, float], eps: float, fused: bool) -> torch.optim.AdamW:
    """torch's AdamW over `param_groups` (learning rate set per step). `fused`: one kernel over
    all parameters, without the per-tensor temporaries of the other implementations (what a GPU
    runs, `platform.fused_adamw`); otherwise torch's default, which the CPU parity tests compare
    bit for bit with a single-process torch AdamW."""
    return torch.optim.AdamW(param_groups, lr=0.0, betas=betas, eps=eps, **({"fused": True} if fused else {}))


def step_count(step: int, *, like: torch.Tensor, fused: bool) -> torch.Tensor:
    """AdamW's `step` state after `step` steps, as torch's AdamW makes it: fp32, on the
    parameter's device for the fused kernel, on the CPU otherwise."""
    return torch.tensor(float(step), dtype=torch.float32, device=like.device if fused else "cpu")


class CpuOptimizer:
    """AdamW over DDP's main_grad buffers, with global-norm clipping. Parameters held in bf16 or
    fp16 get fp32 master copies (updates at small learning rates would round away otherwise);
    fp32 parameters are updated in place."""

    def __init__(self, *, named_params: list[tuple[str, torch.nn.Parameter]], params_once: list[torch.nn.Parameter],
                 group: object, betas: tuple[float, float], eps: float, weight_decay: float, clip_grad: float,
                 fused: bool = False):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.masters = [
            p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float().clone()) for p in self.params
        ]
        self.params_once = params_once
        self.group = group
        self.clip_grad = clip_grad
        self.fused = fused
        self.last_clip = 1.0  # the clip coefficient of the last step (its gradients are scaled by it)
        self.optimizer = build_adamw(decay_groups(self.masters, weight_decay=weight_decay), betas=betas, eps=eps,
                                     fused=fused)

    def step(self, *, lr: float) -> float:
        grad_norm = global_grad_norm(self.params_once, group=self.group)
        clip = clip_coefficient(grad_norm, max_norm=self.clip_grad)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for param, master in zip(self.params, self.masters):
            master.grad = clip_in_place(param.main_grad, clip, dtype=master.dtype)
        self.last_clip = clip
        self.optimizer.step()
        with torch.no_grad():
            for param, master in zip(self.params, self.masters):
                master.grad = None
                if master is not param:
                    param.copy_(master)
        return grad_norm

    def moments(self) -> dict[str, dict[str, torch.Tensor]]:
        """{"exp_avg": {param name: tensor}, "exp_avg_sq": {...}} on the CPU (zeros before step 1)."""
        return {key: self._moment(key) for key in ("exp_avg", "exp_avg_sq")}

    def _moment(self, key: str) -> dict[str, torch.Tensor]:
        return {name: value.to("cpu", torch.float32, copy=True) for name, value in self.whole_state(key).items()}

    def whole_state(self, kind: str) -> dict[str, torch.Tensor]:
        """`checkpoint_tensors`' tensors where they live, not copied (fp32; the moments are zeros
        before step 1), on every rank, so that a writer can copy them out one at a time."""
        if kind == "model":
            return {name: master.detach() for name, master in zip(self.names, self.masters)}
        out = {}
        for name, master in zip(self.names, self.masters):
            state = self.optimizer.state.get(master)
            out[name] = (state[kind] if state else torch.zeros_like(master, dtype=torch.float32)).detach()
        return out

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: fp32 masters that are copies, and moments."""
        total = 0
        for param, master in zip(self.params, self.masters):
            if master is not param:
                total += master.numel() * master.element_size()
            state = self.optimizer.state.get(master, {})
            total += sum(state[k].numel() * state[k].element_size() for k in ("exp_avg", "exp_avg_sq") if k in state)
        return total

    def checkpoint_tensors(self, kind: str, *, dp_rank: int) -> dict[str, torch.Tensor] | None:
        """"model" (the fp32 masters) or a moment name, whole per parameter name, on dp rank 0;
        None on other dp ranks (they hold the same state)."""
        if dp_rank != 0:
            return None
        return self.master_weights() if kind == "model" else self._moment(kind)

    def master_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 weights the optimizer updates (what a checkpoint must keep), on the CPU."""
        return {name: master.to("cpu", torch.float32, copy=True) for name, master in self.whole_state("model").items()}

    def load_moments(self, moments: dict[str, dict[str, torch.Tensor]], *, masters: dict[str, torch.Tensor],
                     step: int) -> None:
        """Restore AdamW's state and the fp32 master weights after `step` optimizer steps."""
        for name, param, master in zip(self.names, self.params, self.masters):
            if master is not param:
                master.data.copy_(masters[name].to(master.device, torch.float32))
            self.optimizer.state[master] = {
                "step": step_count(step, like=master, fused=self.fused),
                "exp_avg": moments["exp_avg"][name].to(master.device, master.dtype).clone(),
                "exp_avg_sq": moments["exp_avg_sq"][name].to(master.device, master.dtype).clone(),
            }
