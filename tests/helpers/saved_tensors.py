"""What autograd saves for the backward of a stage's forward, storage by storage, with the module
that saved it: the measurement behind the memory model's activation counts
(tests/helpers/mla_memory.py, tests/helpers/norm_memory.py), and the two-rank launch both measure
on (`write_stage_saves`)."""

from __future__ import annotations

import json
import os
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path

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


def write_stage_saves(rank: int, ports: tuple[int, int], out_dir: str, *, cases: Callable[[], list[tuple]],
                      tokens: torch.Tensor, measure: Callable, expert_parallel: bool = False) -> None:
    """One of two gloo ranks on the CPU measuring stages. `cases()` (called first, before the
    platform adapts megatron-core) gives (name, tp, spec, dtype) per stage. For tp 1, then tp 2,
    each on a process group of its own port of `ports`: the layout (tp, pp 1, dp 2 / tp, ep tp
    when `expert_parallel`, else 1), model RNG seed 0, every case of that tp built (sequence
    parallelism at tp 2) and measured as `measure(model, tokens)`. Writes {name: measurement} to
    out_dir/rank{rank}.json, or the error to out_dir/error_rank{rank}.txt (and raises)."""
    os.environ["MCORE_DPO_FORCE_CPU"] = "1"
    try:
        stages = cases()
        from mcore_dpo.model.builder import build_stage_model
        from mcore_dpo.parallel import mesh as mesh_lib
        from mcore_dpo.parallel import platform as plat

        platform = plat.detect()
        plat.activate(platform)
        results: dict[str, dict] = {}
        for tp, port in zip((1, 2), ports):
            plat.init_process_group(platform, rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port,
                                    timeout_s=120.0)
            mesh = mesh_lib.initialize(mesh_lib.Layout(tp=tp, pp=1, dp=2 // tp, ep=tp if expert_parallel else 1))
            plat.init_model_rng(platform, 0)
            for name, case_tp, spec, dtype in stages:
                if case_tp != tp:
                    continue
                with plat.building_models(platform):
                    model = build_stage_model(spec, mesh=mesh, dtype=dtype, on_gpu=False, use_te=False,
                                              sequence_parallel=tp > 1)
                results[name] = measure(model, tokens)
            mesh_lib.destroy()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    except BaseException:
        Path(out_dir, f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise
