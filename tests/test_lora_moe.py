"""LoRA on mixture-of-experts models (Qwen3-MoE, Mixtral): adapters on attention and on every
expert, against Hugging Face + PEFT 0.21 (`target_parameters` on the fused expert parameters).

- The key map: an adapter the engine writes loads into PEFT with exactly PEFT's own tensors, and
  each expert's update W_e + scaling·B_e·A_e is PEFT's (both families, each expert target set);
  shards <-> whole over tp, pp and ep round-trip exactly.
- Parity: Qwen3-MoE, targets qkv, proj, expert_fc1, expert_fc2, a fresh adapter (reference =
  PEFT's `disable_adapter()`; step 1 moves B off zero, so step 2 tests A's gradients), 2 steps at
  (tp, pp, dp, ep) = (1,1,1,1) and (1,2,2,2): every metric, every adapter gradient of every rank
  (each ep rank its own experts), the merged weights against `merge_and_unload()`, within 1e-5.
- The command line (in this process) at (1,1,1,1): OUTPUT/adapter loads with `PeftModel.from_pretrained` (no
  missing or unexpected keys) and gives the merged export's logits; OUTPUT/hf equals PEFT's
  `merge_and_unload()`.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.mapping import hf_to_mcore_shard
from checkpoint_convert.peft_adapter import (LoraShape, adapter_config, initial_adapter, lora_shape_of, peft_shapes,
                                             peft_to_shard, read_adapter, shards_to_peft, write_adapter_dir)
from tests.helpers import parity
from tests.helpers.data import make_pairs, write_prefs
from tests.helpers.lora_families import hub_names, lora_tensors, peft_model
from tests.helpers.models import mixtral, qwen3_moe, save_hf
from tests.helpers.moe_parity import check_router_metrics, engine_groups, router_metrics
from tests.helpers.ranks import load_rank_tensors, run_ranks
from tests.helpers.ray_runs import main_in_process
from tests.helpers.reference import assert_close, loss_and_metrics

GLOBAL_BATCH, MICRO_BATCH, STEPS = 8, 2, 2
LR, CLIP, WD, ADAM_EPS, BETA, SEED = 1e-3, 1.0, 0.1, 1e-2, 0.5, 1234
SHAPE = LoraShape(rank=4, alpha=8.0, targets=("qkv", "proj", "expert_fc1", "expert_fc2"))
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected", "grad_norm")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_moe")
    base = save_hf(qwen3_moe(seed=1), root / "qwen3_moe")
    spec = open_hf_dir(base).spec
    fresh = root / "fresh_adapter"  # PEFT's init, as the engine draws it: the reference run's start
    write_adapter_dir(fresh, initial_adapter(spec, SHAPE, seed=SEED), adapter_config(SHAPE, spec=spec, dropout=0.0, base_model=None))
    return {"root": root, "base": base, "spec": spec, "fresh": fresh, "pairs": make_pairs(STEPS * GLOBAL_BATCH, seed=11)}


# --------------------------------------------------------------------------- the key map
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_expert_adapters_are_peft_target_parameters(family, tmp_path):
    make = {"qwen3_moe": qwen3_moe, "mixtral": mixtral}[family]
    base = save_hf(make(seed=3), tmp_path / "base")
    spec = open_hf_dir(base).spec
    gen = torch.Generator().manual_seed(0)
    for targets in [("qkv", "proj", "expert_fc1", "expert_fc2"), ("expert_fc1",), ("proj", "expert_fc2")]:
        shape = LoraShape(rank=2, alpha=6.0, targets=targets)
        whole = {k: torch.randn(v.shape, generator=gen) for k, v in initial_adapter(spec, shape, seed=0).items()}
        assert set(whole) == set(peft_shapes(spec, shape))
        write_adapter_dir(tmp_path / "a", whole, adapter_config(shape, spec=spec, dropout=0.0, base_model=None))
        assert lora_shape_of(tmp_path / "a", spec=spec) == (shape, 0.0)  # what --init-adapter reads back
        model = peft_model(base, tmp_path / "a", trainable=False)
        loaded = lora_tensors(model)
        assert set(loaded) == set(whole), (targets, sorted(set(loaded) ^ set(whole))[:4])
        for name, value in whole.items():
            assert torch.equal(loaded[name], value), name
        # Each expert's update is its own pair: PEFT's delta of expert e == scaling * B_e @ A_e.
        shard = peft_to_shard(whole.__getitem__, spec=spec, lora=shape, tp=1, tp_rank=0, pp=1, pp_rank=0)
        experts = model.base_model.model.model.layers[1].mlp.experts
        nested = {"expert_fc1", "expert_fc2"} <= set(targets)  # PEFT wraps gate_up_proj first (the inner one)
        wrappers = ({"expert_fc2": experts, "expert_fc1": experts.base_layer} if nested
                    else {t: experts for t in targets if t.startswith("expert_")})
        for target, wrapper in wrappers.items():
            linear, part = ("linear_fc1", "gate_up") if target == "expert_fc1" else ("linear_fc2", "down")
            assert wrapper.parameter_name == ("gate_up_proj" if target == "expert_fc1" else "down_proj")
            delta = wrapper.get_delta_weight("default")
            for e in range(spec.num_experts):
                prefix = f"decoder.layers.1.mlp.experts.local_experts.{e}.{linear}.adapter"
                ours = shape.scaling * shard[f"{prefix}.lora_B_{part}"] @ shard[f"{prefix}.lora_A_{part}"]
                assert_close(ours, delta[e], what=f"{family} {target} expert {e}")
    # Shards <-> whole PEFT tensors over every split (tp 2 splits each expert's fc1 B by gate/up halves).
    for tp, pp, ep in [(1, 1, 1), (2, 2, 1), (1, 2, 2), (2, 1, 4)]:
        shards = {}
        for t in range(tp):
            for p in range(pp):
                for e in range(ep):
                    key = (t, p, e) if ep > 1 else (t, p)
                    shards[key] = peft_to_shard(whole.__getitem__, spec=spec, lora=shape, tp=tp, tp_rank=t, pp=pp,
                                                pp_rank=p, ep=ep, ep_rank=e)
        back = shards_to_peft(shards, spec=spec, lora=shape, tp=tp, pp=pp, ep=ep)
        assert set(back) == set(whole) and all(torch.equal(back[k], whole[k]) for k in whole), (tp, pp, ep)


def test_targets_checked_against_the_base(setup):
    """Which targets a base takes, and the MoE limits, before any process starts (run.prepare
    turns these into one line; the command line cases are below)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from checkpoint_convert.families.base import ConversionError
    from mcore_dpo.model.lora import check_targets, shape_of

    spec = setup["spec"]

    def config(**kw):
        return SimpleNamespace(**{"lora_rank": 4, "lora_alpha": None, "lora_targets": None, "tp": 1, "lora_dropout": 0.0,
                                  **kw})

    assert shape_of(config(lora_targets="experts,qkv")).targets == ("qkv", "expert_fc1", "expert_fc2")
    check_targets(config(lora_targets="qkv,proj,experts"), spec=spec, where="m")
    for kw, message in [({"lora_targets": "qkv,fc2"}, "LoRA target 'fc2' is for dense MLPs"),
                        ({"lora_targets": "qkv,experts", "tp": 2}, "trains at tp 1 only"),
                        ({"lora_targets": "expert_fc2", "lora_dropout": 0.05}, "take no dropout")]:
        with pytest.raises(ConversionError, match=message):
            check_targets(config(**kw), spec=spec, where="m")
    dense = replace(spec, num_experts=0, moe_layers=())
    check_targets(config(lora_targets="qkv,fc1,fc2", tp=2, lora_dropout=0.05), spec=dense, where="m")
    with pytest.raises(ConversionError, match="LoRA target 'expert_fc1' needs a mixture-of-experts model"):
        check_targets(config(lora_targets="qkv,experts"), spec=dense, where="m")


