"""Parity: the parallel engine against a single-process Hugging Face reference.

For each (tp, pp, dp) one set of real gloo ranks runs many jobs (model family x ref mode x
loss). Each job trains two steps on global batches with uneven lengths and padding; the
policy and reference start from different weights. Compared: every metric of both steps,
the gradient of every policy parameter at step 2, and the weights after both optimizer steps.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.mapping import hf_to_mcore_shard
from mcore_dpo.loss import LOSS_TYPES, LossSpec
from parity import RTOL, assert_close, load_rank_tensors, make_pairs, reference_run, run_ranks, write_models

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

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 2, 2)]


def _loss_kwargs(loss_type: str) -> dict:
    smoothing = {"robust": 0.1, "exo_pair": 0.1, "cdpo": 0.1}.get(loss_type, 0.0)
    return {"loss_type": loss_type, "label_smoothing": smoothing, "beta": BETA}


def _jobs_for(layout, models: dict, *, all_losses: bool) -> list[dict]:
    tp, pp, dp = layout
    pairs = make_pairs(3 * GLOBAL_BATCH, seed=7)
    batches = [pairs[0:GLOBAL_BATCH], pairs[GLOBAL_BATCH:2 * GLOBAL_BATCH]]
    ids = [list(range(0, GLOBAL_BATCH)), list(range(GLOBAL_BATCH, 2 * GLOBAL_BATCH))]
    jobs = []
    combos = [(f, m, l) for f in FAMILIES for m in MODES for l in ("sigmoid", "ipo")]
    if all_losses:
        combos += [("llama", "interleaved", l) for l in LOSS_TYPES if l not in ("sigmoid", "ipo")]
        combos += [("qwen2", "none", "sigmoid")]  # reference-free
    for family, mode, loss in combos:
        policy_dir, ref_dir = models[family]
        jobs.append({
            "key": (family, mode, loss),
            "config": dict(model=str(policy_dir), ref_model=str(ref_dir), tp=tp, pp=pp, dp=dp,
                           micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH, max_steps=2,
                           ref_mode=mode, lr=LR, adam_eps=ADAM_EPS, timeout_s=60.0, clip_grad=CLIP, weight_decay=WD, **_loss_kwargs(loss)),
            "batches": batches, "batch_ids": ids, "all_pairs": pairs,
        })
    return jobs


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity_models")
    return {family: write_models(family, root) for family in FAMILIES}


@lru_cache(maxsize=None)
def _reference(policy_dir: str, ref_dir: str, loss_type: str, ref_mode: str):
    kw = _loss_kwargs(loss_type)
    spec = LossSpec(loss_types=(loss_type,), beta=kw["beta"], label_smoothing=kw["label_smoothing"],
                    reference_free=ref_mode == "none")
    pairs = make_pairs(3 * GLOBAL_BATCH, seed=7)
    return reference_run(policy_dir=Path(policy_dir), ref_dir=Path(ref_dir),
                         batches=[pairs[:GLOBAL_BATCH], pairs[GLOBAL_BATCH:2 * GLOBAL_BATCH]],
                         spec=spec, lr=LR, clip_grad=CLIP, weight_decay=WD, adam_eps=ADAM_EPS)


def _check_job(out_dir: Path, j: int, job: dict, layout, rtol: float = RTOL) -> None:
    tp, pp, dp = layout
    family, mode, loss = job["key"]
    policy_dir = job["config"]["model"]
    ref = _reference(policy_dir, job["config"]["ref_model"], loss, mode)
    what = f"{family}/{mode}/{loss} at tp{tp} pp{pp} dp{dp}"
    _check_tensors(out_dir, j, job, layout, ref, what, rtol)
    ours = json.loads((out_dir / f"job{j}_metrics.json").read_text())
    ours = [m for m in ours if m is not None]
    assert len(ours) == 2, what
    for step, (m_ours, m_ref) in enumerate(zip(ours, ref["metrics"]), start=1):
        assert abs(m_ref["loss"] - m_ref["loss_autograd"]) <= 1e-6 * max(1.0, abs(m_ref["loss"]))
        # Rewards and margins are differences of summed log-probs (cancellation): their error is
        # measured relative to the magnitude of the beta-scaled log-probs they are made of.
        logp_scale = BETA * max(abs(m_ref["logps/chosen"]), abs(m_ref["logps/rejected"]))
        for name in METRICS + (("nll_loss",) if loss == "sft" else ()):
            if name not in m_ref:  # reference-free runs log no rewards/*
                assert name not in m_ours, f"{what} step {step} {name}"
                continue
            scale = max(abs(m_ref[name]), logp_scale) if name.startswith("rewards/") and name != "rewards/accuracies" else None
            assert_close(torch.tensor(m_ours[name]), torch.tensor(m_ref[name]), what=f"{what} step {step} {name}", scale=scale, rtol=rtol)


def _check_tensors(out_dir: Path, j: int, job: dict, layout, ref: dict, what: str, rtol: float) -> None:
    tp, pp, _ = layout
    spec = open_hf_dir(job["config"]["model"]).spec
    for step, ref_grads in enumerate(ref["grads"], start=1):
        grads = load_rank_tensors(out_dir, j, f"grads{step}")
        for (t, p, d), shard in grads.items():
            expected = hf_to_mcore_shard(spec, tp=tp, tp_rank=t, pp=pp, pp_rank=p, get=ref_grads.__getitem__)
            assert set(expected) == set(shard), what
            for name, value in expected.items():
                assert_close(shard[name], value, what=f"{what} step {step} grad {name} (rank tp{t} pp{p} dp{d})", rtol=rtol)
    weights = load_rank_tensors(out_dir, j, "weights")
    for (t, p, d), shard in weights.items():
        if d != 0:
            continue
        expected = hf_to_mcore_shard(spec, tp=tp, tp_rank=t, pp=pp, pp_rank=p, get=ref["weights"].__getitem__)
        for name, value in expected.items():
            assert_close(shard[name], value, what=f"{what} weight {name} after 2 steps", rtol=rtol)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"tp{l[0]}-pp{l[1]}-dp{l[2]}")
def test_parity(layout, models, tmp_path):
    jobs = _jobs_for(layout, models, all_losses=layout == (2, 2, 1))
    run_ranks(world_size=layout[0] * layout[1] * layout[2], jobs=jobs, out_dir=tmp_path)
    for j, job in enumerate(jobs):
        _check_job(tmp_path, j, job, layout)
