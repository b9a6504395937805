"""Context parallelism (--cp N): which token positions of a row each cp rank holds, and the two
gathers over the cp group that put a row's positions back in order.

The split is megatron-core's, load-balanced for causal attention: a row of width W is cut into
2N chunks of W / 2N positions, and cp rank i holds chunks i and 2N-1-i, in that order (an early
chunk, cheap to attend from, with a late one). Every cp rank of a dp replica runs the same
microbatches; each runs its layers over its own 2W / 2N positions.

Two gathers rebuild a whole row from the ranks' parts, [.., W/N, ..] -> [.., W, ..] in position
order. They differ only in their backward, which says who owns the rest of the computation:
- `gather_shared` (keys and values, in `model/cp_attention.py`): every rank's queries use every
  key, so a key's gradient is the sum over the ranks' backwards (an all-reduce, then this
  rank's positions; a reduce-scatter would do on NCCL, gloo has none);
- `gather_replicated` (per-token log-probs, before the loss): every rank then computes the same
  loss from the same whole rows, so a rank's own positions' gradient is its own backward's, with
  nothing to add (each rank back-propagates the one loss through its own tokens only).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def chunks_of(cp_rank: int, *, cp: int) -> tuple[int, int]:
    """The two chunks (of 2cp) cp rank `cp_rank` holds."""
    return cp_rank, 2 * cp - 1 - cp_rank


def local_positions(seq_len: int, *, cp: int, cp_rank: int) -> torch.Tensor:
    """int64 [seq_len / cp]: the positions of a row of `seq_len` that cp rank `cp_rank` holds, in
    its order (its first chunk, then its second)."""
    if seq_len % (2 * cp):
        raise ValueError(f"context parallelism: a row of {seq_len} positions does not split into {2 * cp} chunks")
    size = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks_of(cp_rank, cp=cp)])


def local_part(tensor: torch.Tensor, *, dim: int, cp: int, cp_rank: int) -> torch.Tensor:
    """This cp rank's positions of `tensor` along `dim` (a row's width), contiguous. Slices, so no
    index goes to the device."""
    if tensor.shape[dim] % (2 * cp):
        raise ValueError(f"context parallelism: a row of {tensor.shape[dim]} positions does not split into "
                         f"{2 * cp} chunks")
    chunks = tensor.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[c] for c in chunks_of(cp_rank, cp=cp)], dim=dim)


def whole_from_parts(parts: list[torch.Tensor], *, dim: int) -> torch.Tensor:
    """The whole row from every cp rank's part (`local_part`), in position order: chunk c is the
    first half of rank c's part for c < cp, else the second half of rank 2cp-1-c's."""
    halves = [p.chunk(2, dim=dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


def _gather(part: torch.Tensor, *, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, part.contiguous(), group=group)
    return whole_from_parts(parts, dim=dim)


class _GatherReplicated(torch.autograd.Function):
    """Forward: the whole row from every cp rank's part. Backward: every rank holds the whole
    gradient already (the values are used alike everywhere); keep this rank's positions."""

    @staticmethod
    def forward(ctx, part, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gather(part, dim=dim, group=group)

    @staticmethod
    def backward(ctx, grad):
        cp, cp_rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return local_part(grad, dim=ctx.dim, cp=cp, cp_rank=cp_rank), None, None


class _GatherShared(_GatherReplicated):
    """The same forward; backward: each rank holds its own share of the gradient (keys and
    values each rank attends to): sum the ranks' gradients first."""

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return _GatherReplicated.backward(ctx, grad)


def gather_shared(part: torch.Tensor, *, dim: int, group) -> torch.Tensor:
    """The whole row from every cp rank's `part` along `dim`; the backward sums the ranks'
    gradients and keeps this rank's positions (module docstring)."""
    if not torch.is_grad_enabled() or not part.requires_grad:
        return _gather(part, dim=dim, group=group)
    return _GatherShared.apply(part, dim, group)


def gather_replicated(part: torch.Tensor, *, dim: int, group) -> torch.Tensor:
    """The whole row from every cp rank's `part` along `dim`; the backward keeps this rank's
    positions of the gradient (module docstring)."""
    if not torch.is_grad_enabled() or not part.requires_grad:
        return _gather(part, dim=dim, group=group)
    return _GatherReplicated.apply(part, dim, group)
