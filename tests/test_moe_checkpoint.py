"""Expert-parallel runs through the command line (in this process, on the session's Ray cluster):
training checkpoints, exact resume (and resume at another tp and ep), the hf/ export, and
evaluation with uneven held-out shares.

One run of Qwen3-MoE (4 experts) at (tp, pp, dp, ep) = (2, 1, 2, 2) with the sharded optimizer
(`--distributed-optimizer`: dense state over dp 2, the experts' over expert dp 2) writes checkpoints at
steps 2 and 4, evaluates 7 held-out pairs (dp rank 1 has a microbatch and a pass fewer than
dp rank 0: the expert all-to-all needs dummies there) and exports hf/. The ep groups run along
tp, so tp rank 0 holds only ep rank 0's experts: the files `tp0_pp0_ep1` and `tp1_pp0_ep0` of
the converter's ep layout are written by the dp-1 ranks from experts sent to them
(mcore_dpo/checkpoint/expert_files.py). Then:

- its evaluation at step 0 and after the last step equals HF AutoModelForCausalLM + TRL's
  formulas on the same pairs within 1e-5 relative (the dummies count nowhere);
- `checkpoint_convert mcore-to-hf` of the shards the ranks wrote for hf/ equals hf/ bit for
  bit, and transformers loads hf/ with no missing or unexpected keys; the step-4 training
  checkpoint (fp32 masters) converts to the same tensors;
- resumed from the step-2 checkpoint at the same layout, steps 3-4 (metrics, evaluation, final
  weights) are bit-identical to the uninterrupted run; resumed at (1, 1, 2, 1) with the
  replicated optimizer (another tp and no expert parallelism: every expert read from its ep
  file under its global index), they equal it within 1e-5;
- TR-DPO's moving reference (`--sync-ref-model`, mixed at steps 2 and 4): the step-2
  checkpoint's `reference/` (in the ep layout) equals α·policy + (1-α)·reference of the
  checkpoint's own policy and the source reference within 1e-5; the resumed runs write it again
  at step 3 (no sync there), bit for bit at the same layout and, at ep 1, under the same HF
  names; the evaluation after the step-4 sync equals HF's with the reference TRL's formula
  gives (from the step-2 reference and the final policy) within 1e-5, at ep 2 and, through the
  metrics above, after the resume at ep 1.

The same run with grouped GEMM experts (a CPU stand-in carrying megatron-core's TEGroupedMLP
parameter names) writes the same files, names and bytes, and resumes bit for bit.

The same run with `--save-format torch_dist` (Megatron-LM's format, without TR-DPO, which it does
not store) trains identically up to step 2, its step-2 checkpoint holds the same masters and
moments bit for bit, and it resumes the same way.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mcore_dpo.data.even_passes import even_passes
from tests.helpers import parity
from tests.helpers.faults import grouped_standin_env
from tests.helpers.models import qwen3_moe, save_hf
from tests.helpers.moe_parity import with_hub_names
from tests.helpers.ranks import run_ranks
from tests.helpers.ray_runs import main_in_process
from tests.helpers.reference import assert_close, loss_and_metrics
TIMING = ("tokens/s", "step_time_s", "bubble_fraction", "memory/peak_gib")  # measured, not computed
RTOL = 1e-5
EVAL_METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected", "logits/chosen", "logits/rejected")
TP2_EP2 = ["--tp", "2", "--ep", "2", "--distributed-optimizer"]
TRDPO = ["--sync-ref-model", "--ref-model-sync-steps", "2", "--ref-model-mixup-alpha", "0.25"]
COMMON = ["--max-steps", "4", "--global-batch-size", "8", "--micro-batch-size", "2", "--save-interval", "2",
          "--eval-interval", "2", "--dp", "2", "--seed", "3"]


def test_even_passes_pads_microbatches_and_passes():
    # dp rank 0: a pass of 2 microbatches, then one of 1; dp rank 1: one pass of 1 microbatch.
    passes = [[(range(0, 7), [[0, 1], [2, 3]]), (range(7, 8), [[7]])], [(range(0, 7), [[4, 5]])]]
    assert even_passes(passes, dp_rank=0) == [(range(0, 7), [[0, 1], [2, 3]], 2), (range(7, 8), [[7]], 1)]
    assert even_passes(passes, dp_rank=1) == [(range(0, 7), [[4, 5], [4, 5]], 1), (range(0, 1), [[0]], 0)]
    assert even_passes([[], []], dp_rank=1) == []


def _rows(start: int, count: int) -> str:
    """Preference rows of uneven prompt lengths (1 to 3 words)."""
    return "".join(json.dumps({"prompt": " ".join(f"w{i + k}" for k in range(1 + i % 3)), "chosen": f" w{i + 3} w{i + 5}",
                               "rejected": f" w{i + 4}"}) + "\n" for i in range(start, start + count))


@pytest.fixture(scope="module")
def run(tmp_path_factory, ray_cluster) -> dict:
    root = tmp_path_factory.mktemp("moe_ckpt")
    policy = save_hf(qwen3_moe(seed=1), root / "policy")
    ref = save_hf(qwen3_moe(seed=2), root / "ref")
    (root / "train.jsonl").write_text(_rows(3, 32))
    (root / "eval.jsonl").write_text(_rows(40, 7))
    args = ["--model", str(policy), "--ref-model", str(ref), "--data", str(root / "train.jsonl"),
            "--eval-data", str(root / "eval.jsonl")]
    result = _train([*args, *TRDPO, *TP2_EP2], root / "a", cluster=ray_cluster)
    assert result.returncode == 0, result.stderr[-3000:]
    # Packing, left unset, does not serve ep > 1: one line says so, and the run pads.
    assert [line for line in result.stdout.splitlines() if line.startswith("packing: off for --ep 2 ")], result.stdout[-2000:]
    assert "packing: false" in (root / "a" / "config.yaml").read_text().splitlines()
    return {"root": root, "args": args, "out": root / "a", "policy": policy, "ref": ref, "cluster": ray_cluster}


def _train(args: list[str], out: Path, *, cluster, grouped_standin: bool = False) -> subprocess.CompletedProcess:
    """The command line in this process, on the session's Ray cluster."""
    return main_in_process([*COMMON, *args, "--output-dir", str(out)], cluster=cluster,
                           env=grouped_standin_env() if grouped_standin else None)


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING and not k.startswith("memory/")} for row in rows]


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _hf_eval(policy_dir: Path, ref_dir: Path, eval_file: Path) -> dict[str, float]:
    """TRL's metrics of every held-out pair, from HF models (tests/helpers/reference.py's formulas)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mcore_dpo.data.pairs import load_pairs

    pairs, _ = load_pairs(str(eval_file), tokenizer=AutoTokenizer.from_pretrained(str(policy_dir)), max_length=64,
                          on_bad_row="error")
    policy, reference = (AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
                         for d in (policy_dir, ref_dir))
    with torch.no_grad():
        _, metrics = loss_and_metrics(policy, reference, pairs, loss_type="sigmoid", beta=0.1, eps=0.0,
                                       reference_free=False)
    return metrics


def _assert_close_metrics(ours: dict, ref: dict, *, names, prefix: str, what: str) -> None:
    for name in names:
        a, b = ours[prefix + name], ref[name]
        assert abs(a - b) <= RTOL * max(1.0, abs(b)), f"{what}: {name} {a} vs {b}"


def test_expert_parallel_checkpoints_export_eval_and_resume(run, tmp_path):
    out, root = run["out"], run["root"]
    rows = _metrics(out)
    by_step = {row["step"]: row for row in rows}
    assert sorted(by_step) == [0, 1, 2, 3, 4]
    # Evaluation at ep 2 over uneven shares equals HF at the start and after the last step.
    _assert_close_metrics(by_step[0], _hf_eval(run["policy"], run["ref"], root / "eval.jsonl"), names=EVAL_METRICS,
                          prefix="eval/", what="eval at step 0")
    # TR-DPO: the evaluation after step 4 runs against the reference mixed at step 4.
    step2 = out / "checkpoints" / "step_00000002"
    ref4 = _mixed_reference(step2 / "reference", out / "hf", tmp_path)
    _assert_close_metrics(by_step[4], _hf_eval(out / "hf", ref4, root / "eval.jsonl"), names=EVAL_METRICS,
                          prefix="eval/", what="eval after step 4")

    # hf/ equals `checkpoint_convert mcore-to-hf` of the last step's checkpoint (the converter's ep
    # layout; fp32 masters, the run's dtype); the export's staging shards are gone (one copy of the
    # final weights); transformers loads it with no missing or unexpected keys.
    from checkpoint_convert.__main__ import main as convert
    from transformers import AutoModelForCausalLM

    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["step_00000002", "step_00000004"]
    final = out / "checkpoints" / "step_00000004" / "model"
    assert sorted(p.name for p in final.glob("tp*")) == ["tp0_pp0_ep0", "tp0_pp0_ep1", "tp1_pp0_ep0", "tp1_pp0_ep1"]
    assert convert(["mcore-to-hf", "--mcore-dir", str(final), "--out", str(tmp_path / "final")]) == 0
    exported, converted = _tensors(out / "hf"), _tensors(tmp_path / "final")
    assert exported.keys() == converted.keys()
    for name in exported:
        assert torch.equal(exported[name], converted[name]), name
    _, info = AutoModelForCausalLM.from_pretrained(str(out / "hf"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert {f"model.layers.{i}.mlp.experts.{e}.down_proj.weight" for i in range(2) for e in range(4)} <= exported.keys()
    # The training checkpoint is in the same layout (its contents are checked by the resumes).
    model_dir = out / "checkpoints" / "step_00000002" / "model"
    assert sorted(p.name for p in model_dir.glob("tp*")) == sorted(p.name for p in final.glob("tp*"))
    assert convert(["mcore-to-hf", "--mcore-dir", str(model_dir), "--out", str(tmp_path / "step2")]) == 0
    assert _tensors(tmp_path / "step2").keys() == exported.keys()
    _check_reference_mixed_at_step2(step2, run["ref"], names=exported.keys())

    # Resume from step 2 at the same layout: bit-identical.
    resumed_out = _resume_from_step2(out, tmp_path / "resumed")
    _assert_resumes_bit_identically([*run["args"], *TRDPO, *TP2_EP2, "--save-interval", "1"], out, resumed_out,
                                    cluster=run["cluster"])
    # The reference read back from step 2 and written again at step 3: the same bytes.
    written = _files(step2 / "reference")
    rewritten = _files(resumed_out / "checkpoints" / "step_00000003" / "reference")
    assert written.keys() == rewritten.keys() and all(torch.equal(written[k], rewritten[k]) for k in written)

    # Resume at tp 1 and ep 1: the same within 1e-5 (reductions run in another order). The run
    # at ep 2 fell back to padded microbatches; --no-packing keeps them at ep 1, so the layout
    # counts (tokens/padded, microbatches) compare too.
    other_out = _resume_from_step2(out, tmp_path / "other")
    result = _train([*run["args"], *TRDPO, "--tp", "1", "--ep", "1", "--no-distributed-optimizer", "--no-export-hf",
                     "--no-packing", "--save-interval", "1"],
                    other_out, cluster=run["cluster"])
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_close_rows(_metrics(other_out), [by_step[3], by_step[4]])
    # Read at ep 1 from the ep files and written again at step 3 in the ep-1 layout: the same
    # tensors under the same HF names (the evaluation after the step-4 sync is among the metrics).
    from checkpoint_convert.mcore_dir import open_mcore_dir

    at_ep1 = open_mcore_dir(other_out / "checkpoints" / "step_00000003" / "reference")
    assert at_ep1.meta.ep == 1
    ours, theirs = open_mcore_dir(step2 / "reference").hf_view(), at_ep1.hf_view()
    for name in exported:
        assert torch.equal(theirs.get(name), ours.get(name)), f"reference resumed at ep 1: {name}"


def _assert_close_rows(rows: list[dict], expected: list[dict]) -> None:
    """Every metric of each step within RTOL of the expected row's."""
    assert [row["step"] for row in rows] == [row["step"] for row in expected]
    for row, want in zip(rows, expected):
        for key, value in want.items():
            assert abs(row[key] - value) <= RTOL * max(1.0, abs(value)), (row["step"], key, row[key], value)


