"""Parity: the parallel engine against a single-process Hugging Face reference.

For each (tp, pp, dp) one set of real gloo ranks runs many jobs (model family x ref mode x
loss). Each job trains two steps (four at pp 4) on global batches with uneven lengths and
padding, then evaluates held-out pairs; the policy and reference start from different weights.
Compared with a reference written from TRL's formulas (tests/helpers/reference.py): every metric of every
step, the gradient of every policy parameter at every step (from every rank's file), the weights
after the last optimizer step, and the eval metrics over all held-out pairs.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from mcore_dpo.objective.loss_spec import LOSS_TYPES
from mcore_dpo.pipeline.plan import OpKind
from mcore_dpo.pipeline.schedule import build_plan
from tests.helpers.parity import (GLOBAL_BATCH, METRICS, MICRO_BATCH, PP4, PP4_STEPS, check_job, jobs_for,
                                  layout_jobs)
from tests.helpers.ranks import load_rank_tensors, run_ranks
from tests.helpers.reference import assert_close
from tests.helpers.reference import REFERENCE_LOSS_TYPES

# Each layout runs a code path the others do not:
#   (1,1,1) no parallelism: the engine's batching, loss and optimizer alone;
#   (2,2,1) tp x pp: vocab-parallel logits and log-probs, every loss type through the pipeline's
#           last stage (all_losses), every reference mode at tp 2, sequence parallelism;
#   (1,1,2) data parallelism alone (gradient reduction, dp-sharded optimizer, a rank's eval share);
#   (2,2,2) tp x pp x dp together, and --ref-mode separate feeding a dp-split policy.
# Pipeline parallelism without tp runs at pp 4 below (warm-up, steady-state interleaving and
# carrying, every reference mode); a separate pp-2 layout would repeat that path. Tensor
# parallelism without a pipeline ((2,1,1), formerly a launch of its own) repeats paths run
# elsewhere: the vocab-parallel logits, log-probs and every reference mode at tp 2 run at (2,2,1); one stage holding the embedding and the output layer runs at (1,1,1) and
# (1,1,2), and with tp 2 and tied embeddings in tests/test_moe.py's (2,1,1) Mixtral job (every
# gradient and weight checked), beside sequence parallelism without a pipeline there.
# ((2,2,2) runs each pair of (family, mode, loss) once: tests/helpers/parity.py's layout_jobs.)
LAYOUTS = [(1, 1, 1), (2, 2, 1), (1, 1, 2), (2, 2, 2)]


def test_reference_has_a_formula_for_every_loss_type():
    missing = [name for name in LOSS_TYPES if name not in REFERENCE_LOSS_TYPES]
    assert not missing, f"tests/helpers/reference.py has no TRL formula for loss types {missing}"


# The fast tier's one gloo parity (two ranks): data parallelism alone.
FAST_TIER_LAYOUT = (1, 1, 2)


LAYOUT_PARAMS = [pytest.param(layout, marks=[pytest.mark.in_fast_tier] if layout == FAST_TIER_LAYOUT else [])
                 for layout in LAYOUTS]


@pytest.mark.parametrize("layout", LAYOUT_PARAMS, ids=lambda l: f"tp{l[0]}-pp{l[1]}-dp{l[2]}")
def test_parity(layout, parity_models, tmp_path):
    jobs = layout_jobs(layout, parity_models)
    run_ranks(world_size=layout[0] * layout[1] * layout[2], jobs=jobs, out_dir=tmp_path)
    for j, job in enumerate(jobs):
        check_job(tmp_path, j, job, layout)


def test_parity_four_steps_at_pp4(parity_models, tmp_path):
    """pp 4, 4 microbatches, 4 steps: step 1 carries reference forwards out, steps 2 and 3 run the
    steady-state plan (carry in and carry out), step 4 carries in only; every reference mode,
    --ref-mode separate included, each also with --prefix-sharing (against the same reference
    and against the unshared job)."""
    plan = build_plan(num_stages=4, num_microbatches=GLOBAL_BATCH // MICRO_BATCH, ref_mode="interleaved",
                      ref_next=True, carry_in=True, carry_out=True)
    kinds = {op.kind for stage in plan.stages for op in stage}
    assert plan.carry_in and plan.carry_out and {OpKind.KEEP_REF_ACT, OpKind.SEND_KEPT_REF_ACT} <= kinds
    jobs = jobs_for(PP4, parity_models, all_losses=False, steps=PP4_STEPS, losses=("sigmoid",))
    # Every mode for the Llama; the tied-embedding Qwen2 where carrying and the separate group matter.
    jobs = [job for job in jobs if job["key"][0] == "llama" or job["key"][1] in ("interleaved", "separate")]
    assert len(jobs) == 6
    # --prefix-sharing in every reference mode (the Llama's four): shared rows in the policy step,
    # the interleaved and sequential reference forwards, the precomputed and separate tables.
    shared = [copy.deepcopy(job) for job in jobs if job["key"][0] == "llama"]
    for job in shared:
        job["config"]["prefix_sharing"] = True
    run_ranks(world_size=4, jobs=jobs + shared, out_dir=tmp_path)
    for j, job in enumerate(jobs + shared):
        check_job(tmp_path, j, job, PP4)
    # Four steps with --prefix-sharing equal four steps without it: every metric and gradient.
    for k, job in enumerate(shared):
        j = jobs.index(next(u for u in jobs if u["key"] == job["key"]))
        with_, without = (json.loads((tmp_path / f"job{i}_metrics.json").read_text()) for i in (len(jobs) + k, j))
        what = f"{job['key']} at pp 4 with --prefix-sharing"
        for step, (on, off) in enumerate(zip(with_, without), start=1):
            for name in METRICS if step <= PP4_STEPS else METRICS[:-1]:
                prefix = "" if step <= PP4_STEPS else "eval/"
                assert_close(torch.tensor(on[prefix + name]), torch.tensor(off[prefix + name]),
                             what=f"{what} step {step} {prefix}{name} vs unshared")
        for step in range(1, PP4_STEPS + 1):
            on, off = (load_rank_tensors(tmp_path, i, f"grads{step}", layout=PP4) for i in (len(jobs) + k, j))
            for rank, tensors in on.items():
                for name, value in tensors.items():
                    assert_close(value, off[rank][name], what=f"{what} step {step} grad {name} {rank} vs unshared")
