"""A CPU stand-in for megatron-core's grouped GEMM experts (TEGroupedMLP), so that the CPU suite
runs the worker's translation between grouped live names and sequential file names (shards,
checkpoints, optimizer files, hf/ export, resume) through the real command line.

Installed by sitecustomize.py when MCORE_DPO_GROUPED_STANDIN=1 (tests/helpers/faults.py's
`with_grouped_standin`): the ranks then decide for grouped experts as a GPU with Transformer
Engine >= 1.9 would (`platform.use_grouped_experts` sees the Transformer Engine spec and its
grouped linear), and `model.build_stage_model(grouped_experts=True)` builds the sequential
experts of the local spec and swaps each MoE layer's `SequentialMLP` for `GroupedStandin`.

`GroupedStandin` has TEGroupedMLP's parameter names (`linear_fc1.weight{i}`,
`linear_fc2.weight{i}`, i the local expert), the sequential experts' shapes, and the attribute
values megatron-core 0.16 gives both (`allreduce = not (ep > 1)`; tensor-parallel, partition_dim 0
for fc1 and 1 for fc2, stride 1), copied from the sequential experts it replaces. Its forward
splits the permuted tokens by tokens_per_expert and runs each expert with the same operations as
megatron-core's SequentialMLP on the local spec (the same linear autograd function, gated SiLU,
the routing probabilities applied after the activation), so its numbers are the sequential
experts' bit for bit. It has no sharded_state_dict (the torch_dist checkpoint format is not
served).
"""

from __future__ import annotations

import torch

EXPERT_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce")


class _GroupedLinear(torch.nn.Module):
    """One `weight{i}` per local expert, like Transformer Engine's GroupedLinear."""

    def __init__(self, weights: list[torch.nn.Parameter], tp_group) -> None:
        super().__init__()
        self.num_gemms = len(weights)
        self.tp_group = tp_group
        for i, old in enumerate(weights):
            new = torch.nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad)
            for attribute in EXPERT_ATTRIBUTES:
                setattr(new, attribute, getattr(old, attribute))
            self.register_parameter(f"weight{i}", new)

    def gemm(self, i: int, tokens: torch.Tensor) -> torch.Tensor:
        """Expert i's linear as megatron-core's expert linears run it (no dgrad all-reduce:
        the token dispatcher does the expert communication)."""
        from megatron.core.tensor_parallel.layers import (linear_with_frozen_weight,
                                                          linear_with_grad_accumulation_and_async_allreduce)

        weight = getattr(self, f"weight{i}")
        linear = linear_with_grad_accumulation_and_async_allreduce if weight.requires_grad else linear_with_frozen_weight
        return linear(input=tokens, weight=weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                      sequence_parallel=False, grad_output_buffer=None, wgrad_deferral_limit=None,
                      tp_group=self.tp_group)


class GroupedStandin(torch.nn.Module):
    """TEGroupedMLP's names around the sequential experts' arithmetic (module docstring)."""

    def __init__(self, sequential) -> None:
        super().__init__()
        experts = list(sequential.local_experts)
        self.config = sequential.config
        self.linear_fc1 = _GroupedLinear([e.linear_fc1.weight for e in experts], experts[0].linear_fc1.tp_group)
        self.linear_fc2 = _GroupedLinear([e.linear_fc2.weight for e in experts], experts[0].linear_fc2.tp_group)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        config = self.config
        assert config.gated_linear_unit and not config.moe_apply_probs_on_input
        assert config.activation_func_clamp_value is None
        counts = tokens_per_expert.tolist()
        outputs = []
        for i, (tokens, probs) in enumerate(zip(torch.split(permuted_local_hidden_states, counts),
                                                torch.split(permuted_probs, counts))):
            gate, up = torch.chunk(self.linear_fc1.gemm(i, tokens), 2, dim=-1)
            hidden = config.activation_func(gate) * (up + config.glu_linear_offset)
            hidden = (hidden * probs.unsqueeze(-1)).to(hidden.dtype)
            outputs.append(self.linear_fc2.gemm(i, hidden))
        return torch.cat(outputs, dim=0), None

    def backward_dw(self) -> None:
        pass


def install() -> None:
    """Grouped experts wherever a MoE run would get them on a GPU with Transformer Engine, built
    as `GroupedStandin` around the local spec's sequential experts."""
    from mcore_dpo.model import builder as model
    from mcore_dpo.parallel import platform

    use_grouped_experts, build_stage_model = platform.use_grouped_experts, model.build_stage_model

    def use_grouped_experts_as_on_a_gpu(*, requested, num_experts, use_te, grouped_linear):
        return use_grouped_experts(requested=requested, num_experts=num_experts, use_te=True, grouped_linear=True)

    def build_with_standin(spec, *, grouped_experts: bool = False, **kwargs):
        from megatron.core.transformer.moe.experts import SequentialMLP

        stage = build_stage_model(spec, grouped_experts=False, **kwargs)
        if grouped_experts:
            layers = [layer for layer in stage.decoder.layers if isinstance(getattr(layer.mlp, "experts", None),
                                                                           SequentialMLP)]
            assert layers, "grouped_experts: no SequentialMLP to replace"
            for layer in layers:
                layer.mlp.experts = GroupedStandin(layer.mlp.experts)
        return stage

    platform.use_grouped_experts = use_grouped_experts_as_on_a_gpu
    model.build_stage_model = build_with_standin
