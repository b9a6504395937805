"""LoRA parity: jobs of the engine's LoRA DPO on real ranks (`lora_job`) and their check
(`check_lora_job`) against Hugging Face + PEFT in one process (`peft_reference_run`).

The reference of a fresh adapter (PEFT's init: A Kaiming-uniform, B zero) is PEFT's
`disable_adapter()`; the reference of a non-zero PEFT adapter (--init-adapter) is a frozen copy of
it (TRL 1.16). Compared within RTOL: every metric of every step, every adapter gradient of every
step (every rank's piece), the merged weights after the last step against PEFT's
`merge_and_unload()`, and the eval metrics over held-out pairs.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from checkpoint_convert.mapping import hf_to_mcore_shard
from checkpoint_convert.peft_adapter import TARGET_MAP, TARGETS, LoraShape, initial_adapter, peft_to_shard
from tests.helpers.ranks import load_rank_tensors
from tests.helpers.reference import assert_close, loss_and_metrics

GLOBAL_BATCH, MICRO_BATCH, STEPS = 8, 2, 2
# Step 2 depends on step 1's B = -lr·g/(|g| + eps): an eps far below the gradients' scale turns
# float32 rounding in g into relative errors of lr/eps in B (and in step 2's gradients of A).
LR, CLIP, WD, ADAM_EPS, BETA = 1e-3, 1.0, 0.1, 1e-2, 0.5
SEED = 1234  # TrainConfig's default seed: the fresh adapter's init
SHAPE = LoraShape(rank=4, alpha=8.0, targets=TARGETS)
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected", "grad_norm")
EVAL_PAIRS = 5


def peft_modules(shape: LoraShape) -> list[str]:
    return sorted(hf.rsplit(".", 1)[1] for t in shape.targets for _, hf in TARGET_MAP[t][2])


def random_adapter(spec, shape: LoraShape, *, seed: int) -> dict[str, torch.Tensor]:
    """A non-zero adapter (B too), PEFT-named: what a LoRA SFT run would leave."""
    gen = torch.Generator().manual_seed(seed)
    init = initial_adapter(spec, shape, seed=seed)
    return {k: 0.2 * torch.randn(v.shape, generator=gen) for k, v in init.items()}


def peft_model(base_dir: Path, state: dict[str, torch.Tensor], shape: LoraShape, *,
               base: torch.nn.Module | None = None, task_type: str | None = None):
    """The HF model `base` (default: the causal LM at `base_dir`, fp32) under PEFT's LoRA of
    `shape` with the adapter tensors `state`. `task_type`: PEFT's ("SEQ_CLS" for a reward model:
    PEFT then trains its score head whole, modules_to_save, from the value `base` holds)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    if base is None:
        base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=shape.rank, lora_alpha=shape.alpha, lora_dropout=0.0,
                                            target_modules=peft_modules(shape), task_type=task_type))
    # The modules PEFT trains whole (a SEQ_CLS model's score head) keep the value `base` gave them.
    result = set_peft_model_state_dict(model, {**get_peft_model_state_dict(model), **state})
    assert not result.unexpected_keys, result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k]
    return model


def fresh_peft_model(base_dir: Path, **kwargs):
    """peft_model with the fresh adapter the engine draws (every target, TrainConfig's default
    seed); `kwargs`: peft_model's `base` and `task_type`."""
    from checkpoint_convert.io import open_hf_dir

    return peft_model(base_dir, initial_adapter(open_hf_dir(base_dir).spec, SHAPE, seed=SEED), SHAPE, **kwargs)


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
    """HF + PEFT + TRL's formulas: the metrics and adapter gradients of every step, the eval
    metrics after the last and the merged weights."""
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


def peft_reference(*, base_dir: Path, spec, init_dir: Path | None, pairs) -> dict:
    """peft_reference_run over `pairs` (STEPS global batches, then the held-out ones) from a
    fresh adapter (init_dir None) or from the PEFT adapter directory init_dir."""
    from safetensors.torch import load_file

    state = (load_file(str(init_dir / "adapter_model.safetensors")) if init_dir is not None
             else initial_adapter(spec, SHAPE, seed=SEED))
    train = pairs[: STEPS * GLOBAL_BATCH]
    return peft_reference_run(base_dir=base_dir, state=state, frozen_reference=init_dir is not None,
                              batches=[train[k * GLOBAL_BATCH:(k + 1) * GLOBAL_BATCH] for k in range(STEPS)],
                              eval_pairs=pairs[STEPS * GLOBAL_BATCH:])


