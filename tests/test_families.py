"""Model families as units (checkpoint_convert/families/): found by `architectures` or
`model_type`, one line listing the supported ones otherwise, and each family's key map covering
exactly the tensors of a tiny Hugging Face model of that family. No processes."""

from __future__ import annotations

import pytest
import torch

from checkpoint_convert.families import ARCHITECTURES, FAMILY_MODULES, family_of_config, spec_from_hf_config
from checkpoint_convert.families.base import ConversionError
from checkpoint_convert.rank_files import ep_shard_shapes
from checkpoint_convert.gather import fused_hf_sources, hf_entry_index, mcore_to_hf
from checkpoint_convert.mapping import (
    hf_tensor_shapes,
    hf_to_mcore_shard,
    mcore_shard_shapes,
    stacked_source,
    stage_layers,
)  # fmt: skip
from tests.helpers import deepseek, gemma, glm, gpt_oss
from tests.helpers.models import TINY_FAMILIES, hub_tensors

FAMILIES = {**TINY_FAMILIES, **deepseek.TINY, **gemma.TINY, **glm.TINY, **gpt_oss.TINY}  # one tiny model of every family


def test_every_family_module_is_registered_by_architecture_and_model_type():
    assert set(FAMILY_MODULES) == set(FAMILIES)
    for model_type, module in FAMILY_MODULES.items():
        assert family_of_config({"architectures": [module.ARCHITECTURE]}, source="c") is module
        assert family_of_config({"model_type": model_type}, source="c") is module


def test_unknown_architecture_is_one_line_listing_the_supported():
    with pytest.raises(ConversionError) as error:
        spec_from_hf_config({"architectures": ["GPT2LMHeadModel"]}, source="m/config.json")
    message = str(error.value)
    assert "\n" not in message and message.startswith("m/config.json: field 'architectures' is 'GPT2LMHeadModel'")
    assert all(architecture in message for architecture in ARCHITECTURES)
    with pytest.raises(ConversionError, match="model_type 'gpt2' is not known; supported: DeepseekV3ForCausalLM, "):
        spec_from_hf_config({"model_type": "gpt2"}, source="m/config.json")


# DeepSeek-V3's released config.json: fp8 weights with 128 x 128 block scales (`*_scale_inv` tensors).
DEEPSEEK_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_quantization_config_the_family_does_not_dequantise_is_one_line(family):
    """A quantised checkpoint read as plain weights would train on the stored values: every family
    refuses a `quantization_config` whose method it does not dequantise on import (GPT-OSS
    dequantises mxfp4, none other any), in one line naming the field; without one, or with an
    empty one, the config reads as before."""
    config = FAMILIES[family]().config.to_dict()
    config.pop("quantization_config", None)
    spec = spec_from_hf_config(config, source="m/config.json")
    assert spec_from_hf_config({**config, "quantization_config": None}, source="m/config.json") == spec
    readable = getattr(FAMILY_MODULES[family], "QUANT_METHODS", ())
    for quantization, method in ((DEEPSEEK_FP8, "'fp8'"), ({"quant_method": "awq", "bits": 4}, "'awq'"),
                                 ({"bits": 8}, "None"), ("fp8", "'fp8'")):
        with pytest.raises(ConversionError) as error:
            spec_from_hf_config({**config, "quantization_config": quantization}, source="m/config.json")
        message = str(error.value)
        assert "\n" not in message, message
        assert message.startswith(f"m/config.json: field 'quantization_config.quant_method' is {method}; "), message
        assert ("only 'mxfp4' (dequantised on import) is read" if readable else "quantised weights are not read") in message
    assert readable == (("mxfp4",) if family == "gpt_oss" else ())
    for method in readable:
        assert spec_from_hf_config({**config, "quantization_config": {"quant_method": method}}, source="m/config.json") == spec


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_key_map_covers_the_hub_checkpoint_and_round_trips(family):
    """hf_tensor_shapes = the tensors save_pretrained writes (names and shapes); HF -> tp2 pp2
    shards -> HF gives every tensor back bit for bit."""
    torch.manual_seed(0)
    model = FAMILIES[family]()
    config = model.config.to_dict()
    spec = spec_from_hf_config(config)
    assert spec.family == family
    hub = hub_tensors(model)
    if spec.tie_word_embeddings:
        hub.pop("lm_head.weight", None)
    assert {n: tuple(t.shape) for n, t in hub.items()} == hf_tensor_shapes(spec)
    shards = {(t, p): hf_to_mcore_shard(spec, tp=2, tp_rank=t, pp=2, pp_rank=p, get=hub.__getitem__)
              for t in range(2) for p in range(2)}
    for (t, p), shard in shards.items():
        assert {n: tuple(v.shape) for n, v in shard.items()} == mcore_shard_shapes(spec, tp=2, pp=2, pp_rank=p)
    back = dict(mcore_to_hf(spec, tp=2, pp=2, get_shard=lambda t, p: shards[(t, p)]))
    assert set(back) == set(hub) and all(torch.equal(back[n], hub[n]) for n in hub)
    # Experts stacked in one tensor (GPT-OSS) are indexed by their slices.
    assert {(stacked_source(n) or (n,))[0] for n in hf_entry_index(spec, pp=2)} == set(hub)