def test_grouped_experts_write_and_resume_as_sequential_experts_bit_for_bit(run, tmp_path):
    """The run above with grouped experts (tests/fault_hooks/grouped_standin.py: megatron-core's
    TEGroupedMLP parameter names, `linear_fc1.weight{i}`, around the sequential experts'
    arithmetic) through the worker's translation paths at ep 2 with the sharded optimizer
    (DDP and the optimizer over `weight{i}`, the ep layout's writes, the hf/ export, the load
    of a checkpoint): the same metrics and the same files, names and bytes, as sequential
    experts; resumed from its step-2 checkpoint, steps 3-4 again bit for bit."""
    out = tmp_path / "grouped"
    result = _train([*run["args"], *TRDPO, *TP2_EP2], out, cluster=run["cluster"], grouped_standin=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "moe_grouped_gemm: true" in (out / "config.yaml").read_text().splitlines()
    sequential_rows = _metrics(run["out"])
    assert _metrics(out) == sequential_rows
    for part in ("checkpoints/step_00000002", "checkpoints/step_00000004", "hf"):
        want, got = _files(run["out"] / part), _files(out / part)
        assert want and got.keys() == want.keys(), part
        for key in want:
            assert torch.equal(got[key], want[key]), f"{part}/{key}"
    assert any("/exp_avg" in key or key.startswith("exp_avg") for key in _files(out / "checkpoints/step_00000002")), \
        "no optimizer moments in the checkpoint"
    resumed_out = _resume_from_step2(out, tmp_path / "grouped_resumed")
    result = _train([*run["args"], *TRDPO, *TP2_EP2], resumed_out, cluster=run["cluster"], grouped_standin=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stdout
    assert _metrics(resumed_out) == sequential_rows[3:]
    want, got = _files(run["out"] / "hf"), _files(resumed_out / "hf")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _files(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every file under `directory`, keyed by file and name."""
    return {f"{file.relative_to(directory)}:{name}": tensor for file in sorted(directory.rglob("*.safetensors"))
            for name, tensor in load_file(str(file)).items()}


def _mixed_reference(reference: Path, policy_hf: Path, tmp_path: Path) -> Path:
    """An HF directory of TRL's sync (SyncRefModelCallback): α·policy + (1-α)·reference,
    parameter by parameter, from a checkpoint's `reference/` and an HF policy."""
    from transformers import AutoModelForCausalLM

    from checkpoint_convert.__main__ import main as convert

    assert convert(["mcore-to-hf", "--mcore-dir", str(reference), "--out", str(tmp_path / "ref_before")]) == 0
    alpha = float(TRDPO[TRDPO.index("--ref-model-mixup-alpha") + 1])
    target, source = (AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
                      for d in (tmp_path / "ref_before", policy_hf))
    with torch.no_grad():
        for t, s in zip(target.parameters(), source.parameters(), strict=True):
            t.mul_(1.0 - alpha).add_(s, alpha=alpha)
    target.save_pretrained(str(tmp_path / "ref_mixed"))
    return tmp_path / "ref_mixed"


def _check_reference_mixed_at_step2(checkpoint: Path, source_ref: Path, *, names) -> None:
    """The reference of a checkpoint written right after the step-2 sync, in the ep layout, is
    TRL's mix of the source reference with the checkpoint's own policy (fp32 masters), tensor by
    tensor through HF names."""
    from checkpoint_convert.io import open_hf_dir
    from checkpoint_convert.mcore_dir import open_mcore_dir

    assert sorted(p.name for p in (checkpoint / "reference").glob("tp*")) == [
        "tp0_pp0_ep0", "tp0_pp0_ep1", "tp1_pp0_ep0", "tp1_pp0_ep1"]
    alpha = float(TRDPO[TRDPO.index("--ref-model-mixup-alpha") + 1])
    reference, policy = (open_mcore_dir(checkpoint / kind).hf_view() for kind in ("reference", "model"))
    source = open_hf_dir(source_ref)
    moved = 0
    for name in names:
        mixed, start = reference.get(name), source.get(name)
        assert_close(mixed, start * (1 - alpha) + policy.get(name) * alpha, what=f"reference mixed at step 2: {name}")
        moved += not torch.equal(mixed, start)
    assert moved == len(names)  # every tensor moved, the experts of both ep ranks among them


def _assert_resumes_bit_identically(args: list[str], out: Path, resumed_out: Path, *, cluster) -> None:
    """Trained with `args` from the step-2 checkpoint copied into `resumed_out`: steps 3-4 and the
    exported weights are bit-identical to the uninterrupted run in `out`."""
    result = _train(args, resumed_out, cluster=cluster)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stdout
    by_step = {row["step"]: row for row in _metrics(out)}
    assert _metrics(resumed_out) == [by_step[3], by_step[4]]
    theirs, resumed = _tensors(out / "hf"), _tensors(resumed_out / "hf")
    assert theirs.keys() == resumed.keys()
    for name in theirs:
        assert torch.equal(theirs[name], resumed[name]), name


def _resume_from_step2(out: Path, resumed_out: Path, *, name: str = "step_00000002") -> Path:
    (resumed_out / "checkpoints").mkdir(parents=True)
    shutil.copytree(out / "checkpoints" / name, resumed_out / "checkpoints" / name)
    (resumed_out / "checkpoints" / "latest").write_text(f"{name}\n")
    return resumed_out


def test_torch_dist_checkpoints_at_ep2_equal_the_safetensors_ones_and_resume(run, tmp_path):
    """The same run with --save-format torch_dist (megatron-core's sharded keys: the experts on
    their global expert axis, written from expert-data-parallel rank 0 of each ep rank), without
    TR-DPO (torch_dist does not store a moving reference): it trains identically up to step 2,
    where the fixture's reference moves; its step-2 checkpoint's fp32 masters and AdamW moments equal the safetensors
    checkpoint's bit for bit (`checkpoint_convert mcore-to-hf` of its iteration directory too);
    resumed from it at the same layout it is bit-identical, at (1, 1, 2, 1) within 1e-5."""
    from checkpoint_convert.__main__ import main as convert
    from checkpoint_convert.dcp import DcpReader
    from mcore_dpo.checkpoint.torch_dist import open_part
    from mcore_dpo.model.builder import open_weights

    out = tmp_path / "td"
    torch_dist = ["--save-format", "torch_dist"]
    result = _train([*run["args"], *TP2_EP2, *torch_dist], out, cluster=run["cluster"])
    assert result.returncode == 0, result.stderr[-3000:]
    # The fixture's run moves its reference (TR-DPO) at step 2, which torch_dist does not store:
    # the two runs are the same run up to step 2's update, and their training metrics agree there.
    ours, fixture = _metrics(out), {row["step"]: row for row in _metrics(run["out"])}
    by_step = {row["step"]: row for row in ours}
    assert by_step.keys() == fixture.keys()
    for step in (0, 1, 2):
        train = {k: v for k, v in by_step[step].items() if not k.startswith("eval/")}
        assert train == {k: v for k, v in fixture[step].items() if not k.startswith("eval/")}, step
    assert by_step[0] == fixture[0]  # the step-0 evaluation precedes any move

    iter_dir = out / "checkpoints" / "iter_0000002"
    stored = DcpReader(iter_dir).tensors
    # Every layer is MoE: megatron-core stacks the layers (Megatron-LM's default moe_layer_freq 1).
    assert stored["decoder.layers.mlp.experts.experts.linear_fc1.weight"].shape == (2, 4, 48, 32)
    assert stored["optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc2.weight"].shape == (2, 4, 32, 24)
    assert not any(key.startswith("decoder.layers.1.") for key in stored)
    safetensors = run["out"] / "checkpoints" / "step_00000002"
    for kind, directory in (("model", "model"), ("exp_avg", "optim/exp_avg"), ("exp_avg_sq", "optim/exp_avg_sq")):
        ours, theirs = open_part(iter_dir, kind), open_weights(str(safetensors / directory))
        assert ours.names == theirs.names
        for name in theirs.names:
            assert torch.equal(ours.get(name), theirs.get(name)), (kind, name)
    # (the save directory's pointer names the final step now; its conversion: tests/test_torch_dist_train.py)
    assert convert(["mcore-to-hf", "--mcore-dir", str(iter_dir), "--out", str(tmp_path / "hf_td")]) == 0
    assert convert(["mcore-to-hf", "--mcore-dir", str(safetensors / "model"), "--out", str(tmp_path / "hf_st")]) == 0
    converted, reference = _tensors(tmp_path / "hf_td"), _tensors(tmp_path / "hf_st")
    assert converted.keys() == reference.keys()
    for name in reference:
        assert torch.equal(converted[name], reference[name]), name

    # Resume from the torch_dist checkpoint at the same layout: bit-identical.
    resumed_out = _resume_from_step2(out, tmp_path / "resumed", name="iter_0000002")
    _assert_resumes_bit_identically([*run["args"], *TP2_EP2, *torch_dist], out, resumed_out, cluster=run["cluster"])

    # At tp 1, ep 1 with the replicated optimizer: within 1e-5; it writes a torch_dist
    # checkpoint at ep 1 (step 3), which the converter reads into an HF model transformers loads.
    other_out = _resume_from_step2(out, tmp_path / "other", name="iter_0000002")
    result = _train([*run["args"], *torch_dist, "--tp", "1", "--ep", "1", "--no-distributed-optimizer", "--no-export-hf",
                     "--no-packing", "--save-interval", "1"], other_out, cluster=run["cluster"])  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_close_rows(_metrics(other_out), [by_step[3], by_step[4]])
    step3 = other_out / "checkpoints" / "iter_0000003"
    assert convert(["mcore-to-hf", "--mcore-dir", str(step3), "--out", str(tmp_path / "hf_ep1")]) == 0
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf_ep1"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_the_sharded_optimizer_with_expert_parallelism_passes_the_command_line_checks():
    """Once refused in one line; now the sharded optimizer runs at ep > 1 (the run above, and
    its parity with the replicated one in tests/test_sharded_optimizer.py)."""
    from mcore_dpo.command_line import resolve

    config, _ = resolve(["--dp", "2", "--ep", "2", "--global-batch-size", "4", "--micro-batch-size", "2",
                         "--distributed-optimizer"])
    assert config.distributed_optimizer and config.ep == 2


def test_precomputed_reference_and_evaluation_at_ep2_match_hf(tmp_path):
    """--ref-mode precomputed at (tp, pp, dp, ep) = (1, 1, 2, 2), 2 steps, 13 held-out pairs: the
    reference tables' and the evaluation's shares are uneven over the dp ranks (dummy
    microbatches and a dummy pass); every metric and the evaluation equal HF + TRL within 1e-5."""
    policy, ref = save_hf(qwen3_moe(seed=1), tmp_path / "policy"), save_hf(qwen3_moe(seed=2), tmp_path / "ref")
    job = parity.parity_job((1, 1, 2), policy, ref, name="qwen3_moe", ep=2, export_hf=False, distributed_optimizer=False)
    job["config"]["ref_mode"] = "precomputed"
    assert len(job["eval_pairs"]) == 13 and len(job["all_pairs"]) == 16
    run_ranks(world_size=2, jobs=[job], out_dir=tmp_path)
    expected = with_hub_names(parity.cached_reference(str(policy), str(ref), "sigmoid", "interleaved", 2), policy)
    ours = json.loads((tmp_path / "job0_metrics.json").read_text())
    assert len(ours) == 3
    for step in (1, 2):
        parity.check_metrics(ours[step - 1], expected["metrics"][step - 1], names=parity.METRICS, prefix="",
                             what=f"precomputed ep2 step {step}", rtol=RTOL)
    parity.check_metrics(ours[2], expected["eval"], names=tuple(n for n in parity.METRICS if n != "grad_norm"),
                         prefix="eval/", what="precomputed ep2 eval", rtol=RTOL)
