"""LoRA on DeepSeek-V3, GPT-OSS, Gemma 3 and GLM-4.5 against Hugging Face + PEFT 0.21 in one
process: a job that joins a family's parity launch (`lora_job`), its reference (`peft_reference`)
and its checks (`check_lora_job`).

The job starts from a non-zero PEFT adapter (--init-adapter; A and B random, as a LoRA SFT run
leaves one) on every target the base has: on MLA (DeepSeek-V3) `qkv` is its q_a/q_b/kv_a/kv_b
projections, on the MoE families the experts' fused parameters (GPT-OSS's gate/up interleaved).
The reference is the adapter's frozen starting copy (the engine's `ReferenceView` "frozen", TRL's
frozen copy of a loaded adapter). The step then runs every adapter's update in the policy forward
(B is not zero: a wrong placement of any part moves the log-probs) and moves both A and B.

Checked within RTOL: every metric of the step, every rank's adapter gradients and its adapters
after the step (each expert-parallel rank its own experts), dp rank 0's merged weights against
PEFT's `merge_and_unload()`. And the export: the ranks' adapters joined as the driver joins
them (`shards_to_peft`, `adapter_config`) load with `PeftModel.from_pretrained` on the HF source
with no missing or unexpected keys, as exactly the tensors written.

`peft_model`, `lora_tensors` and `hub_names` (an adapter loaded in PEFT, its tensors under their
saved names and under the hub's per-expert names) serve tests/test_lora_moe.py as well.
"""

from __future__ import annotations

import copy
import json
import warnings
from functools import lru_cache
from pathlib import Path

import torch

from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.gather import fused_hf_sources
from checkpoint_convert.mapping import hf_to_mcore_shard
from checkpoint_convert.peft_adapter import (LoraShape, adapter_config, initial_adapter, lora_shape_of, peft_to_shard,
                                             shards_to_peft, targets_present, write_adapter_dir)
from tests.helpers import parity
from tests.helpers.ranks import load_rank_tensors
from tests.helpers.reference import RTOL, assert_close, loss_and_metrics

STEPS = 1
RANK, ALPHA = 4, 8.0
# Adam's first update is -lr·g/(|g| + eps) per element: an eps far below the gradients' scale
# turns float32 rounding in near-zero gradient elements into lr-sized differences of the adapters.
ADAM_EPS = 1e-2


def shape_of(spec) -> LoraShape:
    """Every target the base has (dense: qkv, proj, fc1, fc2; MoE: qkv, proj and the experts)."""
    return LoraShape(rank=RANK, alpha=ALPHA, targets=targets_present(spec))


def write_init_adapter(base_dir: Path, directory: Path, *, seed: int) -> Path:
    """A PEFT adapter directory of random A and B (0.2 N(0, 1)) on `shape_of` the base."""
    spec = open_hf_dir(base_dir).spec
    shape = shape_of(spec)
    gen = torch.Generator().manual_seed(seed)
    tensors = {k: 0.2 * torch.randn(v.shape, generator=gen) for k, v in initial_adapter(spec, shape, seed=seed).items()}
    write_adapter_dir(directory, tensors, adapter_config(shape, spec=spec, dropout=0.0, base_model=None))
    assert lora_shape_of(directory, spec=spec) == (shape, 0.0)  # what --init-adapter reads back
    return directory


def lora_job(layout: tuple[int, int, int, int], base_dir: Path, init_dir: Path, *, name: str) -> dict:
    """A LoRA DPO step from `init_dir` on `base_dir` at (tp, pp, dp, ep), the reference the
    adapter's frozen copy; parity_job's batches, learning rate and clipping, no evaluation."""
    shape = shape_of(open_hf_dir(base_dir).spec)
    job = parity.parity_job(layout, base_dir, base_dir, name=f"{name} lora", steps=STEPS, ep=layout[3],
                            lora_rank=shape.rank, lora_alpha=shape.alpha, lora_targets=",".join(shape.targets),
                            init_adapter=str(init_dir), export_hf=False, distributed_optimizer=layout[3] == 1)
    job["config"].update(ref_model=None, adam_eps=ADAM_EPS)  # the reference: the policy's own module, adapters frozen
    job["eval_pairs"] = []
    return job


def peft_model(base_dir: Path, adapter_dir: Path, *, trainable: bool, dtype: torch.dtype = torch.float32):
    """PeftModel.from_pretrained, checked to load every tensor (no missing or unexpected key)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=trainable)
    problems = [str(w.message) for w in caught if "missing" in str(w.message).lower() or "unexpected" in str(w.message).lower()]
    assert not problems, problems
    return peft


def lora_tensors(model) -> dict[str, torch.Tensor]:
    """A PEFT model's adapter tensors under their saved names (no adapter name)."""
    return {n.replace(".default.weight", ".weight"): p for n, p in model.named_parameters() if ".lora_" in n}


def hub_names(tensors: dict[str, torch.Tensor], spec) -> dict[str, torch.Tensor]:
    """transformers 5's fused expert tensors also under the hub's per-expert names (the key map's)."""
    out = dict(tensors)
    for name, (stored, expert, part, parts) in fused_hf_sources(spec, stored=set(tensors)).items():
        tensor = tensors[stored] if expert is None else tensors[stored][expert]
        out[name] = tensor.chunk(parts, dim=0)[part]
    return out