def test_moe_spec_fields_follow_the_hf_rules():
    qwen = spec_from_hf_config(TINY_FAMILIES["qwen3_moe"]().config.to_dict())
    assert (qwen.num_experts, qwen.moe_topk, qwen.moe_intermediate_size, qwen.moe_norm_topk) == (4, 2, 24, True)
    assert qwen.moe_layers == (0, 2, 3)  # mlp_only_layers=[1]
    stepped = spec_from_hf_config({**TINY_FAMILIES["qwen3_moe"]().config.to_dict(), "decoder_sparse_step": 2,
                                   "mlp_only_layers": [], "norm_topk_prob": False})
    assert stepped.moe_layers == (1, 3) and not stepped.moe_norm_topk  # HF: (layer + 1) % step == 0
    mixtral = spec_from_hf_config(TINY_FAMILIES["mixtral"]().config.to_dict())
    assert mixtral.moe_layers == (0, 1, 2, 3) and mixtral.moe_norm_topk and mixtral.moe_intermediate_size == 24
    assert mixtral.router_aux_loss_coef == 0.0  # output_router_logits is false
    on = spec_from_hf_config({**TINY_FAMILIES["mixtral"]().config.to_dict(), "output_router_logits": True,
                              "router_aux_loss_coef": 0.02})
    assert on.router_aux_loss_coef == 0.02


@pytest.mark.parametrize("family,field", [("qwen3_moe", "num_experts"), ("qwen3_moe", "num_experts_per_tok"),
                                          ("qwen3_moe", "moe_intermediate_size"), ("mixtral", "num_local_experts")])
def test_moe_config_missing_an_expert_field_is_one_line(family, field):
    config = TINY_FAMILIES[family]().config.to_dict()
    for key in (field, "num_local_experts") if field == "num_experts" else (field,):
        config.pop(key, None)
    with pytest.raises(ConversionError, match=f"^m/config.json: field '{field}' is missing$"):
        spec_from_hf_config(config, source="m/config.json")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe"])
def test_fused_in_memory_experts_read_as_the_hub_tensors(family):
    """transformers 5 holds experts fused ([E, 2I, h] gate_up, [E, h, I] down); a checkpoint in
    that form names the same hub tensors."""
    torch.manual_seed(0)
    model = FAMILIES[family]()
    spec = spec_from_hf_config(model.config.to_dict())
    memory = {n: t.detach() for n, t in model.state_dict().items()}
    hub = hub_tensors(model)
    sources = fused_hf_sources(spec, stored=set(memory))
    assert set(sources) == set(hub) - set(memory)
    for name, (stored, expert, part, parts) in sources.items():
        tensor = memory[stored] if expert is None else memory[stored][expert]
        assert torch.equal(tensor.chunk(parts, dim=0)[part], hub[name]), name