def lora_job(layout: tuple[int, ...], *, key: tuple, base_dir: Path, init_dir: Path | None, pairs, **config) -> dict:
    """A LoRA job on every target (sharded optimizer, interleaved reference unless `config` says
    otherwise): STEPS global batches of `pairs`, then the rest held out. `layout` is (tp, pp, dp)
    or (tp, pp, dp, cp)."""
    tp, pp, dp = layout[:3]
    train, held_out = pairs[: STEPS * GLOBAL_BATCH], pairs[STEPS * GLOBAL_BATCH:]
    settings = dict(model=str(base_dir), tp=tp, pp=pp, dp=dp, micro_batch_size=MICRO_BATCH,
                    global_batch_size=GLOBAL_BATCH, max_steps=STEPS, ref_mode="interleaved", lr=LR, adam_eps=ADAM_EPS,
                    timeout_s=60.0, clip_grad=CLIP, weight_decay=WD, beta=BETA, seed=SEED, distributed_optimizer=True,
                    lora_rank=SHAPE.rank, lora_alpha=SHAPE.alpha, lora_targets=",".join(SHAPE.targets),
                    init_adapter=str(init_dir) if init_dir is not None else None)
    if len(layout) > 3:
        settings["cp"] = layout[3]
    settings.update(config)
    return {
        "key": key,
        "config": settings,
        "batches": [train[k * GLOBAL_BATCH:(k + 1) * GLOBAL_BATCH] for k in range(STEPS)],
        "batch_ids": [list(range(k * GLOBAL_BATCH, (k + 1) * GLOBAL_BATCH)) for k in range(STEPS)],
        "all_pairs": train, "eval_pairs": held_out,
    }


def check_metrics(ours: dict, ref: dict, *, prefix: str, names, what: str) -> None:
    logp_scale = BETA * max(abs(ref["logps/chosen"]), abs(ref["logps/rejected"]))
    for name in names:
        scale = max(abs(ref[name]), logp_scale) if name.startswith("rewards/") and name != "rewards/accuracies" else None
        assert_close(torch.tensor(ours[prefix + name]), torch.tensor(ref[name]), what=f"{what} {prefix}{name}", scale=scale)


def check_lora_job(out_dir: Path, j: int, job: dict, layout: tuple[int, int, int], *, ref: dict, spec, what: str,
                   vpp: int = 1) -> None:
    """Job j of a run_ranks launch against its peft_reference_run (module docstring); `layout` is
    (tp, pp, dp), whose files are those of cp rank 0 at cp > 1; `vpp`: model chunks per pipeline
    rank, each chunk's part that of its virtual stage (model/chunks.py)."""
    from mcore_dpo.model.chunks import rank_shard
    from mcore_dpo.parallel.mesh import Layout

    tp, pp, _ = layout
    chunked = Layout(tp=tp, pp=pp, dp=layout[2], vpp=vpp)
    if job["config"].get("init_adapter") is None:  # step 1 must have moved B off zero, else step 2 tests nothing new
        assert any(g.abs().max() > 0 for n, g in ref["grads"][1].items() if "lora_A" in n), what
    ours = json.loads((out_dir / f"job{j}_metrics.json").read_text())
    for step in range(STEPS):
        check_metrics(ours[step], ref["metrics"][step], prefix="", names=METRICS, what=f"{what} step {step + 1}")
        shards = load_rank_tensors(out_dir, j, f"grads{step + 1}", layout=layout)
        for (t, p, d), shard in shards.items():
            expected = rank_shard(lambda pp_, stage: peft_to_shard(ref["grads"][step].__getitem__, spec=spec, lora=SHAPE,
                                                                   tp=tp, tp_rank=t, pp=pp_, pp_rank=stage),
                                  layout=chunked, pp_rank=p)
            assert set(shard) == set(expected), f"{what}: the trainable parameters are not exactly the adapters"
            for name, value in expected.items():
                assert_close(shard[name], value, what=f"{what} step {step + 1} grad {name} (tp{t} pp{p} dp{d})")
    check_metrics(ours[STEPS], ref["eval"], prefix="eval/", names=METRICS[:-1], what=f"{what} eval")
    for (t, p, d), shard in load_rank_tensors(out_dir, j, "weights", layout=layout).items():
        if d != 0:
            continue
        expected = rank_shard(lambda pp_, stage: hf_to_mcore_shard(spec, tp=tp, tp_rank=t, pp=pp_, pp_rank=stage,
                                                                   get=ref["merged"].__getitem__),
                              layout=chunked, pp_rank=p)
        assert set(shard) == set(expected), what
        for name, value in expected.items():
            assert_close(shard[name], value, what=f"{what} merged weight {name} (tp{t} pp{p})")
