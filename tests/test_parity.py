"""Parity: the parallel engine against a single-process Hugging Face reference.

For each (tp, pp, dp) one set of real gloo ranks runs many jobs (model family x ref mode x
loss). Each job trains two steps (four at pp 4) on global batches with uneven lengths and
padding, then evaluates held-out pairs; the policy and reference start from different weights.
Compared with a reference written from TRL's formulas (tests/parity.py): every metric of every
step, the gradient of every policy parameter at every step (from every rank's file), the weights
after the last optimizer step, and the eval metrics over all held-out pairs.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.mapping import hf_to_mcore_shard
from mcore_dpo.loss import LOSS_TYPES
from mcore_dpo.schedule import OpKind, build_plan
from parity import (REFERENCE_LOSS_TYPES, RTOL, assert_close, load_rank_tensors, make_pairs, reference_run, run_ranks,
                    write_models)

GLOBAL_BATCH = 8
MICRO_BATCH = 2
LR = 1e-3
CLIP = 1.0
WD = 0.1
# Adam's first step is sign(g)*lr: gradient elements that are zero up to rounding would flip
# whole lr-sized updates. An eps above that rounding keeps the update continuous in g.
ADAM_EPS = 1e-4
BETA = 0.5
FAMILIES = ("llama", "qwen2")
MODES = ("interleaved", "sequential", "precomputed")
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected", "grad_norm")

# Each layout runs a code path the others do not:
#   (1,1,1) no parallelism: the engine's batching, loss and optimizer alone;
#   (2,1,1) tensor parallelism alone (vocab-parallel logits and log-probs, no pipeline);
#   (2,2,1) tp x pp: every loss type through the pipeline's last stage (all_losses);
#   (1,1,2) data parallelism alone (gradient reduction, dp-sharded optimizer, a rank's eval share);
#   (2,2,2) tp x pp x dp together, and --ref-mode separate feeding a dp-split policy.
# Pipeline parallelism without tp runs at pp 4 below (warm-up, steady-state interleaving and
# carrying, every reference mode); a separate pp-2 layout would repeat that path.
LAYOUTS = [(1, 1, 1), (2, 1, 1), (2, 2, 1), (1, 1, 2), (2, 2, 2)]
# Sequence parallelism (megatron-core `sequence_parallel`): jobs with it on join the launch of
# these layouts (tp 2, and tp 2 x pp 2): untied Llama with GQA and tied Qwen2 with qkv bias, the
# three colocated reference modes.
SEQUENCE_PARALLEL = {(2, 1, 1): [("llama", "interleaved", "sigmoid"), ("qwen2", "sequential", "ipo"),
                                 ("qwen2", "precomputed", "sigmoid")],
                     (2, 2, 1): [("llama", "interleaved", "sigmoid"), ("qwen2", "interleaved", "ipo")]}
# At 8 ranks every (family, mode), (family, loss) and (mode, loss) pair runs once rather than
# every triple: no code path there depends on all three together, and the full product runs at
# the smaller layouts.
PAIRWISE = {(2, 2, 2): [("llama", "interleaved", "sigmoid"), ("qwen2", "interleaved", "ipo"),
                        ("llama", "sequential", "ipo"), ("qwen2", "sequential", "sigmoid"),
                        ("llama", "precomputed", "sigmoid"), ("qwen2", "precomputed", "ipo"),
                        ("llama", "separate", "ipo"), ("qwen2", "separate", "sigmoid")]}
PP4 = (1, 4, 1)
PP4_STEPS = 4
# --ref-mode separate: the reference on a group of its own layout (tp 2), fed to the policy.
SEPARATE_LAYOUTS = ((2, 2, 2), PP4)
REF_GROUP = {"ref_tp": 2, "ref_pp": 1, "ref_dp": 1}
# Held-out pairs, evaluated after the last step: not a multiple of the global batch, so the last
# chunk is partial (at dp 2 a rank's share also ends in a smaller microbatch). Precomputed mode
# takes one fewer: its reference table pass needs equal microbatches at pp > 1.
EVAL_PAIRS = 13


def _loss_kwargs(loss_type: str) -> dict:
    smoothing = {"robust": 0.1, "exo_pair": 0.1, "cdpo": 0.1}.get(loss_type, 0.0)
    return {"loss_type": loss_type, "label_smoothing": smoothing, "beta": BETA}


def _data(*, steps: int, mode: str) -> tuple[list, list]:
    """The training pairs of `steps` global batches (uneven lengths, padding) and the eval pairs."""
    pairs = make_pairs(PP4_STEPS * GLOBAL_BATCH + EVAL_PAIRS, seed=7)
    held_out = pairs[PP4_STEPS * GLOBAL_BATCH:]
    return pairs[: steps * GLOBAL_BATCH], held_out[: EVAL_PAIRS - (mode == "precomputed")]


def _jobs_for(layout, models: dict, *, all_losses: bool, steps: int = 2, losses=("sigmoid", "ipo")) -> list[dict]:
    tp, pp, dp = layout
    modes = MODES + (("separate",) if layout in SEPARATE_LAYOUTS else ())
    jobs = []
    combos = [(f, m, l) for f in FAMILIES for m in modes for l in losses]
    if all_losses:
        combos += [("llama", "interleaved", l) for l in LOSS_TYPES if l not in ("sigmoid", "ipo")]
        combos += [("qwen2", "none", "sigmoid")]  # reference-free
    for family, mode, loss in combos:
        policy_dir, ref_dir = models[family]
        train, held_out = _data(steps=steps, mode=mode)
        jobs.append({
            "key": (family, mode, loss),
            "config": dict(model=str(policy_dir), ref_model=str(ref_dir), tp=tp, pp=pp, dp=dp,
                           micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH, max_steps=steps,
                           ref_mode=mode, lr=LR, adam_eps=ADAM_EPS, timeout_s=60.0, clip_grad=CLIP, weight_decay=WD,
                           **(REF_GROUP if mode == "separate" else {}), **_loss_kwargs(loss)),
            "batches": [train[k * GLOBAL_BATCH:(k + 1) * GLOBAL_BATCH] for k in range(steps)],
            "batch_ids": [list(range(k * GLOBAL_BATCH, (k + 1) * GLOBAL_BATCH)) for k in range(steps)],
            "all_pairs": train, "eval_pairs": held_out,
        })
    return jobs


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity_models")
    return {family: write_models(family, root) for family in FAMILIES}


@lru_cache(maxsize=None)
def _reference(policy_dir: str, ref_dir: str, loss_type: str, ref_mode: str, steps: int):
    kw = _loss_kwargs(loss_type)
    train, held_out = _data(steps=steps, mode=ref_mode)
    return reference_run(policy_dir=Path(policy_dir), ref_dir=Path(ref_dir),
                         batches=[train[k * GLOBAL_BATCH:(k + 1) * GLOBAL_BATCH] for k in range(steps)],
                         loss_type=loss_type, beta=kw["beta"], label_smoothing=kw["label_smoothing"],
                         reference_free=ref_mode == "none", lr=LR, clip_grad=CLIP, weight_decay=WD, adam_eps=ADAM_EPS,
                         eval_pairs=held_out)


def _check_metrics(m_ours: dict, m_ref: dict, *, names, prefix: str, what: str, rtol: float,
                   reference_free: bool = False) -> None:
    # Rewards and margins are differences of summed log-probs (cancellation): their error is
    # measured relative to the magnitude of the beta-scaled log-probs they are made of.
    logp_scale = BETA * max(abs(m_ref["logps/chosen"]), abs(m_ref["logps/rejected"]))
    for name in names:
        if reference_free and name.startswith("rewards/"):  # no reference, no rewards logged
            assert prefix + name not in m_ours, f"{what} {prefix}{name}"
            continue
        scale = max(abs(m_ref[name]), logp_scale) if name.startswith("rewards/") and name != "rewards/accuracies" else None
        assert_close(torch.tensor(m_ours[prefix + name]), torch.tensor(m_ref[name]), what=f"{what} {prefix}{name}",
                     scale=scale, rtol=rtol)


def _check_job(out_dir: Path, j: int, job: dict, layout, rtol: float = RTOL) -> None:
    tp, pp, dp = layout
    family, mode, loss = job["key"]
    steps = len(job["batches"])
    ref = _reference(job["config"]["model"], job["config"]["ref_model"], loss, mode, steps)
    what = f"{family}/{mode}/{loss} at tp{tp} pp{pp} dp{dp}" + (" sequence-parallel" if job["config"].get("sequence_parallel") else "")
    _check_tensors(out_dir, j, job, layout, ref, what, rtol)
    metrics_file = out_dir / f"job{j}_metrics.json"
    assert metrics_file.is_file(), f"{what}: the reporting rank wrote no metrics"
    ours = json.loads(metrics_file.read_text())
    assert len(ours) == steps + 1 and all(m is not None for m in ours), what
    names = METRICS + (("nll_loss",) if loss == "sft" else ())
    for step, (m_ours, m_ref) in enumerate(zip(ours[:steps], ref["metrics"]), start=1):
        _check_metrics(m_ours, m_ref, names=names, prefix="", what=f"{what} step {step}", rtol=rtol,
                       reference_free=mode == "none")
    eval_names = tuple(n for n in names if n != "grad_norm")
    _check_metrics(ours[steps], ref["eval"], names=eval_names, prefix="eval/",
                   what=f"{what} after {steps} steps, {len(job['eval_pairs'])} eval pairs", rtol=rtol,
                   reference_free=mode == "none")


def _check_tensors(out_dir: Path, j: int, job: dict, layout, ref: dict, what: str, rtol: float) -> None:
    tp, pp, _ = layout
    spec = open_hf_dir(job["config"]["model"]).spec
    for step, ref_grads in enumerate(ref["grads"], start=1):
        grads = load_rank_tensors(out_dir, j, f"grads{step}", layout=layout)
        for (t, p, d), shard in grads.items():
            expected = hf_to_mcore_shard(spec, tp=tp, tp_rank=t, pp=pp, pp_rank=p, get=ref_grads.__getitem__)
            assert set(expected) == set(shard), what
            for name, value in expected.items():
                assert_close(shard[name], value, what=f"{what} step {step} grad {name} (rank tp{t} pp{p} dp{d})", rtol=rtol)
    weights = load_rank_tensors(out_dir, j, "weights", layout=layout)
    steps = len(ref["grads"])
    for (t, p, d), shard in weights.items():
        if d != 0:
            continue  # only dp rank 0 writes its weights (the file of the others is empty)
        expected = hf_to_mcore_shard(spec, tp=tp, tp_rank=t, pp=pp, pp_rank=p, get=ref["weights"].__getitem__)
        assert set(expected) == set(shard), what
        for name, value in expected.items():
            assert_close(shard[name], value, what=f"{what} weight {name} after {steps} steps", rtol=rtol)


def test_reference_has_a_formula_for_every_loss_type():
    missing = [name for name in LOSS_TYPES if name not in REFERENCE_LOSS_TYPES]
    assert not missing, f"tests/parity.py has no TRL formula for loss types {missing}"


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"tp{l[0]}-pp{l[1]}-dp{l[2]}")
def test_parity(layout, models, tmp_path):
    jobs = _jobs_for(layout, models, all_losses=layout == (2, 2, 1))
    if layout in PAIRWISE:
        jobs = [job for job in jobs if job["key"] in PAIRWISE[layout]]
        assert len(jobs) == len(PAIRWISE[layout])
    if layout in SEQUENCE_PARALLEL:
        sp_jobs = [job for job in _jobs_for(layout, models, all_losses=False) if job["key"] in SEQUENCE_PARALLEL[layout]]
        assert len(sp_jobs) == len(SEQUENCE_PARALLEL[layout])
        for job in sp_jobs:
            job["config"]["sequence_parallel"] = True
        jobs += sp_jobs
    run_ranks(world_size=layout[0] * layout[1] * layout[2], jobs=jobs, out_dir=tmp_path)
    for j, job in enumerate(jobs):
        _check_job(tmp_path, j, job, layout)


def test_parity_four_steps_at_pp4(models, tmp_path):
    """pp 4, 4 microbatches, 4 steps: step 1 carries reference forwards out, steps 2 and 3 run the
    steady-state plan (carry in and carry out), step 4 carries in only; every reference mode,
    --ref-mode separate included."""
    plan = build_plan(num_stages=4, num_microbatches=GLOBAL_BATCH // MICRO_BATCH, ref_mode="interleaved",
                      ref_next=True, carry_in=True, carry_out=True)
    kinds = {op.kind for stage in plan.stages for op in stage}
    assert plan.carry_in and plan.carry_out and {OpKind.KEEP_REF_ACT, OpKind.SEND_KEPT_REF_ACT} <= kinds
    jobs = _jobs_for(PP4, models, all_losses=False, steps=PP4_STEPS, losses=("sigmoid",))
    # Every mode for the Llama; the tied-embedding Qwen2 where carrying and the separate group matter.
    jobs = [job for job in jobs if job["key"][0] == "llama" or job["key"][1] in ("interleaved", "separate")]
    assert len(jobs) == 6
    run_ranks(world_size=4, jobs=jobs, out_dir=tmp_path)
    for j, job in enumerate(jobs):
        _check_job(tmp_path, j, job, PP4)