def test_expert_parallel_shards_split_the_experts_by_local_index():
    """ep 2 over 4 experts: rank r holds experts 2r, 2r+1 as local experts 0, 1; dense and
    attention tensors are the same on both ranks; ep must divide the expert count."""
    torch.manual_seed(0)
    model = TINY_FAMILIES["qwen3_moe"]()
    spec = spec_from_hf_config(model.config.to_dict())
    hub = hub_tensors(model)
    full = hf_to_mcore_shard(spec, tp=1, tp_rank=0, pp=1, pp_rank=0, get=hub.__getitem__)
    ranks = [hf_to_mcore_shard(spec, tp=1, tp_rank=0, pp=1, pp_rank=0, ep=2, ep_rank=r, get=hub.__getitem__) for r in (0, 1)]
    name = "decoder.layers.0.mlp.experts.local_experts.{}.linear_fc1.weight"
    assert set(ranks[0]) == set(ranks[1]) and name.format(2) not in ranks[0]
    for r in (0, 1):
        for local in (0, 1):
            assert torch.equal(ranks[r][name.format(local)], full[name.format(2 * r + local)])
        dense = [n for n in full if "local_experts" not in n]
        assert all(torch.equal(ranks[r][n], full[n]) for n in dense)
    with pytest.raises(ConversionError, match=r"the expert count \(4\) is not divisible by ep=3"):
        hf_to_mcore_shard(spec, tp=1, tp_rank=0, pp=1, pp_rank=0, ep=3, ep_rank=0, get=hub.__getitem__)


def test_te_layer_spec_fuses_the_pre_mlp_norm_only_in_dense_layers():
    """megatron-core's Transformer Engine spec fuses the pre-MLP norm into linear_fc1 in a dense
    layer; a MoE layer keeps `pre_mlp_layernorm` (its router and experts read the normed input).
    Qwen3-MoE with mlp_only_layers=[1]: layer 1 is dense, layers 0, 2, 3 are MoE."""
    model = TINY_FAMILIES["qwen3_moe"]()
    spec = spec_from_hf_config(model.config.to_dict())
    state = hub_tensors(model)
    shards = {(t, p): hf_to_mcore_shard(spec, tp=2, tp_rank=t, pp=2, pp_rank=p, get=state.__getitem__, layer_spec="te")
              for t in range(2) for p in range(2)}
    stage0, stage1 = set(shards[(0, 0)]), set(shards[(0, 1)])  # layers 0-1, then 2-3 (local 0-1)
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in stage0  # MoE
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in stage0  # dense
    assert "decoder.layers.1.pre_mlp_layernorm.weight" not in stage0
    assert {"decoder.layers.0.pre_mlp_layernorm.weight", "decoder.layers.1.pre_mlp_layernorm.weight"} <= stage1
    assert not any(name.endswith("mlp.linear_fc1.layer_norm_weight") for name in stage1)
    assert not any("input_layernorm" in name for name in stage0 | stage1)
    assert set(shards[(0, 0)]) == set(mcore_shard_shapes(spec, tp=2, pp=2, pp_rank=0, layer_spec="te"))
    back = dict(mcore_to_hf(spec, tp=2, pp=2, get_shard=lambda t, p: shards[(t, p)], layer_spec="te"))
    assert set(back) == set(state) and all(torch.equal(back[name], state[name]) for name in state)


# --------------------------------------------------------------------------- grouped GEMM experts
def _grouped_live_name(layer: int, linear: str, expert: int) -> str:
    """megatron-core 0.16's TEGroupedMLP parameter name (`test_grouped_expert_names_are_megatron_cores`)."""
    return f"decoder.layers.{layer}.mlp.experts.{linear}.weight{expert}"


