"""Context parallelism (--cp N): each sequence split over cp ranks, 2N chunks with cp rank i
holding chunks i and 2N-1-i; keys and values all-gathered over cp in the CPU's core attention
(mcore_dpo/model/cp_attention.py), the per-token log-probs gathered before the loss.

- The split (which positions each cp rank holds) and the order the gathers restore, without
  processes; the CP attention on two gloo ranks against megatron-core's plain attention over the
  whole row (outputs and the query, key and value gradients), causal and with a packed row's
  segment mask.
- Parity on real gloo ranks against the single-process Hugging Face reference
  (tests/helpers/parity.py's cached reference, the existing RTOL): every metric of every step,
  every rank's gradients at every step (both cp ranks' files) and the weights after the last
  step, at (tp, pp, dp, cp) = (1,1,1,2), (2,1,1,2) sequence-parallel and (1,2,1,2), padded and
  packed (the padded job at (1,2,1,2) with the precomputed reference: its forward-only table
  passes), and packed at (1,1,2,2) (dp 2 x cp 2); also the distributed optimizer (sharded over
  dp x cp) at (1,1,1,2), --prefix-sharing's shared-prompt rows packed at (1,1,1,2) and (2,1,1,2), and packed
  rows under --recompute full at (1,1,1,2). cp rank 1's gradients equal cp rank 0's bit for bit.
  At (1,1,1,2) the jobs run 3 steps and are also compared directly with the same 3 steps at cp 1
  (dp 2 in the same world of two ranks: the same shards), metrics and gradients; so are LD-DPO
  and WPO's per-token weights on packed rows (1 step).
- In the same two launches: the reference tables made before the step (--ref-mode precomputed
  on packed rows, --ref-mode separate from a reference group of one rank) at (1,1,1,2), against
  the single-process reference and against the interleaved jobs (the reference inside the
  step); LoRA against Hugging Face + PEFT (tests/helpers/lora_parity.py) at (1,1,1,2) and
  (2,1,1,2).
- --save-format torch_dist at cp 2 through the command line: saved at cp 2, resumed at cp 2 (bit
  for bit) and at cp 1 (within 1e-5), and what a cp-1 run writes against what the cp-2 run wrote.
- The flag through the real command-line parser and its refusals, one line each.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mcore_dpo.command_line import build_parser, resolve
from mcore_dpo.config import ConfigError
from mcore_dpo.parallel.context_parallel import local_part, local_positions, whole_from_parts
from tests.helpers.data import PACKED, make_pairs
from tests.helpers.lora_parity import (EVAL_PAIRS as LORA_EVAL_PAIRS, GLOBAL_BATCH as LORA_BATCH, SHAPE as LORA_SHAPE,
                                       STEPS as LORA_STEPS, check_lora_job, lora_job, peft_reference, random_adapter)
from tests.helpers.parity import check_job, jobs_for, packed_parity_job, parity_job
from tests.helpers.ranks import check_ran_packed, load_rank_tensors, run_ranks, spawn_processes
from tests.helpers.ray_runs import main_in_process
from tests.helpers.reference import RTOL, assert_close
from tests.helpers.cli import train_input_error

STEPS = 3  # at (1,1,1,2); 2 at the layouts of four ranks


# ----------------------------------------------------------------------------- the split


def test_each_cp_rank_holds_chunks_i_and_2n_minus_1_minus_i():
    assert local_positions(8, cp=2, cp_rank=0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, cp=2, cp_rank=1).tolist() == [2, 3, 4, 5]
    assert local_positions(12, cp=3, cp_rank=1).tolist() == [2, 3, 8, 9]
    # Every position once over the ranks; a rank's part of a tensor is its positions, and the
    # gathers put the ranks' parts back in position order.
    for seq_len, cp in ((8, 2), (24, 3), (16, 4)):
        positions = [local_positions(seq_len, cp=cp, cp_rank=r) for r in range(cp)]
        assert sorted(torch.cat(positions).tolist()) == list(range(seq_len))
        row = torch.arange(3 * seq_len).view(3, seq_len)
        parts = [local_part(row, dim=1, cp=cp, cp_rank=r) for r in range(cp)]
        assert all(torch.equal(p, row[:, pos]) for p, pos in zip(parts, positions))
        assert torch.equal(whole_from_parts(parts, dim=1), row)
    with pytest.raises(ValueError, match="does not split into 4 chunks"):
        local_positions(10, cp=2, cp_rank=0)
    with pytest.raises(ValueError, match="does not split into 4 chunks"):
        local_part(torch.zeros(2, 10), dim=1, cp=2, cp_rank=0)


def _attention_rank(rank: int, port: int, out_dir: str) -> None:
    """Rank `rank` of two: the CP attention on its positions against megatron-core's local
    attention over the whole row (computed on every rank alike), forward and backward."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from mcore_dpo.model.builder import causal_mask, segment_mask
    from mcore_dpo.model.cp_attention import ContextParallelDotProductAttention
    from mcore_dpo.parallel import platform as plat
    from mcore_dpo.parallel.context_parallel import gather_replicated

    platform = plat.detect(local_rank=0)
    plat.activate(platform)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ps.initialize_model_parallel(context_parallel_size=2)
    plat.init_model_rng(platform, 1)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                               context_parallel_size=2, use_cpu_initialization=True, attention_softmax_in_fp32=True,
                               attention_dropout=0.0)
    plain_config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                     kv_channels=8, use_cpu_initialization=True, attention_softmax_in_fp32=True,
                                     attention_dropout=0.0)
    kwargs = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    cp_attention = ContextParallelDotProductAttention(config, **kwargs)
    plain = DotProductAttention(plain_config, **kwargs)
    seq_len, rows = 16, 2
    segments = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])  # a packed row and a plain one
    errors = {}
    for name, whole_mask in (("causal", causal_mask(seq_len, device=torch.device("cpu"))),
                             ("segments", segment_mask(segments))):
        gen = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(seq_len, rows, h, 8, generator=gen, dtype=torch.float64).float()
                   for h in (4, 2, 2))
        weights = torch.randn(seq_len, rows, 32, generator=gen)
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = plain(*whole, whole_mask)
        (expected * weights).sum().backward()
        mine = [local_part(t, dim=0, cp=2, cp_rank=rank).requires_grad_() for t in (q, k, v)]
        rows_mask = whole_mask.index_select(2, local_positions(seq_len, cp=2, cp_rank=rank))
        out = cp_attention(*mine, rows_mask)
        # The loss of the whole row, the same on both ranks (as the log-probs' gather gives it).
        (gather_replicated(out, dim=0, group=ps.get_context_parallel_group()) * weights).sum().backward()
        errors[f"{name} output"] = (out - local_part(expected.detach(), dim=0, cp=2, cp_rank=rank)).abs().max().item()
        for label, t, w in zip("qkv", mine, whole):
            errors[f"{name} grad {label}"] = (t.grad - local_part(w.grad, dim=0, cp=2, cp_rank=rank)).abs().max().item()
        errors[f"{name} scale"] = expected.abs().max().item()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(errors))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def test_cp_attention_equals_plain_causal_attention(tmp_path):
    from mcore_dpo.parallel.ports import free_port

    spawn_processes(_attention_rank, nprocs=2, args=(free_port(), str(tmp_path)))
    for rank in range(2):
        errors = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name, error in errors.items():
            if not name.endswith("scale"):
                assert error < 1e-6, (rank, name, error, errors)


