"""The executor: runs one stage's list of plan ops over torch.distributed point-to-point.

Device-agnostic: gloo on the CPU, NCCL on GPUs. Sends are non-blocking (a sent buffer is
released once delivered; all are waited for at the end of the step); receives block. The plan
(`schedule.py`) guarantees that this never deadlocks and that sends and receives pair
up in order between neighbouring stages.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mcore_dpo.data import Microbatch
from mcore_dpo.logprobs import LogpsOptions, SequenceLogps, sequence_logps
from mcore_dpo.mesh import Mesh
from mcore_dpo.model import causal_mask, stage_forward
from mcore_dpo.schedule import Op, OpKind

# loss_fn(microbatch_index, policy_logps) -> scalar loss to back-propagate (last stage only)
LossFn = Callable[[int, SequenceLogps], torch.Tensor]


@dataclass
class StageContext:
    """What one stage needs to run its ops for one step."""

    mesh: Mesh
    policy: torch.nn.Module | None
    reference: torch.nn.Module | None
    microbatches: dict[int, Sequence[Microbatch]]  # batch offset (0 = this step, 1 = next) -> microbatches
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    vocab_size: int
    loss_fn: LossFn | None = None
    forward_only: bool = False
    logps_options: LogpsOptions = LogpsOptions()  # LD-DPO and WPO per-token options
    # reference log-probs produced on the last stage, keyed by (batch offset, microbatch)
    ref_logps: dict[tuple[int, int], SequenceLogps] = field(default_factory=dict)
    # --- per-step scratch ---
    _policy_in: dict[int, torch.Tensor] = field(default_factory=dict)
    _policy_out: dict[int, torch.Tensor] = field(default_factory=dict)
    _saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = field(default_factory=dict)
    _grad_in: dict[int, torch.Tensor] = field(default_factory=dict)
    _grad_out: dict[int, torch.Tensor] = field(default_factory=dict)
    _ref_in: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    _ref_out: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    # Carrying plans: next-batch reference activations kept for the next step (by microbatch),
    # and the ones the previous step kept, to send first thing.
    kept_out: dict[int, torch.Tensor] = field(default_factory=dict)
    kept_in: dict[int, torch.Tensor] = field(default_factory=dict)
    _pending_sends: list[tuple[object, torch.Tensor, int]] = field(default_factory=list)
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)
    wait_s: float = 0.0  # time blocked on receives and on outstanding sends: this stage's bubble
    # When a list: run_ops appends (op kind, microbatch, batch, start, end) per op, perf_counter seconds.
    trace: list[tuple[str, int, int, float, float]] | None = None

    def activation_shape(self, batch: int) -> tuple[int, int, int]:
        mb = self.microbatches[batch][0]
        rows, seq_len = mb.tokens.shape
        return (seq_len, rows, self.hidden_size)

    def mask(self, batch: int) -> torch.Tensor:
        if batch not in self._masks:
            seq_len = self.microbatches[batch][0].tokens.shape[1]
            self._masks[batch] = causal_mask(seq_len, device=self.device)
        return self._masks[batch]


def _recv(ctx: StageContext, op: Op, *, src: int) -> torch.Tensor:
    buf = torch.empty(ctx.activation_shape(op.batch), dtype=ctx.dtype, device=ctx.device)
    start = time.perf_counter()
    try:
        dist.recv(buf, src=src)
    except RuntimeError as error:  # a dead or stuck peer: the process group's timeout ends the wait
        raise PeerError(f"pipeline stage {ctx.mesh.pp_rank}: {op.kind.value} of microbatch {op.microbatch} "
                        f"from rank {src} failed: {_first_line(error)}") from None
    ctx.wait_s += time.perf_counter() - start
    return buf


class PeerError(RuntimeError):
    """A point-to-point transfer with a neighbouring stage failed; str() names the peer."""


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _send(ctx: StageContext, tensor: torch.Tensor, *, dst: int) -> None:
    tensor = tensor.detach().contiguous()
    work = dist.isend(tensor, dst=dst)
    # Keep the buffer alive until its send completes; drop the ones already delivered.
    ctx._pending_sends = [entry for entry in ctx._pending_sends if not entry[0].is_completed()]
    ctx._pending_sends.append((work, tensor, dst))


def wait_for_sends(ctx: StageContext) -> None:
    start = time.perf_counter()
    for work, _, dst in ctx._pending_sends:
        try:
            work.wait()
        except RuntimeError as error:
            raise PeerError(f"pipeline stage {ctx.mesh.pp_rank}: send to rank {dst} failed: {_first_line(error)}") from None
    ctx._pending_sends.clear()
    ctx.wait_s += time.perf_counter() - start


def _tokens(ctx: StageContext, batch: int, mb: int) -> torch.Tensor:
    return ctx.microbatches[batch][mb].tokens.to(ctx.device, non_blocking=True)


def _last_stage_logps(
    ctx: StageContext, output: torch.Tensor, batch: int, mb: int, *, policy: bool = True
) -> SequenceLogps:
    micro = ctx.microbatches[batch][mb]
    options = ctx.logps_options
    if not policy and options.wpo:  # WPO weights come from the policy only
        options = LogpsOptions(ld_alpha=options.ld_alpha)
    return sequence_logps(
        output,
        micro.labels.to(ctx.device),
        micro.loss_mask.to(ctx.device),
        vocab_size=ctx.vocab_size,
        tp_rank=ctx.mesh.tp_rank,
        tp_group=ctx.mesh.tp_group,
        options=options,
    )


def run_ops(ops: Sequence[Op], ctx: StageContext) -> None:
    """Run one stage's ops in order."""
    mesh = ctx.mesh
    for op in ops:
        kind, mb, batch = op.kind, op.microbatch, op.batch
        start = time.perf_counter() if ctx.trace is not None else 0.0
        if kind is OpKind.RECV_ACT:
            buf = _recv(ctx, op, src=mesh.prev_rank)
            ctx._policy_in[mb] = buf if ctx.forward_only else buf.requires_grad_()
        elif kind is OpKind.FWD:
            _policy_forward(ctx, mb)
        elif kind is OpKind.SEND_ACT:
            _send(ctx, ctx._policy_out.pop(mb), dst=mesh.next_rank)
        elif kind is OpKind.RECV_GRAD:
            ctx._grad_in[mb] = _recv(ctx, op, src=mesh.next_rank)
        elif kind is OpKind.BWD:
            _policy_backward(ctx, mb)
        elif kind is OpKind.SEND_GRAD:
            _send(ctx, ctx._grad_out.pop(mb), dst=mesh.prev_rank)
        elif kind is OpKind.RECV_REF_ACT:
            ctx._ref_in[(batch, mb)] = _recv(ctx, op, src=mesh.prev_rank)
        elif kind is OpKind.REF_FWD:
            _reference_forward(ctx, mb, batch)
        elif kind is OpKind.SEND_REF_ACT:
            # The reference activation is dropped as soon as it is handed to the send.
            _send(ctx, ctx._ref_out.pop((batch, mb)), dst=mesh.next_rank)
        elif kind is OpKind.KEEP_REF_ACT:
            ctx.kept_out[mb] = ctx._ref_out.pop((batch, mb))
        elif kind is OpKind.SEND_KEPT_REF_ACT:
            _send(ctx, ctx.kept_in.pop(mb), dst=mesh.next_rank)
        else:  # pragma: no cover - the plan validator rejects unknown ops
            raise ValueError(f"unknown op {op}")
        if ctx.trace is not None:
            ctx.trace.append((kind.value, mb, batch, start, time.perf_counter()))


