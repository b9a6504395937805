"""Exact resume of the families whose routers carry a loaded expert bias (DeepSeek-V3's and
GLM-4.5's `e_score_correction_bias`, megatron-core's `router.expert_bias`: frozen, so the
optimizer holds no state of it). One launch of 4 gloo ranks (tests/helpers/resume_ranks.py: the
driver's checkpoint writes and resume without Ray) runs, at (tp, pp, dp, ep) = (1, 2, 2, 2):

- DeepSeek-V3 for 3 steps, checkpoints at steps 2 and 3; resumed from step 2 at the same layout,
  step 3's metrics and its whole step-3 checkpoint (every file and tensor, RNG states included)
  are bit-identical to the uninterrupted run's;
- resumed from step 2 at (2, 1, 2, 1) (another tp, pp and ep): the restored state written again
  before any step holds the same fp32 masters, moments and router biases under every HF name,
  bit for bit; step 3 then equals the uninterrupted run within 1e-5 (at another tp and ep the
  sums run in another order, as for every family: tests/test_resume.py, tests/test_moe_checkpoint.py);
- GLM-4.5 the same way at the same layout, bit for bit;
- DeepSeek-V3 with --save-format torch_dist: its steps 1-2 equal the safetensors run's, its
  step-2 checkpoint holds the same masters and moments, and resumed from it at the same layout,
  step 3 and the step-3 checkpoint equal the uninterrupted safetensors run's bit for bit; and
  megatron-core's own loader reads its step-2 checkpoint (model and optimizer) at tp 2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.deepseek import deepseek_v3
from tests.helpers.glm import glm4_moe
from tests.helpers.models import save_hf
from tests.helpers.parity import parity_job
from tests.helpers.resume_ranks import resume_job, run_resume_jobs

SAVED = (1, 2, 2, 2)  # (tp, pp, dp, ep) of the uninterrupted runs
OTHER = (2, 1, 2, 1)
STEPS = 3
KINDS = ("model", "optim/exp_avg", "optim/exp_avg_sq")
MEASURED = ("tokens/s", "step_time_s", "bubble_fraction")  # timings, not results
RTOL = 1e-5


def _computed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k not in MEASURED and not k.startswith("memory/")}


def _files(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file under `directory`, keyed by file and name."""
    return {f"{file.relative_to(directory)}:{name}": tensor for file in sorted(directory.rglob("*.safetensors"))
            for name, tensor in load_file(str(file)).items()}


def _hf_view(directory: Path):
    from mcore_dpo.model.builder import open_weights

    return open_weights(str(directory))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("expert_bias_resume")
    base = {}
    for family, make in (("deepseek_v3", deepseek_v3), ("glm4_moe", glm4_moe)):
        policy, reference = save_hf(make(seed=1), root / family / "policy"), save_hf(make(seed=2), root / family / "ref")
        base[family] = parity_job(SAVED, policy, reference, name=family, steps=STEPS, export_hf=False)
    ds, glm = base["deepseek_v3"], base["glm4_moe"]

    def step(out: str, n: int, fmt: str = "safetensors") -> Path:
        return root / out / "checkpoints" / (f"iter_{n:07d}" if fmt == "torch_dist" else f"step_{n:08d}")

    td = {"save_format": "torch_dist"}
    jobs = [
        resume_job("ds", ds, output_dir=root / "ds", layout=SAVED, save_at=(2, 3)),
        resume_job("ds_same", ds, output_dir=root / "ds_same", layout=SAVED, first_step=3, resume=step("ds", 2),
                   save_at=(3,)),
        resume_job("ds_other", ds, output_dir=root / "ds_other", layout=OTHER, first_step=3, resume=step("ds", 2),
                   save_at=(2, 3)),
        resume_job("glm", glm, output_dir=root / "glm", layout=SAVED, save_at=(2, 3)),
        resume_job("glm_same", glm, output_dir=root / "glm_same", layout=SAVED, first_step=3, resume=step("glm", 2),
                   save_at=(3,)),
        resume_job("ds_td", ds, output_dir=root / "ds_td", layout=SAVED, save_at=(2,), last_step=2, **td),
        resume_job("ds_td_same", ds, output_dir=root / "ds_td_same", layout=SAVED, first_step=3,
                   resume=step("ds_td", 2, "torch_dist"), save_at=(3,), **td),
    ]
    metrics = run_resume_jobs(world_size=4, jobs=jobs, out_dir=root / "ranks")
    return {"metrics": metrics, "step": step}


@pytest.mark.parametrize("family,base,resumed", [("deepseek_v3", "ds", "ds_same"), ("glm4_moe", "glm", "glm_same")])
def test_resume_at_the_same_layout_is_bit_identical(runs, family, base, resumed):
    metrics, step = runs["metrics"], runs["step"]
    assert sorted(metrics[base]) == [1, 2, 3] and sorted(metrics[resumed]) == [3]
    assert _computed(metrics[resumed][3]) == _computed(metrics[base][3]), family
    want, got = _files(step(base, 3)), _files(step(resumed, 3))
    assert want and got.keys() == want.keys(), family
    assert any(key.endswith("expert_bias") for key in want), f"{family}: no router bias in the checkpoint"
    for key in want:
        assert torch.equal(got[key], want[key]), f"{family}: {key}"


