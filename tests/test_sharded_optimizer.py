"""The data-parallel-sharded optimizer (--distributed-optimizer): slice arithmetic, dp 2 against
dp 1, against the replicated optimizer (fp32 and bf16 masters), and checkpoints written at one
dp size restored bit for bit at another.

Rank processes are real gloo ranks (tests/helpers/ranks.py); the HF parity of the
sharded optimizer at every layout is in tests/test_parity.py (it is the default there).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mcore_dpo.optim.zero import owned_range
from tests.helpers.data import make_pairs
from tests.helpers.ranks import spawn_ranks
from tests.helpers.reference import assert_close
from tests.helpers.resume_ranks import policy_jobs_rank

GLOBAL_BATCH = 8
MICRO_BATCH = 2
STEPS = 3


# --------------------------------------------------------------------------- slice arithmetic
@pytest.mark.parametrize("dp_size", [1, 2, 3, 4])
def test_owned_ranges_cover_every_element_once(dp_size):
    """Parameters laid out in buckets (with gaps, as DDP pads them): over the dp ranks, every
    element of every parameter is owned exactly once."""
    gen = torch.Generator().manual_seed(dp_size)
    offset, layout = 0, []  # (param_start, param_end, bucket_offset, bucket_numel)
    for _bucket in range(3):
        start, params = offset, []
        for _ in range(int(torch.randint(1, 6, (), generator=gen))):
            start += int(torch.randint(0, 5, (), generator=gen))  # padding before a parameter
            numel = int(torch.randint(1, 40, (), generator=gen))
            params.append((start, start + numel))
            start += numel
        numel = -(-(start - offset) // dp_size) * dp_size
        layout += [(s, e, offset, numel) for s, e in params]
        offset += numel
    for start, end, b_off, b_numel in layout:
        owned = torch.zeros(end - start, dtype=torch.int64)
        for rank in range(dp_size):
            lo, hi = owned_range(param_start=start, param_end=end, bucket_offset=b_off, bucket_numel=b_numel,
                                 dp_rank=rank, dp_size=dp_size)
            owned[lo:hi] += 1
        assert owned.eq(1).all(), (start, end, owned.tolist())


def test_a_bucket_not_divisible_by_dp_is_refused():
    with pytest.raises(ValueError, match="not divisible"):
        owned_range(param_start=0, param_end=3, bucket_offset=0, bucket_numel=5, dp_rank=0, dp_size=2)


# --------------------------------------------------------------------------- rank harness
def _save(worker, config, directory: str, *, step: int, rank: int) -> None:
    """What the driver's save does (mcore_dpo/driver/run.py), without the rename: shards from every
    rank, then the metadata and the state file."""
    import json

    from checkpoint_convert.convert import write_mcore_meta
    from mcore_dpo.checkpoint import layout as checkpoint
    from mcore_dpo.driver.outputs import model_meta

    worker.save_checkpoint(directory, step=step)
    # Every rank's files are written before the metadata records their checksums (the driver's
    # group.call waits for every rank the same way).
    torch.distributed.barrier()
    if rank == 0:
        meta, aux = model_meta(config, worker.spec, dtype="float32", layer_spec=worker.layer_spec())
        for kind in ("model",) + tuple(f"optim/{m}" for m in checkpoint.MOMENTS):
            write_mcore_meta(Path(directory) / kind, meta=meta, aux_files=aux)
        state = {"format": checkpoint.FORMAT, "format_version": checkpoint.FORMAT_VERSION, "step": step}
        Path(directory, "trainer_state.json").write_text(json.dumps(state))


def _steps_and_states(worker, config, job: dict, *, rank: int, out_dir: str) -> None:
    """A job's steps on its worker: the metrics of each step, the checkpoints of `save_at` and
    each rank's optimizer state bytes."""
    from mcore_dpo.rank.worker import StepBatch

    name, batches, first = job["name"], job["batches"], job["first_step"]
    if first - 1 in job["save_at"]:  # restored, not stepped
        _save(worker, config, os.path.join(out_dir, f"{name}_step{first - 1}"), step=first - 1, rank=rank)
    for k in range(first, len(batches) + 1):
        metrics = worker.train_step(StepBatch(step=k, pairs=batches[k - 1]))
        if metrics is not None:
            save_file({"grad_norm": torch.tensor(metrics["grad_norm"], dtype=torch.float64),
                       "loss": torch.tensor(metrics["loss"], dtype=torch.float64)},
                      os.path.join(out_dir, f"{name}_metrics{k}.safetensors"))
        if k in job["save_at"]:
            _save(worker, config, os.path.join(out_dir, f"{name}_step{k}"), step=k, rank=rank)
    bytes_ = torch.tensor([worker.optimizer.state_bytes()], dtype=torch.int64)
    save_file({"state_bytes": bytes_, "tp_rank": torch.tensor([worker.mesh.tp_rank])},
              os.path.join(out_dir, f"{name}_bytes_rank{rank}.safetensors"))


