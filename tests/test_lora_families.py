"""LoRA on DeepSeek-V3 (multi-latent attention), GPT-OSS, Gemma 3 and GLM-4.5, without processes:

- the key map against PEFT itself: an adapter on every target the base has, written as the engine
  writes one, loads with `PeftModel.from_pretrained` (no missing or unexpected keys) as exactly
  its tensors, and the engine's adapter on each megatron-core linear (`Adapter.merged_delta`, from
  the key map's shard) is PEFT's update of that linear: PEFT's `merge_and_unload()` minus the base,
  carried to megatron-core by the family's key map. That covers MLA's q_a/q_b (or q)/kv_a/kv_b
  projections, each expert's pair and GPT-OSS's interleaved gate/up rows;
- shards <-> whole PEFT tensors over tp, pp and ep;
- what LoRA does not train on these families: one line from the command line, before Ray starts.

The training parity (one LoRA DPO step against HF + PEFT at pp 2, and ep 2 on the MoE families)
runs in each family's parity launch (tests/test_<family>.py, tests/helpers/lora_families.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.mapping import hf_to_mcore_shard
from checkpoint_convert.peft_adapter import (EXPERT_TARGETS, LoraShape, adapter_config, peft_to_shard, shards_to_peft,
                                             target_layout, target_linears, write_adapter_dir)
from mcore_dpo.model.lora import Adapter
from tests.helpers.deepseek import deepseek_v3
from tests.helpers.gemma import gemma3
from tests.helpers.glm import glm4_moe
from tests.helpers.gpt_oss import gpt_oss
from tests.helpers.lora_families import hub_names, lora_tensors, peft_model, shape_of, write_init_adapter
from tests.helpers.models import save_hf
from tests.helpers.reference import assert_close

FAMILIES = {
    "deepseek_v3": lambda: deepseek_v3(seed=3),
    "deepseek_v3_plain_q": lambda: deepseek_v3(seed=3, q_lora_rank=None),  # q_proj instead of q_a/q_b
    "gpt_oss": lambda: gpt_oss(seed=3),
    "gemma3": lambda: gemma3(seed=3),
    "glm4_moe": lambda: glm4_moe(seed=3),
}
VALID = Path(__file__).resolve().parent / "bad_inputs" / "valid_prefs.jsonl"


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_families")
    return {name: save_hf(make(), root / name) for name, make in FAMILIES.items()}


def _linears(spec, shape: LoraShape):
    """(megatron-core linear under a layer, target, (column|row|replicated, parts)) of every
    adapted linear of a layer (an expert's with `{e}` for the expert)."""
    for target in shape.targets:
        if target in EXPERT_TARGETS:
            linear = "linear_fc1" if target == "expert_fc1" else "linear_fc2"
            yield f"mlp.experts.local_experts.{{e}}.{linear}", target, target_layout(target)
            continue
        for path, parallel, parts in target_linears(spec, target):
            yield path, target, (parallel, tuple(p for p, _ in parts))


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_updates_equal_peft_s(family, bases, tmp_path):
    base = bases[family]
    spec = open_hf_dir(base).spec
    shape = shape_of(spec)
    adapter = write_init_adapter(base, tmp_path / "adapter", seed=7)
    config = json.loads((adapter / "adapter_config.json").read_text())
    if spec.multi_latent_attention:
        q = ["q_a_proj", "q_b_proj"] if spec.q_lora_rank else ["q_proj"]
        assert config["target_modules"] == sorted(q + ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]), config
    model = peft_model(base, adapter, trainable=False)
    loaded = lora_tensors(model)
    from safetensors.torch import load_file

    written = load_file(str(adapter / "adapter_model.safetensors"))
    assert set(loaded) == set(written), sorted(set(loaded) ^ set(written))[:4]
    assert all(torch.equal(loaded[k], written[k]) for k in written)

    # PEFT's update of every linear, in megatron-core's layout, against the engine's adapter on it.
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).state_dict()
    merged = {k: v.detach() for k, v in model.merge_and_unload().state_dict().items()}
    before, after = (hf_to_mcore_shard(spec, tp=1, tp_rank=0, pp=1, pp_rank=0, get=hub_names(t, spec).__getitem__)
                     for t in (plain, merged))
    shard = peft_to_shard(written.__getitem__, spec=spec, lora=shape, tp=1, tp_rank=0, pp=1, pp_rank=0)
    checked = set()
    for layer in range(spec.num_layers):
        moe = spec.is_moe_layer(layer)
        for template, target, layout in _linears(spec, shape):
            if (target in EXPERT_TARGETS and not moe) or (target in ("fc1", "fc2") and moe):
                continue
            for expert in range(spec.num_experts) if target in EXPERT_TARGETS else (None,):
                linear = f"decoder.layers.{layer}.{template.format(e=expert)}"
                ours = Adapter(spec=spec, target=target, lora=shape, dropout=0.0, tp=1, tp_group=None,
                               dtype=torch.float32, device=torch.device("cpu"), layout=layout)
                ours.load_state_dict({k.removeprefix(f"{linear}.adapter."): v for k, v in shard.items()
                                      if k.startswith(f"{linear}.adapter.")})
                peft_delta = after[f"{linear}.weight"] - before[f"{linear}.weight"]
                assert_close(ours.merged_delta(), peft_delta, what=f"{family} {linear}", rtol=1e-5)
                checked.add(linear)
    # Every adapted linear was compared, and every linear PEFT changed is one of them.
    changed = {n.removesuffix(".weight") for n in after if not torch.equal(after[n], before[n])}
    assert changed == checked, sorted(changed ^ checked)[:4]


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_shards_round_trip_over_tp_pp_ep(family, bases):
    spec = open_hf_dir(bases[family]).spec
    shape = shape_of(spec)
    from checkpoint_convert.peft_adapter import initial_adapter

    gen = torch.Generator().manual_seed(0)
    whole = {k: torch.randn(v.shape, generator=gen) for k, v in initial_adapter(spec, shape, seed=0).items()}
    for tp, pp, ep in [(1, 1, 1), (1, 2, 2), (2, 1, 4)]:
        shards = {}
        for t in range(tp):
            for p in range(pp):
                for e in range(ep):
                    shards[(t, p, e) if ep > 1 else (t, p)] = peft_to_shard(
                        whole.__getitem__, spec=spec, lora=shape, tp=tp, tp_rank=t, pp=pp, pp_rank=p, ep=ep, ep_rank=e)
        back = shards_to_peft(shards, spec=spec, lora=shape, tp=tp, pp=pp, ep=ep)
        assert set(back) == set(whole) and all(torch.equal(back[k], whole[k]) for k in whole), (family, tp, pp, ep)


