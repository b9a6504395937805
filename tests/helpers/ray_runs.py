"""Ray for the tests: the session's local cluster, and training runs in this process on it
(tests/helpers/tiers.py marks a test that reaches one of these `ray`).

An in-process run joins the session's cluster for the length of the run (`ray.init(address=)`,
then `ray.shutdown()`), so between runs this process is not connected to Ray, as the bad-input
tests check. `mcore_dpo.driver.ray_workers.connect` sees Ray initialised and leaves the connection to
the caller. The workers of a run get `env` through the job's runtime environment, on top of the
cluster's environment (this process's at the session's start); the driver side is this process.
"""

from __future__ import annotations

import io
import os
import subprocess
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.tiers import launches

SESSION_CPUS = 8  # logical CPUs the session's cluster hands out: the largest layout the suite runs


@dataclass
class LocalCluster:
    """A Ray head node in processes of its own (`ray.cluster_utils.Cluster`), tied to this
    process by mcore_dpo's reaper: its processes end with this process, even after kill -9."""

    cluster: object  # ray.cluster_utils.Cluster
    nodes: list  # the nodes added beside the head (Cluster.add_node's)
    reaper: object
    environ: dict  # this process's environment when the cluster started: its workers' environment

    @property
    def address(self) -> str:
        return self.cluster.address

    def shutdown(self) -> None:
        from mcore_dpo.driver import reaper

        self.cluster.shutdown()
        reaper.release(self.reaper)


@launches("ray")
def start_cluster(*, num_cpus: int = SESSION_CPUS, nodes: int = 0, cpus_per_node: int = 2) -> LocalCluster:
    """A local cluster: the head with num_cpus, and `nodes` more nodes (raylets on this machine)
    of cpus_per_node each. The caller shuts it down."""
    from ray.cluster_utils import Cluster

    from mcore_dpo.driver import reaper

    environ = dict(os.environ)
    before = set(reaper.tree({os.getpid()}))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": num_cpus, "include_dashboard": False})
    added = [cluster.add_node(num_cpus=cpus_per_node) for _ in range(nodes)]
    if added:
        cluster.wait_for_nodes()
    started = set(reaper.tree({os.getpid()})) - before  # the cluster's processes
    return LocalCluster(cluster=cluster, nodes=added, reaper=reaper.start(roots=started), environ=environ)


def _runtime_env(cluster: LocalCluster, env: dict | None) -> dict | None:
    """The job's runtime environment: the variables a run's workers need (what
    mcore_dpo.driver.ray_workers.connect gives a local cluster's, this process's MCORE_DPO_CACHE, and
    `env`) where the cluster's own environment differs; None when it already holds them all (a
    runtime environment costs every worker group a second or so to set up)."""
    wanted = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
    if os.environ.get("MCORE_DPO_CACHE"):
        wanted["MCORE_DPO_CACHE"] = os.environ["MCORE_DPO_CACHE"]
    wanted.update(env or {})
    if all(cluster.environ.get(name) == value for name, value in wanted.items()):
        return None
    return {"env_vars": wanted}


@contextmanager
def joined(cluster: LocalCluster, env: dict | None = None):
    """Inside the block this process is a driver of `cluster` (module docstring)."""
    import ray

    assert not ray.is_initialized(), "this process is connected to Ray already"
    ray.init(address=cluster.address, runtime_env=_runtime_env(cluster, env), log_to_driver=True, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


@launches("ray")
def train_in_process(config, *, cluster: LocalCluster, env: dict | None = None, log=lambda _line: None) -> Path:
    """`mcore_dpo.train(config)` on the session's cluster, with `env` for the driver and the
    workers; returns the run directory."""
    from mcore_dpo.driver.run import train

    with _driver_environment(env), joined(cluster, env):
        return train(config, log=log)


@contextmanager
def _driver_environment(env: dict | None):
    """This process's environment with `env` on top for the block (the driver's side of a run)."""
    saved = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@launches("ray")
def main_in_process(argv: list[str], *, cluster: LocalCluster, env: dict | None = None) -> subprocess.CompletedProcess:
    """`mcore_dpo.train.main(argv)`, the command line without its process: the real parser, the
    command line's messages and exit code, in this process on the session's cluster, with `env`
    for the driver and the workers. Returns what a subprocess run would: the exit code and what
    was printed (the workers' lines too, which Ray prints on the driver)."""
    from mcore_dpo.train import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with _driver_environment(env), joined(cluster, env), redirect_stdout(stdout), redirect_stderr(stderr):
        code = main(argv)
    return subprocess.CompletedProcess(args=argv, returncode=code, stdout=stdout.getvalue(), stderr=stderr.getvalue())
