"""LoRA parity: the parallel engine's LoRA DPO against Hugging Face + PEFT in one process.

Adapters on all four targets (q/k/v, o, gate/up, down), two steps, (tp, pp, dp) = (1,1,1),
(2,2,1), (1,2,2). Two starts per layout:
- a fresh adapter (PEFT's init: A Kaiming-uniform, B zero); the reference is PEFT's
  `disable_adapter()`. Step 1 moves B off zero, so step 2 is a real test of A's gradients.
- a non-zero PEFT adapter (--init-adapter); the reference is a frozen copy of it (TRL 1.16),
  which step 2 compares where policy != reference.
Compared within RTOL: every metric of both steps, every adapter gradient of both steps (every
rank's piece), the merged weights after step 2 against PEFT's `merge_and_unload()`, and the
eval metrics over held-out pairs.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.mapping import hf_to_mcore_shard
from checkpoint_convert.peft_adapter import (TARGET_MAP, TARGETS, LoraShape, adapter_config, adapter_entries,
                                             initial_adapter, peft_to_shard, write_adapter_dir)
from tests.helpers.data import make_pairs
from tests.helpers.models import make_model, save_hf, write_models
from tests.helpers.ranks import load_rank_tensors, run_ranks
from tests.helpers.reference import assert_close, loss_and_metrics

GLOBAL_BATCH, MICRO_BATCH, STEPS = 8, 2, 2
# Step 2 depends on step 1's B = -lr·g/(|g| + eps): an eps far below the gradients' scale turns
# float32 rounding in g into relative errors of lr/eps in B (and in step 2's gradients of A).
LR, CLIP, WD, ADAM_EPS, BETA = 1e-3, 1.0, 0.1, 1e-2, 0.5
SEED = 1234  # TrainConfig's default seed: the fresh adapter's init
SHAPE = LoraShape(rank=4, alpha=8.0, targets=TARGETS)
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected", "grad_norm")
LAYOUTS = [(1, 1, 1), (2, 2, 1), (1, 2, 2)]
EVAL_PAIRS = 5


def peft_modules(shape: LoraShape) -> list[str]:
    return sorted(hf.rsplit(".", 1)[1] for t in shape.targets for _, hf in TARGET_MAP[t][2])


def random_adapter(spec, shape: LoraShape, *, seed: int) -> dict[str, torch.Tensor]:
    """A non-zero adapter (B too), PEFT-named: what a LoRA SFT run would leave."""
    gen = torch.Generator().manual_seed(seed)
    init = initial_adapter(spec, shape, seed=seed)
    return {k: 0.2 * torch.randn(v.shape, generator=gen) for k, v in init.items()}


def peft_model(base_dir: Path, state: dict[str, torch.Tensor], shape: LoraShape):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=shape.rank, lora_alpha=shape.alpha, lora_dropout=0.0,
                                            target_modules=peft_modules(shape)))
    result = set_peft_model_state_dict(model, state)
    assert not result.unexpected_keys, result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k]
    return model


def saved_name(name: str) -> str:
    return name.replace(".default.weight", ".weight")


class _Disabled:
    """PEFT's base model as the reference: the policy with its adapter switched off."""

    def __init__(self, model):
        self.model = model

    def __call__(self, **kwargs):
        with self.model.disable_adapter():
            return self.model(**kwargs)


