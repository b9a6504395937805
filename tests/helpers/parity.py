"""Parity jobs and their checks: the engine's ranks (tests/helpers/ranks.py) against the
single-process reference (tests/helpers/reference.py).

A job trains two steps (four at pp 4) of GLOBAL_BATCH pairs with uneven lengths and padding,
then evaluates held-out pairs; policy and reference start from different weights.
`check_job` compares every metric of every step, the gradient of every policy parameter at
every step (from every rank's file), the weights after the last optimizer step and the eval
metrics over all held-out pairs.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.mapping import hf_to_mcore_shard
from mcore_dpo.objective.loss_spec import LOSS_TYPES
from tests.helpers.data import PACKED, make_pairs
from tests.helpers.ranks import load_rank_tensors
from tests.helpers.reference import RTOL, assert_close, reference_run

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
PP4 = (1, 4, 1)
PP4_STEPS = 4
# --ref-mode separate: the reference on a group of its own layout (tp 2), fed to the policy.
SEPARATE_LAYOUTS = ((2, 2, 2), PP4)
REF_GROUP = {"ref_tp": 2, "ref_pp": 1, "ref_dp": 1}
# Held-out pairs, evaluated after the last step: not a multiple of the global batch, so the last
# chunk is partial (at dp 2 a rank's share also ends in a smaller microbatch). Precomputed mode
# takes one fewer: its reference table pass needs equal microbatches at pp > 1.
EVAL_PAIRS = 13


def loss_kwargs(loss_type: str) -> dict:
    smoothing = {"robust": 0.1, "exo_pair": 0.1, "cdpo": 0.1}.get(loss_type, 0.0)
    return {"loss_type": loss_type, "label_smoothing": smoothing, "beta": BETA}


def parity_data(*, steps: int, mode: str) -> tuple[list, list]:
    """The training pairs of `steps` global batches (uneven lengths, padding) and the eval pairs."""
    pairs = make_pairs(PP4_STEPS * GLOBAL_BATCH + EVAL_PAIRS, seed=7)
    held_out = pairs[PP4_STEPS * GLOBAL_BATCH:]
    return pairs[: steps * GLOBAL_BATCH], held_out[: EVAL_PAIRS - (mode == "precomputed")]


def jobs_for(layout, models: dict, *, all_losses: bool, steps: int = 2, losses=("sigmoid", "ipo")) -> list[dict]:
    """Every (family, mode, loss) job at this layout; `all_losses` adds every other loss type
    (Llama, interleaved) and a reference-free Qwen2 job. `models`: family -> (policy, ref) dirs."""
    tp, pp, dp = layout
    modes = MODES + (("separate",) if layout in SEPARATE_LAYOUTS else ())
    jobs = []
    combos = [(f, m, l) for f in FAMILIES for m in modes for l in losses]
    if all_losses:
        combos += [("llama", "interleaved", l) for l in LOSS_TYPES if l not in ("sigmoid", "ipo")]
        combos += [("qwen2", "none", "sigmoid")]  # reference-free
    for family, mode, loss in combos:
        policy_dir, ref_dir = models[family]
        train, held_out = parity_data(steps=steps, mode=mode)
        jobs.append({
            "key": (family, mode, loss),
            "config": dict(model=str(policy_dir), ref_model=str(ref_dir), tp=tp, pp=pp, dp=dp,
                           micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH, max_steps=steps,
                           ref_mode=mode, lr=LR, adam_eps=ADAM_EPS, timeout_s=60.0, clip_grad=CLIP, weight_decay=WD,
                           **(REF_GROUP if mode == "separate" else {}), **loss_kwargs(loss)),
            "batches": [train[k * GLOBAL_BATCH:(k + 1) * GLOBAL_BATCH] for k in range(steps)],
            "batch_ids": [list(range(k * GLOBAL_BATCH, (k + 1) * GLOBAL_BATCH)) for k in range(steps)],
            "all_pairs": train, "eval_pairs": held_out,
        })
    return jobs


# Sequence parallelism (megatron-core `sequence_parallel`): jobs with it on join the launch of
# tp 2 x pp 2: untied Llama with GQA and tied Qwen2 with qkv bias, the three colocated reference
# modes. (At tp 2 without a pipeline it runs in tests/test_moe.py's (2, 1, 1, 2) launch, which
# megatron-core's MoE layer runs sequence-parallel.)
SEQUENCE_PARALLEL = {(2, 2, 1): [("llama", "interleaved", "sigmoid"), ("qwen2", "interleaved", "ipo"),
                                 ("qwen2", "sequential", "ipo"), ("qwen2", "precomputed", "sigmoid")]}
# At 8 ranks every (family, mode), (family, loss) and (mode, loss) pair runs once rather than
# every triple: no code path there depends on all three together, and the full product runs at
# the smaller layouts.
PAIRWISE = {(2, 2, 2): [("llama", "interleaved", "sigmoid"), ("qwen2", "interleaved", "ipo"),
                        ("llama", "sequential", "ipo"), ("qwen2", "sequential", "sigmoid"),
                        ("llama", "precomputed", "sigmoid"), ("qwen2", "precomputed", "ipo"),
                        ("llama", "separate", "ipo"), ("qwen2", "separate", "sigmoid")]}


def layout_jobs(layout, models: dict) -> list[dict]:
    """test_parity's launch at this layout: every (family, mode, loss) job (all loss types at
    (2,2,1); every pair of them once at (2,2,2)), plus the sequence-parallel jobs at tp 2."""
    jobs = jobs_for(layout, models, all_losses=layout == (2, 2, 1))
    if layout in PAIRWISE:
        jobs = [job for job in jobs if job["key"] in PAIRWISE[layout]]
        assert len(jobs) == len(PAIRWISE[layout])
    if layout in SEQUENCE_PARALLEL:
        sp_jobs = [job for job in jobs_for(layout, models, all_losses=False) if job["key"] in SEQUENCE_PARALLEL[layout]]
        assert len(sp_jobs) == len(SEQUENCE_PARALLEL[layout])
        for job in sp_jobs:
            job["config"]["sequence_parallel"] = True
        jobs += sp_jobs
    return jobs


def parity_job(layout: tuple[int, ...], policy_dir: Path, ref_dir: Path, *, name: str, steps: int = 2, **config) -> dict:
    """One interleaved sigmoid job of jobs_for's shape (its batches, learning rate, clipping) for
    any model; `config` adds or overrides TrainConfig fields."""
    tp, pp, dp = layout[:3]
    train, held_out = parity_data(steps=steps, mode="interleaved")
    batch = GLOBAL_BATCH
    return {
        "key": (name, "interleaved", "sigmoid"),
        "config": dict(model=str(policy_dir), ref_model=str(ref_dir), tp=tp, pp=pp, dp=dp,
                       micro_batch_size=MICRO_BATCH, global_batch_size=batch, max_steps=steps,
                       ref_mode="interleaved", lr=LR, adam_eps=ADAM_EPS, timeout_s=60.0, clip_grad=CLIP,
                       weight_decay=WD, **loss_kwargs("sigmoid"), **config),
        "batches": [train[k * batch:(k + 1) * batch] for k in range(steps)],
        "batch_ids": [list(range(k * batch, (k + 1) * batch)) for k in range(steps)],
        "all_pairs": train, "eval_pairs": held_out,
    }


def packed_parity_job(layout: tuple[int, ...], policy_dir: Path, ref_dir: Path, *, name: str, **config) -> dict:
    """parity_job with packed microbatches (data.PACKED): the same data, reference and checks
    (the HF reference runs whole global batches, so the microbatch split does not enter it)."""
    return parity_job(layout, policy_dir, ref_dir, name=name, **PACKED, **config)


@lru_cache(maxsize=None)
def cached_reference(policy_dir: str, ref_dir: str, loss_type: str, ref_mode: str, steps: int,
                     dtype: torch.dtype = torch.float32) -> dict:
    """reference_run on parity_data's batches, once per pytest run for each set of arguments
    (`dtype`: reference_run's; GPT-OSS's float64 reference is tests/helpers/gpt_oss.float64_reference)."""
    kw = loss_kwargs(loss_type)
    train, held_out = parity_data(steps=steps, mode=ref_mode)
    return reference_run(policy_dir=Path(policy_dir), ref_dir=Path(ref_dir),
                         batches=[train[k * GLOBAL_BATCH:(k + 1) * GLOBAL_BATCH] for k in range(steps)],
                         loss_type=loss_type, beta=kw["beta"], label_smoothing=kw["label_smoothing"],
                         reference_free=ref_mode == "none", lr=LR, clip_grad=CLIP, weight_decay=WD, adam_eps=ADAM_EPS,
                         eval_pairs=held_out, dtype=dtype)


def check_metrics(m_ours: dict, m_ref: dict, *, names, prefix: str, what: str, rtol: float,
                  reference_free: bool = False) -> None:
    # Rewards and margins are differences of summed log-probs (cancellation): their error is
    # measured relative to the magnitude of the beta-scaled log-probs they are made of.
    logp_scale = BETA * max(abs(m_ref["logps/chosen"]), abs(m_ref["logps/rejected"]))
    for name in names:
        if reference_free and name.startswith("rewards/"):  # no reference, no rewards logged
            assert prefix + name not in m_ours, f"{what} {prefix}{name}"
            continue
        scale = max(abs(m_ref[name]), logp_scale) if name.startswith("rewards/") and name != "rewards/accuracies" else None
        # The mean logit is a mean over tokens x vocabulary of logits of either sign, which can
        # cancel to ~1e-3 while each logit is ~0.1-1: its float32 rounding is absolute, ~1e-8
        # (1.5e-8 on an AVX2 CPU for a mean of -1.5e-3), so its scale is at least 1e-2.
        if name.startswith("logits/"):
            scale = max(abs(m_ref[name]), 1e-2)
        assert_close(torch.tensor(m_ours[prefix + name]), torch.tensor(m_ref[name]), what=f"{what} {prefix}{name}",
                     scale=scale, rtol=rtol)


def check_job(out_dir: Path, j: int, job: dict, layout, rtol: float = RTOL) -> None:
    """Job j of a run_ranks launch against cached_reference (module docstring)."""
    tp, pp, dp = layout
    family, mode, loss = job["key"]
    steps = len(job["batches"])
    ref = cached_reference(job["config"]["model"], job["config"]["ref_model"], loss, mode, steps)
    what = f"{family}/{mode}/{loss} at tp{tp} pp{pp} dp{dp}" + (" sequence-parallel" if job["config"].get("sequence_parallel") else "")
    check_tensors(out_dir, j, job, layout, ref, what, rtol)
    metrics_file = out_dir / f"job{j}_metrics.json"
    assert metrics_file.is_file(), f"{what}: the reporting rank wrote no metrics"
    ours = json.loads(metrics_file.read_text())
    assert len(ours) == steps + 1 and all(m is not None for m in ours), what
    names = METRICS + (("nll_loss",) if loss == "sft" else ())
    for step, (m_ours, m_ref) in enumerate(zip(ours[:steps], ref["metrics"]), start=1):
        check_metrics(m_ours, m_ref, names=names, prefix="", what=f"{what} step {step}", rtol=rtol,
                      reference_free=mode == "none")
    eval_names = tuple(n for n in names if n != "grad_norm")
    check_metrics(ours[steps], ref["eval"], names=eval_names, prefix="eval/",
                  what=f"{what} after {steps} steps, {len(job['eval_pairs'])} eval pairs", rtol=rtol,
                  reference_free=mode == "none")


def check_tensors(out_dir: Path, j: int, job: dict, layout, ref: dict, what: str, rtol: float,
                  unchecked_grads: frozenset[str] = frozenset()) -> None:
    """Every rank's gradients at each step of ref["grads"] (but those named in `unchecked_grads`, the
    caller says why) and dp rank 0's weights after the job's last, against ref."""
    tp, pp, _ = layout
    spec = open_hf_dir(job["config"]["model"]).spec
    for step, ref_grads in enumerate(ref["grads"], start=1):
        grads = load_rank_tensors(out_dir, j, f"grads{step}", layout=layout)
        for (t, p, d), shard in grads.items():
            expected = hf_to_mcore_shard(spec, tp=tp, tp_rank=t, pp=pp, pp_rank=p, get=ref_grads.__getitem__)
            assert set(expected) == set(shard), what
            for name, value in expected.items():
                if name not in unchecked_grads:
                    assert_close(shard[name], value, what=f"{what} step {step} grad {name} (rank tp{t} pp{p} dp{d})",
                                 rtol=rtol)
    weights = load_rank_tensors(out_dir, j, "weights", layout=layout)
    steps = len(job["batches"])
    for (t, p, d), shard in weights.items():
        if d != 0:
            continue  # only dp rank 0 writes its weights (the file of the others is empty)
        expected = hf_to_mcore_shard(spec, tp=tp, tp_rank=t, pp=pp, pp_rank=p, get=ref["weights"].__getitem__)
        assert set(expected) == set(shard), what
        for name, value in expected.items():
            assert_close(shard[name], value, what=f"{what} weight {name} after {steps} steps", rtol=rtol)