# ----------------------------------------------------------------------------- parity


def _launch_jobs(layouts, models: dict, *, steps: int) -> list[tuple[tuple[int, int, int, int], dict]]:
    policy, ref = models["llama"]
    jobs = []
    for layout in layouts:
        tp, pp, dp, cp = layout
        extra = {"cp": cp, "sequence_parallel": True} if tp > 1 else {"cp": cp}
        jobs.append((layout, parity_job(layout, policy, ref, name=f"padded-cp{cp}", steps=steps, **extra)))
        jobs.append((layout, packed_parity_job(layout, policy, ref, name=f"packed-cp{cp}", steps=steps, **extra)))
    return jobs


def _shared_jobs(layout, models: dict) -> list[tuple[tuple[int, int, int, int], dict]]:
    """--prefix-sharing at cp 2, packed rows (sequence-parallel at tp 2): shared prompts and
    several pairs to a row, the segment mask at its most varied."""
    policy, ref = models["llama"]
    extra = {"cp": layout[3], "prefix_sharing": True, **({"sequence_parallel": True} if layout[0] > 1 else {})}
    return [(layout, packed_parity_job(layout, policy, ref, name="shared-packed-cp2", **extra))]


def _check_cp_ranks_agree(out_dir: Path, j: int, layout, steps: int) -> None:
    """cp rank 1's gradients and weights are cp rank 0's (the reduction over dp x cp)."""
    for kind in [f"grads{k}" for k in range(1, steps + 1)] + ["weights"]:
        zero, one = (load_rank_tensors(out_dir, j, kind, layout=layout, cp_rank=c) for c in (0, 1))
        for rank, shard in zero.items():
            if kind == "weights" and rank[2] != 0:
                continue
            assert set(one[rank]) == set(shard) or kind == "weights", (kind, rank)
            for name, value in shard.items():
                if name in one[rank]:
                    assert torch.equal(one[rank][name], value), f"job {j} {kind} {name} {rank}: cp ranks differ"