def _rank_main(rank: int, world_size: int, port: int, jobs: list[dict], out_dir: str) -> None:
    policy_jobs_rank(rank, port, jobs, out_dir, _steps_and_states)


def _run(*, world_size: int, jobs: list[dict], out_dir: Path) -> None:
    """The ranks fork from tests/helpers/ranks.py's preloaded server (torch and megatron-core imported once)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spawn_ranks(_rank_main, world_size=world_size, jobs=jobs, out_dir=out_dir)


STEPS_BEFORE_RESUME = 2


def _job(name: str, models, *, dp: int, sharded: bool, dtype: str = "float32", clip_grad: float = 1.0,
         resume: Path | None = None, save_at: tuple[int, ...] = (STEPS,), ep: int = 1, tp: int = 1) -> dict:
    policy_dir, ref_dir = models
    pairs = make_pairs(STEPS * GLOBAL_BATCH, seed=11)
    return {
        "name": name,
        "config": dict(model=str(policy_dir), ref_model=str(ref_dir), tp=tp, dp=dp, micro_batch_size=MICRO_BATCH,
                       global_batch_size=GLOBAL_BATCH, max_steps=STEPS, lr=1e-3, adam_eps=1e-4, weight_decay=0.1,
                       clip_grad=clip_grad, dtype=dtype, ref_mode="sequential", timeout_s=120.0,
                       distributed_optimizer=sharded, ep=ep),
        "batches": [pairs[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH] for k in range(STEPS)],
        "first_step": 1 if resume is None else STEPS_BEFORE_RESUME + 1,
        "resume": str(resume) if resume else None,
        "save_at": list(save_at),
    }


def _state(directory: Path, *, tp_rank: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """{kind: {name: tensor}} of tp rank `tp_rank`'s shard of a checkpoint written at pp 1 (at
    ep > 1 every expert under its global index, read from the ep files)."""
    from checkpoint_convert.mcore_dir import open_mcore_dir

    return {kind: open_mcore_dir(directory / kind).shard(tp_rank, 0)
            for kind in ("model", "optim/exp_avg", "optim/exp_avg_sq")}


def _assert_states_equal(a: dict, b: dict, *, what: str) -> None:
    for kind in a:
        assert a[kind].keys() == b[kind].keys(), (what, kind)
        for name in a[kind]:
            assert torch.equal(a[kind][name], b[kind][name]), f"{what}: {kind} {name} differs"


def _assert_states_close(ours: dict, ref: dict, *, what: str) -> None:
    """The same names in every kind (masters, moments) and every tensor within 1e-5."""
    for kind in ref:
        assert ours[kind].keys() == ref[kind].keys(), (what, kind)
        for name, value in ref[kind].items():
            assert_close(ours[kind][name], value, what=f"{what} {kind} {name}")


def _assert_clipped_steps_close(runs: Path, *, what: str) -> None:
    """Loss and grad norm of the sharded and the replicated job within 1e-5 at every step, with
    clipping (at 0.05) active at each."""
    from safetensors.torch import load_file

    for k in range(1, STEPS + 1):
        a = load_file(str(runs / f"sharded_metrics{k}.safetensors"))
        b = load_file(str(runs / f"replicated_metrics{k}.safetensors"))
        assert b["grad_norm"] > 0.05, "clipping is not active"
        for key in ("loss", "grad_norm"):
            assert_close(a[key], b[key], what=f"{what} step {k} {key}")


@pytest.fixture(scope="module")
def models(parity_models):
    return parity_models["llama"]


@pytest.fixture(scope="module")
def dp2_runs(models, tmp_path_factory):
    """At dp 2: the sharded optimizer (fp32, saved at steps 2 and 3), and bf16 parameters with
    clipping off under both optimizers."""
    out = tmp_path_factory.mktemp("dp2")
    jobs = [_job("sharded", models, dp=2, sharded=True, save_at=(STEPS_BEFORE_RESUME, STEPS)),
            _job("sharded_bf16", models, dp=2, sharded=True, dtype="bfloat16", clip_grad=0.0),
            _job("replicated_bf16", models, dp=2, sharded=False, dtype="bfloat16", clip_grad=0.0)]
    _run(world_size=2, jobs=jobs, out_dir=out)
    return out


@pytest.fixture(scope="module")
def dp1_runs(models, dp2_runs, tmp_path_factory):
    """At dp 1: the replicated optimizer; and the dp-2 checkpoint of step 2 restored, written
    again before any step, and trained on to step 3."""
    out = tmp_path_factory.mktemp("dp1")
    resumed = _job("resumed", models, dp=1, sharded=True, resume=dp2_runs / f"sharded_step{STEPS_BEFORE_RESUME}",
                   save_at=(STEPS_BEFORE_RESUME, STEPS))
    _run(world_size=1, jobs=[_job("replicated", models, dp=1, sharded=False), resumed], out_dir=out)
    return out


def test_dp2_sharded_equals_dp1_within_1e_5(dp1_runs, dp2_runs):
    """Weights, moments, loss and grad norm of 3 steps at dp 2 (sharded) against dp 1."""
    ours, ref = _state(dp2_runs / f"sharded_step{STEPS}"), _state(dp1_runs / f"replicated_step{STEPS}")
    for kind in ref:
        for name, value in ref[kind].items():
            assert_close(ours[kind][name], value, what=f"{kind} {name}")
    for k in range(1, STEPS + 1):
        from safetensors.torch import load_file

        a = load_file(str(dp2_runs / f"sharded_metrics{k}.safetensors"))
        b = load_file(str(dp1_runs / f"replicated_metrics{k}.safetensors"))
        for key in ("loss", "grad_norm"):
            assert_close(a[key], b[key], what=f"step {k} {key}")


def test_sharded_equals_replicated_bitwise_at_dp2(dp2_runs):
    """bf16 parameters, clipping off: both optimizers see the same reduced gradients, so the
    fp32 masters and moments agree bit for bit after 3 steps."""
    sharded, replicated = _state(dp2_runs / f"sharded_bf16_step{STEPS}"), _state(dp2_runs / f"replicated_bf16_step{STEPS}")
    _assert_states_equal(sharded, replicated, what="bf16")
    model = sharded["model"]
    assert all(t.dtype == torch.float32 for t in model.values())
    # The masters hold what bf16 cannot: they are not all representable in bf16.
    assert any(not torch.equal(t, t.bfloat16().float()) for t in model.values())


def test_state_per_rank_halves_at_dp2(dp2_runs):
    """bf16 parameters: fp32 masters plus two moments, per rank."""
    from safetensors.torch import load_file

    def state_bytes(name: str) -> list[int]:
        return [int(load_file(str(dp2_runs / f"{name}_bytes_rank{r}.safetensors"))["state_bytes"]) for r in (0, 1)]

    sharded, replicated = state_bytes("sharded_bf16"), state_bytes("replicated_bf16")
    assert replicated[0] == replicated[1] and sum(sharded) == replicated[0], (sharded, replicated)
    for b in sharded:  # half, up to where DDP's padding puts the slice boundary
        assert abs(b / replicated[0] - 0.5) < 0.05, (sharded, replicated)


def test_dp2_checkpoint_restores_bit_exactly_at_dp1(dp1_runs, dp2_runs):
    """A step-2 checkpoint written at dp 2 (gathered from the slices), restored at dp 1 and
    written again: the same bytes; training on from it matches the uninterrupted dp-2 run."""
    before = _state(dp2_runs / f"sharded_step{STEPS_BEFORE_RESUME}")
    _assert_states_equal(_state(dp1_runs / f"resumed_step{STEPS_BEFORE_RESUME}"), before, what="dp2 -> dp1")
    ours, ref = _state(dp1_runs / f"resumed_step{STEPS}"), _state(dp2_runs / f"sharded_step{STEPS}")
    for kind in ref:
        for name, value in ref[kind].items():
            assert_close(ours[kind][name], value, what=f"resumed {kind} {name}")
        # Not the checkpoint read back: a step was taken.
        assert any(not torch.equal(ours[kind][n], before[kind][n]) for n in before[kind])


@pytest.fixture(scope="module")
def ep2_runs(moe_models, tmp_path_factory):
    """Qwen3-MoE at (tp, pp, dp, ep) = (1, 1, 2, 2), clipping on, in one launch: the sharded
    optimizer (expert slices over the expert-data-parallel group, dense ones over dp; saved at
    steps 2 and 3), the replicated one, and the sharded one resumed from the step-2 checkpoint."""
    root = tmp_path_factory.mktemp("ep2")
    models = moe_models["qwen3_moe"]
    out = root / "runs"
    jobs = [_job("sharded", models, dp=2, ep=2, sharded=True, clip_grad=0.05, save_at=(STEPS_BEFORE_RESUME, STEPS)),
            _job("replicated", models, dp=2, ep=2, sharded=False, clip_grad=0.05),
            _job("resumed", models, dp=2, ep=2, sharded=True, clip_grad=0.05, resume=out / f"sharded_step{STEPS_BEFORE_RESUME}")]
    _run(world_size=2, jobs=jobs, out_dir=out)
    return out


def test_sharded_optimizer_at_ep2_equals_the_replicated_one_and_resumes_bit_exactly(ep2_runs):
    """At ep 2: loss, grad norm (clipping active), masters and moments of 3 steps within 1e-5 of
    the replicated optimizer; each rank holds its slices only; resumed from step 2 at the same
    layout, the step-3 state equals the uninterrupted run's bit for bit."""
    from safetensors.torch import load_file

    ours, ref = _state(ep2_runs / f"sharded_step{STEPS}"), _state(ep2_runs / f"replicated_step{STEPS}")
    assert any(".local_experts.3." in name for name in ref["model"])  # ep rank 1's experts are in the checkpoint
    _assert_states_close(ours, ref, what="ep2")
    _assert_clipped_steps_close(ep2_runs, what="ep2")
    sharded = [int(load_file(str(ep2_runs / f"sharded_bytes_rank{r}.safetensors"))["state_bytes"]) for r in (0, 1)]
    replicated = [int(load_file(str(ep2_runs / f"replicated_bytes_rank{r}.safetensors"))["state_bytes"]) for r in (0, 1)]
    # fp32 parameters: the state is the two moments. Each rank holds its ep rank's experts (half
    # of them, not sharded further: expert dp is tp x dp / ep = 1) and half the dense elements
    # (sharded over dp 2, up to DDP's padding).
    dense = sum(t.numel() for n, t in ref["model"].items() if ".local_experts." not in n)
    experts = sum(t.numel() for n, t in ref["model"].items() if ".local_experts." in n)
    assert replicated == [8 * (dense + experts // 2)] * 2, (replicated, dense, experts)
    for s in sharded:
        assert abs(s / (8 * (dense / 2 + experts / 2)) - 1) < 0.02, (sharded, dense, experts)
    _assert_states_equal(_state(ep2_runs / f"resumed_step{STEPS}"), ours, what="ep2 resumed")
    for k in (STEPS_BEFORE_RESUME + 1,):
        a = load_file(str(ep2_runs / f"resumed_metrics{k}.safetensors"))
        b = load_file(str(ep2_runs / f"sharded_metrics{k}.safetensors"))
        assert all(torch.equal(a[key], b[key]) for key in ("loss", "grad_norm")), (a, b)


@pytest.fixture(scope="module")
def tp2_ep2_runs(moe_models, tmp_path_factory):
    """Qwen3-MoE at (tp, pp, dp, ep) = (2, 1, 2, 2), world 4, clipping on, in one launch: the
    sharded optimizer and the replicated one. megatron-core carves the ep groups from the tp x dp
    ranks, so here they run along tp (tp rank t holds ep rank t's experts, whole) and the expert-
    data-parallel group of an ep rank is its two dp ranks: dense slices are cut over dp 2, expert
    slices over expert dp 2."""
    root = tmp_path_factory.mktemp("tp2_ep2")
    models = moe_models["qwen3_moe"]
    out = root / "runs"
    jobs = [_job(name, models, tp=2, dp=2, ep=2, sharded=sharded, clip_grad=0.05)
            for name, sharded in (("sharded", True), ("replicated", False))]
    _run(world_size=4, jobs=jobs, out_dir=out)
    return out


def test_sharded_optimizer_at_tp2_ep2_equals_the_replicated_one(tp2_ep2_runs):
    """At tp 2 x ep 2: loss, grad norm (clipping active), masters and moments of every parameter
    (each tp rank's shard; experts through their tp part) after 3 steps within 1e-5 of the
    replicated optimizer; each rank holds half of its dense part and half of its ep rank's
    experts."""
    from safetensors.torch import load_file

    runs = tp2_ep2_runs
    dense, experts = {}, 0
    for t in (0, 1):
        ours = _state(runs / f"sharded_step{STEPS}", tp_rank=t)
        ref = _state(runs / f"replicated_step{STEPS}", tp_rank=t)
        assert any(".local_experts.3." in name for name in ref["model"])  # ep rank 1's experts are in the checkpoint
        _assert_states_close(ours, ref, what=f"tp2 ep2 (tp rank {t})")
        dense[t] = sum(v.numel() for n, v in ref["model"].items() if ".local_experts." not in n)
        experts = sum(v.numel() for n, v in ref["model"].items() if ".local_experts." in n)  # = all experts / tp
    _assert_clipped_steps_close(runs, what="tp2 ep2")
    # fp32 parameters: the state is the two moments. A rank at tp rank t holds tp rank t's dense
    # part and its ep rank's experts, whole: E/ep = half of the experts, as many elements as one
    # tp part of them all (`experts`). The sharded optimizer keeps half of each (dp 2 and expert
    # dp 2), up to DDP's padding.
    for r in range(4):
        sharded = load_file(str(runs / f"sharded_bytes_rank{r}.safetensors"))
        replicated = load_file(str(runs / f"replicated_bytes_rank{r}.safetensors"))
        t = int(replicated["tp_rank"])
        assert int(sharded["tp_rank"]) == t
        assert int(replicated["state_bytes"]) == 8 * (dense[t] + experts), (r, replicated, dense, experts)
        half = 8 * (dense[t] + experts) / 2
        assert abs(int(sharded["state_bytes"]) / half - 1) < 0.02, (r, sharded, dense, experts)


def test_the_flag_reaches_the_config_from_the_command_line():
    from mcore_dpo.command_line import resolve

    assert resolve(["--dp", "2"])[0].distributed_optimizer is True
    assert resolve(["--dp", "2", "--no-distributed-optimizer"])[0].distributed_optimizer is False


# --------------------------------------------------------------------------- the step's memory
# Clipping scales the gradient buffers in place, the norm squares one fp64 chunk at a time, and a
# GPU runs torch's fused AdamW (which also runs on the CPU, so its plumbing is tested here).


def test_clipping_scales_the_gradient_buffer_in_place_without_a_copy():
    from mcore_dpo.optim.adamw import clip_in_place

    grad = torch.randn(64, 32)
    before = grad.clone()
    out = clip_in_place(grad, 0.25, dtype=torch.float32)
    assert out.data_ptr() == grad.data_ptr()  # the optimizer's gradient is the buffer itself
    assert torch.equal(out, before * 0.25)
    assert clip_in_place(grad, 1.0, dtype=torch.float32).data_ptr() == grad.data_ptr()
    half = torch.randn(8).bfloat16()
    assert clip_in_place(half, 0.5, dtype=torch.float32).dtype == torch.float32  # a cast needs its copy


def test_the_norm_in_fp64_chunks_equals_the_whole_fp64_sum():
    from mcore_dpo.optim.adamw import NORM_CHUNK, squared_sum

    small = torch.randn(1000)
    assert torch.equal(squared_sum(small), small.double().pow(2).sum())  # one chunk: bit for bit
    big = torch.randn(3 * NORM_CHUNK + 7)
    whole = big.double().pow(2).sum().item()
    assert squared_sum(big).item() == pytest.approx(whole, rel=1e-13)


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield dist.group.WORLD
    if owned:
        dist.destroy_process_group()


def _replicated_run(*, fused: bool, steps: int, group, start=None) -> tuple[dict, object, list]:
    """CpuOptimizer over three parameters (two decayed matrices, one vector) whose main_grad is
    a fixed gradient per step, large enough that clipping at 0.5 scales it; `start`: resume from
    (masters, moments, step) instead of step 0."""
    from mcore_dpo.optim.adamw import CpuOptimizer

    gen = torch.Generator().manual_seed(0)
    named = [(name, torch.nn.Parameter(torch.randn(shape, generator=gen)))
             for name, shape in (("a.weight", (48, 16)), ("b.weight", (16, 48)), ("norm.weight", (16,)))]
    opt = CpuOptimizer(named_params=named, params_once=[p for _, p in named], group=group, betas=(0.9, 0.999),
                       eps=1e-8, weight_decay=0.1, clip_grad=0.5, fused=fused)
    first = 0
    if start is not None:
        masters, moments, first = start
        opt.load_moments(moments, masters=masters, step=first)
        with torch.no_grad():
            for name, p in named:
                p.copy_(masters[name])
    grads_seen = []
    for step in range(steps):
        grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + first + step)) * 3
                 for _, p in named]
        for (_, p), g in zip(named, grads):
            p.main_grad = g.clone()
        opt.step(lr=1e-2)
        assert opt.last_clip < 1.0
        grads_seen.append([(p.main_grad, g) for (_, p), g in zip(named, grads)])
    return {n: p.detach().clone() for n, p in named}, opt, grads_seen


