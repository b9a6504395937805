"""What autograd saves for the backward of a stage's forward, storage by storage, with the module
that saved it: the measurement behind the memory model's activation counts
(tests/helpers/mla_memory.py, tests/helpers/norm_memory.py)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch


def saved_storages(model, tokens: torch.Tensor, *, layer_of: Callable[[str], str | None]
                   ) -> list[tuple[str, str, torch.UntypedStorage]]:
    """Run the stage's forward on `tokens` (causal mask) under autograd's saved-tensor hooks.
    Returns the storages still held once the forward is done (a node whose outputs die in the
    forward frees what it saved), each once per layer, parameters and buffers left out, as
    (layer, innermost module that saved it, storage). `layer_of(module name)` names the layer a
    module belongs to, or None outside every layer. Forward hooks the caller registered on the
    model's modules run in the same forward."""
    from mcore_dpo.model.builder import causal_mask, stage_forward

    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    stack: list[str] = []
    records: list[tuple[str, str, weakref.ref]] = []
    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda *_, name=name: stack.append(name)))
        handles.append(module.register_forward_hook(lambda *_: (stack.pop(), None)[1]))

    def pack(t: torch.Tensor) -> torch.Tensor:
        layer = next((layer_of(n) for n in reversed(stack) if layer_of(n) is not None), None)
        if layer is not None and t.untyped_storage().data_ptr() not in skip:
            records.append((layer, stack[-1], weakref.ref(t.untyped_storage())))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = stage_forward(model, tokens=tokens, input_tensor=None,
                               mask=causal_mask(tokens.shape[1], device=torch.device("cpu")))
    for handle in handles:
        handle.remove()
    held: list[tuple[str, str, torch.UntypedStorage]] = []
    seen: set[tuple[str, int]] = set()
    for layer, inner, ref in records:  # resolved while the output keeps the graph alive
        storage = ref()
        if storage is None or (layer, storage.data_ptr()) in seen:
            continue
        seen.add((layer, storage.data_ptr()))
        held.append((layer, inner, storage))
    del output
    return held