def _table_jobs(layout, models: dict) -> list[tuple[tuple[int, int, int, int], dict]]:
    """The reference tables made before the step at cp 2: --ref-mode precomputed on packed rows
    (its forward-only pass over the data set runs padded rows, split over cp like any others) and
    --ref-mode separate (a reference group of one rank at cp 1 sends the tables)."""
    jobs = []
    for mode, extra in (("precomputed", PACKED), ("separate", {"ref_tp": 1, "ref_pp": 1, "ref_dp": 1})):
        job = next(job for job in jobs_for(layout[:3], models, all_losses=False, losses=("sigmoid",))
                   if job["key"] == ("llama", "precomputed" if mode == "precomputed" else "interleaved", "sigmoid"))
        job["key"] = ("llama", mode, "sigmoid")
        job["config"].update(cp=layout[3], ref_mode=mode, **extra)
        jobs.append((layout, job))
    return jobs


def _lora_jobs(layout, lora_setup: dict, variants) -> list[tuple[tuple[int, int, int, int], dict]]:
    """LoRA on every target at cp 2 (tests/helpers/lora_parity.py): `variants` are (start, packed),
    start "fresh" (the reference: the adapters off) or "init" (a PEFT adapter to start from; the
    reference: its frozen copy)."""
    jobs = []
    for start, packed in variants:
        jobs.append((layout, lora_job(layout, key=(f"lora-{start}", "packed" if packed else "padded"),
                                      base_dir=lora_setup["base"], pairs=lora_setup["pairs"],
                                      init_dir=lora_setup["init_dir"] if start == "init" else None,
                                      **(PACKED if packed else {}))))
    return jobs


@pytest.fixture(scope="module")
def lora_setup(parity_models, tmp_path_factory):
    """The Llama parity policy as a LoRA base, a non-zero PEFT adapter for it, the pairs of the
    LoRA jobs (tests/helpers/lora_parity.py's shapes) and the HF + PEFT references, once."""
    from checkpoint_convert.io import open_hf_dir
    from checkpoint_convert.peft_adapter import adapter_config, write_adapter_dir

    base = parity_models["llama"][0]
    spec = open_hf_dir(base).spec
    init_dir = tmp_path_factory.mktemp("lora_cp") / "init_adapter"
    write_adapter_dir(init_dir, random_adapter(spec, LORA_SHAPE, seed=5),
                      adapter_config(LORA_SHAPE, spec=spec, dropout=0.0, base_model=None))
    pairs = make_pairs(LORA_STEPS * LORA_BATCH + LORA_EVAL_PAIRS, seed=11)
    setup = {"base": base, "spec": spec, "init_dir": init_dir, "pairs": pairs}
    setup["references"] = {start: peft_reference(base_dir=base, spec=spec, pairs=pairs,
                                                 init_dir=init_dir if start == "init" else None)
                           for start in ("fresh", "init")}
    return setup


# Per-token options (LD-DPO's weights over each pair's shorter completion, WPO's weights): the
# same step at cp 2 and at cp 1 (dp 2), compared directly (the reference has neither).
PER_TOKEN = {"ld_alpha": 0.5, "use_weighting": True}


