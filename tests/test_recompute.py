"""Activation recompute (--recompute none|selective|full, --recompute-num-layers): megatron-core's
own recompute, on the CPU through its checkpoint function and RNG tracker.

- Parity on real gloo ranks, three steps and the evaluation, each job against the same job
  without recompute: every step's metrics, every rank's gradients at every step and the weights
  after the last, within 1e-6 in fp32. At tp 1 x pp 2: --recompute selective, full (groups of 1
  and of 2 layers) and, for LoRA (a frozen embedding feeding the first recomputed group) and
  packed rows (RoPE per token), full. At tp 2 x pp 2 with sequence parallelism (groups keep
  [s/tp, b, h] inputs; tensor-parallel layers under the RNG tracker): selective and full. The
  exact memory count of the same runs shows the policy stash fall: full < selective < none.
- The flags through the real command-line parser, and each bad value refused with one line
  before any worker starts (the group size against the model's layers per stage; full
  recompute of a mixture-of-experts model).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mcore_dpo.command_line import build_parser, resolve
from mcore_dpo.config import ConfigError
from tests.helpers.parity import packed_parity_job, parity_job
from tests.helpers.ranks import load_rank_tensors, run_ranks
from tests.helpers.cli import train_input_error

LAYOUTS = [(1, 2, 1), (2, 2, 1)]
STEPS = 3
TOLERANCE = 1e-6
LORA = {"lora_rank": 4}


def _jobs(layout: tuple[int, int, int], models: dict) -> list[tuple[int, dict]]:
    """(index of the job it must equal, job) for every job of the launch at `layout`; the first
    four are none, selective, full and full in groups of 2 (or, at tp 2, none, selective, full)."""
    policy, ref = models["llama"]
    if layout[0] > 1:
        return [(0, parity_job(layout, policy, ref, name=f"llama-sp-{name}", steps=STEPS, sequence_parallel=True, **fields))
                for name, fields in (("none", {}), ("selective", {"recompute": "selective"}),
                                     ("full", {"recompute": "full"}))]
    plain = [parity_job(layout, policy, ref, name=f"llama-{name}", steps=STEPS, **fields)
             for name, fields in (("none", {}), ("selective", {"recompute": "selective"}), ("full", {"recompute": "full"}),
                                  ("full2", {"recompute": "full", "recompute_num_layers": 2}))]
    lora = [parity_job(layout, policy, ref, name=f"lora-{name}", steps=STEPS, **LORA, **fields)
            for name, fields in (("none", {}), ("full", {"recompute": "full"}))]
    packed = [packed_parity_job(layout, policy, ref, name=f"packed-{name}", steps=STEPS, **fields)
              for name, fields in (("none", {}), ("full", {"recompute": "full"}))]
    baseline = [0, 0, 0, 0, 4, 4, 6, 6]
    return list(zip(baseline, plain + lora + packed))


def _close(ours: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(ours, expected, rtol=TOLERANCE, atol=TOLERANCE, msg=lambda m: f"{what}: {m}")


def _metrics(out_dir: Path, j: int) -> list[dict]:
    return json.loads((out_dir / f"job{j}_metrics.json").read_text())


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda l: f"tp{l[0]}-pp{l[1]}-dp{l[2]}")
def launch(request, parity_models, tmp_path_factory) -> tuple[tuple[int, int, int], Path, list[tuple[int, dict]]]:
    layout = request.param
    out_dir = tmp_path_factory.mktemp("recompute")
    jobs = _jobs(layout, parity_models)
    run_ranks(world_size=layout[0] * layout[1] * layout[2], jobs=[job for _, job in jobs], out_dir=out_dir)
    return layout, out_dir, jobs


def test_recompute_equals_no_recompute(launch):
    layout, out_dir, jobs = launch
    for j, (base, job) in enumerate(jobs):
        if j == base:
            continue
        what = f"{job['key'][0]} against {jobs[base][1]['key'][0]}"
        ours, expected = _metrics(out_dir, j), _metrics(out_dir, base)
        assert len(ours) == len(expected) == STEPS + 1, what  # every step, then the evaluation
        for step, (m_ours, m_expected) in enumerate(zip(ours, expected), start=1):
            names = [n for n in m_expected if n.split("/")[0] in ("loss", "rewards", "logps", "logits", "grad_norm", "eval")]
            assert "loss" in names or "eval/loss" in names, names
            for name in names:
                _close(torch.tensor(m_ours[name]), torch.tensor(m_expected[name]), f"{what} step {step} {name}")
        for kind in [f"grads{k}" for k in range(1, STEPS + 1)] + ["weights"]:
            mine, theirs = (load_rank_tensors(out_dir, i, kind, layout=layout) for i in (j, base))
            for rank, shard in theirs.items():
                assert set(mine[rank]) == set(shard), f"{what} {kind} rank {rank}"
                for name, value in shard.items():
                    _close(mine[rank][name], value, f"{what} {kind} rank {rank} {name}")
        # Something trained: the gradients compared are not all zero on either stage.
        grads = load_rank_tensors(out_dir, j, "grads1", layout=layout)
        assert all(any(v.abs().sum() > 0 for v in shard.values()) for shard in grads.values()), what


def test_recompute_lowers_the_measured_policy_stash(launch):
    """The memory/* count of step 1 (max over ranks): full keeps only each group's input, so
    groups of 2 keep less than groups of 1; selective drops the attention probabilities."""
    layout, out_dir, jobs = launch
    stash = [_metrics(out_dir, j)[0]["memory/policy_stash_peak_bytes"] for j in range(len(jobs))]
    if layout[0] > 1:  # none, selective, full
        assert stash[2] < stash[1] < stash[0], stash
        return
    assert stash[3] < stash[2] < stash[1] < stash[0], stash  # none, selective, full, full in groups of 2
    assert stash[5] < stash[4] and stash[7] < stash[6], stash  # LoRA and packed: full < none


# ----------------------------------------------------------------------------- the command line


def test_flags_reach_the_config_and_default_to_none():
    config = resolve([])[0]
    assert (config.recompute, config.recompute_num_layers) == ("none", None)
    config = resolve(["--recompute", "full", "--recompute-num-layers", "2"])[0]
    assert (config.recompute, config.recompute_num_layers) == ("full", 2)
    assert resolve(["--recompute", "selective"])[0].recompute == "selective"
    text = build_parser().format_help()
    assert "--recompute RECOMPUTE" in text and "--recompute-num-layers RECOMPUTE_NUM_LAYERS" in text
    assert "none | selective | full" in text
    assert '"uniform"' in text


def test_a_yaml_file_sets_them_and_is_named_in_an_error(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("recompute: full\nrecompute_num_layers: 2\n")
    assert resolve(["--config", str(good)])[0].recompute_num_layers == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("recompute_num_layers: 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: recompute_num_layers: given with --recompute none"):
        resolve(["--config", str(bad)])


@pytest.fixture
def data_file(tmp_path) -> Path:
    path = tmp_path / "prefs.jsonl"
    rows = [{"prompt": f"w{i} w{i + 1}", "chosen": f" w{i + 2}", "rejected": f" w{i + 3}"} for i in range(3, 40)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize("argv,expected", [
    (["--recompute", "sideways"], "recompute: 'sideways' is not one of none, selective, full"),
    (["--recompute-num-layers", "2"], "recompute_num_layers: given with --recompute none"),
    (["--recompute", "selective", "--recompute-num-layers", "1"], "recompute_num_layers: given with --recompute selective"),
    (["--recompute", "full", "--recompute-num-layers", "0"], "recompute_num_layers: must be a positive integer, got 0"),
    (["--recompute", "full", "--recompute-num-layers", "two"], "--recompute-num-layers: invalid int value: 'two'"),
], ids=["unknown", "without-full", "with-selective", "zero", "not-an-int"])
def test_bad_values_are_one_line(capsys, argv, expected):
    assert expected in train_input_error(capsys, argv)


@pytest.mark.parametrize("argv,expected", [
    (["--pp", "2", "--recompute-num-layers", "3"], "recompute_num_layers: 3 is more than the 2 layers of pipeline stage 0"),
    (["--recompute-num-layers", "3"], "recompute_num_layers: 3 does not divide the 4 layers of the model"),
], ids=["more-than-a-stage", "not-a-divisor"])
def test_group_size_is_checked_against_the_model(capsys, hf_llama, data_file, tmp_path, argv, expected):
    err = train_input_error(capsys, ["--model", str(hf_llama), "--data", str(data_file), "--recompute", "full", *argv,
                                   "--output-dir", str(tmp_path / "o")])
    assert expected in err and "config.json: 4 layers over pp" in err, err


def test_full_recompute_of_a_moe_model_is_refused(capsys, moe_models, data_file, tmp_path):
    # Its routers' statistics and load-balancing gradient come from the forward, which full
    # recompute runs without gradients; selective passes the same check (and the run stops at
    # the next one, the load-balancing weight's, checked after it).
    policy, _ = moe_models["mixtral"]
    argv = ["--model", str(policy), "--data", str(data_file), "--output-dir", str(tmp_path / "o")]
    err = train_input_error(capsys, [*argv, "--recompute", "full"])
    assert "recompute: full is not supported yet for mixture-of-experts models" in err, err
    err = train_input_error(capsys, [*argv, "--recompute", "selective", "--moe-aux-loss-coef", "-1"])
    assert "moe_aux_loss_coef: must be >= 0" in err, err
