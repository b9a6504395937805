"""Exact tensor memory of a training rank, by category: what each byte is for.

Counted in bytes of live tensor storages (each storage once, however many views share it),
not RSS: RSS adds the interpreter, allocator slack and pages the allocator keeps, and moves
by tens of MiB between identical runs. Categories (`CATEGORIES`):

- held for the whole run, counted from the tensors themselves: `policy_params`, `grads`
  (megatron-core's fp32 main-grad buffers and any .grad), `optimizer_state` (fp32 masters
  that are copies, and the AdamW moments), `reference_params`;
- activations, counted where the executor (`pipeline/executor.py`) creates and frees them:
  `policy_stash` (tensors autograd saves in a policy forward for its backward, minus
  parameters: recorded by a saved-tensors hook, freed at the microbatch's backward),
  `reference_in_flight` (reference stage activations received and not yet consumed, or
  produced and not yet sent), `carried` (reference activations kept for the next step),
  `log_prob_tables` (reference log-probs waiting for their loss, and precomputed tables),
  `comm_buffers` (policy activations and activation grads between their transfer and
  their use).

The executor calls `observe` after each op and inside each transfer (when the sent and the
received tensors are alive together); the peaks are over those points, per step. Temporary
tensors inside one forward or backward are not in any category: on a GPU the CUDA
allocator's own peaks (`device_figures`) cover them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

STATIC_CATEGORIES = ("policy_params", "grads", "optimizer_state", "reference_params")
ACTIVATION_CATEGORIES = ("policy_stash", "reference_in_flight", "carried")
DYNAMIC_CATEGORIES = ACTIVATION_CATEGORIES + ("log_prob_tables", "comm_buffers")
CATEGORIES = STATIC_CATEGORIES + DYNAMIC_CATEGORIES


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a tensor, a tuple/list/dict of them, or a dataclass of them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            yield from _tensors(getattr(value, name))


def storage_bytes(values: Iterable[Any], *, seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind `values` (tensors or containers of them);
    storages already in `seen` are skipped, and the counted ones are added to it."""
    seen = set() if seen is None else seen
    total = 0
    for value in values:
        for tensor in _tensors(value):
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
    return total