@pytest.fixture(scope="module")
def two_ranks(parity_models, lora_setup, tmp_path_factory):
    """(1,1,1,2) padded and packed over STEPS steps, then the same at cp 1 (dp 2); then at cp 2
    the distributed optimizer (sharded over dp x cp), shared prompts, full recompute, the
    per-token options at cp 2 and cp 1, the precomputed and separate reference tables, and LoRA
    (a fresh adapter on padded rows, a PEFT adapter to start from on packed rows)."""
    out_dir = tmp_path_factory.mktemp("cp2")
    policy, ref = parity_models["llama"]
    jobs = _launch_jobs([(1, 1, 1, 2), (1, 1, 2, 1)], parity_models, steps=STEPS)
    jobs.append(((1, 1, 1, 2), parity_job((1, 1, 1, 2), policy, ref, name="zero-cp2", cp=2,
                                          distributed_optimizer=True)))
    jobs += _shared_jobs((1, 1, 1, 2), parity_models)
    # --recompute full: the layers' key/value gathers run again in the backward, on every cp rank alike
    jobs.append(((1, 1, 1, 2), packed_parity_job((1, 1, 1, 2), policy, ref, name="recompute-cp2", cp=2,
                                                 recompute="full")))
    for layout in ((1, 1, 1, 2), (1, 1, 2, 1)):
        jobs.append((layout, packed_parity_job(layout, policy, ref, name=f"per-token-cp{layout[3]}", cp=layout[3],
                                               steps=1, **PER_TOKEN)))
    jobs += _table_jobs((1, 1, 1, 2), parity_models)
    jobs += _lora_jobs((1, 1, 1, 2), lora_setup, [("fresh", False), ("init", True)])
    run_ranks(world_size=2, jobs=[job for _, job in jobs], out_dir=out_dir)
    return out_dir, jobs


@pytest.fixture(scope="module")
def four_ranks(parity_models, lora_setup, tmp_path_factory):
    """(2,1,1,2) sequence-parallel, padded and packed; (1,2,1,2) packed, and padded with the
    precomputed reference (its forward-only table passes, Rank.reference_table); (1,1,2,2)
    packed (the pairs split by tokens over dp, the gradients reduced over dp x cp); (2,1,1,2)
    with shared prompts, and LoRA from a fresh adapter on packed rows (the adapters' tp
    reductions); in one launch of four ranks."""
    out_dir = tmp_path_factory.mktemp("cp4")
    jobs = _launch_jobs([(2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 2, 2)], parity_models, steps=2)
    jobs = [(layout, job) for layout, job in jobs if layout == (2, 1, 1, 2) or job["key"][0] == "packed-cp2"]
    jobs += _shared_jobs((2, 1, 1, 2), parity_models)
    precomputed = [job for job in jobs_for((1, 2, 1), parity_models, all_losses=False, losses=("sigmoid",))
                   if job["key"] == ("llama", "precomputed", "sigmoid")]
    assert len(precomputed) == 1
    precomputed[0]["config"]["cp"] = 2
    jobs.append(((1, 2, 1, 2), precomputed[0]))
    jobs += _lora_jobs((2, 1, 1, 2), lora_setup, [("fresh", True)])
    run_ranks(world_size=4, jobs=[job for _, job in jobs], out_dir=out_dir)
    return out_dir, jobs


def _check_parity(out_dir: Path, jobs) -> None:
    for j, (layout, job) in enumerate(jobs):
        if layout[3] == 1 or job["config"].get("ld_alpha") or job["config"].get("lora_rank"):
            continue
        check_job(out_dir, j, job, layout[:3])
        _check_cp_ranks_agree(out_dir, j, layout[:3], len(job["batches"]))


def test_cp2_equals_the_reference_at_two_ranks(two_ranks):
    _check_parity(*two_ranks)


def test_cp2_equals_the_reference_at_four_ranks(four_ranks):
    _check_parity(*four_ranks)