def test_fused_adamw_matches_the_default_one_and_resumes_bit_for_bit(one_rank_group):
    plain, _, _ = _replicated_run(fused=False, steps=3, group=one_rank_group)
    fused, _, grads_seen = _replicated_run(fused=True, steps=3, group=one_rank_group)
    for name in plain:
        assert_close(fused[name], plain[name], what=f"fused AdamW {name}", rtol=1e-6)
    for step in grads_seen:  # each buffer holds its gradient times the step's clip coefficient
        for held, given in step:
            ratio = (held / given).flatten()
            assert torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-6) and ratio[0] < 1
    # Two fused steps, then a fused optimizer rebuilt from their state: the third step is the
    # uninterrupted third step bit for bit (AdamW's step count must sit where the fused kernel reads it).
    _, two, _ = _replicated_run(fused=True, steps=2, group=one_rank_group)
    resumed, _, _ = _replicated_run(fused=True, steps=1, group=one_rank_group,
                                    start=(two.master_weights(), two.moments(), 2))
    for name in fused:
        assert torch.equal(resumed[name], fused[name]), name


def test_the_estimate_counts_the_step_where_it_outgrows_the_activations():
    """A rank's peak is its held state plus the larger of the activations and the optimizer
    step's temporaries (the step runs after the last backward has freed the activations)."""
    from mcore_dpo.tools.memory_estimate import LayerShape, optimizer_step_bytes, per_gpu_bytes, plan_activation_bytes
    from mcore_dpo.optim.adamw import NORM_CHUNK

    assert optimizer_step_bytes() == 16 * NORM_CHUNK  # an fp64 chunk and its square
    shape = LayerShape(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=172, vocab=128)
    act = dict(layers=4, pp=1, num_microbatches=2, ref_mode="interleaved", seq_len=32, rows=2, tp=1,
               sequence_parallel=False, attention="local", dtype_bytes=2)
    kw = dict(params=10_000, layers=4, tp=1, pp=1, dp=1, distributed_optimizer=True, micro_batch_size=1,
              num_microbatches=2, seq_len=32, ref_mode="interleaved", sequence_parallel=False, attention="local")
    static = per_gpu_bytes(shape, **kw) - max(plan_activation_bytes(shape, **act), optimizer_step_bytes())
    assert plan_activation_bytes(shape, **act) < optimizer_step_bytes()  # tiny: the step is the peak
    assert static == pytest.approx(10_000 * (2 + 4 + 2 + 12), rel=1e-12)
    long = dict(kw, seq_len=4096, micro_batch_size=4)
    long_act = plan_activation_bytes(shape, **dict(act, seq_len=4096, rows=8))
    assert long_act > optimizer_step_bytes()
    assert per_gpu_bytes(shape, **long) == pytest.approx(static + long_act, rel=1e-12)