# --------------------------------------------------------------------------- parity
_REFERENCE: dict = {}


def _reference(setup) -> dict:
    """HF + PEFT in one process: the fresh adapter, reference = the adapter disabled."""
    if _REFERENCE:
        return _REFERENCE
    model = peft_model(setup["base"], setup["fresh"], trainable=True)
    params = list(lora_tensors(model).items())
    assert len(params) == len(peft_shapes(setup["spec"], SHAPE))

    class Disabled:
        def __call__(self, **kwargs):
            with model.disable_adapter():
                return model(**kwargs)

    opt = torch.optim.AdamW([p for _, p in params], lr=LR, betas=(0.9, 0.999), eps=ADAM_EPS, weight_decay=WD)
    metrics, grads = [], []
    for k in range(STEPS):
        opt.zero_grad()
        loss, m = loss_and_metrics(model, Disabled(), setup["pairs"][k * GLOBAL_BATCH:(k + 1) * GLOBAL_BATCH],
                                    loss_type="sigmoid", beta=BETA, eps=0.0, reference_free=False)
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in params})
        m["grad_norm"] = float(torch.nn.utils.clip_grad_norm_([p for _, p in params], CLIP))
        metrics.append(m)
        opt.step()
    merged = {n: p.detach().clone() for n, p in model.merge_and_unload().state_dict().items()}
    _REFERENCE.update(metrics=metrics, grads=grads, merged=hub_names(merged, setup["spec"]))
    return _REFERENCE