def peft_reference_run(*, base_dir: Path, state: dict, frozen_reference: bool, batches, eval_pairs) -> dict:
    model = peft_model(base_dir, state, SHAPE)
    reference = copy.deepcopy(model).eval() if frozen_reference else _Disabled(model)
    params = [(saved_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    assert len(params) == len(state)
    opt = torch.optim.AdamW([p for _, p in params], lr=LR, betas=(0.9, 0.999), eps=ADAM_EPS, weight_decay=WD)
    kw = dict(loss_type="sigmoid", beta=BETA, eps=0.0, reference_free=False)
    metrics, grads = [], []
    for pairs in batches:
        opt.zero_grad()
        loss, m = loss_and_metrics(model, reference, pairs, **kw)
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in params})
        m["grad_norm"] = float(torch.nn.utils.clip_grad_norm_([p for _, p in params], CLIP))
        metrics.append(m)
        opt.step()
    with torch.no_grad():
        _, eval_metrics = loss_and_metrics(model, reference, list(eval_pairs), **kw)
    merged = {n: p.detach().clone() for n, p in model.merge_and_unload().state_dict().items()}
    return {"metrics": metrics, "grads": grads, "eval": eval_metrics, "merged": merged}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_parity")
    found = {"pairs": make_pairs(STEPS * GLOBAL_BATCH + EVAL_PAIRS, seed=11)}
    for family in ("llama", "qwen2"):  # qwen2: q/k/v biases and tied embeddings (frozen under LoRA)
        base, _ = write_models(family, root)
        spec = open_hf_dir(base).spec
        init_dir = root / f"{family}_init_adapter"
        write_adapter_dir(init_dir, random_adapter(spec, SHAPE, seed=5), adapter_config(SHAPE, spec=spec, dropout=0.0, base_model=None))
        found[family] = {"base": base, "spec": spec, "init_dir": init_dir}
    return found


def _jobs(layout, setup) -> list[dict]:
    tp, pp, dp = layout
    pairs = setup["pairs"]
    train, held_out = pairs[: STEPS * GLOBAL_BATCH], pairs[STEPS * GLOBAL_BATCH:]
    jobs = []
    # (1,1,1) also runs the sequential reference slot; (2,2,1) Qwen2 (q/k/v biases, tied embeddings).
    # The replicated optimizer (--no-distributed-optimizer) is covered by tests/test_lora_cli.py.
    # (1,2,2) also runs --prefix-sharing: the reference as the adapter-off view over shared rows.
    variants = [("llama", "fresh", "interleaved", True, False), ("llama", "init", "interleaved", True, False)]
    variants += [("llama", "init", "sequential", True, False)] if layout == (1, 1, 1) else []
    variants += [("qwen2", "init", "interleaved", True, False)] if layout == (2, 2, 1) else []
    variants += [("llama", "fresh", "interleaved", True, True)] if layout == (1, 2, 2) else []
    for family, start, mode, sharded, shared in variants:
        jobs.append({
            "key": (family, start, mode, sharded, shared),
            "config": dict(model=str(setup[family]["base"]), tp=tp, pp=pp, dp=dp, micro_batch_size=MICRO_BATCH,
                           global_batch_size=GLOBAL_BATCH, max_steps=STEPS, ref_mode=mode, lr=LR, adam_eps=ADAM_EPS,
                           timeout_s=60.0, clip_grad=CLIP, weight_decay=WD, beta=BETA, seed=SEED,
                           distributed_optimizer=sharded, lora_rank=SHAPE.rank, lora_alpha=SHAPE.alpha,
                           lora_targets=",".join(SHAPE.targets),
                           init_adapter=str(setup[family]["init_dir"]) if start == "init" else None,
                           prefix_sharing=shared),
            "batches": [train[k * GLOBAL_BATCH:(k + 1) * GLOBAL_BATCH] for k in range(STEPS)],
            "batch_ids": [list(range(k * GLOBAL_BATCH, (k + 1) * GLOBAL_BATCH)) for k in range(STEPS)],
            "all_pairs": train, "eval_pairs": held_out,
        })
    return jobs


_REFERENCES: dict = {}


