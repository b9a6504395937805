"""Launching on Ray: a reference worker group of its own equal to 1 rank, a dead worker, a stuck
peer, impossible resources, and tensor-parallel groups kept on one node of a (simulated) 2-node
cluster. 8 ranks as actors equal to 1 rank: tests/test_packing_run.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.cli import run_train
from tests.helpers.faults import fault_env
from tests.helpers.ray_runs import joined, main_in_process, start_cluster


def _train(args: list[str], *, cluster, fault: str | None = None) -> subprocess.CompletedProcess:
    """The command line in this process, on the session's Ray cluster."""
    return main_in_process(args, cluster=cluster, env=fault_env(fault) if fault else None)


def _losses(run_dir: Path) -> list[float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if r["step"] >= 1]


SMALL_RUN = ["--max-steps", "3", "--global-batch-size", "16", "--micro-batch-size", "4", "--no-export-hf"]


@pytest.fixture(scope="module")
def single_rank_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, list[float]]:
    """One rank (tp 1, pp 1, colocated reference) through `python -m mcore_dpo.train`, on the local
    Ray cluster the command starts itself (what it prints is the subject below): what it printed,
    and its losses, the yardstick of the separate reference group below."""
    out = tmp_path_factory.mktemp("single_rank") / "tp1pp1"
    one = run_train(["--tp", "1", "--pp", "1", "--output-dir", str(out), *SMALL_RUN], timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    losses = _losses(out)
    assert len(losses) == 3, losses
    return one, losses


@pytest.fixture(scope="module")
def single_rank_losses(single_rank_run) -> list[float]:
    return single_rank_run[1]


def test_a_run_prints_no_warning_from_ray(single_rank_run):
    """Ray 2.50 warns at ray.init that tasks asking for no GPU will keep the node's GPUs visible,
    as 2.60 does; ray_workers asks every release for that behaviour, so a run at either end of
    Ray's range prints no warning (scripts/compat_check.sh runs this test at both)."""
    result, _ = single_rank_run
    assert "Warning" not in result.stderr and "Warning" not in result.stdout, result.stderr[-3000:]


# `--tp 4 --pp 2` as 8 Ray actors, equal to one rank: tests/test_packing_run.py, whose tp 4 x pp 2
# run is checked against a tp 1 x pp 1 run of the same command (one 8-rank launch for both).


def test_dead_worker_stops_the_run(tmp_path, ray_cluster):
    """Killing one worker mid-run: every worker is stopped and the driver (the command line in
    this process) ends non-zero within 60 s, naming the role, the rank and the worker's error."""
    import threading

    out = tmp_path / "run"
    killed: dict = {}

    def kill_a_worker_after_two_steps() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            metrics = out / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                killed["workers"] = json.loads((out / "workers.json").read_text())
                os.kill(killed["workers"]["policy/tp1-pp0-dp0"]["pid"], signal.SIGKILL)
                killed["at"] = time.monotonic()
                return
            time.sleep(0.5)

    killer = threading.Thread(target=kill_a_worker_after_two_steps, daemon=True)
    killer.start()
    result = _train(["--tp", "2", "--pp", "2", "--max-steps", "400", "--global-batch-size", "16", "--micro-batch-size",
                     "4", "--output-dir", str(out), "--no-export-hf"], cluster=ray_cluster)
    ended_at = time.monotonic()
    killer.join(timeout=5)
    assert "at" in killed, f"no worker was killed: the run ended first ({result.returncode})\n{result.stderr[-3000:]}"
    assert ended_at - killed["at"] < 60, "the driver took too long to stop"
    workers = killed["workers"]
    assert result.returncode not in (0, None)
    stderr = result.stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: policy/") and "died" in last, stderr[-2000:]
    time.sleep(1)
    for info in workers.values():
        with pytest.raises(ProcessLookupError):
            os.kill(info["pid"], 0)


def test_impossible_resources_fail_within_a_bounded_wait():
    """A placement group the cluster cannot meet fails within the bound and says what was
    needed and what is available."""
    from mcore_dpo.driver import ray_workers

    cluster = start_cluster(num_cpus=2)
    try:
        with joined(cluster):
            t0 = time.monotonic()
            with pytest.raises(ray_workers.WorkerGroupError) as caught:
                ray_workers.create_group(
                    role="policy", world_size=4, tp=2, pp=2, dp=1, factory=dict,
                    kwargs_of_rank=lambda rank, addr, port: {}, use_gpus=False, placement_timeout_s=2,
                )
            elapsed = time.monotonic() - t0
    finally:
        cluster.shutdown()
    message = str(caught.value)
    assert len(message.splitlines()) == 1
    assert "policy" in message and "4 bundles" in message and "CPU=2" in message, message
    assert elapsed < 30


def test_tensor_parallel_groups_stay_on_one_node():
    """A simulated 2-node cluster (two raylets on this machine): ranks are laid out so that
    every tp group shares a node, and rendezvous uses bundle 0's node."""
    from mcore_dpo.driver import ray_workers

    cluster = start_cluster(num_cpus=4, nodes=1, cpus_per_node=4)
    try:
        with joined(cluster):
            group = ray_workers.create_group(
                role="policy", world_size=8, tp=2, pp=2, dp=2, factory=dict,  # each rank holds its kwargs
                kwargs_of_rank=lambda rank, addr, port: {"rank": rank, "addr": addr, "port": port},
                use_gpus=False, placement_timeout_s=60,
            )
            nodes = [info["node_id"] for info in group.processes]
            assert len(set(nodes)) == 2
            for start in range(0, 8, 2):  # tp fastest: ranks 2k and 2k+1 form a tp group
                assert nodes[start] == nodes[start + 1], nodes
            assert group.call("get", "rank") == list(range(8))
            assert len(set(group.call("get", "addr"))) == 1 and len(set(group.call("get", "port"))) == 1
            group.stop()
    finally:
        cluster.shutdown()


def test_reference_as_its_own_worker_group(tmp_path, single_rank_losses, ray_cluster):
    """`--ref-mode separate`: the reference runs as role "ref" with its own tp/pp (tp 2, beside a
    pp-2 policy); the losses equal those of the colocated reference (the single-rank run) within 1e-5."""
    sep = _train(["--pp", "2", *SMALL_RUN, "--ref-mode", "separate", "--ref-tp", "2",
                  "--output-dir", str(tmp_path / "sep")], cluster=ray_cluster)
    assert sep.returncode == 0, sep.stderr[-3000:]
    workers = json.loads((tmp_path / "sep" / "workers.json").read_text())
    assert {"ref/tp0-pp0-dp0", "ref/tp1-pp0-dp0", "policy/tp0-pp0-dp0", "policy/tp0-pp1-dp0"} == set(workers)
    losses = _losses(tmp_path / "sep")
    assert len(losses) == len(single_rank_losses) == 3
    for x, y in zip(losses, single_rank_losses):
        assert abs(x - y) <= 1e-5, (losses, single_rank_losses)


def test_a_stuck_peer_ends_in_an_error_naming_it(tmp_path, ray_cluster):
    """A rank that stops responding: its pipeline neighbour's receive times out after
    --timeout-s and the run ends with a message naming the stage, the transfer and the peer."""
    t0 = time.monotonic()
    result = _train(["--pp", "2", "--max-steps", "4", "--global-batch-size", "16", "--micro-batch-size", "4",
                     "--timeout-s", "5", "--output-dir", str(tmp_path / "run"), "--no-export-hf"], cluster=ray_cluster,
                    fault="hang:2")
    assert result.returncode not in (0, None)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: policy/tp0-pp1-dp0 failed:") and "from rank 0" in last, last
    assert time.monotonic() - t0 < 120