def _check_metrics(ours: dict, ref: dict, *, what: str) -> None:
    logp_scale = BETA * max(abs(ref["logps/chosen"]), abs(ref["logps/rejected"]))
    for name in METRICS:
        scale = max(abs(ref[name]), logp_scale) if name.startswith("rewards/") and name != "rewards/accuracies" else None
        assert_close(torch.tensor(ours[name]), torch.tensor(ref[name]), what=f"{what} {name}", scale=scale)


@pytest.mark.parametrize("layout", [(1, 1, 1, 1), (1, 2, 2, 2)], ids=lambda l: "tp{}-pp{}-dp{}-ep{}".format(*l))
def test_lora_moe_parity_with_peft(layout, setup, tmp_path):
    tp, pp, dp, ep = layout
    spec, pairs = setup["spec"], setup["pairs"]
    job = {
        "config": dict(model=str(setup["base"]), tp=tp, pp=pp, dp=dp, ep=ep, micro_batch_size=MICRO_BATCH,
                       global_batch_size=GLOBAL_BATCH, max_steps=STEPS, ref_mode="interleaved", lr=LR,
                       adam_eps=ADAM_EPS, timeout_s=60.0, clip_grad=CLIP, weight_decay=WD, beta=BETA, seed=SEED,
                       distributed_optimizer=ep == 1, lora_rank=SHAPE.rank, lora_alpha=SHAPE.alpha,
                       lora_targets="qkv,proj,experts"),
        "batches": [pairs[k * GLOBAL_BATCH:(k + 1) * GLOBAL_BATCH] for k in range(STEPS)],
        "batch_ids": [list(range(k * GLOBAL_BATCH, (k + 1) * GLOBAL_BATCH)) for k in range(STEPS)],
        "all_pairs": pairs, "eval_pairs": [],
    }
    run_ranks(world_size=tp * pp * dp, jobs=[job], out_dir=tmp_path)
    ref = _reference(setup)
    what = "qwen3_moe tp{} pp{} dp{} ep{}".format(*layout)
    assert any(g.abs().max() > 0 for n, g in ref["grads"][1].items() if "experts" in n and "lora_A" in n), what
    ours = json.loads((tmp_path / "job0_metrics.json").read_text())
    for step in range(STEPS):
        _check_metrics(ours[step], ref["metrics"][step], what=f"{what} step {step + 1}")
        for (t, p, d), shard in load_rank_tensors(tmp_path, 0, f"grads{step + 1}", layout=(tp, pp, dp)).items():
            expected = peft_to_shard(ref["grads"][step].__getitem__, spec=spec, lora=SHAPE, tp=tp, tp_rank=t, pp=pp,
                                     pp_rank=p, ep=ep, ep_rank=d % ep)
            assert set(shard) == set(expected), f"{what}: the trainable parameters are not exactly the adapters"
            assert any(".local_experts." in n for n in shard), what
            for name, value in expected.items():
                assert_close(shard[name], value, what=f"{what} step {step + 1} grad {name} (tp{t} pp{p} dp{d})")
    # The router metrics of step 1 (the policy is the base then): the reference forwards run the
    # same module with the adapters off, and must not count as the policy's routing.
    assert GLOBAL_BATCH == parity.GLOBAL_BATCH and MICRO_BATCH == parity.MICRO_BATCH  # engine_groups' microbatches
    check_router_metrics(ours[0], router_metrics(str(setup["base"]), job["batches"][0], groups=engine_groups(dp=dp)),
                         what=f"{what} step 1")
    for (t, p, d), shard in load_rank_tensors(tmp_path, 0, "weights", layout=(tp, pp, dp)).items():
        if d != 0:
            continue
        expected = hf_to_mcore_shard(spec, tp=tp, tp_rank=t, pp=pp, pp_rank=p, ep=ep, ep_rank=0,
                                     get=ref["merged"].__getitem__)
        assert set(shard) == set(expected), what
        for name, value in expected.items():
            assert_close(shard[name], value, what=f"{what} merged weight {name} (tp{t} pp{p})")