def test_resume_at_another_layout_restores_the_state_bit_for_bit(runs):
    metrics, step = runs["metrics"], runs["step"]
    # The state restored at (2, 1, 2, 1) and written again: the same tensors under every HF name.
    for kind in KINDS:
        saved, restored = _hf_view(step("ds", 2) / kind), _hf_view(step("ds_other", 2) / kind)
        assert restored.names == saved.names, kind
        for name in saved.names:
            assert torch.equal(restored.get(name), saved.get(name)), (kind, name)
    assert any(name.endswith("e_score_correction_bias") for name in _hf_view(step("ds", 2) / "model").names)
    # Step 3 at the other layout: the uninterrupted run's within RTOL.
    ours, theirs = _computed(metrics["ds_other"][3]), _computed(metrics["ds"][3])
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert abs(ours[key] - value) <= RTOL * max(1.0, abs(value)), (key, ours[key], value)
    final, want = _hf_view(step("ds_other", 3) / "model"), _hf_view(step("ds", 3) / "model")
    assert final.names == want.names
    for name in want.names:
        a, b = final.get(name), want.get(name)
        assert (a - b).abs().max() <= RTOL * max(1.0, b.abs().max().item()), name


def test_torch_dist_checkpoints_hold_the_same_state_and_resume_bit_identically(runs):
    from mcore_dpo.checkpoint.torch_dist import open_part

    metrics, step = runs["metrics"], runs["step"]
    assert {k: _computed(v) for k, v in metrics["ds_td"].items()} == {k: _computed(metrics["ds"][k]) for k in (1, 2)}
    for n, run in ((2, "ds_td"), (3, "ds_td_same")):
        for kind, part in zip(KINDS, ("model", "exp_avg", "exp_avg_sq")):
            ours, theirs = open_part(step(run, n, "torch_dist"), part), _hf_view(step("ds", n) / kind)
            assert ours.names == theirs.names and any(name.endswith("e_score_correction_bias") for name in ours.names)
            for name in theirs.names:
                assert torch.equal(ours.get(name), theirs.get(name)), (run, kind, name)
    assert _computed(metrics["ds_td_same"][3]) == _computed(metrics["ds"][3])
    weights, want = _hf_view(step("ds_td_same", 3, "torch_dist")), _hf_view(step("ds", 3) / "model")
    for name in want.names:
        assert torch.equal(weights.get(name).float(), want.get(name)), name


def test_megatron_core_loads_the_deepseek_training_checkpoint(runs, tmp_path):
    """The step-2 torch_dist checkpoint of the DeepSeek-V3 run (trained at (1, 2, 2, 2)) read by
    megatron-core's own dist_checkpointing.load into a GPTModel built from the checkpoint's args
    alone, model and optimizer state, at tp 2 pp 1: every parameter, fp32 master and moment it
    gets is this project's reader's, bit for bit, and its logits are those of the checkpoint
    converted to HF (the MLA down projections' extra state and the args' MLA fields are what a
    strict load of it needs)."""
    from safetensors.torch import save_file

    from checkpoint_convert.mapping import hf_to_mcore_shard
    from mcore_dpo.checkpoint.torch_dist import open_part
    from tests.helpers.megatron_ranks import spawn, training_consumer_rank
    from tests.helpers.models import VOCAB_SIZE, exported_logits
    from tests.helpers.reference import assert_close

    iter_dir = runs["step"]("ds_td", 2, "torch_dist")
    tp, divisor = 2, 64
    tokens = torch.randint(0, VOCAB_SIZE, (2, 12), generator=torch.Generator().manual_seed(0))
    save_file({"tokens": tokens}, str(tmp_path / "tokens.safetensors"))
    job = {"checkpoint": str(iter_dir), "tp": tp, "pp": 1, "divisor": divisor, "tokens": str(tmp_path / "tokens.safetensors"),
           "logits": str(tmp_path / "logits.safetensors"), "state": str(tmp_path / "state_rank{rank}.safetensors")}
    spawn(training_consumer_rank, world_size=tp, job=job)
    model_view = _hf_view(iter_dir)
    parts = {"model": model_view, "fp32_param": open_part(iter_dir, "model"), "exp_avg": open_part(iter_dir, "exp_avg"),
             "exp_avg_sq": open_part(iter_dir, "exp_avg_sq")}
    for rank in range(tp):
        loaded = load_file(job["state"].format(rank=rank))
        for part, view in parts.items():
            expected = hf_to_mcore_shard(model_view.spec, tp=tp, tp_rank=rank, pp=1, pp_rank=0, get=view.get,
                                         divisor=divisor)  # fmt: skip
            params = {name for name in expected if not name.endswith("expert_bias")}  # a buffer, not a parameter
            assert {key.split("/", 1)[1] for key in loaded if key.startswith(part + "/")} == params, (rank, part)
            for name in params:
                want = expected[name]
                if name.endswith("_down_proj.weight"):  # whole on every rank here, split over tp in megatron-core's local spec
                    want = want.chunk(tp, dim=0)[rank]
                assert torch.equal(loaded[f"{part}/{name}"], want), (rank, part, name)
    reference = exported_logits(iter_dir, tmp_path / "hf_step2", tokens)
    megatron = load_file(job["logits"])["logits"]
    assert_close(megatron[..., :VOCAB_SIZE], reference, what="megatron-core's logits of the step-2 checkpoint")
