"""A guard that makes every host read of a tensor fail inside a stage's forward and backward ops.

On a GPU, `.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `bool(t)`, `int(t)`, `float(t)`,
`.to("cpu")` and `torch.tensor(..., device=...)` block the host until the GPU gets there; on
NCCL, before the links are connected, that can hang a step (`plan_check.validate_host_device`).
On the CPU every tensor is a host tensor, so the guard does not look at devices: inside the
executor's compute ops (`pipeline._policy_forward`, `_policy_backward`, `_reference_forward`,
which on the last stage include the per-microbatch loss), it refuses those calls on any tensor.
Host-side bookkeeping belongs before the ops (`StageContext.stage_inputs`, `MoeStep.begin`) or
after them (the metrics at the step's end, read once per step). Point-to-point calls other than
the plan's own transfers are refused anywhere in the job: every batch_isend_irecv comes from
the executor's `transfer` (holding exactly its plan op's parts and their riders) or the
start-up `warm_up_links`, and no lone send or receive is posted. A message outside the plan is
one the plan validator never sees.

Sites inside megatron-core that read the device by design are listed in `ALLOWED` with the
reason; the guard records each hit of them instead of failing, and the test checks which paths
hit them.

Used by the rank processes of tests/test_host_sync.py: `install(job, rank, out_dir)`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

# (path suffix of the file, function) -> why megatron-core reads there. On a GPU the first two
# do nothing (their tensors are on the device already: `model.place_on_device`; on the CPU they
# "move" a CPU tensor to the CPU). The other two are the dropless MoE layer's design: it splits
# the tokens by each expert's count, on the host (the all-to-all dispatcher copies the counts
# off the device once per layer, then these read the host copy) -- syncs the warm-up keeps from
# hanging a step (`plan_check.validate_host_device`).
ALLOWED = {
    ("megatron/core/models/common/embeddings/rotary_pos_embedding.py", "get_emb"): "RoPE frequencies to the device",
    ("megatron/core/transformer/moe/router.py", "gating"): "router weight to the device",
    ("megatron/core/transformer/moe/moe_utils.py", "sort_chunks_by_idxs"): "MoE token counts per expert",
    ("megatron/core/transformer/moe/experts.py", "forward"): "MoE token counts per expert",
}

_TENSOR_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
_P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv")


class HostReadError(AssertionError):
    pass


class Guard:
    def __init__(self):
        self.depth = 0
        self.op = ""
        self.allowed_hits: dict[str, int] = {}
        self.transfers = 0  # the executor's transfer ops run
        self.riders = 0  # tensors that rode on them (the MoE aux counts)
        self.channel: str | None = None  # inside pipeline.transfer or warm_up_links
        self.expected: int | None = None  # messages the transfer's batch must hold
        self.in_batch = False
        self.first_transfers: list[list[tuple[str, int]]] = []
        self.collect = False  # record the reads instead of raising at the first (to list them all)
        self.reads: dict[str, int] = {}

    @contextlib.contextmanager
    def compute(self, op: str):
        self.depth += 1
        self.op = op
        try:
            yield
        finally:
            self.depth -= 1

    def check(self, what: str) -> None:
        if not self.depth:
            return
        site = _caller()
        for (suffix, function), _why in ALLOWED.items():
            if site[0].endswith(suffix) and site[2] == function:
                key = f"{suffix}:{function}:{what}"
                self.allowed_hits[key] = self.allowed_hits.get(key, 0) + 1
                return
        message = f"host read in {self.op}: {what} at {site[0]}:{site[1]} ({site[2]})"
        if not self.collect:
            raise HostReadError(message)
        self.reads[message] = self.reads.get(message, 0) + 1


_GUARD: Guard | None = None


_WRAPPERS = {"read", "guarded_to", "build", "p2p", "check", "_caller"}


def _caller() -> tuple[str, int, str]:
    """The innermost frame outside the guard's wrappers and torch's own Python code."""
    for frame in reversed(traceback.extract_stack()):
        name = frame.filename.replace(os.sep, "/")
        if (name.endswith("host_sync_guard.py") and frame.name in _WRAPPERS) or "/site-packages/torch/" in name:
            continue
        return name, frame.lineno, frame.name
    return "?", 0, "?"


def _is_host_device(value) -> bool:
    if isinstance(value, str):
        return value.split(":")[0] == "cpu"
    return isinstance(value, torch.device) and value.type == "cpu"


def _patch_tensor_methods(guard: Guard) -> None:
    for name in _TENSOR_READS:
        original = getattr(torch.Tensor, name)

        def read(self, *args, _original=original, _name=name, **kwargs):
            guard.check(f"Tensor.{_name}")
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, read)
    to = torch.Tensor.to

    def guarded_to(self, *args, **kwargs):
        if any(_is_host_device(a) for a in (*args, kwargs.get("device"))):
            guard.check("Tensor.to(cpu)")
        return to(self, *args, **kwargs)

    torch.Tensor.to = guarded_to
    for factory in ("tensor", "as_tensor"):
        original = getattr(torch, factory)

        def build(*args, _original=original, _name=factory, **kwargs):
            if kwargs.get("device") is not None:
                guard.check(f"torch.{_name}(..., device=...)")
            return _original(*args, **kwargs)

        setattr(torch, factory, build)


def _patch_p2p(guard: Guard) -> None:
    """Point-to-point messages only in the executor's transfers (one batch_isend_irecv per plan
    transfer op, holding its parts and their riders) and in the start-up warm-up."""
    from mcore_dpo.pipeline import executor as pipeline
    from mcore_dpo.rank import base as rank
    from mcore_dpo.pipeline.plan import OpKind

    policy_kinds = (OpKind.SEND_ACT, OpKind.RECV_ACT, OpKind.SEND_GRAD, OpKind.RECV_GRAD)
    transfer, warm_up = pipeline.transfer, pipeline.warm_up_links

    def guarded_transfer(ctx, op):
        parts = op.parts if op.kind is OpKind.P2P else (op,)
        riders = sum(part.kind in policy_kinds for part in parts) if ctx.riders is not None else 0
        guard.channel, guard.expected = "transfer", len(parts) + riders
        guard.transfers += 1
        guard.riders += riders
        try:
            return transfer(ctx, op)
        finally:
            guard.channel = None

    def guarded_warm_up(mesh, **kwargs):
        guard.channel, guard.expected = "warm_up", None
        try:
            return warm_up(mesh, **kwargs)
        finally:
            guard.channel = None

    pipeline.transfer, pipeline.warm_up_links = guarded_transfer, guarded_warm_up
    rank.warm_up_links = guarded_warm_up  # imported by name there
    for name in _P2P:
        original = getattr(dist, name)

        def p2p(*args, _original=original, _name=name, **kwargs):
            batch = _name == "batch_isend_irecv"
            if guard.depth or (guard.channel is None if batch else not guard.in_batch):
                where = f"in {guard.op}" if guard.depth else "outside"
                message = (f"point-to-point dist.{_name} {where}, not a transfer of the plan "
                           f"(at {':'.join(map(str, _caller()[:2]))})")
                if not guard.collect:
                    raise HostReadError(message)
                guard.reads[message] = guard.reads.get(message, 0) + 1
            if not batch:
                return _original(*args, **kwargs)
            ops = args[0] if args else kwargs["p2p_op_list"]
            if guard.expected is not None and len(ops) != guard.expected:
                raise HostReadError(f"a transfer posted {len(ops)} messages, its plan op and riders {guard.expected}")
            if not guard.first_transfers:
                guard.first_transfers.append([(op.op.__name__, op.peer) for op in ops])
            guard.in_batch = True
            try:
                return _original(*args, **kwargs)
            finally:
                guard.in_batch = False

        p2p.__name__ = name  # what a recorded P2POp names
        setattr(dist, name, p2p)
        # P2POp accepts only the isend/irecv that distributed_c10d names: the same wrappers there.
        setattr(dist.distributed_c10d, name, p2p)


def _wrap_compute_ops(guard: Guard, *, inject_item: bool) -> None:
    from mcore_dpo.model import builder as model
    from mcore_dpo.pipeline import executor as pipeline

    for name in ("_policy_forward", "_policy_backward", "_reference_forward"):
        original = getattr(pipeline, name)

        def op(*args, _original=original, _name=name, **kwargs):
            with guard.compute(_name.lstrip("_")):
                return _original(*args, **kwargs)

        setattr(pipeline, name, op)
    if inject_item:  # what the guard must catch: a host read put into a forward
        forward = model.stage_forward

        def stage_forward(*args, **kwargs):
            out = forward(*args, **kwargs)
            out.float().sum().item()
            return out

        pipeline.stage_forward = stage_forward


def install(job: dict, rank: int, out_dir: str) -> None:
    """Called by tests/helpers/ranks.py's rank process before each job (`job["setup"]`)."""
    global _GUARD
    if _GUARD is None:
        _GUARD = Guard()
        _patch_tensor_methods(_GUARD)
        _patch_p2p(_GUARD)
        _wrap_compute_ops(_GUARD, inject_item=bool(job.get("inject_item")))
    _GUARD.allowed_hits, _GUARD.transfers, _GUARD.riders, _GUARD.first_transfers = {}, 0, 0, []
    _GUARD.collect, _GUARD.reads = bool(job.get("collect_reads")), {}


def report(job_index: int, rank: int, out_dir: str) -> None:
    """Called after each job: what the guard saw, per rank."""
    assert _GUARD is not None
    Path(out_dir, f"job{job_index}_guard_rank{rank}.json").write_text(json.dumps({
        "allowed_hits": _GUARD.allowed_hits, "transfers": _GUARD.transfers, "riders": _GUARD.riders,
        "first_transfers": _GUARD.first_transfers, "reads": _GUARD.reads}))


if __name__ == "__main__":  # pragma: no cover
    sys.exit("imported by tests/helpers/ranks.py's rank processes")
