"""Pure tests of checkpoint_convert.mapping: no files, no processes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from checkpoint_convert.families import spec_from_hf_config
from checkpoint_convert.families.base import ConversionError
from checkpoint_convert.gather import mcore_to_hf
from checkpoint_convert.mapping import (
    check_layout,
    hf_tensor_names,
    hf_to_mcore_shard,
    mcore_shard_shapes,
    padded_vocab_size,
    stage_layers,
)
from tests.helpers.models import FAMILY_VARIANTS, VOCAB_SIZE, hf_state

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2)]


def _shard_all(spec, state, *, tp, pp, layer_spec="local"):
    return {
        (t, p): hf_to_mcore_shard(spec, tp=tp, tp_rank=t, pp=pp, pp_rank=p, get=state.__getitem__, layer_spec=layer_spec)
        for p in range(pp)
        for t in range(tp)
    }


@pytest.fixture(scope="module")
def models():
    return {name: factory() for name, factory in FAMILY_VARIANTS.items()}


@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("variant", ["llama_gqa_untied", "llama_tied", "mistral_mha", "qwen2_bias_tied", "llama3_rope_scaled"])
def test_round_trip_is_lossless(models, variant, tp, pp):
    model = models[variant]
    spec = spec_from_hf_config(model.config.to_dict())
    state = hf_state(model)
    assert set(state) == set(hf_tensor_names(spec))
    shards = _shard_all(spec, state, tp=tp, pp=pp)
    for (t, p), shard in shards.items():
        shapes = {name: tuple(tensor.shape) for name, tensor in shard.items()}
        assert shapes == mcore_shard_shapes(spec, tp=tp, pp=pp, pp_rank=p)
    back = dict(mcore_to_hf(spec, tp=tp, pp=pp, get_shard=lambda t, p: shards[(t, p)]))
    assert list(back) == hf_tensor_names(spec)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_shard_names_vocab_padding_and_tied_output_layer(models):
    model = models["qwen2_bias_tied"]
    spec = spec_from_hf_config(model.config.to_dict())
    state = hf_state(model)
    single = _shard_all(spec, state, tp=1, pp=1)[(0, 0)]
    assert "output_layer.weight" not in single  # tied, one stage: megatron shares the embedding
    assert "decoder.layers.3.self_attention.linear_qkv.bias" in single
    shards = _shard_all(spec, state, tp=2, pp=2)
    first, last = shards[(1, 0)], shards[(1, 1)]
    assert sorted(n for n in first if not n.startswith("decoder.layers.")) == ["embedding.word_embeddings.weight"]
    assert sorted(n for n in last if not n.startswith("decoder.layers.")) == ["decoder.final_layernorm.weight", "output_layer.weight"]
    # Local layer numbers: each of the two stages holds layers 0 and 1.
    assert {n.split(".")[2] for n in last if n.startswith("decoder.layers.")} == {"0", "1"}
    padded = padded_vocab_size(VOCAB_SIZE, tp=2)
    assert padded == 256
    embedding = torch.cat([shards[(0, 0)]["embedding.word_embeddings.weight"], first["embedding.word_embeddings.weight"]])
    assert embedding.shape[0] == padded
    assert torch.equal(embedding[:VOCAB_SIZE], state["model.embed_tokens.weight"])
    assert torch.count_nonzero(embedding[VOCAB_SIZE:]) == 0
    assert torch.equal(shards[(1, 1)]["output_layer.weight"], first["embedding.word_embeddings.weight"])


def test_fused_qkv_and_fc1_layout(models):
    spec = spec_from_hf_config(models["llama_gqa_untied"].config.to_dict())  # 8 heads, 4 groups, d=4
    state = hf_state(models["llama_gqa_untied"])
    shard = _shard_all(spec, state, tp=2, pp=1)[(1, 0)]
    d, r = spec.head_dim, spec.num_heads // spec.num_query_groups
    qkv = shard["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (state[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    # tp rank 1 holds groups 2 and 3; group 2 = its r query heads, then its k head, then its v head.
    group2 = qkv[: (r + 2) * d]
    assert torch.equal(group2[: r * d], q[2 * r * d : 3 * r * d])
    assert torch.equal(group2[r * d : (r + 1) * d], k[2 * d : 3 * d])
    assert torch.equal(group2[(r + 1) * d :], v[2 * d : 3 * d])
    fc1 = shard["decoder.layers.0.mlp.linear_fc1.weight"]
    half = spec.intermediate_size // 2
    assert torch.equal(fc1[:half], state["model.layers.0.mlp.gate_proj.weight"][half:])
    assert torch.equal(fc1[half:], state["model.layers.0.mlp.up_proj.weight"][half:])


def test_te_layer_spec_renames_norms_and_round_trips(models):
    spec = spec_from_hf_config(models["llama_gqa_untied"].config.to_dict())
    state = hf_state(models["llama_gqa_untied"])
    shards = _shard_all(spec, state, tp=2, pp=2, layer_spec="te")
    names = set(shards[(0, 0)])
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in names)
    back = dict(mcore_to_hf(spec, tp=2, pp=2, get_shard=lambda t, p: shards[(t, p)], layer_spec="te"))
    assert all(torch.equal(back[n], state[n]) for n in state)


def test_stage_layers_contiguous_earlier_stages_take_extra():
    assert [stage_layers(10, pp=4, pp_rank=p) for p in range(4)] == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert [len(stage_layers(4, pp=4, pp_rank=p)) for p in range(4)] == [1, 1, 1, 1]


def test_padded_vocab_size():
    assert padded_vocab_size(32000, tp=1) == 32000
    assert padded_vocab_size(32001, tp=1) == 32128
    assert padded_vocab_size(151936, tp=4) == 152064
    assert padded_vocab_size(100, tp=4, divisor=8) == 128


def test_spec_reads_llama3_rope_scaling_in_both_config_forms(models):
    new_form = spec_from_hf_config(models["llama3_rope_scaled"].config.to_dict())
    old_form = spec_from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "rope_theta": 500000.0,
            "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
            "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 32},
        }
    )  # fmt: skip
    assert new_form.rope_scaling == old_form.rope_scaling == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }  # fmt: skip
    assert new_form.rope_theta == old_form.rope_theta == 500000.0
    assert old_form.torch_dtype == "bfloat16"


@pytest.mark.parametrize(
    "change,field",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_parameters.rope_type"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}, "low_freq_factor"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": None}, "hidden_size"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_bad_config_names_the_field(models, change, field):
    config = {**models["llama_gqa_untied"].config.to_dict(), **change}
    with pytest.raises(ConversionError) as error:
        spec_from_hf_config(config, source="some/config.json")
    message = str(error.value)
    assert "\n" not in message and "some/config.json" in message and field in message


@pytest.mark.parametrize(
    "change,tp,pp,field",
    [
        ({"num_heads": 6, "num_query_groups": 2}, 4, 1, "num_attention_heads"),
        ({"num_query_groups": 2}, 4, 1, "num_key_value_heads"),
        ({"intermediate_size": 66}, 4, 1, "intermediate_size"),
        ({}, 1, 5, "num_hidden_layers"),
    ],
)
def test_check_layout_names_the_field(models, change, tp, pp, field):
    spec = dataclasses.replace(spec_from_hf_config(models["llama_gqa_untied"].config.to_dict()), **change)
    with pytest.raises(ConversionError, match=field):
        check_layout(spec, tp=tp, pp=pp)
    with pytest.raises(ConversionError, match=field):
        hf_to_mcore_shard(spec, tp=tp, tp_rank=0, pp=pp, pp_rank=0, get=lambda name: None)
