"""No forward or backward of a stage reads a device value on the host, and no point-to-point
message travels outside the plan: real gloo ranks run their steps under tests/helpers/host_sync_guard.py,
which refuses `.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `bool/int/float(tensor)`,
`.to("cpu")` and `torch.tensor(..., device=...)` inside the executor's compute ops, for the
dense (padded), packed, MoE (with the aux loss, whose counts ride on the plan's messages) and
LoRA paths at pp 2, and the dense path at tp 2 with sequence parallelism. The same launch checks that the first transfer of every rank is the
warm-up exchange with its neighbour, that every message is in a plan transfer (the MoE counts
riding on its act and grad messages), and parity (dense, packed, MoE with aux) within the usual
tolerance, so the guarded code is the code that trains right.

Why it matters on a GPU: such a read waits for the GPU, and on NCCL, while a link is not
connected yet, that can hang the step (`plan_check.validate_host_device`, tests/test_p2p_plan.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from checkpoint_convert.peft_adapter import TARGETS, LoraShape
from tests.helpers.host_sync_guard import ALLOWED
from tests.helpers.moe_parity import aux_job, check_aux_parity
from tests.helpers.parity import check_job, packed_parity_job, parity_job
from tests.helpers.ranks import run_ranks

LAYOUT = (1, 2, 1)
SHAPE = LoraShape(rank=4, alpha=8.0, targets=TARGETS)  # test_lora_parity's adapters
# Megatron-core sites each path may hit (ALLOWED says why); anything else fails the run.
NO_OPS_ON_GPU = {"megatron/core/models/common/embeddings/rotary_pos_embedding.py:get_emb:Tensor.to(cpu)"}
MOE_SITES = {"megatron/core/transformer/moe/router.py:gating:Tensor.to(cpu)",
             "megatron/core/transformer/moe/moe_utils.py:sort_chunks_by_idxs:Tensor.tolist",
             "megatron/core/transformer/moe/experts.py:forward:Tensor.tolist"}


@pytest.fixture(scope="module")
def models(parity_models, moe_models):
    return {"llama": parity_models["llama"], "qwen3_moe": moe_models["qwen3_moe"]}


def _guarded(job: dict, **extra) -> dict:
    return {**job, "setup": "tests.helpers.host_sync_guard", **extra}


def _reports(out_dir: Path, j: int, world_size: int) -> list[dict]:
    return [json.loads((out_dir / f"job{j}_guard_rank{r}.json").read_text()) for r in range(world_size)]


def test_no_stage_op_reads_the_device_dense_packed_moe_lora(models, tmp_path):
    policy, ref = models["llama"]
    lora = parity_job(LAYOUT, policy, ref, name="llama", steps=1, lora_rank=SHAPE.rank, lora_alpha=SHAPE.alpha,
                      lora_targets=",".join(SHAPE.targets))
    lora["config"].pop("ref_model")  # the reference is the adapter switched off
    jobs = [_guarded(parity_job(LAYOUT, policy, ref, name="llama")),
            _guarded(packed_parity_job(LAYOUT, policy, ref, name="llama")),
            _guarded(aux_job((*LAYOUT, 1), *models["qwen3_moe"])),
            _guarded(lora),
            _guarded(parity_job((2, 1, 1), policy, ref, name="llama", sequence_parallel=True))]
    run_ranks(world_size=2, jobs=jobs, out_dir=tmp_path)  # a refused read or message fails its rank
    allowed = {f"{suffix}:{function}:{what}" for suffix, function in ALLOWED
               for what in ("Tensor.to(cpu)", "Tensor.tolist")}
    for j, name in enumerate(["dense", "packed", "moe", "lora", "tp2 sequence parallel"]):
        for rank, report in enumerate(_reports(tmp_path, j, 2)):
            hits = set(report["allowed_hits"])
            assert hits <= allowed, (name, hits)
            assert hits - NO_OPS_ON_GPU == (MOE_SITES if name == "moe" else set()), (name, rank, hits)
            # The first transfer of the job is the warm-up: one message each way with the neighbour.
            if name.startswith("tp2"):  # one stage: no links, no transfers
                assert report["first_transfers"] == [] and report["transfers"] == 0, (name, rank)
                continue
            assert report["first_transfers"] == [[["isend", 1 - rank], ["irecv", 1 - rank]]], (name, rank)
            assert report["transfers"] > 0, (name, rank)
            # The MoE aux counts ride on the act and grad messages: each stage's policy parts.
            assert (report["riders"] > 0) == (name == "moe"), (name, rank, report["riders"])
    check_job(tmp_path, 0, jobs[0], LAYOUT)
    check_job(tmp_path, 1, jobs[1], LAYOUT)
    check_aux_parity(tmp_path, 2, jobs[2], (*LAYOUT, 1))
    check_job(tmp_path, 4, jobs[4], (2, 1, 1))


def test_the_guard_fails_a_forward_that_reads_the_device(models, tmp_path):
    policy, ref = models["llama"]
    job = _guarded(parity_job((1, 1, 1), policy, ref, name="llama", steps=1), inject_item=True)
    with pytest.raises(AssertionError) as info:
        run_ranks(world_size=1, jobs=[job], out_dir=tmp_path)
    # The first step computes this batch's reference first: its forward is the first to read.
    assert "HostReadError: host read in reference_forward: Tensor.item at " in str(info.value)
    assert "host_sync_guard.py" in str(info.value) and "(stage_forward)" in str(info.value)
