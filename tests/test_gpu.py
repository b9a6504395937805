"""GPU checks (marked `gpu`; skipped on machines without CUDA). `scripts/gpu_checks.sh` runs
them one by one and prints a table; `scripts/gpu_checks.sh --cpu` runs them on the CPU at
their smallest size (MCORE_DPO_GPU_CHECKS_ON_CPU=1). The CPU suite runs `--cpu --wiring`
(tests/test_gpu_checks_script.py): it collects the parity and resume checks by node id, whose
code paths the CPU suite runs elsewhere, and runs the Transformer Engine check (SKIP).

- Parity at world size 1 with both optimizers (megatron-core's distributed optimizer and the
  AdamW path) against the single-process HF reference on the CPU. Gradients are compared
  before the optimizer step on both sides (unclipped), and the ranks run with TF32 off
  (NVIDIA_TF32_OVERRIDE=0 is inherited by the spawned ranks, which also switch it off
  themselves). fp32 on a GPU still reorders sums inside cuBLAS: tolerance 1e-4 relative.
- The Transformer Engine layer spec against the local spec on the same weights, bf16.
- Qwen3-MoE on the Transformer Engine spec with grouped GEMM experts (TEGroupedMLP) against the
  same spec with sequential experts, fp32 with TF32 off: the shard loads with no missing or
  unexpected parameter, the sequential experts' logits equal HF's within 1e-4 relative, and the
  grouped experts' logits and gradients equal the sequential ones within 1e-4 relative.
- A bf16 run through the CLI with the distributed optimizer: checkpoint, kill, rerun, and the
  resumed steps equal an uninterrupted run exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import traceback
from pathlib import Path

import pytest
import torch

from mcore_dpo.parallel.ports import free_port
from tests.helpers import devices
from tests.helpers.cli import run_train
from tests.helpers.faults import with_fault
from tests.helpers.models import make_model, qwen3_moe, save_hf
from tests.helpers.parity import check_job, jobs_for
from tests.helpers.ranks import run_ranks, spawn_processes

pytestmark = pytest.mark.gpu
GPU_RTOL = 1e-4
ON_GPU = torch.cuda.is_available() and not devices.USER_FORCED_CPU
# The dry run on the CPU keeps two jobs (both families, two reference modes) of each parity run.
QUICK = os.environ.get("MCORE_DPO_GPU_CHECKS_ON_CPU") == "1"
QUICK_KEYS = {("llama", "interleaved", "sigmoid"), ("qwen2", "sequential", "ipo")}
# bf16 logits of two implementations (fused vs unfused softmax, different summation order):
# a few bf16 ulps at the logits' scale.
BF16_LOGIT_RTOL = 3e-2
TIMING = ("tokens/s", "step_time_s", "bubble_fraction", "memory/peak_gib")


# Fused kernels are on by default on the Transformer Engine spec; "unfused" runs the same parity
# with --no-fused-kernels, so that a failing fusion shows as one row failing and the other passing.
@pytest.mark.parametrize("distributed_optimizer, fused_kernels", [(True, None), (False, None), (True, False)],
                         ids=["sharded-optimizer", "adamw", "unfused"])
def test_parity_on_gpu(parity_models, tmp_path, monkeypatch, distributed_optimizer, fused_kernels):
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")  # read by cuBLAS in the spawned ranks
    layout = (1, 1, 1)
    jobs = jobs_for(layout, parity_models, all_losses=False)
    if QUICK:
        jobs = [job for job in jobs if job["key"] in QUICK_KEYS]
    for job in jobs:
        job["config"]["distributed_optimizer"] = distributed_optimizer
        job["config"]["fused_kernels"] = fused_kernels
    run_ranks(world_size=1, jobs=jobs, out_dir=tmp_path)
    for j, job in enumerate(jobs):
        check_job(tmp_path, j, job, layout, rtol=GPU_RTOL)


def _world_size_one(port: int):
    """One rank's process group, mesh (tp = pp = dp = 1) and model RNG: (platform, mesh)."""
    from mcore_dpo.parallel import mesh as mesh_lib
    from mcore_dpo.parallel import platform as plat

    platform = plat.detect()
    plat.activate(platform)
    plat.init_process_group(platform, rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, timeout_s=120.0)
    mesh = mesh_lib.initialize(mesh_lib.Layout(tp=1, pp=1, dp=1))
    plat.init_model_rng(platform, 0)
    return platform, mesh