def test_three_steps_at_cp2_equal_cp1(two_ranks):
    """Padded and packed, 3 steps (and the per-token options' step, packed), cp 2 against
    cp 1: every metric, the gradients of every step."""
    out_dir, jobs = two_ranks
    index = {job["key"][0]: j for j, (_, job) in enumerate(jobs)}
    for name in ("padded", "packed", "per-token"):
        j, base = index[f"{name}-cp2"], index[f"{name}-cp1"]
        job = jobs[j][1]
        steps = len(job["batches"])
        what = f"{job['key'][0]} cp 2 against cp 1"
        ours, theirs = (json.loads((out_dir / f"job{i}_metrics.json").read_text()) for i in (j, base))
        assert len(ours) == len(theirs) == steps + 1
        for step, (m_ours, m_base) in enumerate(zip(ours, theirs), start=1):
            names = [n for n in m_base
                     if n.split("/")[0] in ("loss", "rewards", "logps", "logits", "grad_norm", "eval")]
            assert "loss" in names or "eval/loss" in names
            for name in names:
                assert_close(torch.tensor(m_ours[name]), torch.tensor(m_base[name]), what=f"{what} step {step} {name}")
        for step in range(1, steps + 1):
            mine = load_rank_tensors(out_dir, j, f"grads{step}", layout=(1, 1, 1))
            base_grads = load_rank_tensors(out_dir, base, f"grads{step}", layout=(1, 1, 2))[(0, 0, 0)]
            for name, value in mine[(0, 0, 0)].items():
                assert_close(value, base_grads[name], what=f"{what} step {step} grad {name}", rtol=RTOL)


def _assert_same_steps(out_dir: Path, j: int, base: int, *, steps: int, what: str) -> None:
    """Job j's first `steps` steps against job base's: every metric, and the gradients of both cp ranks."""
    ours, theirs = (json.loads((out_dir / f"job{i}_metrics.json").read_text()) for i in (j, base))
    for step in range(1, steps + 1):
        m_ours, m_base = ours[step - 1], theirs[step - 1]
        names = [n for n in m_base if n.split("/")[0] in ("loss", "rewards", "logps", "logits", "grad_norm")]
        assert "rewards/chosen" in names and "rewards/margins" in names
        for name in names:
            assert_close(torch.tensor(m_ours[name]), torch.tensor(m_base[name]), what=f"{what} step {step} {name}")
        for cp_rank in (0, 1):
            mine, base_grads = (load_rank_tensors(out_dir, i, f"grads{step}", layout=(1, 1, 1), cp_rank=cp_rank)[(0, 0, 0)]
                                for i in (j, base))
            assert mine.keys() == base_grads.keys()
            for name, value in mine.items():
                assert_close(value, base_grads[name], what=f"{what} step {step} grad {name} (cp rank {cp_rank})")


def test_reference_tables_at_cp2_equal_the_in_schedule_reference(two_ranks):
    """--ref-mode precomputed (packed rows) and separate (padded) at cp 2 against the
    interleaved jobs of the same launch, whose reference runs inside the step at cp 2: the same
    rewards (the reference's log-probs enter them), loss and gradients in the steps they share.
    (Both also equal the single-process reference: test_cp2_equals_the_reference_at_two_ranks.)"""
    out_dir, jobs = two_ranks
    index = {(job["key"][0], job["key"][1]): j for j, (_, job) in enumerate(jobs)}
    check_ran_packed(out_dir, padded=index[("llama", "separate")], packed=index[("llama", "precomputed")])
    for mode, base in (("precomputed", "packed-cp2"), ("separate", "padded-cp2")):
        j = index[("llama", mode)]
        assert jobs[j][1]["config"]["ref_mode"] == mode and jobs[j][1]["config"]["cp"] == 2
        _assert_same_steps(out_dir, j, index[(base, "interleaved")], steps=len(jobs[j][1]["batches"]),
                           what=f"--ref-mode {mode} at cp 2 against {base}")


