"""Before the first update the policy IS the reference: every log-prob difference must be
exactly 0, so the held-out metrics at step 0 and the first training step's rewards are exactly
0 and the reward accuracy (TRL's strict `>`) is 0, not a count of float-noise signs.

Policy and reference are built from the same directory and run through the same functions;
they differ only in that the policy's weights require grad (and live in DDP's buffer). At
tp 2 with packed rows (one row, b = 1) that once sent the reference's first linear down
another torch.matmul path (a batched product of one-row products instead of one matrix
product: see model._canonical_strides), and the two disagreed by ~1e-7 per sequence.
Padded rows at tp 2 are the control. Real gloo ranks (tests/helpers/ranks.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.data import PACKED, make_pairs
from tests.helpers.models import make_model, save_hf
from tests.helpers.ranks import spawn_ranks
from tests.helpers.resume_ranks import policy_jobs_rank

GLOBAL_BATCH = 8
EVAL_PAIRS = 12  # not a multiple of the global batch: the last chunk is partial
ZERO_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


def _first_step(worker, config, job: dict, *, rank: int, out_dir: str) -> None:
    """The held-out metrics of the initial weights (step 0) and the first training step's."""
    from mcore_dpo.rank.worker import StepBatch

    initial_eval = worker.evaluate(job["eval_pairs"])  # step 0: the initial weights
    first_step = worker.train_step(StepBatch(step=1, pairs=job["batch"]))
    if first_step is not None:
        Path(out_dir, f"{job['name']}.json").write_text(json.dumps({"eval": initial_eval, "step": first_step}))


def _rank_main(rank: int, world_size: int, port: int, jobs: list[dict], out_dir: str) -> None:
    policy_jobs_rank(rank, port, jobs, out_dir, _first_step)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("policy_equals_reference")
    model_dir = save_hf(make_model("llama", seed=1), root / "model")
    pairs = make_pairs(GLOBAL_BATCH + EVAL_PAIRS, seed=5)
    common = dict(model=str(model_dir), tp=2, micro_batch_size=2, global_batch_size=GLOBAL_BATCH, max_steps=1,
                  max_length=PACKED["max_length"], ref_mode="interleaved", lr=1e-3, timeout_s=120.0,
                  loss_type="sigmoid", beta=0.1)
    jobs = [{"name": "packed", "config": {**common, "packing": True,
                                          "max_tokens_per_microbatch": PACKED["max_tokens_per_microbatch"]}},
            {"name": "padded", "config": {**common, "packing": False}}]
    for job in jobs:
        job.update(batch=pairs[:GLOBAL_BATCH], eval_pairs=pairs[GLOBAL_BATCH:])
    out = root / "ranks"
    out.mkdir()
    spawn_ranks(_rank_main, world_size=2, jobs=jobs, out_dir=out)
    return {job["name"]: json.loads((out / f"{job['name']}.json").read_text()) for job in jobs}


def test_the_packed_job_ran_packed_rows(results):
    packed, padded = results["packed"]["step"], results["padded"]["step"]
    assert packed["tokens/real"] == padded["tokens/real"] and packed["tokens/padded"] < padded["tokens/padded"]


@pytest.mark.parametrize("name", ["packed", "padded"])
def test_tp2_rewards_are_exactly_zero_while_the_policy_is_the_reference(results, name):
    initial_eval, first_step = results[name]["eval"], results[name]["step"]
    assert {k: initial_eval[f"eval/{k}"] for k in ZERO_KEYS} == dict.fromkeys(ZERO_KEYS, 0.0), initial_eval
    assert {k: first_step[k] for k in ZERO_KEYS} == dict.fromkeys(ZERO_KEYS, 0.0), first_step
    # sigmoid loss at a zero margin: -log sigmoid(0) = log 2, in float32
    assert first_step["loss"] == initial_eval["eval/loss"] == float(torch.tensor(2.0).log())
