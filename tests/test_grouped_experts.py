"""Grouped GEMM experts (megatron-core's TEGroupedMLP, on the Transformer Engine spec) on the
CPU, where Transformer Engine cannot run: when a rank builds them (`platform.use_grouped_experts`),
the live model's boundary (`model.load_shard`, `model.shard_names`, `model.live_names`) over the
grouped names, the flag. Their numerics against sequential experts: tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

from checkpoint_convert.families import spec_from_hf_config
from checkpoint_convert.mapping import grouped_expert_name, hf_to_mcore_shard
from mcore_dpo.model.builder import live_names, load_shard, shard_names
from mcore_dpo.parallel.platform import use_grouped_experts
from tests.helpers.models import TINY_FAMILIES, hub_tensors


def _module_with(params: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module tree whose named_parameters() are `params`' names (zeros of their shapes)."""
    root = torch.nn.Module()
    for name, value in params.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(value)))
    return root


@pytest.mark.parametrize("ep", [1, 2])
def test_a_grouped_model_loads_the_sequential_shard_and_gives_it_back(ep):
    """A model whose parameters carry the grouped names (Qwen3-MoE, TE spec, tp 2, stage 0 of pp 2,
    ep rank 1 of ep) loads the shard as the converter writes it, and its tensors under shard names
    are that shard, bit for bit; a shard that lacks an expert's tensor, or has one too many, is one
    error naming the tensor as the shard does (the sequential experts' name)."""
    model = TINY_FAMILIES["qwen3_moe"]()
    spec = spec_from_hf_config(model.config.to_dict())
    hub = hub_tensors(model)
    shard = hf_to_mcore_shard(spec, tp=2, tp_rank=1, pp=2, pp_rank=0, get=hub.__getitem__, layer_spec="te", ep=ep,
                              ep_rank=ep - 1)
    grouped = _module_with({grouped_expert_name(n): v for n, v in shard.items()})
    assert "mlp.experts.linear_fc1.weight1" in " ".join(n for n, _ in grouped.named_parameters())
    load_shard(grouped, shard)
    back = shard_names({n: p.detach() for n, p in grouped.named_parameters()})
    assert set(back) == set(shard) and all(torch.equal(back[n], shard[n]) for n in shard)
    assert set(live_names(grouped, shard)) == {n for n, _ in grouped.named_parameters()}
    missing = dict(shard)
    missing.pop("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight")
    with pytest.raises(ValueError, match=r"missing \['decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight'\], "
                                         r"unexpected \[\]$"):
        load_shard(grouped, missing)
    extra = dict(shard, **{"decoder.layers.0.mlp.experts.local_experts.9.linear_fc2.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['decoder.layers.0.mlp.experts.local_experts.9."
                                         r"linear_fc2.weight'\]$"):
        load_shard(grouped, extra)


def test_a_sequential_model_is_unchanged_by_the_boundary():
    model = TINY_FAMILIES["qwen3_moe"]()
    spec = spec_from_hf_config(model.config.to_dict())
    shard = hf_to_mcore_shard(spec, tp=1, tp_rank=0, pp=1, pp_rank=0, get=hub_tensors(model).__getitem__)
    sequential = _module_with(shard)
    assert live_names(sequential, shard).keys() == shard.keys() == shard_names(shard).keys()


@pytest.mark.parametrize("requested,num_experts,use_te,grouped_linear,want,note", [
    (None, 4, True, True, True, None),  # the default on a GPU with Transformer Engine >= 1.9
    (True, 4, True, True, True, None),
    (False, 4, True, True, False, None),  # --no-moe-grouped-gemm
    (None, 0, True, True, False, None),  # dense model
    (None, 4, False, False, False, None),  # the CPU (or LoRA): sequential, nothing to say
    (True, 4, False, False, False, "Transformer Engine is not importable on the ranks"),
    (None, 4, True, False, False, "Transformer Engine >= 1.9"),  # an old Transformer Engine
    (True, 4, True, False, False, "Transformer Engine >= 1.9"),
])
def test_when_the_experts_are_grouped(requested, num_experts, use_te, grouped_linear, want, note):
    grouped, said = use_grouped_experts(requested=requested, num_experts=num_experts, use_te=use_te,
                                        grouped_linear=grouped_linear)
    assert grouped is want
    if note is None:
        assert said is None
    else:
        assert note in said and said.startswith("moe_grouped_gemm: ") and "\n" not in said
        assert said.endswith("running sequential experts")


def test_the_flag_parses_and_defaults_to_unset():
    from mcore_dpo.command_line import build_parser
    from mcore_dpo.config import TrainConfig

    assert build_parser().parse_args([]).moe_grouped_gemm is None and TrainConfig().moe_grouped_gemm is None
    assert build_parser().parse_args(["--moe-grouped-gemm"]).moe_grouped_gemm is True
    assert build_parser().parse_args(["--no-moe-grouped-gemm"]).moe_grouped_gemm is False
    help_text = " ".join(build_parser().format_help().split())
    assert "--moe-grouped-gemm, --no-moe-grouped-gemm MoE models: run each layer's local experts as one grouped GEMM" in help_text


def test_the_flag_on_a_dense_model_is_one_line():
    from mcore_dpo.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match=r"^moe_grouped_gemm: m/config.json describes a dense model \(no experts\)$"):
        TrainConfig(moe_grouped_gemm=True).check_moe_grouped_gemm(num_experts=0, source="m/config.json")
    for config, num_experts in ((TrainConfig(moe_grouped_gemm=False), 0), (TrainConfig(), 0),
                                (TrainConfig(moe_grouped_gemm=True), 4)):
        config.check_moe_grouped_gemm(num_experts=num_experts, source="m/config.json")  # no error


def test_lora_refuses_grouped_experts_in_one_line():
    """LoRA hooks each expert's linear; a MoE layer with grouped experts has none."""
    from types import SimpleNamespace

    from mcore_dpo.model import lora

    grouped = torch.nn.Module()  # TEGroupedMLP keeps linear_fc1/fc2 and no local_experts
    grouped.add_module("linear_fc1", torch.nn.Module())
    layer = torch.nn.Module()
    layer.layer_number = 1
    layer.add_module("mlp", torch.nn.Module())
    layer.mlp.add_module("experts", grouped)
    model = torch.nn.Module()
    model.add_module("decoder", torch.nn.Module())
    model.decoder.add_module("layers", torch.nn.ModuleList([layer]))
    shape = SimpleNamespace(targets=())
    with pytest.raises(ValueError, match=r"^LoRA: layer 1's experts are Module \(grouped GEMM\), which has no "
                                         r"per-expert linears to adapt; build it with sequential experts$"):
        lora.attach(model, spec=SimpleNamespace(num_labels=0), lora=shape, dropout=0.0, tp=1, tp_group=None)