def _policy_forward(ctx: StageContext, mb: int) -> None:
    mesh = ctx.mesh
    inp = None if mesh.is_first_stage else ctx._policy_in.pop(mb)
    with torch.set_grad_enabled(not ctx.forward_only):
        out = stage_forward(ctx.policy, tokens=_tokens(ctx, 0, mb), input_tensor=inp, mask=ctx.mask(0))
        if mesh.is_last_stage:
            out = ctx.loss_fn(mb, _last_stage_logps(ctx, out, 0, mb))
    if ctx.forward_only:
        if not mesh.is_last_stage:
            ctx._policy_out[mb] = out
        return
    ctx._saved[mb] = (inp, out)
    if not mesh.is_last_stage:
        ctx._policy_out[mb] = out


def _policy_backward(ctx: StageContext, mb: int) -> None:
    inp, out = ctx._saved.pop(mb)
    if ctx.mesh.is_last_stage:
        out.backward()
    else:
        torch.autograd.backward(out, grad_tensors=ctx._grad_in.pop(mb))
    if inp is not None:
        ctx._grad_out[mb] = inp.grad


@torch.no_grad()
def _reference_forward(ctx: StageContext, mb: int, batch: int) -> None:
    mesh = ctx.mesh
    inp = None if mesh.is_first_stage else ctx._ref_in.pop((batch, mb))
    out = stage_forward(ctx.reference, tokens=_tokens(ctx, batch, mb), input_tensor=inp, mask=ctx.mask(batch))
    if mesh.is_last_stage:
        ctx.ref_logps[(batch, mb)] = _last_stage_logps(ctx, out, batch, mb, policy=False)
    else:
        ctx._ref_out[(batch, mb)] = out


def forward_only_ops(*, mesh: Mesh, num_microbatches: int, policy: bool, reference: bool) -> list[Op]:
    """Ops of a forward-only pass (evaluation, precomputing the reference): a plain chain per
    microbatch, reference first. Sends never block, so the chain cannot deadlock."""
    ops: list[Op] = []
    for mb in range(num_microbatches):
        for enabled, recv, fwd, send in (
            (reference, OpKind.RECV_REF_ACT, OpKind.REF_FWD, OpKind.SEND_REF_ACT),
            (policy, OpKind.RECV_ACT, OpKind.FWD, OpKind.SEND_ACT),
        ):
            if not enabled:
                continue
            if not mesh.is_first_stage:
                ops.append(Op(recv, mb))
            ops.append(Op(fwd, mb))
            if not mesh.is_last_stage:
                ops.append(Op(send, mb))
    return ops