def static_bytes(
    *, policy: torch.nn.Module, reference: torch.nn.Module | None, optimizer_state_bytes: int
) -> dict[str, int]:
    """The run-long categories of one rank. `policy` is the module whose parameters carry
    `main_grad` (megatron-core DDP's buffers)."""
    params = list(policy.parameters())
    grads = [g for p in params for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
    return {
        "policy_params": storage_bytes(params + list(policy.buffers())),
        "grads": storage_bytes(grads),
        "optimizer_state": int(optimizer_state_bytes),
        "reference_params": (storage_bytes(list(reference.parameters()) + list(reference.buffers()))
                             if reference is not None else 0),
    }


class MemoryAccount:
    """Current and peak bytes per category of one rank, over one step (`start_step`)."""

    def __init__(self, *, tables: Callable[[], Iterable[Any]] = tuple):
        self._exclude: set[int] = set()
        self._cached: set[int] = set()  # outputs of memoised modules (`exclude_cached_outputs`)
        self._stashing = False
        self._tables = tables  # log-prob tables held outside the step (precomputed)
        self._stash: dict[tuple[int, int], dict[int, int]] = {}  # live (chunk, microbatch) -> {storage: bytes}
        self.stash_bytes_per_microbatch: dict[int, int] = {}  # this step's, by microbatch
        self.static: dict[str, int] = dict.fromkeys(STATIC_CATEGORIES, 0)
        self.current: dict[str, int] = dict.fromkeys(DYNAMIC_CATEGORIES, 0)
        self.peak: dict[str, int] = dict.fromkeys(DYNAMIC_CATEGORIES, 0)
        self.peak_dynamic_total = 0  # the peak of the sum, not the sum of the peaks

    def start_step(self, *, exclude: Iterable[torch.Tensor] = ()) -> None:
        """`exclude`: tensors never counted as activations (the parameters a forward saves for
        its backward)."""
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._cached = set()
        self.stash_bytes_per_microbatch = {}
        self.peak = dict.fromkeys(DYNAMIC_CATEGORIES, 0)
        self.peak_dynamic_total = 0

    def exclude_cached_outputs(self, module: torch.nn.Module) -> None:
        """Count none of `module`'s outputs as activations while its forward is memoised (a
        functools cache, as megatron-core's rotary embedding table is): the cache, not a
        microbatch, holds them, from one step to the next. Full recompute (--recompute full)
        saves that table with each layer group's input; counted, it would land in whichever
        microbatch saved it first while no other held it. A memoised forward replaced on the
        instance (a packed row's per-token RoPE, `model.builder`) is a microbatch's own and
        is counted."""

        def note(mod: torch.nn.Module, _args, output) -> None:
            if self._stashing and "forward" not in vars(mod) and hasattr(type(mod).forward, "cache_info"):
                self._cached.update(t.untyped_storage().data_ptr() for t in _tensors(output))

        module.register_forward_hook(note)

    # ---------------------------------------------------------------- policy stash
    @contextlib.contextmanager
    def stash(self, microbatch: int, *, chunk: int = 0, shared: Iterable[torch.Tensor] = ()) -> Iterator[None]:
        """Record what autograd saves for the backward in the policy forward run inside (of model
        chunk `chunk`, --vpp: a microbatch's figure sums its chunks').
        `shared`: tensors every microbatch's forward saves (the attention mask), in no category."""
        mine: dict[int, int] = {}
        held = {key for saved in self._stash.values() for key in saved}
        held |= {t.untyped_storage().data_ptr() for t in shared}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in self._exclude and key not in held and key not in self._cached and storage.nbytes() > 0:
                mine[key] = storage.nbytes()
            return tensor

        self._stashing = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                yield
        finally:
            self._stashing = False
        self._stash[(chunk, microbatch)] = mine
        self.stash_bytes_per_microbatch[microbatch] = self.stash_bytes_per_microbatch.get(microbatch, 0) + sum(mine.values())

    def free_stash(self, microbatch: int, *, chunk: int = 0) -> None:
        """The microbatch's backward (of model chunk `chunk`) has run: autograd has released what it saved."""
        self._stash.pop((chunk, microbatch), None)

    # ---------------------------------------------------------------- observation
    def observe(self, ctx: Any, *, in_transit: dict[str, list[torch.Tensor]] | None = None) -> None:
        """Count the executor's live tensors (`pipeline.StageContext.held_tensors`), plus tensors
        that are between a transfer's post and its end (`in_transit`, by category)."""
        in_transit = in_transit or {}
        stash = {key: size for saved in self._stash.values() for key, size in saved.items()}
        seen = set(stash) | self._exclude
        held = ctx.held_tensors()
        held["log_prob_tables"] = [*held["log_prob_tables"], *self._tables()]
        now = {"policy_stash": sum(stash.values())}
        for name in ("reference_in_flight", "carried", "log_prob_tables", "comm_buffers"):  # in this order: `seen`
            now[name] = storage_bytes([*held[name], in_transit.get(name)], seen=seen)
        self.current = now
        for name, value in now.items():
            self.peak[name] = max(self.peak[name], value)
        self.peak_dynamic_total = max(self.peak_dynamic_total, sum(now.values()))

    def report(self) -> dict[str, int]:
        """{category}_peak_bytes for every category (run-long ones: their size), and
        total_peak_bytes = run-long categories + the peak of the activation-side sum."""
        out = {f"{name}_peak_bytes": value for name, value in self.static.items()}
        out.update({f"{name}_peak_bytes": value for name, value in self.peak.items()})
        out["total_peak_bytes"] = sum(self.static.values()) + self.peak_dynamic_total
        return out


def device_figures(device: torch.device) -> dict[str, int]:
    """What the device's allocator says (GPU only): the peak of all allocated tensor bytes,
    temporaries included, and of the bytes it reserved from the driver, since the process
    started or `reset_device_peaks`."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)  # GPU only
    return {"cuda_allocated_peak_bytes": int(stats.get("allocated_bytes.all.peak", 0)),
            "cuda_reserved_peak_bytes": int(stats.get("reserved_bytes.all.peak", 0))}


def reset_device_peaks(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # GPU only
