"""The LoRA key map and splits as pure functions (no processes): PEFT <-> megatron shards round
trip at any layout, the fused q/k/v and gate/up updates laid out exactly as checkpoint_convert
fuses the weights, and PEFT's init."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from checkpoint_convert.families.base import ModelSpec
from checkpoint_convert.mapping import split_entry
from checkpoint_convert.peft_adapter import (TARGET_MAP, TARGETS, LoraShape, adapter_config, adapter_entries,
                                             initial_adapter, peft_to_shard, shards_to_peft)
from mcore_dpo.model.lora import Adapter

SPEC = ModelSpec(architecture="LlamaForCausalLM", family="llama", vocab_size=100, hidden_size=32, intermediate_size=64,
                 num_layers=4, num_heads=8, num_query_groups=4, head_dim=4, rms_norm_eps=1e-6, rope_theta=10000.0,
                 rope_scaling=None, tie_word_embeddings=False, qkv_bias=False, max_position_embeddings=64,
                 torch_dtype="float32")
SHAPE = LoraShape(rank=3, alpha=6.0, targets=TARGETS)
KINDS = {"qkv": "qkv", "fc1": "fc1", "proj": "row", "fc2": "row"}  # checkpoint_convert's split kinds


def _random_adapter(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) for k, v in initial_adapter(SPEC, SHAPE, seed=0).items()}


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), (4, 3)])
def test_shards_round_trip_exactly(tp, pp):
    whole = _random_adapter(1)
    shards = {(t, p): peft_to_shard(whole.__getitem__, spec=SPEC, lora=SHAPE, tp=tp, tp_rank=t, pp=pp, pp_rank=p)
              for t in range(tp) for p in range(pp)}
    back = shards_to_peft(shards, spec=SPEC, lora=SHAPE, tp=tp, pp=pp)
    assert back.keys() == whole.keys()
    assert all(torch.equal(back[k], whole[k]) for k in whole)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), (4, 3)])
def test_a_reward_models_score_head_travels_with_the_adapter_as_peft_saves_it(tp, pp):
    """A *ForSequenceClassification base: PEFT's SEQ_CLS adapter saves the score head whole
    (modules_to_save) as base_model.model.score.weight; the shards hold it on every tp rank of the
    last stage (with `saved`), the join takes it from tp rank 0, and the config says SEQ_CLS."""
    reward = dataclasses.replace(SPEC, architecture="LlamaForSequenceClassification", num_labels=1)
    head = torch.randn(1, SPEC.hidden_size, generator=torch.Generator().manual_seed(5))
    whole = {**_random_adapter(1), "base_model.model.score.weight": head}
    shards = {(t, p): peft_to_shard(whole.__getitem__, spec=reward, lora=SHAPE, tp=tp, tp_rank=t, pp=pp, pp_rank=p,
                                    saved=True) for t in range(tp) for p in range(pp)}
    assert all(("score.weight" in shard) is (p == pp - 1) for (_, p), shard in shards.items())
    assert all(torch.equal(shards[(t, pp - 1)]["score.weight"], head) for t in range(tp))
    back = shards_to_peft(shards, spec=reward, lora=SHAPE, tp=tp, pp=pp)
    assert back.keys() == whole.keys() and all(torch.equal(back[k], whole[k]) for k in whole)
    # Without `saved` (a fresh or --init-adapter adapter): the adapters only, the head from the model.
    assert "score.weight" not in peft_to_shard(whole.__getitem__, spec=reward, lora=SHAPE, tp=tp, tp_rank=0, pp=pp,
                                               pp_rank=pp - 1)
    causal, seq_cls = (adapter_config(SHAPE, spec=s, dropout=0.0, base_model=None) for s in (SPEC, reward))
    assert (causal["task_type"], causal["modules_to_save"]) == ("CAUSAL_LM", None)
    assert (seq_cls["task_type"], seq_cls["modules_to_save"]) == ("SEQ_CLS", ["score"])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_merged_update_is_the_fused_weights_update(target, tp):
    """Each rank's scaling·B·A, laid out by the adapter, equals checkpoint_convert's split of the
    per-projection updates (q/k/v interleaved per query group, [gate; up] chunks, row splits)."""
    whole = _random_adapter(2)
    parts = TARGET_MAP[target][2]
    per_projection = []
    for _, hf_module in parts:
        a = whole[f"base_model.model.model.layers.0.{hf_module}.lora_A.weight"]
        b = whole[f"base_model.model.model.layers.0.{hf_module}.lora_B.weight"]
        per_projection.append(SHAPE.scaling * b @ a)
    for t in range(tp):
        shard = peft_to_shard(whole.__getitem__, spec=SPEC, lora=SHAPE, tp=tp, tp_rank=t, pp=1, pp_rank=0)
        adapter = Adapter(spec=SPEC, target=target, lora=SHAPE, dropout=0.0, tp=tp, tp_group=None,
                          dtype=torch.float32, device=torch.device("cpu"))
        prefix = f"decoder.layers.0.{TARGET_MAP[target][0]}.adapter."
        adapter.load_state_dict({k.removeprefix(prefix): v for k, v in shard.items() if k.startswith(prefix)})
        expected = split_entry(SPEC, kind=KINDS[target], tensors=per_projection, tp=tp, tp_rank=t)
        torch.testing.assert_close(adapter.merged_delta(), expected, rtol=1e-6, atol=1e-6)
        if tp == 1:  # the forward update is the same linear map
            x = torch.randn(5, 2, expected.shape[1])
            torch.testing.assert_close(adapter.delta(x), x @ expected.t(), rtol=1e-5, atol=1e-5)


def test_initial_adapter_is_peft_init_and_layout_free():
    a = initial_adapter(SPEC, SHAPE, seed=7)
    assert a.keys() == {peft for _, peft, _, _, _ in adapter_entries(SPEC, SHAPE, pp=1, pp_rank=0)}
    for name, value in a.items():
        if ".lora_B." in name:
            assert not value.any()
        else:
            fan_in = value.shape[1]
            assert value.abs().max() <= 1 / math.sqrt(fan_in) and value.abs().max() > 0.5 / math.sqrt(fan_in)
    again = initial_adapter(SPEC, SHAPE, seed=7)
    assert all(torch.equal(a[k], again[k]) for k in a)
    assert not torch.equal(initial_adapter(SPEC, SHAPE, seed=8)[next(iter(a))], a[next(iter(a))])
    # Distinct A per projection: q, k and v do not share one.
    q = a["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    k = a["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"]
    assert not torch.equal(q, k)