def test_lora_at_cp2_equals_peft(two_ranks, four_ranks, lora_setup):
    """LoRA at cp 2 against Hugging Face + PEFT (tests/helpers/lora_parity.py: every metric of
    both steps, every adapter gradient, the merged weights, the eval metrics): at (1,1,1,2) from a
    fresh adapter on padded rows and from a PEFT adapter on packed rows, at (2,1,1,2) from a fresh
    adapter on packed rows; cp rank 1's adapter gradients are cp rank 0's."""
    # The packed job ran packed rows: the padded job's real tokens (the same batches) in fewer positions.
    index = {job["key"]: j for j, (_, job) in enumerate(two_ranks[1])}
    packed, padded = (json.loads((two_ranks[0] / f"job{index[key]}_metrics.json").read_text())[:2]
                      for key in (("lora-init", "packed"), ("lora-fresh", "padded")))
    for a, b in zip(packed, padded):
        assert a["tokens/real"] == b["tokens/real"] and a["tokens/padded"] < b["tokens/padded"], (a, b)
    checked = 0
    for out_dir, jobs in (two_ranks, four_ranks):
        for j, (layout, job) in enumerate(jobs):
            if not job["config"].get("lora_rank"):
                continue
            start = "init" if job["config"]["init_adapter"] else "fresh"
            what = f"LoRA {job['key']} at (tp, pp, dp, cp) = {layout}"
            check_lora_job(out_dir, j, job, layout[:3], ref=lora_setup["references"][start], spec=lora_setup["spec"],
                           what=what)
            _check_cp_ranks_agree(out_dir, j, layout[:3], len(job["batches"]))
            checked += 1
    assert checked == 3


# ----------------------------------------------------------------------------- torch_dist checkpoints

# The command line in this process on the session's Ray cluster (tests/helpers/ray_runs.py), the
# tiny default model and data: 4 steps, Megatron-LM's format, a checkpoint every 2 steps.
TORCH_DIST_RUN = ["--max-steps", "4", "--global-batch-size", "16", "--micro-batch-size", "4", "--eval-interval", "0",
                  "--save-format", "torch_dist", "--save-interval", "2"]  # fmt: skip
MEASURED = ("tokens/s", "step_time_s", "bubble_fraction")  # and memory/*: measured, not computed
PADDED_COUNTS = ("tokens/padded", "padding_fraction")  # rows are padded to a multiple of 2 x cp


def _torch_dist_run(args: list[str], out: Path, cluster, *, resumed: bool) -> None:
    result = main_in_process([*TORCH_DIST_RUN, *args, "--output-dir", str(out)], cluster=cluster)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("resuming from" in result.stdout) == resumed, result.stdout[-3000:]


def _resumed_from(source: Path, out: Path) -> Path:
    """A run directory holding `source`'s step-2 checkpoint as its latest."""
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / "iter_0000002", out / "checkpoints" / "iter_0000002")
    (out / "checkpoints" / "latest").write_text("iter_0000002\n")
    return out


def _run_metrics(out: Path, *, skip=()) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in MEASURED + tuple(skip) and not k.startswith("memory/")}
            for row in rows if row["step"] >= 3]