# --------------------------------------------------------------------------- refused, one line
def _qkv_adapter(base: Path, directory: Path, modules: list[str]) -> Path:
    """An adapter directory whose config names `modules` (its tensors never read: refused first)."""
    spec = open_hf_dir(base).spec
    config = adapter_config(LoraShape(rank=4, alpha=8.0, targets=("qkv",)), spec=spec, dropout=0.0, base_model=None)
    write_adapter_dir(directory, {}, {**config, "target_modules": modules})
    return directory


CASES = [
    ("deepseek_v3", ["--lora-rank", "4", "--lora-targets", "qkv,fc1"], "{model}/config.json",
     "LoRA target 'fc1' is for dense MLPs; on a mixture-of-experts model use expert_fc1/expert_fc2 "
     "(DeepseekV3ForCausalLM: PEFT maps gate/up/down_proj onto the routed experts there"),
    ("gpt_oss", ["--lora-rank", "4", "--lora-targets", "qkv,fc2"], "{model}/config.json",
     "LoRA target 'fc2' is for dense MLPs; on a mixture-of-experts model use expert_fc1/expert_fc2 "
     "(GptOssForCausalLM: all its MLPs are experts)"),
    ("deepseek_v3", ["--lora-rank", "4", "--tp", "2"], "{model}/config.json",
     "LoRA on a mixture-of-experts model (DeepseekV3ForCausalLM) trains at tp 1 only"),
    ("glm4_moe", ["--lora-rank", "4", "--lora-dropout", "0.1"], "{model}/config.json",
     "lora_dropout 0.1 with expert targets: PEFT's adapters on the fused expert parameters take no dropout"),
    ("deepseek_v3", ["--init-adapter", "{qkv_adapter}"], "{qkv_adapter}/adapter_config.json",
     "field 'target_modules' names 'k_proj', which DeepseekV3ForCausalLM does not have (its qkv projections: "
     "kv_a_proj_with_mqa, kv_b_proj, q_a_proj, q_b_proj)"),
    ("deepseek_v3", ["--init-adapter", "{up_only_adapter}"], "{up_only_adapter}/adapter_config.json",
     "field 'target_modules' has ['kv_b_proj', 'q_b_proj'] without ['kv_a_proj_with_mqa', 'q_a_proj']; LoRA adapts "
     "all of multi-latent attention's q/kv projections together"),
]


@pytest.mark.parametrize("case", CASES, ids=["fc1-on-deepseek", "fc2-on-gpt-oss", "tp2-on-deepseek", "dropout-on-glm-experts",
                                             "qkv-adapter-on-mla", "partial-mla-adapter"])
def test_what_lora_does_not_train_is_one_line(case, bases, tmp_path, capsys):
    import ray

    from mcore_dpo.train import main

    family, flags, where, fragment = case
    paths = {"model": str(bases[family]),
             "qkv_adapter": str(_qkv_adapter(bases[family], tmp_path / "qkv", ["q_proj", "k_proj", "v_proj"])),
             "up_only_adapter": str(_qkv_adapter(bases[family], tmp_path / "up", ["q_b_proj", "kv_b_proj"]))}
    out = tmp_path / "out"
    code = main(["--model", paths["model"], "--data", str(VALID), "--output-dir", str(out),
                 *[f.format_map(paths) for f in flags]])
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2 and "Traceback" not in captured.err + captured.out, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert where.format_map(paths) in err and fragment in err, err
    assert not ray.is_initialized(), "Ray was started before the input was checked"
    assert not out.exists()