@lru_cache(maxsize=None)
def peft_reference(base_dir: str, init_dir: str, dtype: torch.dtype = torch.float32) -> dict:
    """HF + PEFT + TRL's sigmoid loss in one process over `lora_job`'s batches: the metrics, the
    adapter gradients of each step, the adapters after the last and the merged weights (fp32)."""
    train, _ = parity.parity_data(steps=STEPS, mode="interleaved")
    batches = [train[k * parity.GLOBAL_BATCH:(k + 1) * parity.GLOBAL_BATCH] for k in range(STEPS)]
    model = peft_model(Path(base_dir), Path(init_dir), trainable=True, dtype=dtype)
    reference = copy.deepcopy(model).eval()  # the frozen starting copy
    params = list(lora_tensors(model).items())
    assert params and all(p.requires_grad for _, p in params)
    opt = torch.optim.AdamW([p for _, p in params], lr=parity.LR, betas=(0.9, 0.999), eps=ADAM_EPS,
                            weight_decay=parity.WD)
    kw = parity.loss_kwargs("sigmoid")
    metrics, grads = [], []
    for pairs in batches:
        opt.zero_grad()
        loss, m = loss_and_metrics(model, reference, pairs, loss_type="sigmoid", beta=kw["beta"], eps=0.0,
                                   reference_free=False)
        loss.backward()
        grads.append({n: p.grad.detach().float().clone() for n, p in params})
        m["grad_norm"] = float(torch.nn.utils.clip_grad_norm_([p for _, p in params], parity.CLIP))
        metrics.append(m)
        opt.step()
    adapters = {n: p.detach().float().clone() for n, p in params}
    merged = {n: p.detach().float().clone() for n, p in model.merge_and_unload().state_dict().items()}
    return {"metrics": metrics, "grads": grads, "adapters": adapters,
            "merged": hub_names(merged, open_hf_dir(base_dir).spec)}


def check_lora_job(out_dir: Path, j: int, job: dict, layout: tuple[int, int, int, int], *,
                   dtype: torch.dtype = torch.float32) -> None:
    """Job j of a launch (`lora_job`) against `peft_reference` (module docstring); `dtype`: the
    reference's (GPT-OSS's float64: tests/helpers/gpt_oss.float64_reference says why)."""
    from mcore_dpo.parallel.mesh import Layout

    tp, pp, dp, ep = layout
    config = job["config"]
    base, init_dir = Path(config["model"]), Path(config["init_adapter"])
    spec = open_hf_dir(base).spec
    shape = shape_of(spec)
    ref = peft_reference(str(base), str(init_dir), dtype)
    ep_rank_of = Layout(tp=tp, pp=pp, dp=dp, ep=ep).ep_rank_of
    what = f"{spec.family} LoRA at tp{tp} pp{pp} dp{dp} ep{ep}"

    def expected(tensors: dict, t: int, p: int, d: int) -> dict:
        return peft_to_shard(tensors.__getitem__, spec=spec, lora=shape, tp=tp, tp_rank=t, pp=pp, pp_rank=p, ep=ep,
                             ep_rank=ep_rank_of(tp_rank=t, dp_rank=d))

    ours = json.loads((out_dir / f"job{j}_metrics.json").read_text())
    assert len(ours) == STEPS, what
    for step in range(STEPS):
        parity.check_metrics(ours[step], ref["metrics"][step], names=parity.METRICS, prefix="",
                             what=f"{what} step {step + 1}", rtol=RTOL)
        for (t, p, d), shard in load_rank_tensors(out_dir, j, f"grads{step + 1}", layout=(tp, pp, dp)).items():
            want = expected(ref["grads"][step], t, p, d)
            assert set(shard) == set(want), f"{what}: the trainable parameters are not exactly the adapters"
            for name, value in want.items():
                assert_close(shard[name], value, what=f"{what} step {step + 1} grad {name} (tp{t} pp{p} dp{d})")
    adapters = load_rank_tensors(out_dir, j, "adapters", layout=(tp, pp, dp))
    for (t, p, d), shard in adapters.items():
        want = expected(ref["adapters"], t, p, d)
        assert set(shard) == set(want), what
        for name, value in want.items():
            assert_close(shard[name], value, what=f"{what} adapter {name} after {STEPS} steps (tp{t} pp{p} dp{d})")
    for (t, p, d), shard in load_rank_tensors(out_dir, j, "weights", layout=(tp, pp, dp)).items():
        if d != 0:
            continue  # dp rank 0 writes the merged weights (its ep rank's experts)
        want = hf_to_mcore_shard(spec, tp=tp, tp_rank=t, pp=pp, pp_rank=p, ep=ep, ep_rank=ep_rank_of(tp_rank=t, dp_rank=0),
                                 get=ref["merged"].__getitem__)
        assert set(shard) == set(want), what
        for name, value in want.items():
            assert_close(shard[name], value, what=f"{what} merged weight {name} after {STEPS} steps (tp{t} pp{p})")
    # The export: every (tp, pp, ep) shard from a rank that holds it, joined into PEFT's tensors.
    holders = {}
    for (t, p, d), shard in adapters.items():
        holders.setdefault((t, p, ep_rank_of(tp_rank=t, dp_rank=d)) if ep > 1 else (t, p), shard)
    whole = shards_to_peft(holders, spec=spec, lora=shape, tp=tp, pp=pp, ep=ep)
    assert set(whole) == set(ref["adapters"]), (what, sorted(set(whole) ^ set(ref["adapters"]))[:4])
    exported = out_dir / f"job{j}_adapter"
    write_adapter_dir(exported, whole, adapter_config(shape, spec=spec, dropout=0.0, base_model=str(base)))
    loaded = lora_tensors(peft_model(base, exported, trainable=False))
    assert set(loaded) == set(whole), (what, sorted(set(loaded) ^ set(whole))[:4])
    for name, value in whole.items():
        assert torch.equal(loaded[name], value), f"{what}: exported {name} did not load as written"
