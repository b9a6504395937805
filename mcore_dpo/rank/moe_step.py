"""One train step's router bookkeeping on a MoE policy: the load-balancing loss's gradient
(`model/moe_aux.py` has the formula) and the metrics `aux_loss`, `moe/load_min`, `moe/load_max` and,
per MoE layer i (HF numbering), `moe/load_min/layer{i}` and `moe/load_max/layer{i}`.

The aux of one forward couples all MoE layers and, at tp > 1 (sequence parallel), all tokens:
aux = E / (L R)^2 * sum_e C[e] S[e], with C and S sums over layers and tokens and C without
gradient. So each piece of the model can carry its own share: on each stage and tp rank,

    aux_part = E / (L R)^2 * sum_e C[e] * S_part[e]

(S_part: this rank's layers and tokens, C: everyone's), and the parts' gradients add up to
aux's. Each stage attaches its part to its own output's backward (a custom autograd function
that, at the backward, hands S_part the gradient coef / microbatches * E C / (L R)^2 and passes
the output's gradient through), as megatron-core's MoEAuxLossAutoScaler attaches its per-layer
loss. C is summed over tp in the forward; at pp > 1 the counts travel in the plan's own
messages (`pipeline.Riders`): each stage adds its counts to the sum that came with the
microbatch's activation and sends the sum on with its own, the last stage has the whole sum,
and it goes back upstream with the activation gradient, which every stage's backward waits for
anyway. No channel outside the plan, and nothing read on the host in a forward: the token
masks and counts are computed from the host rows in `begin`, the statistics read once in
`finish`. With model chunks (--vpp) the same holds per virtual stage: each chunk's forward hook
adds its counts, the sum travels with the chunk's act (keyed by the receiving chunk) from chunk 0
of stage 0 to the last chunk of the last stage, and the whole sum comes back with every grad.

The reference never goes through here: its routing is its own and frozen."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from mcore_dpo.model import moe_aux
from mcore_dpo.data.pairs import Microbatch
from mcore_dpo.parallel.mesh import Mesh
from mcore_dpo.model.builder import RouterTap
from mcore_dpo.model.chunks import chunk_modules
from mcore_dpo.pipeline.plan import Op, OpKind
from mcore_dpo.parallel.platform import to_device


def token_mask(micro: Microbatch) -> torch.Tensor:
    """[rows, S]: 1 on real tokens (padding and a packed row's tail are 0)."""
    if micro.has_segments:
        return (micro.segment_ids < micro.num_sequences).to(torch.float32)
    return moe_aux.real_token_mask(micro.loss_mask)


def router_token_mask(mask: torch.Tensor, *, tp: int, tp_rank: int) -> torch.Tensor:
    """The mask [rows, S] in one rank's router token order: megatron-core's hidden states are
    [s, b, h], and with sequence parallelism (tp > 1) tp rank r holds positions
    [r S/tp, (r+1) S/tp)."""
    seq = mask.t()
    if tp > 1:
        seq = seq.chunk(tp, dim=0)[tp_rank]
    return seq.reshape(-1)


class _AuxGradient(torch.autograd.Function):
    """Identity on a stage's output; in the backward, also the gradient of this rank's aux part
    with respect to its probability sums S_part (computed then: it needs every stage's counts)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, prob_sums: torch.Tensor, weight: Callable[[], torch.Tensor]):
        ctx.weight = weight
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return grad_output, ctx.weight(), None


class MoeStep:
    def __init__(self, policy: torch.nn.Module, *, moe_layers: tuple[int, ...], num_experts: int, topk: int,
                 mesh: Mesh, device: torch.device):
        self.tap = RouterTap(policy)
        self.moe_layers = tuple(sorted(moe_layers))
        self.slot = {layer: i for i, layer in enumerate(self.moe_layers)}
        self.num_experts, self.topk, self.mesh, self.device = num_experts, topk, mesh, device
        # MoE models run sequence-parallel at tp > 1: each tp rank routes its slice of the sequence.
        self.split = mesh.layout.tp
        chunks = chunk_modules(policy)
        for chunk, module in enumerate(chunks):  # a chunk's training forwards run in microbatch order
            module.register_forward_hook(functools.partial(self._after_forward, chunk))
        self._microbatches: list[Microbatch] = []
        self._coef = 0.0
        self._forwards = [0] * len(chunks)  # per chunk: the training forwards it has run this step
        self._stats: dict[int, torch.Tensor] = {}  # microbatch -> [L, 2, E] (C, S) of this rank, detached, on the device
        self._rows: list[float] = []  # per microbatch: its real tokens (host)
        self._masks: list[torch.Tensor] = []  # per microbatch: the real-token mask in router order, on the device
        # Expert counts of each microbatch, summed over the (virtual) stages: the sum so far arrives
        # with the act (stages before this one), the whole sum with the grad (from the last stage).
        self._partial: dict[tuple[int, int], torch.Tensor] = {}  # (chunk, mb) -> the stages' before it (received)
        self._sent: dict[tuple[int, int], torch.Tensor] = {}  # (chunk, mb) -> up to it (to send with the act)
        self._total: dict[int, torch.Tensor] = {}  # mb -> every stage's counts

    def begin(self, microbatches: list[Microbatch], *, coef: float) -> None:
        """Before the step's forwards: its microbatches (this dp rank's, in order) and the aux
        weight. The token masks and counts come from the host rows here, not in the forwards."""
        self.tap.take()
        self._microbatches, self._coef, self._forwards = microbatches, coef, [0] * len(self._forwards)
        self._stats, self._partial, self._sent, self._total = {}, {}, {}, {}
        masks = [token_mask(micro) for micro in microbatches]
        self._rows = [float(mask.sum()) for mask in masks]
        self._masks = [to_device(router_token_mask(mask, tp=self.split, tp_rank=self.mesh.tp_rank), self.device)
                       for mask in masks]
        self.tap.active = True

    def riders(self) -> "MoeStep | None":
        """What rides on the plan's messages in this step (`pipeline.Riders`): the counts, when the
        aux loss is on and there are several stages; None otherwise."""
        return self if self._coef and self.mesh.layout.pp > 1 else None

    # --- pipeline.Riders: the counts travel with the policy act (downstream) and grad (upstream)
    def outgoing(self, op: Op) -> torch.Tensor | None:
        if op.kind is OpKind.SEND_ACT:
            return self._sent.pop((op.chunk, op.microbatch))
        if op.kind is OpKind.SEND_GRAD:
            return self._total[op.microbatch]
        return None

    def incoming(self, op: Op) -> torch.Tensor | None:
        if op.kind in (OpKind.RECV_ACT, OpKind.RECV_GRAD):
            return torch.empty(self.num_experts, dtype=torch.float32, device=self.device)
        return None

    def received(self, op: Op, tensor: torch.Tensor) -> None:
        if op.kind is OpKind.RECV_ACT:
            self._partial[(op.chunk, op.microbatch)] = tensor
        else:
            self._total[op.microbatch] = tensor

    def _after_forward(self, chunk: int, module, args, output):
        """Forward hook of the policy's model chunk `chunk` (0 without chunks): its training
        forwards run in microbatch order."""
        if not self.tap.active or not torch.is_grad_enabled():
            return None
        mb = self._forwards[chunk]
        self._forwards[chunk] += 1
        flat = self._masks[mb]
        stats = torch.zeros(len(self.moe_layers), 2, self.num_experts, dtype=torch.float64, device=self.device)
        counts = torch.zeros(self.num_experts, dtype=torch.float32, device=self.device)
        prob_sums = None
        for layer, logits in self.tap.take():
            c, s = moe_aux.layer_sums(logits, flat, topk=self.topk)
            stats[self.slot[layer], 0], stats[self.slot[layer], 1] = c.detach().double(), s.detach().double()
            counts = counts + c.detach()
            prob_sums = s if prob_sums is None else prob_sums + s
        self._stats[mb] = stats if mb not in self._stats else self._stats[mb] + stats  # chunks: their own layers
        if not self._coef:
            return None
        if self.split > 1:
            dist.all_reduce(counts, group=self.mesh.tp_group)
        if self.mesh.layout.pp > 1:  # every (virtual) stage, routers or not, so that the sums go on
            summed = counts if self.mesh.holds_input(chunk) else self._partial.pop((chunk, mb)) + counts
            if self.mesh.holds_output(chunk):
                self._total[mb] = summed
            else:
                self._sent[(chunk, mb)] = summed
        else:
            self._total[mb] = counts
        if prob_sums is None:  # no MoE layer on this stage
            return None
        scale = self._coef / len(self._microbatches) * self.num_experts / (len(self.moe_layers) * self._rows[mb]) ** 2

        def weight() -> torch.Tensor:  # at the backward: the last stage's sum has come with the grad
            return (scale * self._total[mb]).to(prob_sums.dtype)

        return _AuxGradient.apply(output, prob_sums, weight)

    def finish(self, microbatches: list[Microbatch]) -> dict[str, float] | None:
        """Collective over the tp group, the pp group, then (last stage) the dp group: the step's
        metrics on the reporting rank, None elsewhere."""
        self.tap.active = False
        self.tap.take()
        self._partial, self._sent, self._total = {}, {}, {}
        mesh = self.mesh
        num_mb = len(microbatches)
        if sorted(self._stats) != list(range(num_mb)):
            raise AssertionError(f"router statistics of microbatches {sorted(self._stats)}, expected {num_mb}")
        # The step's one read of the device: every microbatch's statistics at once.
        stats = (torch.stack([self._stats[mb] for mb in range(num_mb)]) if num_mb
                 else torch.zeros(0, dtype=torch.float64, device=self.device))
        rows = torch.tensor(self._rows, dtype=torch.float64)
        if self.split > 1:  # each tp rank routed its slice of the sequence
            flat = stats.reshape(-1)
            dist.all_reduce(flat, group=mesh.tp_group)
            stats = flat.reshape(stats.shape)
        if mesh.layout.pp > 1:  # each stage holds its own layers: sum them; the rows once
            rows = rows if mesh.is_first_stage else torch.zeros_like(rows)
            flat = torch.cat([stats.reshape(-1), rows.to(self.device)])
            dist.all_reduce(flat, group=mesh.pp_group)
            stats, rows = flat[:stats.numel()].reshape(stats.shape), flat[stats.numel():]
        stats, rows = stats.cpu(), rows.cpu()
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