def test_grouped_expert_names_translate_both_ways():
    """Every name of a Qwen3-MoE (dense layer 1 between MoE layers 0, 2, 3) at tp2 x pp2, at ep 1
    and at ep 2 (local expert indices): experts become `linear_fc*.weight{local}`, every other name
    (router, TE-fused norms, the dense MLP, attention) stays, and the inverse gives them back."""
    from checkpoint_convert.mapping import grouped_expert_name, sequential_expert_name

    spec = spec_from_hf_config(TINY_FAMILIES["qwen3_moe"]().config.to_dict())
    for ep in (1, 2):
        for pp_rank in (0, 1):
            for ep_rank in range(ep):
                shapes = ep_shard_shapes(spec, tp=2, pp=2, pp_rank=pp_rank, ep=ep, layer_spec="te", divisor=128)[ep_rank]
                experts = {name for name in shapes if ".local_experts." in name}
                moe_layers = [local for local, layer in enumerate(stage_layers(4, pp=2, pp_rank=pp_rank))
                              if spec.is_moe_layer(layer)]
                want = {_grouped_live_name(local, linear, e): f"decoder.layers.{local}.mlp.experts.local_experts.{e}.{linear}.weight"
                        for local in moe_layers for linear in ("linear_fc1", "linear_fc2") for e in range(4 // ep)}
                assert set(want.values()) == experts
                live = {grouped_expert_name(name): name for name in shapes}
                assert len(live) == len(shapes)  # no two names collide
                assert {n: live[n] for n in want} == want
                assert {n: o for n, o in live.items() if n not in want} == {o: o for o in set(shapes) - experts}
                assert all(sequential_expert_name(n) == o for n, o in live.items())
    assert grouped_expert_name("decoder.layers.7.mlp.experts.local_experts.12.linear_fc2.weight") == \
        "decoder.layers.7.mlp.experts.linear_fc2.weight12"
    for untouched in ("decoder.layers.1.mlp.linear_fc1.weight", "decoder.layers.1.mlp.linear_fc1.layer_norm_weight",
                      "decoder.layers.0.mlp.router.weight",
                      "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.adapter.lora_A_0",
                      "output_layer.weight"):
        assert grouped_expert_name(untouched) == untouched == sequential_expert_name(untouched)


def test_grouped_expert_names_are_megatron_cores():
    """The grouped names are megatron-core's own (Transformer Engine, which builds the module,
    needs CUDA; its GroupedLinear registers `weight{i}`, [out, in], one per local expert): the
    installed TEGroupedMLP builds `linear_fc1`/`linear_fc2` with one GEMM per local expert and
    keys its state dict `{linear}.weight{i}`, each fc1 (gate;up) split over expert tp by the
    swiglu sharded factory, as SequentialMLP's."""
    import inspect
    import re

    from megatron.core.transformer.moe.experts import TEGroupedMLP

    init = " ".join(inspect.getsource(TEGroupedMLP.__init__).split())
    for linear in ("linear_fc1", "linear_fc2"):  # 0.16: build_module(submodules.X, ...); 0.19: submodules.X(...)
        built = rf"self\.{linear} = (build_module\( ?submodules\.{linear},|submodules\.{linear}\() ?self\.num_local_experts,"
        assert re.search(built, init), linear
    assert "ffn_hidden_size *= 2" in init  # fc1 holds gate and up
    sharded = inspect.getsource(TEGroupedMLP.sharded_state_dict)
    assert "for k in (f'{name}.weight{i}', f'{name}.bias{i}'):" in sharded
    assert "apply_swiglu_sharded_factory" in sharded
    forward = inspect.getsource(TEGroupedMLP.forward)
    assert "x_glu, x_linear = torch.chunk(x, 2, dim=-1)" in forward  # gate rows first, then up, as SequentialMLP


def test_te_layer_spec_with_grouped_experts_round_trips_a_tp2_pp2_shard():
    """The whole rename at the live model's boundary, Transformer Engine norm fusion and grouped
    experts together: Qwen3-MoE tp2 x pp2 shards in the grouped model's names (every expert
    `linear_fc*.weight{i}`, same shapes) and back to the shard names give the hub tensors back
    bit for bit."""
    from checkpoint_convert.mapping import grouped_expert_name
    from mcore_dpo.model.builder import shard_names

    model = TINY_FAMILIES["qwen3_moe"]()
    spec = spec_from_hf_config(model.config.to_dict())
    state = hub_tensors(model)
    shards = {(t, p): hf_to_mcore_shard(spec, tp=2, tp_rank=t, pp=2, pp_rank=p, get=state.__getitem__, layer_spec="te")
              for t in range(2) for p in range(2)}
    live = {key: {grouped_expert_name(n): v for n, v in shard.items()} for key, shard in shards.items()}
    for (t, p), tensors in live.items():
        assert not any(".local_experts." in n for n in tensors)
        assert "decoder.layers.0.pre_mlp_layernorm.weight" in tensors  # the TE rename is still there
        assert not any("input_layernorm" in n for n in tensors)
        for e in range(4):
            assert tensors[_grouped_live_name(0, "linear_fc1", e)].shape == (24, 32)  # [2 x 24 / tp, h]
            assert tensors[_grouped_live_name(0, "linear_fc2", e)].shape == (32, 12)  # [h, 24 / tp]
    back = {key: shard_names(tensors) for key, tensors in live.items()}
    assert all(set(back[key]) == set(shards[key]) for key in shards)
    hf = dict(mcore_to_hf(spec, tp=2, pp=2, get_shard=lambda t, p: back[(t, p)], layer_spec="te"))
    assert set(hf) == set(state) and all(torch.equal(hf[name], state[name]) for name in state)
