"""Optimizer step on the CPU path: AdamW (decoupled weight decay), clipping by the global
gradient norm over all model-parallel ranks, and the learning-rate schedule.

Gradients come from megatron-core DDP's `main_grad` buffers, already summed over
microbatches and reduced over data-parallel ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist


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
    total = torch.zeros((), dtype=torch.float64)
    for param in params_once:
        grad = param.main_grad
        total += grad.detach().double().pow(2).sum().cpu()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return float(total.sqrt())


def clip_coefficient(grad_norm: float, *, max_norm: float) -> float:
    if max_norm <= 0 or not math.isfinite(grad_norm):
        return 1.0
    return min(1.0, max_norm / (grad_norm + 1e-6))


def build_adamw(params: list[torch.nn.Parameter], *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def adamw_step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], *, lr: float, clip: float) -> None:
    """Move main_grad into .grad (scaled by the clip coefficient `clip`) and take one AdamW step."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    for param in params:
        grad = param.main_grad
        param.grad = (grad * clip if clip != 1.0 else grad).to(param.dtype)
    optimizer.step()
    for param in params:
        param.grad = None
