"""Metrics across the ranks of a group: a step's metric sums reduced over data-parallel ranks
and read once, the whole batch's order for the losses that sort it, figures taken as their
largest or mean over every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_dpo.objective.loss import METRIC_SUM_KEYS, BatchSort, PairLogps, batch_sort, finalize_metrics
from mcore_dpo.objective.loss_spec import LossSpec
from mcore_dpo.parallel.mesh import Mesh


def reduce_metrics(sums: torch.Tensor, *, spec: LossSpec, mesh: Mesh) -> dict[str, float] | None:
    """Sum the last stage's metric sums ([METRIC_SUM_KEYS] on the device) over dp ranks and
    read them; tp rank 0 of the last stage of dp replica 0 reports (None elsewhere)."""
    if not mesh.is_last_stage:
        return None
    if mesh.layout.dp > 1:
        dist.all_reduce(sums, group=mesh.dp_group)
    if not mesh.returns_result:
        return None
    return finalize_metrics(dict(zip(METRIC_SUM_KEYS, sums.tolist())), spec=spec)


def global_sort(parts: dict[int, PairLogps], *, num_pairs: int, spec: LossSpec, mesh: Mesh,
                device: torch.device) -> BatchSort:
    """Every pair's log-probs of the global batch, gathered over dp ranks, sorted once."""
    table = torch.zeros(num_pairs, 4, dtype=torch.float64, device=device)
    for pl in parts.values():
        table[pl.pair_index] = torch.stack(
            [pl.chosen_logps, pl.rejected_logps, pl.ref_chosen_logps, pl.ref_rejected_logps], dim=1
        ).double()
    if mesh.layout.dp > 1:
        dist.all_reduce(table, group=mesh.dp_group)
    values = table.float()  # the loss's own dtype: sorted values match the live ones exactly
    zeros = torch.zeros(num_pairs, device=table.device)
    whole = PairLogps(values[:, 0], values[:, 1], values[:, 2], values[:, 3], zeros, zeros, zeros, zeros)
    return batch_sort(whole, spec=spec)


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
