"""The executor: runs one stage's list of plan ops over torch.distributed point-to-point.

Device-agnostic: gloo on the CPU, NCCL on GPUs, the same code on both. Each transfer op of
the plan (a lone send or receive, or a P2P op of several) is posted as one
`batch_isend_irecv` and waited for before the next op: a send ends once the peer has
received it, which is the rendezvous semantics the plan is checked under (`pipeline/check.py`),
so a plan that would hang on NCCL also hangs here. gloo itself holds a send until the
peer's receive is posted, once the send is waited for.

Every transfer goes through `batch_isend_irecv`, even one alone: NCCL runs batched
point-to-point ops on the group's communicator and single ones on a separate two-rank
communicator, and messages between two ranks stay in order only within one communicator.

No op reads a device value on the host (`tests/test_host_sync.py` checks it): the
microbatches' inputs are on the device before the first op (`StageContext.stage_inputs`), and
the facts the host needs (the largest packed position, whether the vocabulary is padded) are
computed from host data. A sync in a forward can hang a step on NCCL while a link is not yet
connected (`plan_check.validate_host_device`); `warm_up_links` connects them all at start-up.
Tensors that ride along with a policy message (`StageContext.riders`: the MoE aux-loss counts)
travel in the same `batch_isend_irecv`, on the same link, in the plan's order.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from mcore_dpo.data.pairs import Microbatch
from mcore_dpo.objective.logprobs import LogpsOptions, SequenceLogps, sequence_logps
from mcore_dpo.objective.reward import SequenceScores, row_scores, segment_scores
from mcore_dpo.pipeline.account import MemoryAccount
from mcore_dpo.parallel.context_parallel import gather_replicated, local_part
from mcore_dpo.parallel.mesh import Mesh
from mcore_dpo.model.chunks import chunk_of
from mcore_dpo.model.builder import causal_mask, packed_seq_params, segment_mask, stage_forward
from mcore_dpo.pipeline.plan import RECV_KINDS, SEND_KINDS, Op, OpKind
from mcore_dpo.parallel.platform import IntervalClock, to_device
from mcore_dpo.pipeline.schedule import forward_only_stages

# loss_fn(microbatch_index, policy_output) -> scalar loss to back-propagate (last stage only);
# policy_output: the rows' log-prob sums, or their scores with a score head (`score_pad_token_id`)
LossFn = Callable[[int, SequenceLogps | SequenceScores], torch.Tensor]


class Riders(Protocol):
    """Small tensors that travel with a policy message of the plan (its act or grad of a
    microbatch), posted in the same transfer right after it; both ends must agree which."""

    def outgoing(self, op: Op) -> torch.Tensor | None:
        """The tensor to send with this send part, or None."""

    def incoming(self, op: Op) -> torch.Tensor | None:
        """A buffer to receive into with this receive part, or None."""

    def received(self, op: Op, tensor: torch.Tensor) -> None:
        """The rider of a receive part has arrived."""


@dataclass
class StagedInputs:
    """One microbatch's inputs on the device (copied before the step's first op) and the
    host-side facts a forward needs, so that no op copies to the device or reads it."""

    tokens: torch.Tensor
    labels: torch.Tensor | None  # the last stage only, as loss_mask
    loss_mask: torch.Tensor | None
    segment_ids: torch.Tensor | None = None  # rows of segments (packed, shared-prompt)
    position_ids: torch.Tensor | None = None
    num_positions: int | None = None  # rows of segments: the largest position + 1
    shared_prompt: torch.Tensor | None = None  # shared-prompt rows: the prompt bodies
    whole_tokens: torch.Tensor | None = None  # --cp, a score head's last stage: the rows' tokens, every position
    packed_params: object | None = None  # THD layout: megatron-core's PackedSeqParams


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
    logps_options: LogpsOptions = LogpsOptions()  # LD-DPO, WPO and whole-sequence options
    # A score head (Objective.head "score"): the last stage hands over each row's score at its last
    # token that is not this pad token, instead of log-probs.
    score_pad_token_id: int | None = None
    # reference log-probs produced on the last stage, keyed by (batch offset, microbatch)
    ref_logps: dict[tuple[int, int], SequenceLogps] = field(default_factory=dict)
    # --- per-step scratch, by (model chunk, microbatch) and (model chunk, batch, microbatch) ---
    _policy_in: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    _policy_out: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    _saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = field(default_factory=dict)
    _grad_in: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    _grad_out: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    _ref_in: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)
    _ref_out: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)
    # Carrying plans: next-batch reference activations kept for the next step (by microbatch: with
    # model chunks only the last chunk keeps, `plan.kept`), and the ones the previous step kept, to
    # send first thing.
    kept_out: dict[int, torch.Tensor] = field(default_factory=dict)
    kept_in: dict[int, torch.Tensor] = field(default_factory=dict)
    _masks: dict = field(default_factory=dict)  # batch (padded) or (batch, mb) (packed) -> mask
    # Sums the time this stage is blocked in transfers (its bubble); see IntervalClock.
    wait_clock: IntervalClock | None = None
    # When a list: run_ops appends (op kind, microbatch, batch, start, end) per op, perf_counter seconds.
    trace: list[tuple[str, int, int, float, float]] | None = None
    sequence_parallel: bool = False  # stages exchange [s/tp, b, h] instead of [s, b, h]
    packed_thd: bool = False  # packed rows run in the THD layout (Transformer Engine) rather than with a mask
    memory: MemoryAccount | None = None  # exact tensor bytes by category (pipeline/account.py)
    riders: Riders | None = None  # tensors that ride with policy messages (the MoE aux counts)
    _staged: dict[tuple[int, int], StagedInputs] = field(default_factory=dict)

    def activation_shape(self, batch: int, mb: int) -> tuple[int, int, int]:
        """[seq, rows, hidden] of microbatch `mb`'s activations (a batch's last microbatch may
        hold fewer rows than the others)."""
        rows, seq_len = self.microbatches[batch][mb].tokens.shape
        seq_len //= self.mesh.layout.cp  # each cp rank holds 2 of the row's 2cp chunks
        if self.sequence_parallel:  # each tp rank holds its slice of the sequence
            seq_len //= self.mesh.layout.tp
        return (seq_len, rows, self.hidden_size)

    def held_tensors(self) -> dict[str, list]:
        """What this context holds between ops, by memory category (pipeline/account.py): the
        tensors (in dicts) that the exact memory count reads after each op."""
        return {
            "reference_in_flight": [self._ref_in, self._ref_out],
            "carried": [self.kept_in, self.kept_out],
            "log_prob_tables": [self.ref_logps],
            "comm_buffers": [self._policy_in, self._policy_out, self._grad_in, self._grad_out],
        }

    def stage_inputs(self) -> None:
        """Put every microbatch's inputs on the device (non-blocking copies from pinned memory
        on a GPU; the tensors themselves on the CPU), before the first op."""
        last = self.mesh.is_last_stage
        for batch, micros in self.microbatches.items():
            for mb, micro in enumerate(micros):
                if (batch, mb) in self._staged:
                    continue
                staged = StagedInputs(tokens=to_device(micro.tokens, self.device),
                                      labels=to_device(micro.labels, self.device) if last else None,
                                      loss_mask=to_device(micro.loss_mask, self.device) if last else None)
                if self.mesh.layout.cp > 1:
                    self._stage_context_parallel(staged, micro)
                elif micro.has_segments:
                    staged.segment_ids = to_device(micro.segment_ids, self.device)
                    staged.position_ids = to_device(micro.position_ids, self.device)
                    staged.num_positions = micro.num_positions
                    if micro.shared_prompt is not None:
                        staged.shared_prompt = to_device(micro.shared_prompt, self.device)
                    if self.packed_thd and micro.seq_lens is not None:
                        staged.packed_params = packed_seq_params(micro.seq_lens, device=self.device)
                self._staged[(batch, mb)] = staged

    def _stage_context_parallel(self, staged: StagedInputs, micro: Microbatch) -> None:
        """--cp > 1: this cp rank's positions of the tokens, with RoPE at their positions in the
        row (a packed row's per-sequence ones); the labels, the loss mask and the segments stay
        whole (the log-probs are gathered whole before the loss, the mask is the whole row's)."""
        if self.packed_thd:
            raise ValueError("context parallelism: packed rows in the THD layout (Transformer Engine) are not wired; "
                             "run with --no-packing")
        cp, cp_rank = self.mesh.layout.cp, self.mesh.cp_rank
        rows, seq_len = micro.tokens.shape
        staged.tokens = to_device(local_part(micro.tokens, dim=1, cp=cp, cp_rank=cp_rank), self.device)
        if self.score_pad_token_id is not None and self.mesh.is_last_stage:  # where the scores are read
            staged.whole_tokens = to_device(micro.tokens, self.device)
        if micro.has_segments:
            positions, staged.num_positions = micro.position_ids, micro.num_positions
            staged.segment_ids = to_device(micro.segment_ids, self.device)
            if micro.shared_prompt is not None:
                staged.shared_prompt = to_device(micro.shared_prompt, self.device)
        else:
            positions, staged.num_positions = torch.arange(seq_len).expand(rows, seq_len), seq_len
        staged.position_ids = to_device(local_part(positions, dim=1, cp=cp, cp_rank=cp_rank), self.device)

    def forward_inputs(self, batch: int, mb: int) -> dict:
        """The attention inputs of microbatch `mb` (stage_forward's keyword arguments): one
        causal mask per batch for padded rows; for rows of segments, a packed row's THD cu_seqlens
        when `packed_thd`, else their `segment_mask` and per-sequence positions."""
        staged = self._staged[(batch, mb)]
        if self.mesh.layout.cp > 1:
            return self._context_parallel_inputs(batch, mb, staged)
        if staged.position_ids is not None:
            if staged.packed_params is not None:
                return {"mask": None, "position_ids": staged.position_ids, "packed_params": staged.packed_params}
            key = (batch, mb)
            if key not in self._masks:
                self._masks[key] = segment_mask(staged.segment_ids, shared_prompt=staged.shared_prompt,
                                                num_sequences=self.microbatches[batch][mb].num_sequences)
            return {"mask": self._masks[key], "position_ids": staged.position_ids,
                    "num_positions": staged.num_positions}
        if batch not in self._masks:
            seq_len = self.microbatches[batch][0].tokens.shape[1]
            self._masks[batch] = causal_mask(seq_len, device=self.device)
        return {"mask": self._masks[batch]}

    def _context_parallel_inputs(self, batch: int, mb: int, staged: StagedInputs) -> dict:
        """--cp > 1: the whole row's mask (causal, or its `segment_mask`) at this rank's query
        positions against every key in position order, [rows, 1, W/cp, W], which
        model/cp_attention.py takes; RoPE at the tokens' positions in the row."""
        key = (batch, mb) if staged.segment_ids is not None else batch
        if key not in self._masks:
            micro = self.microbatches[batch][mb]
            seq_len = micro.tokens.shape[1]
            if staged.segment_ids is not None:
                whole = segment_mask(staged.segment_ids, shared_prompt=staged.shared_prompt,
                                     num_sequences=micro.num_sequences)
            else:
                whole = causal_mask(seq_len, device=self.device)
            self._masks[key] = local_part(whole, dim=2, cp=self.mesh.layout.cp, cp_rank=self.mesh.cp_rank)
        return {"mask": self._masks[key], "position_ids": staged.position_ids, "num_positions": staged.num_positions}


_SEND_TO_NEXT = (OpKind.SEND_ACT, OpKind.SEND_REF_ACT, OpKind.SEND_KEPT_REF_ACT)
_RECV_FROM_PREV = (OpKind.RECV_ACT, OpKind.RECV_REF_ACT)
_TRANSIT_CATEGORY = {
    OpKind.SEND_ACT: "comm_buffers", OpKind.RECV_ACT: "comm_buffers", OpKind.SEND_GRAD: "comm_buffers",
    OpKind.RECV_GRAD: "comm_buffers", OpKind.SEND_REF_ACT: "reference_in_flight",
    OpKind.RECV_REF_ACT: "reference_in_flight", OpKind.SEND_KEPT_REF_ACT: "carried",
}


class PeerError(RuntimeError):
    """A point-to-point transfer with a neighbouring stage failed; str() names the peer."""


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _outgoing(ctx: StageContext, op: Op) -> torch.Tensor:
    """The tensor a send op hands over (dropped here once sent)."""
    if op.kind is OpKind.SEND_ACT:
        tensor = ctx._policy_out.pop((op.chunk, op.microbatch))
    elif op.kind is OpKind.SEND_GRAD:
        tensor = ctx._grad_out.pop((op.chunk, op.microbatch))
    elif op.kind is OpKind.SEND_REF_ACT:
        tensor = ctx._ref_out.pop((op.chunk, op.batch, op.microbatch))
    else:
        tensor = ctx.kept_in.pop(op.microbatch)
    return tensor.detach().contiguous()


def _store(ctx: StageContext, op: Op, buf: torch.Tensor) -> None:
    """A received tensor, kept for the op of the receiving model chunk (`op.chunk`) that uses it."""
    if op.kind is OpKind.RECV_ACT:
        ctx._policy_in[(op.chunk, op.microbatch)] = buf if ctx.forward_only else buf.requires_grad_()
    elif op.kind is OpKind.RECV_GRAD:
        ctx._grad_in[(op.chunk, op.microbatch)] = buf
    else:
        ctx._ref_in[(op.chunk, op.batch, op.microbatch)] = buf


def transfer(ctx: StageContext, op: Op) -> None:
    """Run one transfer op (a send, a receive, or a P2P op of several): post its transfers
    together and wait until all have completed."""
    parts = op.parts if op.kind is OpKind.P2P else (op,)
    mesh = ctx.mesh
    p2p_ops, received, words = [], [], []
    in_transit: dict[str, list[torch.Tensor]] = {}  # sent and received tensors, by memory category
    riders = []  # (receive part, its rider's buffer)
    for part in parts:
        if part.kind in _SEND_TO_NEXT or part.kind is OpKind.SEND_GRAD:
            peer = mesh.next_rank if part.kind in _SEND_TO_NEXT else mesh.prev_rank
            tensor = _outgoing(ctx, part)
            in_transit.setdefault(_TRANSIT_CATEGORY[part.kind], []).append(tensor)
            p2p_ops.append(dist.P2POp(dist.isend, tensor, peer))
            rider = ctx.riders.outgoing(part) if ctx.riders is not None else None
            if rider is not None:
                p2p_ops.append(dist.P2POp(dist.isend, rider, peer))
            words.append(f"{part.kind.value} of microbatch {part.microbatch} to rank {peer}")
        else:
            peer = mesh.prev_rank if part.kind in _RECV_FROM_PREV else mesh.next_rank
            buf = torch.empty(ctx.activation_shape(part.batch, part.microbatch), dtype=ctx.dtype, device=ctx.device)
            p2p_ops.append(dist.P2POp(dist.irecv, buf, peer))
            received.append((part, buf))
            rider = ctx.riders.incoming(part) if ctx.riders is not None else None
            if rider is not None:
                p2p_ops.append(dist.P2POp(dist.irecv, rider, peer))
                riders.append((part, rider))
            in_transit.setdefault(_TRANSIT_CATEGORY[part.kind], []).append(buf)
            words.append(f"{part.kind.value} of microbatch {part.microbatch} from rank {peer}")
    if ctx.memory is not None:
        ctx.memory.observe(ctx, in_transit=in_transit)
    if ctx.wait_clock is not None:
        ctx.wait_clock.start()
    try:
        for work in dist.batch_isend_irecv(p2p_ops):
            work.wait()
    except RuntimeError as error:  # a dead or stuck peer: the process group's timeout ends the wait
        raise PeerError(f"pipeline stage {mesh.pp_rank}: {' + '.join(words)} failed: {_first_line(error)}") from None
    if ctx.wait_clock is not None:
        ctx.wait_clock.stop()
    for part, buf in received:
        _store(ctx, part, buf)
    for part, rider in riders:
        ctx.riders.received(part, rider)


def warm_up_links(mesh: Mesh, *, device: torch.device) -> None:
    """Connect every pipeline link, both directions, before the first step: one small message
    to and one from each neighbouring stage, all posted in one `batch_isend_irecv` on every
    rank. NCCL connects a link direction on its first message, in a host call that waits until
    the peer's host posts the partner; inside a step, that wait could meet a peer whose host
    waits for its GPU (a sync in a forward), which waits for this host (see
    `plan_check.validate_host_device`). Every rank calls it (the first `batch_isend_irecv` on a
    group must involve all its ranks); at pp 1 there are no links."""
    if mesh.layout.pp == 1:
        return
    # Without model chunks a stage's two neighbours; with them (a ring) at pp 2 one rank is both.
    ops, peers = [], list(dict.fromkeys(peer for peer in (mesh.prev_rank, mesh.next_rank) if peer is not None))
    for peer in peers:
        ops.append(dist.P2POp(dist.isend, torch.zeros(1, device=device), peer))
        ops.append(dist.P2POp(dist.irecv, torch.empty(1, device=device), peer))
    try:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    except RuntimeError as error:
        raise PeerError(f"pipeline stage {mesh.pp_rank}: connecting the links to ranks "
                        f"{' and '.join(map(str, peers))} failed: {_first_line(error)}") from None


def _tokens(ctx: StageContext, batch: int, mb: int) -> torch.Tensor:
    return ctx._staged[(batch, mb)].tokens


def _last_stage_logps(
    ctx: StageContext, output: torch.Tensor, batch: int, mb: int, *, policy: bool = True
) -> SequenceLogps | SequenceScores:
    micro, staged = ctx.microbatches[batch][mb], ctx._staged[(batch, mb)]
    if ctx.score_pad_token_id is not None:
        return _last_stage_scores(ctx, output, micro, staged)
    options = ctx.logps_options
    if not policy and options.wpo:  # WPO weights come from the policy only
        options = LogpsOptions(ld_alpha=options.ld_alpha)
    return sequence_logps(
        output,
        staged.labels,
        staged.loss_mask,
        vocab_size=ctx.vocab_size,
        tp_rank=ctx.mesh.tp_rank,
        tp_group=ctx.mesh.tp_group,
        options=options,
        segment_ids=staged.segment_ids,
        num_sequences=micro.num_sequences,
        cp_group=ctx.mesh.cp_group if ctx.mesh.layout.cp > 1 else None,
    )


def _last_stage_scores(ctx: StageContext, output: torch.Tensor, micro: Microbatch,
                       staged: StagedInputs) -> SequenceScores:
    """A score head's sequence scores from its outputs [rows, s, 1]. With --cp the outputs of this
    rank's positions are gathered whole first: every cp rank then reads the same rows, and the
    gather's backward keeps this rank's positions (parallel/context_parallel.py)."""
    tokens = staged.tokens
    if ctx.mesh.layout.cp > 1:
        output = gather_replicated(output, dim=1, group=ctx.mesh.cp_group)
        tokens = staged.whole_tokens
    if staged.segment_ids is not None:
        return segment_scores(output, tokens, segment_ids=staged.segment_ids, num_sequences=micro.num_sequences,
                              pad_token_id=ctx.score_pad_token_id, shared_prompt=staged.shared_prompt)
    return row_scores(output, tokens, loss_mask=staged.loss_mask, pad_token_id=ctx.score_pad_token_id)


def run_ops(ops: Sequence[Op], ctx: StageContext) -> None:
    """Run one stage's ops in order (the microbatches' inputs go to the device first)."""
    ctx.stage_inputs()
    for op in ops:
        kind, mb, batch = op.kind, op.microbatch, op.batch
        start = time.perf_counter() if ctx.trace is not None else 0.0
        if kind is OpKind.FWD:
            _policy_forward(ctx, mb, op.chunk)
        elif kind is OpKind.BWD:
            _policy_backward(ctx, mb, op.chunk)
        elif kind is OpKind.REF_FWD:
            _reference_forward(ctx, mb, batch, op.chunk)
        elif kind is OpKind.KEEP_REF_ACT:
            ctx.kept_out[mb] = ctx._ref_out.pop((op.chunk, batch, mb))
        elif kind is OpKind.P2P or kind in SEND_KINDS or kind in RECV_KINDS:
            transfer(ctx, op)
        else:  # pragma: no cover - the plan validator rejects unknown ops
            raise ValueError(f"unknown op {op}")
        if ctx.trace is not None:
            ctx.trace.append((kind.value, mb, batch, start, time.perf_counter()))
        if ctx.memory is not None:
            ctx.memory.observe(ctx)


def _policy_forward(ctx: StageContext, mb: int, chunk: int) -> None:
    """The policy forward of microbatch `mb` through model chunk `chunk` of this stage (--vpp; 0
    without): the tokens on the first virtual stage, the loss on the last."""
    mesh = ctx.mesh
    first, last = mesh.holds_input(chunk), mesh.holds_output(chunk)
    inp = None if first else ctx._policy_in.pop((chunk, mb))
    inputs = ctx.forward_inputs(0, mb)
    stash = contextlib.nullcontext()
    if ctx.memory is not None and not ctx.forward_only:
        stash = ctx.memory.stash(mb, chunk=chunk, shared=[inputs["mask"]] if inputs.get("mask") is not None else [])
    with torch.set_grad_enabled(not ctx.forward_only), stash:
        out = stage_forward(chunk_of(ctx.policy, chunk), tokens=_tokens(ctx, 0, mb), input_tensor=inp, **inputs)
        if last:
            out = ctx.loss_fn(mb, _last_stage_logps(ctx, out, 0, mb))
            if mesh.layout.cp > 1 and not ctx.forward_only:
                # Every cp rank back-propagates the same loss through its own tokens; DDP averages
                # the gradients over dp x cp where they add up over cp (exact for a power of 2).
                out = out * mesh.layout.cp
    if ctx.forward_only:
        if not last:
            ctx._policy_out[(chunk, mb)] = out
        return
    ctx._saved[(chunk, mb)] = (inp, out)
    if not last:
        ctx._policy_out[(chunk, mb)] = out


def _policy_backward(ctx: StageContext, mb: int, chunk: int) -> None:
    inp, out = ctx._saved.pop((chunk, mb))
    if ctx.mesh.holds_output(chunk):
        out.backward()
    else:
        torch.autograd.backward(out, grad_tensors=ctx._grad_in.pop((chunk, mb)))
    if inp is not None:
        ctx._grad_out[(chunk, mb)] = inp.grad
    if ctx.memory is not None:
        ctx.memory.free_stash(mb, chunk=chunk)


@torch.no_grad()
def _reference_forward(ctx: StageContext, mb: int, batch: int, chunk: int) -> None:
    mesh = ctx.mesh
    inp = None if mesh.holds_input(chunk) else ctx._ref_in.pop((chunk, batch, mb))
    out = stage_forward(chunk_of(ctx.reference, chunk), tokens=_tokens(ctx, batch, mb), input_tensor=inp,
                        **ctx.forward_inputs(batch, mb))
    if mesh.holds_output(chunk):
        ctx.ref_logps[(batch, mb)] = _last_stage_logps(ctx, out, batch, mb, policy=False)
    else:
        ctx._ref_out[(chunk, batch, mb)] = out


def forward_only_ops(*, mesh: Mesh, num_microbatches: int, policy: bool, reference: bool) -> tuple[Op, ...]:
    """This stage's ops of a forward-only pass (evaluation, precomputing the reference)."""
    stages = forward_only_stages(num_stages=mesh.layout.pp, num_microbatches=num_microbatches, policy=policy,
                                 reference=reference, num_chunks=mesh.layout.vpp)
    return stages[mesh.pp_rank]
