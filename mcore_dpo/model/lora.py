"""LoRA adapters on megatron-core's tensor-parallel linears, and the reference they give for free.

Each targeted linear (linear_qkv, linear_proj, linear_fc1, linear_fc2, each expert's
linear_fc1/linear_fc2 on MoE layers; for `qkv` on multi-latent attention its four (three) q/kv
projections, each adapted on its own) gets an `Adapter`
submodule and a forward hook that adds the low-rank update to the linear's output. A fused
linear holds one A/B pair per Hugging Face projection (q, k, v; gate, up), so the adapters are
exactly PEFT's (`checkpoint_convert.peft_adapter` has the key map and the splits):

    column-parallel (qkv, fc1): A [r, in] whole, B [out/tp, r]; the input x is whole on every
        tp rank, so h = A·x is too; its gradient is summed over tp (each rank's B sees only its
        output rows), which `copy_to_tensor_model_parallel_region` does in the backward.
        q/k/v updates are interleaved per query group as the fused weight is.
    row-parallel (proj, fc2): A [r, in/tp], B [out, r] whole; h = Σ_tp A_t·x_t is all-reduced
        (`reduce_from_tensor_model_parallel_region`), and B·h is the same on every tp rank.
    replicated (MLA's down projections): A and B whole, as the weight; LoRA runs them at tp 1
        only (they are on MoE models, which LoRA trains at tp 1).

A reward model's score head (`model/score_head.py`) is trained whole beside the adapters, as
PEFT's LoraConfig(task_type="SEQ_CLS") puts `score` in its modules_to_save
(`peft_adapter.saved_modules`): `attach` leaves it trainable, and it is part of the adapters'
state (`trained_parameters`: checkpoints, the optimizer, OUTPUT/adapter under PEFT's saved name
`base_model.model.score.weight`). It is whole and identical on every tp rank of the last stage,
its gradient too.

The reference: the same stage module with every adapter switched off (a fresh adapter: the base
model) or switched to its frozen starting copy (--init-adapter), dropout off. `ReferenceView`
is what the pipeline calls as "the reference model"; no second copy of the base weights exists.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from checkpoint_convert.families.base import ModelSpec
from checkpoint_convert.peft_adapter import (ADAPTER_MODULE, EXPERT_TARGET_MAP, EXPERT_TARGETS, TARGETS, LoraShape,
                                             part_features, saved_modules, target_layout, target_linears, target_names,
                                             targets_present)
from mcore_dpo.model.chunks import chunk_modules, rank_shard

# Adapter modes: "train" (trained weights, dropout when training), "eval" (trained weights, no
# dropout), "off" (no update), "frozen" (the starting copy, no dropout).
MODES = ("train", "eval", "off", "frozen")


class Adapter(torch.nn.Module):
    """The A/B pairs of one megatron-core linear, this tp rank's pieces. `layout`: (column|row|
    replicated, parts) of the linear, when the target has several (`target_linears`)."""

    def __init__(self, *, spec: ModelSpec, target: str, lora: LoraShape, dropout: float, tp: int, tp_group,
                 dtype: torch.dtype, device: torch.device, layout: tuple[str, tuple[str, ...]] | None = None):
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.target = target
        self.parallel, self.parts = layout or target_layout(target)
        self.spec = spec
        self.scaling = lora.scaling
        self.tp, self.tp_group = tp, tp_group
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.mode = "train"
        self.frozen: dict[str, torch.Tensor] | None = None  # name -> the starting copy
        for part in self.parts:
            fan_in, fan_out = part_features(spec, target, part)
            column, row = self.parallel == "column", self.parallel == "row"
            a = torch.nn.Parameter(torch.zeros(lora.rank, fan_in // tp if row else fan_in, dtype=dtype, device=device))
            b = torch.nn.Parameter(torch.zeros(fan_out // tp if column else fan_out, lora.rank, dtype=dtype, device=device))
            # The split one is tensor-parallel (counted on every tp rank in the gradient norm).
            if column or row:
                set_tensor_model_parallel_attributes(b if column else a, True, 0 if column else 1, 1)
            self.register_parameter(f"lora_A_{part}", a)
            self.register_parameter(f"lora_B_{part}", b)

    def weights(self, *, frozen: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if frozen:
            return {p: (self.frozen[f"lora_A_{p}"], self.frozen[f"lora_B_{p}"]) for p in self.parts}
        return {p: (getattr(self, f"lora_A_{p}"), getattr(self, f"lora_B_{p}")) for p in self.parts}

    def keep_frozen_copy(self) -> None:
        self.frozen = {n: p.detach().clone() for n, p in self.named_parameters()}

    def delta(self, x: torch.Tensor) -> torch.Tensor | None:
        """The update to add to the linear's output for input x ([s, b, in] or its tp piece)."""
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            reduce_from_tensor_model_parallel_region)

        if self.mode == "off":
            return None
        frozen = self.mode == "frozen"
        pairs = self.weights(frozen=frozen)
        x = self.dropout(x) if self.mode == "train" else x
        a_all = torch.cat([a for a, _ in pairs.values()], dim=0)  # one matmul for every part's A
        h = torch.matmul(x, a_all.t())
        if self.tp > 1 and self.parallel == "column":
            h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        elif self.tp > 1 and self.parallel == "row":
            h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        rank = a_all.shape[0] // len(pairs)
        outs = [torch.matmul(h[..., i * rank:(i + 1) * rank], b.t()) for i, (_, b) in enumerate(pairs.values())]
        return self._assemble(outs).mul(self.scaling)

    def merged_delta(self) -> torch.Tensor:
        """scaling * B·A laid out as this rank's piece of the linear's weight [out_local, in_local]."""
        outs = [torch.matmul(b.float(), a.float()).t() for a, b in self.weights().values()]  # [in, out_p]
        return self._assemble(outs).t().mul(self.scaling)

    def _assemble(self, outs: list[torch.Tensor]) -> torch.Tensor:
        """Per-part outputs (last dim) -> the fused linear's output layout on this tp rank."""
        if self.parts == ("q", "k", "v"):
            groups = self.spec.num_query_groups // self.tp
            lead = outs[0].shape[:-1]
            q, k, v = (o.reshape(*lead, groups, o.shape[-1] // groups) for o in outs)
            return torch.cat([q, k, v], dim=-1).reshape(*lead, -1)
        return torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]


def _hook(linear, args, kwargs, output):
    adapter = getattr(linear, ADAPTER_MODULE)
    x = args[0] if args else kwargs["input_"]
    delta = adapter.delta(x)
    if delta is None:
        return output
    out, bias = output
    return out + delta.to(out.dtype), bias


def attach(model: torch.nn.Module, *, spec: ModelSpec, lora: LoraShape, dropout: float, tp: int, tp_group
           ) -> list[Adapter]:
    """Freeze every base parameter of this stage model but the modules trained whole
    (`saved_modules`: a reward model's score head, where this stage has it) and give each
    targeted linear of each of its layers an adapter (zeros until `load_shard`): fc1/fc2 on dense
    MLP layers, expert_fc1/fc2 on each local expert of the MoE layers, each q/kv projection of
    multi-latent attention. Returns the adapters, layer by layer."""
    for param in model.parameters():
        param.requires_grad_(False)
    for name in saved_modules(spec):
        for chunk in chunk_modules(model):  # --vpp: on the chunk that has it
            module = getattr(chunk, name, None)
            if module is not None:
                module.requires_grad_(True)
    adapters = []
    for layer in (layer for chunk in chunk_modules(model) for layer in chunk.decoder.layers):  # --vpp: every chunk's
        linears = []
        for target in (t for t in TARGETS if t in lora.targets):
            for path, parallel, parts in target_linears(spec, target):
                if target not in ("fc1", "fc2") or hasattr(layer.mlp, path.split(".")[1]):
                    linears.append((target, (parallel, tuple(p for p, _ in parts)), layer.get_submodule(path)))
        experts_module = getattr(layer.mlp, "experts", None)
        if experts_module is not None and not hasattr(experts_module, "local_experts"):
            # Grouped GEMM experts have no per-expert linear to hook (workers build LoRA runs with
            # the local layer spec, whose experts are sequential, so this is never reached there).
            raise ValueError(f"LoRA: layer {layer.layer_number}'s experts are {type(experts_module).__name__} "
                             "(grouped GEMM), which has no per-expert linears to adapt; build it with sequential experts")
        experts = getattr(experts_module, "local_experts", ())
        for expert in experts:
            linears += [(t, target_layout(t), getattr(expert, EXPERT_TARGET_MAP[t][0])) for t in EXPERT_TARGETS
                        if t in lora.targets]
        for target, layout, linear in linears:
            ref = linear.weight
            adapter = Adapter(spec=spec, target=target, lora=lora, dropout=dropout, tp=tp, tp_group=tp_group,
                              dtype=ref.dtype, device=ref.device, layout=layout)
            # An expert's adapters are expert parameters too: with ep > 1 megatron-core's DDP reduces
            # them over the expert-data-parallel group (allreduce=False), as the expert weights.
            for param in adapter.parameters():
                param.allreduce = getattr(ref, "allreduce", True)
            linear.add_module(ADAPTER_MODULE, adapter)
            linear.register_forward_hook(_hook, with_kwargs=True)
            adapters.append(adapter)
    return adapters


def adapters_of(model: torch.nn.Module) -> list[Adapter]:
    return [m for m in model.modules() if isinstance(m, Adapter)]


def adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The adapter parameters of a stage model by name."""
    return {n: p for n, p in model.named_parameters() if f".{ADAPTER_MODULE}.lora_" in n}


def trained_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters a LoRA run trains on this stage, by name: the adapters and the modules
    `attach` left trainable (a reward model's score head), the state its checkpoints keep."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def load_shard(model: torch.nn.Module, shard: dict[str, torch.Tensor], *, saved: bool = False) -> None:
    """Copy an adapter shard (megatron names) in; key sets and shapes must match. `saved`: the
    shard holds the modules trained whole as well (a checkpoint's; a fresh or --init-adapter
    adapter has the adapters only, the head coming with the model's weights)."""
    params = trained_parameters(model) if saved else adapter_parameters(model)
    if set(params) != set(shard):
        missing, extra = sorted(set(params) - set(shard)), sorted(set(shard) - set(params))
        raise ValueError(f"adapter shard does not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        for name, param in params.items():
            if tuple(shard[name].shape) != tuple(param.shape):
                raise ValueError(f"adapter tensor {name}: shape {tuple(shard[name].shape)}, expected {tuple(param.shape)}")
            param.copy_(shard[name].to(param.dtype))


@contextlib.contextmanager
def mode(model: torch.nn.Module, value: str) -> Iterator[None]:
    """Every adapter of `model` in mode `value` for the duration."""
    assert value in MODES, value
    adapters = adapters_of(model)
    before = [a.mode for a in adapters]
    for a in adapters:
        a.mode = value
    try:
        yield
    finally:
        for a, m in zip(adapters, before):
            a.mode = m


class ReferenceView:
    """The reference as the policy's own stage module: adapters off (fresh adapter) or set to
    their frozen starting copy (--init-adapter). Called like a stage model by the pipeline."""

    def __init__(self, module: torch.nn.Module, *, frozen: bool):
        self.module = module  # the unwrapped stage model: stage_forward sets its input tensor
        self.adapter_mode = "frozen" if frozen else "off"
        self.router_tap = None  # a MoE policy's RouterTap: the reference's routing is not the policy's

    def chunk(self, chunk: int) -> ReferenceView:
        """The view of the policy's model chunk `chunk` (--vpp; `model.chunks.chunk_of`)."""
        view = ReferenceView(chunk_modules(self.module)[chunk], frozen=self.adapter_mode == "frozen")
        view.router_tap = self.router_tap
        return view

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """None of its own: the weights are the policy's (the frozen copies are buffers of a few MB)."""
        return iter(())

    def buffers(self) -> Iterator[torch.Tensor]:
        """None of its own either: the frozen starting copies are buffers of the policy's module."""
        return iter(())

    @torch.no_grad()
    def __call__(self, **kwargs) -> torch.Tensor:
        tap = self.router_tap
        recording = tap is not None and tap.active
        if recording:
            tap.active = False
        try:
            with mode(self.module, self.adapter_mode):
                return self.module(**kwargs)
        finally:
            if recording:
                tap.active = True


def merged_weights(model: torch.nn.Module, *, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """This rank's base parameters with the adapters merged in (W + scaling·B·A, in fp32, then
    `dtype`), under the base parameters' names: what an exported HF model holds."""
    out = {}
    deltas = {}
    for name, module in model.named_modules():
        if isinstance(module, Adapter):
            linear_name = name.rsplit(".", 1)[0]
            deltas[f"{linear_name}.weight"] = module.merged_delta()
    for name, param in model.named_parameters():
        if f".{ADAPTER_MODULE}.lora_" in name:
            continue
        value = param.detach().float()
        if name in deltas:
            value = value + deltas[name].to(value.device)
        out[name] = value.to("cpu", dtype, copy=True)
    return out


# --------------------------------------------------------------------------- configuration
def shape_of(config) -> LoraShape:
    """The adapters' shape from a TrainConfig whose LoRA fields are resolved (`resolve`)."""
    targets = TARGETS if config.lora_targets is None else target_names(config.lora_targets)
    rank = config.lora_rank
    return LoraShape(rank=rank, alpha=float(config.lora_alpha if config.lora_alpha is not None else rank),
                     targets=targets)


def check_targets(config, *, spec: ModelSpec, where: str) -> None:
    """Raise ConversionError (one line) when a target has no linear in this base, or the run asks
    for what PEFT's adapters on the experts cannot be (dropout) or the engine does not build
    (experts at tp > 1)."""
    from checkpoint_convert.families.base import ConversionError

    targets = shape_of(config).targets
    present = targets_present(spec)
    absent = [t for t in targets if t not in present]
    if absent:
        if absent[0] in EXPERT_TARGETS:
            raise ConversionError(f"{where}: LoRA target {absent[0]!r} needs a mixture-of-experts model; "
                                  f"{spec.architecture} has no experts (targets: {', '.join(present)})")
        if len(spec.moe_layers) == spec.num_layers and not spec.moe_shared_intermediate_size:
            why = "all its MLPs are experts"
        else:  # dense layers (DeepSeek-V3's and GLM-4.5's first ones, Qwen3-MoE's mlp_only_layers) or shared experts
            why = "PEFT maps gate/up/down_proj onto the routed experts there, so its dense and shared-expert MLPs cannot be adapted"
        raise ConversionError(f"{where}: LoRA target {absent[0]!r} is for dense MLPs; on a mixture-of-experts model "
                              f"use expert_fc1/expert_fc2 ({spec.architecture}: {why})")
    if spec.num_experts and config.tp > 1:
        raise ConversionError(f"{where}: LoRA on a mixture-of-experts model ({spec.architecture}) trains at tp 1 only "
                              f"(split the experts with --ep instead), got --tp {config.tp}")
    if config.lora_dropout and any(t in EXPERT_TARGETS for t in targets):
        raise ConversionError(f"{where}: lora_dropout {config.lora_dropout:g} with expert targets: PEFT's adapters "
                              "on the fused expert parameters take no dropout (use 0)")


def resolve(config, *, spec: ModelSpec):
    """Fill rank, alpha and targets from --init-adapter where not given, and check the adapter
    against them and against the base `spec` (every tensor, every shape). Raises
    checkpoint_convert's ConversionError (one line naming the file) on a mismatch."""
    from dataclasses import replace

    from checkpoint_convert.families.base import ConversionError
    from checkpoint_convert.peft_adapter import ADAPTER_CONFIG, lora_shape_of, read_adapter

    if config.init_adapter is None:
        if spec.num_experts and config.lora_targets is None:  # default: every target the base has
            config = replace(config, lora_targets=",".join(targets_present(spec)))
        check_targets(config, spec=spec, where=f"{config.model}/config.json")
        return replace(config, lora_alpha=shape_of(config).alpha)
    declared, _ = lora_shape_of(config.init_adapter, spec=spec)
    where = f"{config.init_adapter}/{ADAPTER_CONFIG}"
    if config.lora_rank is not None and config.lora_rank != declared.rank:
        raise ConversionError(f"{where}: the adapter has rank {declared.rank}, --lora-rank is {config.lora_rank}")
    if config.lora_alpha is not None and float(config.lora_alpha) != declared.alpha:
        raise ConversionError(f"{where}: the adapter has lora_alpha {declared.alpha:g}, --lora-alpha is {config.lora_alpha:g}")
    if config.lora_targets is not None and shape_of(replace(config, lora_rank=declared.rank)).targets != declared.targets:
        raise ConversionError(f"{where}: the adapter targets {','.join(declared.targets)}, --lora-targets is "
                              f"{config.lora_targets}")
    resolved = replace(config, lora_rank=declared.rank, lora_alpha=declared.alpha, lora_targets=",".join(declared.targets))
    check_targets(resolved, spec=spec, where=where)
    read_adapter(config.init_adapter, spec=spec, lora=declared)  # every tensor against the base
    return resolved


def adapter_shard(whole: dict[str, torch.Tensor], *, rank, saved: bool = False) -> dict[str, torch.Tensor]:
    """This rank's part of whole PEFT-named adapter tensors, under megatron names (the start of a
    LoRA run and its resume alike; `saved`: with the modules trained whole, as a checkpoint holds
    them). `rank`: the worker's `rank.base.Rank`."""
    from checkpoint_convert.peft_adapter import peft_to_shard

    return rank_shard(lambda pp, pp_rank: peft_to_shard(
        whole.__getitem__, spec=rank.spec, lora=shape_of(rank.config), tp=rank.layout.tp, tp_rank=rank.mesh.tp_rank,
        pp=pp, pp_rank=pp_rank, ep=rank.layout.ep, ep_rank=rank.mesh.ep_rank, saved=saved),
        layout=rank.layout, pp_rank=rank.mesh.pp_rank)
