"""Reliability: exact resume, resume after resharding, restarts after worker kills, and a kill
during a checkpoint write. Runs the command line in this process on the session's Ray cluster
(its actors are processes of their own); faults are injected through mcore_dpo.hooks by
tests/fault_hooks (see tests/helpers/faults.py), which kill rank 0's process outright."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.faults import fault_env
from tests.helpers.ray_runs import joined, main_in_process, start_cluster

STEPS = 4
COMMON = ["--max-steps", str(STEPS), "--global-batch-size", "16", "--micro-batch-size", "4", "--eval-interval", "0"]
TIMING = ("tokens/s", "step_time_s", "bubble_fraction", "memory/peak_gib")  # measured, not computed
LAYOUT_COUNTS = ("tokens/padded", "padding_fraction", "microbatches")  # of the packed split over dp ranks


def _run(args: list[str], out: Path, *, fault: str | None = None, cluster) -> subprocess.CompletedProcess:
    """The command line in this process, on the session's Ray cluster (the subprocess door and a
    rerun of the same command after a kill: tests/test_process_lifetime.py)."""
    return main_in_process([*COMMON, *args, "--output-dir", str(out)], cluster=cluster,
                           env=fault_env(fault) if fault else None)


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING and not k.startswith("memory/")} for row in rows]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted((out / "hf").glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _assert_identical(a: Path, b: Path) -> None:
    assert _metrics(a) == _metrics(b)
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


@pytest.fixture(scope="module")
def baselines(tmp_path_factory, ray_cluster) -> dict:
    """Uninterrupted runs (saving every step) at tp2-pp2-dp1 and tp1-pp1-dp2."""
    root = tmp_path_factory.mktemp("baselines")
    runs = {}
    for name, layout in (("tp2pp2", ["--tp", "2", "--pp", "2"]), ("dp2", ["--dp", "2"])):
        result = _run([*layout, "--save-interval", "1"], root / name, cluster=ray_cluster)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = (root / name, layout)
    return runs


# dp 2 is resumed after a kill by test_kill_during_checkpoint_write (a rerun of the CLI) and
# test_restarts_after_three_kills (restarts inside one run); this one adds the pipeline's
# carried state.
@pytest.mark.parametrize("name", ["tp2pp2"])
def test_exact_resume_after_kill(baselines, ray_cluster, tmp_path, name):
    base, layout = baselines[name]
    out = tmp_path / "run"
    killed = _run([*layout, "--save-interval", "2"], out, fault="step:3", cluster=ray_cluster)
    assert killed.returncode != 0 and "died" in killed.stderr.strip().splitlines()[-1]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    resumed = _run([*layout, "--save-interval", "2"], out, cluster=ray_cluster)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    _assert_identical(base, out)


def test_resume_after_resharding(baselines, ray_cluster, tmp_path):
    """A tp2-pp2 checkpoint resumed at tp1-pp1 gives the same weights within 1e-6."""
    base, _ = baselines["tp2pp2"]
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(base / "checkpoints" / "step_00000002", out / "checkpoints" / "step_00000002")
    (out / "checkpoints" / "latest").write_text("step_00000002\n")
    result = _run(["--tp", "1", "--pp", "1"], out, cluster=ray_cluster)
    assert result.returncode == 0, result.stderr[-3000:]
    wa, wb = _weights(base), _weights(out)
    for name in wa:
        err = (wa[name] - wb[name]).abs().max().item()
        assert err <= 1e-6, (name, err)


def _from_the_dp2_step2(baselines, tmp_path):
    """The dp-2 baseline and a run directory holding its step-2 checkpoint as the latest."""
    base, _ = baselines["dp2"]
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(base / "checkpoints" / "step_00000002", out / "checkpoints" / "step_00000002")
    (out / "checkpoints" / "latest").write_text("step_00000002\n")
    return base, out


def _assert_steps_3_4_equal_the_baseline(base, out) -> None:
    """Steps 3-4 of `out` equal the uninterrupted baseline's within 1e-5: metrics and final weights."""
    ours, ref = _metrics(out), [m for m in _metrics(base) if m["step"] >= 3]
    assert [m["step"] for m in ours] == [m["step"] for m in ref] == [3, 4]
    for a, b in zip(ours, ref):
        assert a.keys() == b.keys()
        for key in b:
            if key in LAYOUT_COUNTS:
                continue
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (a["step"], key, a[key], b[key])
    wa, wb = _weights(base), _weights(out)
    assert wa.keys() == wb.keys()
    for name in wa:
        err = (wa[name] - wb[name]).abs().max().item()
        assert err <= 1e-5 * wa[name].abs().max().item(), (name, err)


def test_resume_at_another_dp(baselines, ray_cluster, tmp_path):
    """The dp-2 run's step-2 checkpoint (the sharded optimizer's state gathered into it) resumed
    at dp 1: the end state equals the uninterrupted dp-2 run within 1e-5 (at another dp the
    gradient is reduced in another order). Packed microbatches are split by tokens over the dp
    ranks, so the layout's own counts (token positions, padding, microbatches) of steps 3-4 are
    dp 1's; the real tokens are the same. The run resumes from a copy of the baseline's
    checkpoint: a kill at dp 2 and a rerun of the same command are covered by
    test_kill_during_checkpoint_write (and restarts inside one run by
    test_restarts_after_three_kills); a killed run writes the same step-2 checkpoint."""
    base, out = _from_the_dp2_step2(baselines, tmp_path)
    resumed = _run(["--dp", "1", "--save-interval", "2"], out, cluster=ray_cluster)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    _assert_steps_3_4_equal_the_baseline(base, out)