# --------------------------------------------------------------------------- the command line
def test_lora_moe_cli_exports_load_in_peft(setup, tmp_path, ray_cluster):
    data = write_prefs(tmp_path / "prefs.jsonl", [{"prompt": f"w{i} w4 w{i + 7}", "chosen": f" w5 w{i}", "rejected": " w6"}
                                                  for i in range(3, 40)])
    out = tmp_path / "out"
    result = main_in_process(["--model", str(setup["base"]), "--data", str(data), "--output-dir", str(out),
                              "--max-steps", "2", "--global-batch-size", "4", "--micro-batch-size", "2", "--eval-interval",
                              "0", "--save-interval", "1", "--save-interval-min", "0", "--lr", "1e-2", "--lora-rank", "4",
                              "--lora-alpha", "8", "--lora-targets", "qkv,proj,expert_fc1,expert_fc2"], cluster=ray_cluster)
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"], config
    # The step-1 checkpoint holds the adapter and its moments PEFT-named (what a resume at any layout reads).
    step1 = out / "checkpoints" / "step_00000001"
    for kind in ("adapter", "optim/exp_avg", "optim/exp_avg_sq"):
        tensors = read_adapter(step1 / "adapter", spec=setup["spec"], lora=SHAPE) if kind == "adapter" else \
            load_file(str(step1 / kind / "adapter_model.safetensors"))
        assert set(tensors) == set(peft_shapes(setup["spec"], SHAPE)), kind
    peft = peft_model(setup["base"], out / "adapter", trainable=False)
    trained = lora_tensors(peft)
    assert set(trained) == set(peft_shapes(setup["spec"], SHAPE))
    assert all(v.abs().max() > 0 for n, v in trained.items() if "lora_B" in n), "the experts' B did not move"
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(out / "hf"), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 7, 9, 11, 13, 5, 21, 30, 8]])
    with torch.no_grad():
        expected = peft.eval()(input_ids=ids).logits
        assert_close(merged(input_ids=ids).logits, expected, what="merged export vs PeftModel logits")
        reference = peft.merge_and_unload().state_dict()
    ours = merged.state_dict()
    for name, value in reference.items():
        if name in ours:
            assert_close(ours[name], value, what=f"merged export {name} vs merge_and_unload()")
    assert set(reference) - set(ours) <= {"lm_head.weight"}, sorted(set(reference) - set(ours))


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("flags,message", [
    (["--lora-rank", "4", "--lora-targets", "qkv,fc1"], "LoRA target 'fc1' is for dense MLPs; on a mixture-of-experts "
                                                         "model use expert_fc1/expert_fc2"),
    (["--lora-rank", "4", "--lora-dropout", "0.1"], "lora_dropout 0.1 with expert targets: PEFT's adapters on the fused "
                                                    "expert parameters take no dropout"),
], ids=["dense-target-on-moe", "dropout-on-experts"])
def test_bad_moe_lora_input_is_one_line(setup, tmp_path, capsys, flags, message):
    import ray

    from mcore_dpo.train import main

    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"w{i} w4", "chosen": " w5", "rejected": " w6"}) + "\n" for i in range(3, 30)))
    code = main(["--model", str(setup["base"]), "--data", str(data), "--output-dir", str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"{setup['base']}/config.json" in err and message in err, err
    assert not ray.is_initialized(), "a worker group was started before the input was checked"
    assert not (tmp_path / "out").exists()
