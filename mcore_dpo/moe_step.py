"""One train step's router bookkeeping on a MoE policy: the load-balancing loss each microbatch
adds (`moe_aux.py` has the formula) and the metrics `aux_loss`, `moe/load_min`, `moe/load_max`
and, per MoE layer i (HF numbering), `moe/load_min/layer{i}` and `moe/load_max/layer{i}`.

The reference never goes through here: its routing is its own and frozen."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_dpo import moe_aux
from mcore_dpo.data import Microbatch
from mcore_dpo.mesh import Mesh
from mcore_dpo.model import RouterTap


def token_mask(micro: Microbatch) -> torch.Tensor:
    """[rows, S]: 1 on real tokens (padding and a packed row's tail are 0)."""
    if micro.is_packed:
        return (micro.segment_ids < micro.num_sequences).to(torch.float32)
    return moe_aux.real_token_mask(micro.loss_mask)


def _flat_mask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mask in the router's token order: megatron-core's hidden states are [s, b, h]."""
    return mask.to(logits.device).t().reshape(-1)


class MoeStep:
    def __init__(self, policy: torch.nn.Module, *, moe_layers: tuple[int, ...], num_experts: int, topk: int,
                 mesh: Mesh, device: torch.device):
        self.tap = RouterTap(policy)
        self.moe_layers = tuple(sorted(moe_layers))
        self.slot = {layer: i for i, layer in enumerate(self.moe_layers)}
        self.num_experts, self.topk, self.mesh, self.device = num_experts, topk, mesh, device
        self._stats: dict[int, torch.Tensor] = {}  # microbatch -> [L, 2, E] (C, S), detached
        self._rows: dict[int, float] = {}

    def begin(self) -> None:
        self.tap.take()
        self._stats, self._rows = {}, {}
        self.tap.active = True

    def _record(self, mb: int, micro: Microbatch, records) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mask = token_mask(micro)
        stats = torch.zeros(len(self.moe_layers), 2, self.num_experts, dtype=torch.float64)
        counts = prob_sums = 0
        for layer, logits in records:
            c, s = moe_aux.layer_sums(logits, _flat_mask(logits, mask), topk=self.topk)
            stats[self.slot[layer], 0], stats[self.slot[layer], 1] = c.detach().double().cpu(), s.detach().double().cpu()
            counts, prob_sums = counts + c, prob_sums + s
        self._stats[mb] = stats
        self._rows[mb] = float(mask.sum())
        return counts, prob_sums, mask.sum()

    def aux_loss(self, mb: int, micro: Microbatch) -> torch.Tensor:
        """The differentiable aux of microbatch `mb`'s policy forward, just run (every MoE layer
        on this stage: pp 1)."""
        counts, prob_sums, tokens = self._record(mb, micro, self.tap.take())
        return moe_aux.load_balancing_loss(counts, prob_sums, num_layers=len(self.moe_layers), num_tokens=tokens)

    def finish(self, microbatches: list[Microbatch]) -> dict[str, float] | None:
        """Collective over the pp group, then (last stage) the dp group: the step's metrics on
        the reporting rank, None elsewhere. Forwards not taken by `aux_loss` ran in microbatch
        order, each over this stage's MoE layers."""
        self.tap.active = False
        records = self.tap.take()
        per_forward = self.tap.num_layers
        pending = [mb for mb in range(len(microbatches)) if mb not in self._stats]
        for k, mb in enumerate(pending):
            with torch.no_grad():
                self._record(mb, microbatches[mb], records[k * per_forward:(k + 1) * per_forward])
        mesh = self.mesh
        num_mb = len(microbatches)
        stats = torch.stack([self._stats[mb] for mb in range(num_mb)]) if num_mb else torch.zeros(0)
        rows = torch.tensor([self._rows[mb] for mb in range(num_mb)], dtype=torch.float64)
        if mesh.layout.pp > 1:  # each stage holds its own layers: sum them; the rows once
            rows = rows if mesh.is_first_stage else torch.zeros_like(rows)
            flat = torch.cat([stats.reshape(-1), rows]).to(self.device)
            dist.all_reduce(flat, group=mesh.pp_group)
            flat = flat.cpu()
            stats, rows = flat[:stats.numel()].reshape(stats.shape), flat[stats.numel():]
        if not mesh.is_last_stage:
            return None
        num_layers = len(self.moe_layers)
        aux_sum = sum(float(moe_aux.load_balancing_loss(stats[m, :, 0].sum(0), stats[m, :, 1].sum(0),
                                                        num_layers=num_layers, num_tokens=rows[m]))
                      for m in range(num_mb) if rows[m] > 0)
        forwards = float((rows > 0).sum())
        counts = stats[:, :, 0].sum(0) if num_mb else torch.zeros(num_layers, self.num_experts, dtype=torch.float64)
        vec = torch.cat([torch.tensor([aux_sum, forwards], dtype=torch.float64), counts.reshape(-1)]).to(self.device)
        if mesh.layout.dp > 1:
            dist.all_reduce(vec, group=mesh.dp_group)
        if not mesh.returns_result:
            return None
        vec = vec.cpu()
        low, high = moe_aux.load_shares(vec[2:].reshape(num_layers, self.num_experts))
        out = {"aux_loss": float(vec[0] / vec[1].clamp_min(1)), "moe/load_min": float(low.min()),
               "moe/load_max": float(high.max())}
        for layer, lo, hi in zip(self.moe_layers, low.tolist(), high.tolist()):
            out[f"moe/load_min/layer{layer}"], out[f"moe/load_max/layer{layer}"] = lo, hi
        return out