def test_resume_at_another_cp(baselines, ray_cluster, tmp_path):
    """The dp-2 run's step-2 checkpoint resumed at dp 1 x cp 2 (each sequence split over two
    ranks, --cp): the checkpoint holds no cp, and the end state equals the uninterrupted dp-2 run
    within 1e-5, as at another dp. The resumed run writes its step-4 checkpoint from cp rank 0."""
    base, out = _from_the_dp2_step2(baselines, tmp_path)
    resumed = _run(["--dp", "1", "--cp", "2", "--save-interval", "2"], out, cluster=ray_cluster)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    _assert_steps_3_4_equal_the_baseline(base, out)
    # The step-4 checkpoint written at cp 2 holds what the uninterrupted run's holds (weights,
    # fp32 masters, moments; not the per-rank RNG files): what a resume at cp 1 reads.
    theirs, ours = (d / "checkpoints" / "step_00000004" for d in (base, out))
    files = sorted(f.relative_to(theirs) for f in theirs.rglob("*.safetensors") if "rng" not in f.parts)
    assert files and files == sorted(f.relative_to(ours) for f in ours.rglob("*.safetensors") if "rng" not in f.parts)
    for relative in files:
        a, b = load_file(str(theirs / relative)), load_file(str(ours / relative))
        assert a.keys() == b.keys(), relative
        for name in a:
            err = (a[name].float() - b[name].float()).abs().max().item()
            assert err <= 1e-5 * max(a[name].float().abs().max().item(), 1e-30), (str(relative), name, err)


def test_restarts_after_three_kills(baselines, ray_cluster, tmp_path):
    """--max-restarts 3 with three worker kills at random steps: identical to the uninterrupted run."""
    base, layout = baselines["dp2"]
    kill_steps = sorted(random.Random(7).sample(range(2, STEPS + 1), 3))
    out = tmp_path / "run"
    result = _run([*layout, "--save-interval", "1", "--max-restarts", "3"], out,
                  fault="step:" + ",".join(map(str, kill_steps)), cluster=ray_cluster)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("restart ") == 3, result.stdout
    _assert_identical(base, out)


def test_kill_during_checkpoint_write(baselines, ray_cluster, tmp_path):
    """A kill in the middle of writing step 4's checkpoint leaves step 2's current and loadable;
    the next run resumes from it and ends identical to the uninterrupted run."""
    from checkpoint_convert.mcore_dir import open_mcore_dir

    base, layout = baselines["dp2"]
    out = tmp_path / "run"
    result = _run([*layout, "--save-interval", "2", "--max-steps", "6"], out, fault="save:4", cluster=ray_cluster)
    assert result.returncode != 0
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000002"
    assert any(".partial-" in p.name for p in ckpts.iterdir())
    model = open_mcore_dir(ckpts / "step_00000002" / "model")
    assert model.meta.tp == 1 and model.shard(0, 0)
    result = _run([*layout, "--save-interval", "2"], out, cluster=ray_cluster)  # back to the baseline's 4 steps
    assert result.returncode == 0, result.stderr[-3000:]
    assert not any(".partial-" in p.name for p in ckpts.iterdir())
    _assert_identical(base, out)


def test_lost_node_restarts_on_the_remaining_node(tmp_path, monkeypatch):
    """A node lost mid-run (its raylet stopped): the driver rebuilds the group on the node that
    is left and resumes from the latest checkpoint; the run finishes."""
    import threading
    import time

    from mcore_dpo.config import TrainConfig
    from mcore_dpo.driver.run import train

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    local = start_cluster(num_cpus=0, nodes=2, cpus_per_node=2)
    cluster, nodes = local.cluster, local.nodes
    out = tmp_path / "run"
    removed: list[str] = []

    def remove_the_busy_node() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            metrics = out / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                busy = {info["node_id"] for info in json.loads((out / "workers.json").read_text()).values()}
                for node in nodes:
                    if node.node_id in busy:
                        cluster.remove_node(node)
                        removed.append(node.node_id)
                return
            time.sleep(0.2)

    try:
        with joined(local):
            killer = threading.Thread(target=remove_the_busy_node, daemon=True)
            killer.start()
            config = TrainConfig(dp=2, max_steps=12, global_batch_size=16, micro_batch_size=4, eval_interval=0,
                                 save_interval=1, max_restarts=2, output_dir=str(out), export_hf=False)
            train(config, log=lambda _msg: None)
            killer.join(timeout=5)
    finally:
        local.shutdown()
    assert len(removed) == 1
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 12 and steps == sorted(set(steps))
    workers = json.loads((out / "workers.json").read_text())
    assert removed[0] not in {info["node_id"] for info in workers.values()}