def _spec_logits_rank(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    """World size 1: the same HF weights in the local spec and (when TE imports) the TE spec."""
    try:
        from checkpoint_convert.mapping import hf_to_mcore_shard
        from mcore_dpo.parallel import mesh as mesh_lib
        from mcore_dpo.parallel import platform as plat
        from mcore_dpo.model.builder import build_stage_model, causal_mask, load_shard, open_weights, stage_forward

        platform, mesh = _world_size_one(port)
        weights = open_weights(model_dir)
        tokens = torch.randint(3, weights.spec.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
        tokens = tokens.to(platform.device)
        out = {}
        for name, use_te in (("local", False), ("te", True)):
            if use_te and not plat.transformer_engine_available():
                continue
            with plat.building_models(platform):
                model = build_stage_model(weights.spec, mesh=mesh, dtype=torch.bfloat16, on_gpu=platform.is_cuda,
                                          use_te=use_te).to(platform.device)
            load_shard(model, hf_to_mcore_shard(weights.spec, tp=1, tp_rank=0, pp=1, pp_rank=0, get=weights.get,
                                                layer_spec="te" if use_te else "local"))
            with torch.no_grad():
                logits = stage_forward(model.eval(), tokens=tokens, input_tensor=None,
                                       mask=causal_mask(tokens.shape[1], device=platform.device))
            out[name] = logits[..., : weights.spec.vocab_size].float().cpu()
        torch.save({"tokens": tokens.cpu(), **out}, Path(out_dir, "logits.pt"))
        mesh_lib.destroy()
    except BaseException:
        Path(out_dir, "error.txt").write_text(traceback.format_exc())
        raise


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_transformer_engine_spec_matches_local_spec(tmp_path, family):
    """Dense Llama, and a Qwen3-MoE with a dense layer between MoE layers (TE fuses the pre-MLP
    norm into linear_fc1 only in the dense one)."""
    model = make_model("llama", seed=1) if family == "llama" else qwen3_moe(seed=1, num_layers=4)
    model_dir = save_hf(model, tmp_path / family)
    spawn_processes(_spec_logits_rank, nprocs=1, args=(free_port(), str(model_dir), str(tmp_path)),
                    start_method="spawn")
    result = torch.load(tmp_path / "logits.pt", weights_only=True)
    # Both against the fp32 HF model first: the bf16 local spec is the yardstick for "bf16 close".
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        reference = hf(input_ids=result["tokens"]).logits
    scale = reference.abs().max().item()
    local_err = (result["local"] - reference).abs().max().item()
    # Sanity: the bf16 local spec is the same model (its distance to fp32 is the bf16 yardstick).
    assert local_err <= 0.2 * scale, f"local spec bf16 vs HF fp32: {local_err:.3e} (scale {scale:.3e})"
    if "te" not in result:
        pytest.skip("Transformer Engine needs CUDA: only the local spec ran")
    # TE and the local spec may differ by their kernels' bf16 rounding: no more than bf16 itself
    # moves the logits away from fp32 (x2), or a few bf16 ulps at the logits' scale.
    tolerance = max(2 * local_err, BF16_LOGIT_RTOL * scale)
    te_err = (result["te"] - result["local"]).abs().max().item()
    assert te_err <= tolerance, f"TE spec vs local spec: max |dlogit| {te_err:.3e} > {tolerance:.3e}"
    agree = (result["te"].argmax(-1) == result["local"].argmax(-1)).float().mean().item()
    assert agree >= 0.99, f"TE vs local argmax agreement {agree:.2%}"


def _te_grouped_linear() -> bool:
    if not ON_GPU:
        return False
    from mcore_dpo.parallel.platform import te_grouped_linear_available

    return te_grouped_linear_available()


def _experts_rank(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    """World size 1: a Qwen3-MoE on the Transformer Engine spec, fp32 with TF32 off, with
    sequential and with grouped GEMM experts; logits and every gradient (under the shard names)
    of one backward."""
    try:
        from checkpoint_convert.mapping import hf_to_mcore_shard
        from mcore_dpo.parallel import mesh as mesh_lib
        from mcore_dpo.parallel import platform as plat
        from mcore_dpo.model.builder import build_stage_model, causal_mask, load_shard, open_weights, shard_names, stage_forward

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        platform, mesh = _world_size_one(port)
        weights = open_weights(model_dir)
        shard = hf_to_mcore_shard(weights.spec, tp=1, tp_rank=0, pp=1, pp_rank=0, get=weights.get, layer_spec="te")
        tokens = torch.randint(3, weights.spec.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
        tokens = tokens.to(platform.device)
        out = {"tokens": tokens.cpu()}
        for name, grouped in (("sequential", False), ("grouped", True)):
            with plat.building_models(platform):
                model = build_stage_model(weights.spec, mesh=mesh, dtype=torch.float32, on_gpu=True, use_te=True,
                                          grouped_experts=grouped).to(platform.device)
            out[f"{name}/names"] = sorted(n for n, _ in model.named_parameters())
            load_shard(model, shard)  # raises on any missing or unexpected parameter
            logits = stage_forward(model.train(), tokens=tokens, input_tensor=None,
                                   mask=causal_mask(tokens.shape[1], device=platform.device))
            logits = logits[..., : weights.spec.vocab_size].float()
            logits.logsumexp(-1).mean().backward()
            out[f"{name}/logits"] = logits.detach().cpu()
            out[f"{name}/grads"] = shard_names({n: (p.grad if p.grad is not None else torch.zeros_like(p)).float().cpu()
                                                for n, p in model.named_parameters()})  # an expert given no token: 0
        torch.save(out, Path(out_dir, "experts.pt"))
        mesh_lib.destroy()
    except BaseException:
        Path(out_dir, "error.txt").write_text(traceback.format_exc())
        raise


@pytest.mark.skipif(not _te_grouped_linear(), reason="grouped GEMM experts need Transformer Engine >= 1.9 and CUDA")
def test_grouped_gemm_experts_match_sequential_experts(tmp_path, monkeypatch):
    """Qwen3-MoE with a dense layer between its MoE layers, fp32 with TF32 off (in bf16 the
    grouped GEMM's rounding may flip a later layer's top-k routing): the grouped experts hold
    every expert as `linear_fc1.weight{i}` (no `local_experts`), load the sequential experts'
    shard, and give the sequential experts' logits and gradients within GPU_RTOL; the sequential
    experts give HF's fp32 logits within GPU_RTOL."""
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")  # read by cuBLAS in the spawned rank
    model_dir = save_hf(qwen3_moe(seed=1, num_layers=4), tmp_path / "qwen3_moe")
    spawn_processes(_experts_rank, nprocs=1, args=(free_port(), str(model_dir), str(tmp_path)),
                    start_method="spawn")
    result = torch.load(tmp_path / "experts.pt", weights_only=True)
    grouped_names, sequential_names = result["grouped/names"], result["sequential/names"]
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight0" in grouped_names
    assert not any("local_experts" in n for n in grouped_names)
    assert "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight" in sequential_names
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        reference = hf(input_ids=result["tokens"]).logits
    scale = reference.abs().max().item()
    sequential, grouped = result["sequential/logits"], result["grouped/logits"]
    for label, got, want in (("sequential vs HF", sequential, reference), ("grouped vs sequential", grouped, sequential)):
        err = (got - want).abs().max().item()
        assert err <= GPU_RTOL * scale, f"{label}: max |dlogit| {err:.3e} > {GPU_RTOL * scale:.3e}"
    want, got = result["sequential/grads"], result["grouped/grads"]
    assert set(got) == set(want)
    expert_grads = [value for name, value in want.items() if ".local_experts." in name]
    assert expert_grads and any(value.abs().max().item() > 0 for value in expert_grads), "no expert got a gradient"
    for name, value in want.items():
        bound = GPU_RTOL * max(value.abs().max().item(), 1e-12)
        diff = (got[name] - value).abs().max().item()
        assert diff <= bound, f"grad {name}: grouped vs sequential {diff:.3e} > {bound:.3e}"


def _train(out: Path, *, fault: str | None, cache: Path, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = with_fault(dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                          MCORE_DPO_CACHE=str(cache)), fault)
    # One GPU holds one rank; the CPU dry run shards the optimizer over dp 2.
    dp = "1" if ON_GPU else "2"
    return run_train(["--dtype", "bfloat16", "--distributed-optimizer", "--dp", dp, "--max-steps", "4", "--save-interval",
                      "2", "--global-batch-size", "8", "--micro-batch-size", "2", "--eval-interval", "0", "--output-dir",
                      str(out), *extra], env=env, timeout=600)


def _metrics(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: {k: v for k, v in row.items() if k not in TIMING and not k.startswith("memory/")} for row in rows if "step" in row}


# Without --deterministic the GPU's atomics (segment sums, attention backward) reorder float
# additions: a resumed bf16 run then agrees with an uninterrupted one to this relative error.
NONDETERMINISTIC_BF16_RTOL = 2e-2


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default-kernels"])
def test_bf16_checkpoint_and_exact_resume_through_cli(tmp_path, deterministic):
    cache = tmp_path / "cache"
    extra = ("--deterministic",) if deterministic else ()
    straight = _train(tmp_path / "straight", fault=None, cache=cache, extra=extra)
    assert straight.returncode == 0, straight.stderr[-2000:]
    killed = _train(tmp_path / "resumed", fault="step:3", cache=cache, extra=extra)  # rank 0 dies at step 3
    assert killed.returncode != 0, "the injected kill did not end the run"
    resumed = _train(tmp_path / "resumed", fault="step:3", cache=cache, extra=extra)  # the fault fires once per directory
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    want, got = _metrics(tmp_path / "straight"), _metrics(tmp_path / "resumed")
    assert {1, 2, 3, 4} <= set(want) and {3, 4} <= set(got), (sorted(want), sorted(got))
    for step in (3, 4):
        if deterministic or not ON_GPU:  # bit for bit (the CPU is deterministic either way)
            assert got[step] == want[step], f"step {step} after resume: {got[step]} != {want[step]}"
            continue
        assert got[step].keys() == want[step].keys()
        for key, value in want[step].items():
            bound = NONDETERMINISTIC_BF16_RTOL * max(1.0, abs(value))
            assert abs(got[step][key] - value) <= bound, f"step {step} {key}: {got[step][key]} vs {value} (> {bound:.3g})"