def _reference(setup, family: str, start: str) -> dict:
    if (family, start) not in _REFERENCES:
        from safetensors.torch import load_file

        model = setup[family]
        state = (load_file(str(model["init_dir"] / "adapter_model.safetensors")) if start == "init"
                 else initial_adapter(model["spec"], SHAPE, seed=SEED))
        train = setup["pairs"][: STEPS * GLOBAL_BATCH]
        _REFERENCES[(family, start)] = peft_reference_run(
            base_dir=model["base"], state=state, frozen_reference=start == "init",
            batches=[train[k * GLOBAL_BATCH:(k + 1) * GLOBAL_BATCH] for k in range(STEPS)],
            eval_pairs=setup["pairs"][STEPS * GLOBAL_BATCH:])
    return _REFERENCES[(family, start)]


def _check_metrics(ours: dict, ref: dict, *, prefix: str, names, what: str) -> None:
    logp_scale = BETA * max(abs(ref["logps/chosen"]), abs(ref["logps/rejected"]))
    for name in names:
        scale = max(abs(ref[name]), logp_scale) if name.startswith("rewards/") and name != "rewards/accuracies" else None
        assert_close(torch.tensor(ours[prefix + name]), torch.tensor(ref[name]), what=f"{what} {prefix}{name}", scale=scale)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"tp{l[0]}-pp{l[1]}-dp{l[2]}")
def test_lora_parity_with_peft(layout, setup, tmp_path):
    tp, pp, dp = layout
    jobs = _jobs(layout, setup)
    run_ranks(world_size=tp * pp * dp, jobs=jobs, out_dir=tmp_path)
    for j, job in enumerate(jobs):
        family, start = job["key"][:2]
        spec = setup[family]["spec"]
        ref = _reference(setup, family, start)
        what = f"{job['key']} at tp{tp} pp{pp} dp{dp}"
        if start == "fresh":  # step 1 must have moved B off zero, else step 2 tests nothing new
            assert any(g.abs().max() > 0 for n, g in ref["grads"][1].items() if "lora_A" in n), what
        ours = json.loads((tmp_path / f"job{j}_metrics.json").read_text())
        for step in range(STEPS):
            _check_metrics(ours[step], ref["metrics"][step], prefix="", names=METRICS, what=f"{what} step {step + 1}")
            shards = load_rank_tensors(tmp_path, j, f"grads{step + 1}", layout=layout)
            for (t, p, d), shard in shards.items():
                expected = peft_to_shard(ref["grads"][step].__getitem__, spec=spec, lora=SHAPE, tp=tp, tp_rank=t, pp=pp,
                                         pp_rank=p)
                assert set(shard) == set(expected), f"{what}: the trainable parameters are not exactly the adapters"
                for name, value in expected.items():
                    assert_close(shard[name], value, what=f"{what} step {step + 1} grad {name} (tp{t} pp{p} dp{d})")
        _check_metrics(ours[STEPS], ref["eval"], prefix="eval/", names=METRICS[:-1], what=f"{what} eval")
        for (t, p, d), shard in load_rank_tensors(tmp_path, j, "weights", layout=layout).items():
            if d != 0:
                continue
            expected = hf_to_mcore_shard(spec, tp=tp, tp_rank=t, pp=pp, pp_rank=p, get=ref["merged"].__getitem__)
            assert set(shard) == set(expected), what
            for name, value in expected.items():
                assert_close(shard[name], value, what=f"{what} merged weight {name} (tp{t} pp{p})")


def test_adapter_names_cover_every_peft_module():
    """The key map names PEFT's own parameters: a PEFT model on the same base has exactly them."""
    import tempfile

    spec_entries = None
    with tempfile.TemporaryDirectory() as d:
        base = save_hf(make_model("llama", seed=1), Path(d) / "m")
        spec = open_hf_dir(base).spec
        model = peft_model(base, initial_adapter(spec, SHAPE, seed=0), SHAPE)
        spec_entries = {peft for _, peft, _, _, _ in adapter_entries(spec, SHAPE, pp=1, pp_rank=0)}
        assert spec_entries == {saved_name(n) for n, p in model.named_parameters() if p.requires_grad}