def _checkpoint_parts(iter_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every part of a torch_dist training checkpoint through HF names: the model in the run's
    dtype, the fp32 masters and AdamW's moments."""
    from mcore_dpo.checkpoint.torch_dist import open_part
    from mcore_dpo.model.builder import open_weights

    views = {"model": open_weights(str(iter_dir))}
    views.update({f"optimizer {kind}": open_part(iter_dir, kind) for kind in ("model", "exp_avg", "exp_avg_sq")})
    return {part: {name: view.get(name) for name in view.names} for part, view in views.items()}


def test_torch_dist_checkpoints_at_cp2(tmp_path, ray_cluster):
    """--save-format torch_dist at cp 2 through the command line: the checkpoint says cp 2 in
    Megatron-LM's args (the tensors hold no cp: cp rank 0 of each (tp, pp) writes). Its step-2
    checkpoint resumed at cp 2 repeats the uninterrupted run's steps 3-4 bit for bit (metrics; the
    step-4 checkpoint: weights, fp32 masters, moments); resumed at cp 1, it equals them within
    1e-5 (the end eval too). The step-4 checkpoint that run writes at cp 1 holds the tensors the
    cp-2 one holds (names, shapes, dtypes; values within 1e-5): a resume at cp 2 reads those files
    as the resume at cp 2 above reads its own."""
    from checkpoint_convert.safe_pickle import torch_load_file

    base = tmp_path / "cp2"
    _torch_dist_run(["--cp", "2"], base, ray_cluster, resumed=False)
    iter2 = base / "checkpoints" / "iter_0000002"
    assert json.loads((iter2 / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    args = torch_load_file(iter2 / "common.pt")["args"]
    assert (args.context_parallel_size, args.data_parallel_size, args.world_size) == (2, 1, 2)
    final = _checkpoint_parts(base / "checkpoints" / "iter_0000004")

    again = _resumed_from(base, tmp_path / "again")
    _torch_dist_run(["--cp", "2"], again, ray_cluster, resumed=True)
    assert _run_metrics(again) == _run_metrics(base) and [m["step"] for m in _run_metrics(again)] == [3, 4]
    for part, tensors in _checkpoint_parts(again / "checkpoints" / "iter_0000004").items():
        assert tensors.keys() == final[part].keys(), part
        for name, tensor in tensors.items():
            assert torch.equal(tensor, final[part][name]), f"resumed at cp 2: {part} {name} differs"

    at_cp1 = _resumed_from(base, tmp_path / "at_cp1")
    _torch_dist_run([], at_cp1, ray_cluster, resumed=True)
    ours, theirs = _run_metrics(at_cp1, skip=PADDED_COUNTS), _run_metrics(base, skip=PADDED_COUNTS)
    assert [m["step"] for m in ours] == [3, 4] and all(a.keys() == b.keys() for a, b in zip(ours, theirs))
    for a, b in zip(ours, theirs):
        for key, value in b.items():
            assert abs(a[key] - value) <= RTOL * max(1.0, abs(value)), (a["step"], key, a[key], value)
    iter4 = at_cp1 / "checkpoints" / "iter_0000004"
    assert torch_load_file(iter4 / "common.pt")["args"].context_parallel_size == 1
    for part, tensors in _checkpoint_parts(iter4).items():
        assert tensors.keys() == final[part].keys(), part
        for name, tensor in tensors.items():
            expected = final[part][name]
            assert tensor.shape == expected.shape and tensor.dtype == expected.dtype, (part, name)
            assert_close(tensor, expected, what=f"resumed at cp 1: step-4 {part} {name}")


# ----------------------------------------------------------------------------- the command line


def test_the_flag_reaches_the_config_and_the_world():
    from mcore_dpo.config import starting_line, world_size

    assert resolve([])[0].cp == 1
    config = resolve(["--cp", "2", "--tp", "2"])[0]
    assert config.cp == 2 and world_size(config) == 4
    assert "4 workers (tp 2 x pp 1 x dp 1 x cp 2)" in starting_line(config, ray_address=None)
    text = build_parser().format_help()
    assert "--cp CP" in text and "2 x cp chunks" in text
    from mcore_dpo.data.pairs import seq_len_multiple

    # rows are padded to 2cp chunks, each a multiple of tp under sequence parallelism
    assert seq_len_multiple(tp=1, sequence_parallel=False, cp=2) == 8
    assert seq_len_multiple(tp=2, sequence_parallel=True, cp=4) == 16
    assert seq_len_multiple(tp=3, sequence_parallel=True, cp=2) == 24


@pytest.mark.parametrize("argv,expected", [
    (["--cp", "0"], "cp: must be a positive integer, got 0"),
    (["--cp", "-2"], "cp: must be a positive integer, got -2"),
    (["--cp", "two"], "--cp: invalid int value: 'two'"),
    (["--cp", "2", "--ep", "2", "--dp", "2"],
     "cp: context parallelism is for dense models; not with expert parallelism (--ep 2)"),
], ids=["zero", "negative", "not-an-int", "expert-parallel"])
def test_bad_values_are_one_line(capsys, argv, expected):
    assert expected in train_input_error(capsys, argv)
    with pytest.raises((ConfigError, SystemExit)):
        resolve(argv)


def test_a_mixture_of_experts_model_is_refused(capsys, moe_models, tmp_path):
    from mcore_dpo.driver.defaults import DEFAULT_TRAIN_DATA

    with pytest.raises(ConfigError, match="cp: x/config.json describes multi-latent attention"):
        resolve(["--cp", "2"])[0].check_context_parallel(num_experts=0, multi_latent_attention=True,
                                                        family="deepseek_v3", source="x/config.json")
    resolve(["--cp", "1"])[0].check_context_parallel(num_experts=8, multi_latent_attention=False, family="mixtral",
                                                    source="x/config.json")
    policy, _ = moe_models["mixtral"]
    out = tmp_path / "out"
    err = train_input_error(capsys, ["--model", str(policy), "--data", DEFAULT_TRAIN_DATA, "--cp", "2",
                                   "--output-dir", str(out)])
    assert "cp: " in err and "describes a mixture-of-experts model" in err, err
    assert not out.exists()
