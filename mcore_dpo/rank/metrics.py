"""Metrics across the ranks of a group: a step's metric sums reduced over data-parallel ranks
and read once, the whole batch's pre-pass tables for the objectives that need one, figures
taken as their largest or mean over every rank."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from mcore_dpo.objective.contract import Objective
from mcore_dpo.objective.logprobs import SequenceLogps
from mcore_dpo.parallel.mesh import Mesh
from mcore_dpo.parallel.platform import to_device


def reduce_metrics(sums: torch.Tensor, *, objective: Objective, mesh: Mesh) -> dict[str, float] | None:
    """Combine the last stage's metric sums ([objective.metric_keys] on the device) over dp ranks
    (added, the objective's max_keys by max) and read them; tp rank 0 of the last stage of dp
    replica 0 reports (None elsewhere)."""
    if not mesh.is_last_stage:
        return None
    if mesh.layout.dp > 1:
        k = len(objective.metric_keys) - len(objective.max_keys)
        added, maxed = sums[:k].clone(), sums[k:].clone()
        dist.all_reduce(added, group=mesh.dp_group)
        if objective.max_keys:
            dist.all_reduce(maxed, op=dist.ReduceOp.MAX, group=mesh.dp_group)
        sums = torch.cat([added, maxed])
    if not mesh.returns_result:
        return None
    return objective.finalize(dict(zip(objective.metric_keys, sums.tolist())))


def whole_batch_prepass(parts: Iterable[tuple[SequenceLogps, torch.Tensor | None, Sequence[int]]], *,
                        objective: Objective, num_samples: int, mesh: Mesh, device: torch.device) -> object:
    """The objective's `prepass` over the global batch: every sample's per-sequence log-prob
    sums, of the policy and of the reference (zeros without one), from this rank's microbatches
    (`parts`: policy log-probs, reference rows, the samples' positions) gathered over dp ranks."""
    k = objective.shape.count
    table = torch.zeros(num_samples, 2 * k, dtype=torch.float64, device=device)
    for logps, reference, positions in parts:
        b = len(positions)
        index = to_device(torch.tensor(positions, dtype=torch.long), device)  # without blocking the host
        table[index, :k] = logps.logp_sum.detach().view(k, b).T.double()
        if reference is not None:
            table[index, k:] = reference.detach().view(k, b).T.double()
    if mesh.layout.dp > 1:
        dist.all_reduce(table, group=mesh.dp_group)
    return objective.prepass(table[:, :k], table[:, k:])


def max_over_ranks(figures: dict[str, int], *, world_size: int, device: torch.device) -> dict[str, int]:
    """Each figure's largest value over the ranks of the group (the same keys on every rank)."""
    if world_size == 1:
        return dict(figures)
    vec = torch.tensor(list(figures.values()), dtype=torch.float64, device=device)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX)
    return dict(zip(figures, (int(v) for v in vec.tolist())))


def mean_and_max_over_ranks(*, mean: float, max_: float, world_size: int,
                            device: torch.device) -> tuple[float, float]:
    """(mean of `mean`, max of `max_`) over every rank of the group."""
    if world_size == 1:
        return mean, max_
    vec = torch.tensor([mean, -max_], dtype=torch.float64, device=device)
    total = vec.clone()
    dist.all_reduce(total)
    dist.all_reduce(vec, op=dist.ReduceOp.MIN)
    return float(total[0]) / world_size, -float(vec[1])
