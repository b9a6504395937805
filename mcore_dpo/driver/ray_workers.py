"""The only module that knows about Ray: the cluster connection, one placement group and one
worker group per role, rendezvous, and turning actor failures into one clear error.

A rank's exception, at start-up or in a method, never crosses Ray as an exception: the actor
keeps it as a `_Failure` (type, message, traceback) and returns it, and `WorkerGroup.gather`
raises WorkerGroupError("<rank> failed: <Type>: <message>") with the traceback in `.detail`.
So the user's line carries the rank's own message, never Ray's wrapping (ANSI-coloured, the
cause cut off or missing), and Ray prints no traceback of its own. A process that died is
still Ray's RayActorError: "the worker process died".
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Not a terminal (a log file, a pipe, SLURM's output): Ray's worker-log prefixes and its
# "[repeated Nx]" marks are coloured with ANSI codes; these two settings (read when Ray is
# imported) print plain text instead, every rank's lines in full.
if not (sys.stdout.isatty() and sys.stderr.isatty()):
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# A task or actor that asks for no GPU keeps the GPUs its node's processes see, as Ray 2.60 does by
# default; older releases (2.50 among them) empty CUDA_VISIBLE_DEVICES for it instead and print a
# FutureWarning at ray.init saying so. Every release in setup.py's range then behaves alike and
# prints nothing. The ranks ask for a GPU whenever the cluster has one, so of this project's tasks
# only the rendezvous one (bundle 0's address and a port) is affected.
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")

import ray  # noqa: E402
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mcore_dpo.driver import local_ray, reaper
from mcore_dpo.parallel import platform
from mcore_dpo.parallel.ports import free_port

# Ray's worker processes import this module before they unpickle a worker class (which imports
# megatron-core), so the known-harmless warnings are filtered there in time, and in a worker
# process (Ray's default_worker.py, never the driver) the imports no rank uses are skipped.
platform.quiet_known_warnings()
if os.path.basename(sys.argv[0]) == "default_worker.py":
    platform.skip_unused_imports()


class WorkerGroupError(RuntimeError):
    """A worker failed; str() is one line naming the role, the rank and the worker's error.
    `detail`: more for OUTPUT/train.log (the rank's traceback), "" when there is none."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail

    def __reduce__(self):
        return type(self), (str(self), self.detail)


HEAD_START_TIMEOUT_S = 180
DEATH_GRACE_S = 5.0  # after a rank's error, how long a death of another rank may take to show
HEAD_STOP_TIMEOUT_S = 15


@dataclass
class _LocalHead:
    """A local Ray cluster this process started: `ray start --head --block` in a session of its
    own, its temporary directory, and the reaper (mcore_dpo/driver/reaper.py) that ends it with this
    process, even after kill -9."""

    process: subprocess.Popen
    temp_dir: str
    reaper: subprocess.Popen | None
    address: str = ""  # the GCS address, once the head is up
    auth_env_before: dict | None = None  # what `local_ray.private_token` changed in os.environ, to restore


_local_head: _LocalHead | None = None


def connected() -> bool:
    """Whether this process is connected to a Ray cluster already (`connect` then joins none)."""
    return ray.is_initialized()


def connect(*, address: str | None, num_cpus: int) -> bool:
    """Join the Ray cluster at `address`, or start a local one (dashboard off) whose processes
    end with this process, even after kill -9. Returns True when this process started Ray (and
    must stop it)."""
    global _local_head
    if ray.is_initialized():
        return False
    env = {"env_vars": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}}
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=True)
        return False
    head = _start_local_head(num_cpus=num_cpus)
    try:
        ray.init(address=head.address, _node_ip_address="127.0.0.1", runtime_env=env, log_to_driver=True,
                 configure_logging=False)
    except BaseException:
        _stop_local_head(head)
        raise
    _local_head = head
    return True


def disconnect(started: bool) -> None:
    global _local_head
    if started and ray.is_initialized():
        ray.shutdown()
    if started and _local_head is not None:
        _stop_local_head(_local_head)
        _local_head = None


def _start_local_head(*, num_cpus: int) -> _LocalHead:
    """`ray start --head --block` in a new session: a signal to this process's group (Ctrl-C,
    `timeout`, `kill -TERM -PGID`) reaches this process alone, which stops at a step boundary
    while Ray keeps running; Ray's worker processes are the raylet's children, in its session.
    Every port is a free one (two runs on one machine do not collide), and the temporary
    directory is private, so `ray.init()` elsewhere on the machine never joins this cluster;
    the directories that killed drivers left behind are removed first (local_ray.py)."""
    local_ray.sweep_temp_dirs()
    auth_env_before = local_ray.private_token()
    try:
        head = _spawn_head(num_cpus=num_cpus)
    except BaseException:
        local_ray.restore_env(auth_env_before)
        raise
    head.auth_env_before = auth_env_before
    process, temp_dir, log_path = head.process, head.temp_dir, os.path.join(head.temp_dir, "ray_start.log")
    address_file = os.path.join(temp_dir, "ray_current_cluster")  # `ray start` writes it once the head is up
    deadline = time.monotonic() + HEAD_START_TIMEOUT_S
    try:
        while not head.address:
            if process.poll() is not None or time.monotonic() > deadline:
                why = f"exited with status {process.returncode}" if process.returncode is not None else \
                    f"did not start within {HEAD_START_TIMEOUT_S} s"
                raise WorkerGroupError(f"the local Ray head {why}: {_last_line(log_path)} (its log: {log_path})")
            time.sleep(0.1)
            head.address = _read_text(address_file).strip()
    except BaseException:
        _stop_local_head(head, keep_temp_dir=True)
        raise
    return head


def _spawn_head(*, num_cpus: int) -> _LocalHead:
    """`ray start --head --block` with a fresh temporary directory, and its reaper."""
    temp_dir = local_ray.make_temp_dir()
    port = free_port(count=4, host="")  # GCS, dashboard, dashboard agent, Ray client server
    command = [
        sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--node-ip-address=127.0.0.1",
        f"--port={port}", f"--dashboard-port={port + 1}", f"--dashboard-agent-listen-port={port + 2}",
        "--include-dashboard=false", "--disable-usage-stats", f"--num-cpus={num_cpus}", f"--temp-dir={temp_dir}",
    ]
    if importlib.util.find_spec("grpc") is not None:  # `ray start` runs a client server then (default port 10001)
        command.append(f"--ray-client-server-port={port + 3}")
    # No draining on SIGTERM: the head stops its processes at once when this process stops it.
    head_env = dict(os.environ, RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0", RAY_USAGE_STATS_ENABLED="0")
    with open(os.path.join(temp_dir, "ray_start.log"), "wb") as log_file:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                   env=head_env, start_new_session=True, close_fds=True)
    return _LocalHead(process=process, temp_dir=temp_dir, reaper=reaper.start(roots={process.pid}))


def _stop_local_head(head: _LocalHead, *, keep_temp_dir: bool = False) -> None:
    """SIGTERM to `ray start`, which stops the processes it started; then SIGKILL to whatever
    of its session is left (the raylet's workers and agents)."""
    if head.process.poll() is None:
        head.process.send_signal(signal.SIGTERM)
        try:
            head.process.wait(timeout=HEAD_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
    # A session id is not reused while a process of the session lives, so this finds only Ray's.
    reaper.kill(reaper.in_session(head.process.pid))
    if head.process.poll() is None:
        head.process.wait()
    reaper.release(head.reaper)
    local_ray.restore_env(head.auth_env_before)
    if not keep_temp_dir:
        shutil.rmtree(head.temp_dir, ignore_errors=True)


def _read_text(path: str) -> str:
    """The file's text, "" while it does not exist."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def _last_line(path: str) -> str:
    lines = [line.strip() for line in _read_text(path).splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0


def coordinates_of(rank: int, *, tp: int, pp: int, dp: int, cp: int = 1) -> tuple[int, int, int]:
    """(tp, pp, dp) coordinates in megatron-core's default rank order: tp fastest, then cp, then
    dp, then pp (`cp_rank_of` gives the cp coordinate)."""
    return rank % tp, rank // (tp * cp * dp), (rank // (tp * cp)) % dp


def cp_rank_of(rank: int, *, tp: int, cp: int) -> int:
    """The context-parallel coordinate of `rank` (coordinates_of's order)."""
    return (rank // tp) % cp


@ray.remote
def _node_address_and_port() -> tuple[str, int]:
    """Runs on bundle 0's node: its address as Ray knows it, and a free TCP port there."""
    from mcore_dpo.parallel.ports import free_port

    return ray.util.get_node_ip_address(), free_port(host="")


@dataclass(frozen=True)
class _Failure:
    """A rank's exception as plain data, returned where a result was expected: Ray wraps a
    raised exception (ANSI-coloured, the message cut) and prints its traceback when nobody
    fetches it; a returned value crosses as it is."""

    type_name: str
    message: str
    traceback: str

    @classmethod
    def of(cls, error: BaseException) -> _Failure:
        return cls(type_name=type(error).__name__, message=str(error),
                   traceback="".join(traceback.format_exception(error)).rstrip())


class _RayWorker:
    """Actor body: builds the rank's worker inside the actor process. Its exceptions, from the
    factory and from the methods, come back as `_Failure`s (the factory's from `describe`, the
    first method the driver calls, and from every later call)."""

    def __init__(self, factory: Callable[..., object], kwargs: dict):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        self.worker = None
        self.failure: _Failure | None = None
        try:
            self.worker = factory(**kwargs)
        except Exception as error:  # noqa: BLE001 - reported by describe(), naming this rank
            self.failure = _Failure.of(error)

    def call(self, method: str, *args, **kwargs):
        if self.failure is not None:
            return self.failure
        try:
            return getattr(self.worker, method)(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - the driver reports it, naming this rank
            return _Failure.of(error)

    def read_text(self, path: str) -> tuple[str, str | None]:
        """(this node's address, the file's text as this process sees it, None when unreadable)."""
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except OSError:
            text = None
        return ray.util.get_node_ip_address(), text

    def describe(self) -> dict | _Failure:
        if self.failure is not None:
            return self.failure
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address()}


@dataclass
class WorkerGroup:
    role: str
    actors: list
    names: list[str]
    placement: object
    processes: list[dict] | None = None  # pid and node of each rank, for operators and tests

    def call(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> list:
        """Call `method` on every rank; any failure stops the group and raises WorkerGroupError."""
        return self.gather(self.submit(method, *args, **kwargs), timeout_s=timeout_s)

    def submit(self, method: str, *args, **kwargs) -> list:
        """Start `method` on every rank without waiting; `gather` the returned refs later."""
        return [a.call.remote(method, *args, **kwargs) for a in self.actors]

    def gather(self, refs: Sequence, *, timeout_s: float | None = None) -> list:
        pending = {ref: i for i, ref in enumerate(refs)}
        results: list = [None] * len(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            wait_s = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            done, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s)
            for ref in done:
                i = pending.pop(ref)
                try:
                    results[i] = ray.get(ref)
                    if not isinstance(results[i], _Failure):
                        continue
                    error = results[i]
                except RayActorError as death:
                    self.stop()
                    raise _group_error(self.names[i], death) from None
                except RayError as ray_error:
                    error = ray_error
                # A peer's failure is often the first sign of a death: the death is the cause then.
                i, error = _death_among(pending, grace_s=DEATH_GRACE_S) or (i, error)
                self.stop()
                raise _group_error(self.names[i], error) from None
            if deadline is not None and time.monotonic() > deadline and pending:
                self.stop()
                raise WorkerGroupError(f"{self.role}: no answer within {timeout_s:.0f} s from {self.names[next(iter(pending.values()))]}")
        return results

    def stop(self) -> None:
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        self.actors = []
        try:
            remove_placement_group(self.placement)
        except Exception:
            pass


def _death_among(pending: dict, *, grace_s: float) -> tuple[int, RayActorError] | None:
    """(rank, error) of a rank among `pending` (ref -> rank) whose process dies within `grace_s`.
    When a rank dies, its peers' transfers fail at once, often before Ray reports the death: the
    death, not a peer's error, is what the run reports then."""
    deadline = time.monotonic() + grace_s
    while pending and time.monotonic() < deadline:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        for ref in done:
            i = pending.pop(ref)
            try:
                ray.get(ref)
            except RayActorError as error:
                return i, error
            except RayError:
                pass
    return None


def ranks_not_seeing(group: WorkerGroup, *, path: str, text: str) -> list[tuple[str, str]]:
    """(rank name, node address) of every rank whose process reads something other than `text`
    at `path` (a file the driver wrote): the ranks that do not share the driver's directory."""
    seen = group.gather([actor.read_text.remote(path) for actor in group.actors])
    return [(name, node) for name, (node, found) in zip(group.names, seen) if found != text]


_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def _plain(text: str) -> str:
    """`text` without ANSI escape sequences (Ray colours its wrapping of workers' errors)."""
    return _ANSI.sub("", text)


def _first_line(text: str) -> str:
    lines = [line.strip() for line in _plain(text).splitlines() if line.strip()]
    return lines[0] if lines else ""


def _exception_line(type_name: str, message: str) -> str:
    """"Type: first line of the message", as Python prints an exception's last line."""
    first = _first_line(message)
    return f"{type_name}: {first}" if first else type_name


def _group_error(name: str, error: _Failure | RayError) -> WorkerGroupError:
    """WorkerGroupError("<name> failed: <cause>"): one line with the rank's own exception (type
    and message), not Ray's wrapping; the traceback, where there is one, in `detail`."""
    if isinstance(error, _Failure):
        return WorkerGroupError(f"{name} failed: {_exception_line(error.type_name, error.message)}",
                                detail=_plain(error.traceback))
    text = _plain(str(error)).strip()
    if isinstance(error, RayActorError) and getattr(error, "actor_init_failed", False):
        # Raised before _RayWorker.__init__ could catch it (its class or arguments did not load):
        # Ray's text ends in the traceback, whose last line is the exception.
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        cause = lines[-1] if len(lines) > 1 else "an error in its creation task"
        return WorkerGroupError(f"{name} failed at start-up: {cause}", detail=text)
    if isinstance(error, RayActorError):
        return WorkerGroupError(f"{name} failed: the worker process died ({_first_line(text) or 'no detail'})",
                                detail=text)
    cause = getattr(error, "cause", None)
    if isinstance(error, RayTaskError) and cause is not None:
        return WorkerGroupError(f"{name} failed: {_exception_line(type(cause).__name__, str(cause))}", detail=text)
    lines = text.splitlines()
    return WorkerGroupError(f"{name} failed: {lines[-1] if lines else type(error).__name__}", detail=text)


def bundle_order(node_of: Sequence[str], *, tp: int, ep: int = 1, role: str) -> list[int]:
    """The bundle of each rank (megatron-core order: tp fastest, then cp, dp, pp), given each
    bundle's node. Every tensor-parallel group lands on one node (else WorkerGroupError), and
    as many expert-parallel blocks as the nodes can hold whole: with the expert groups carved
    from tp x dp (expert tp = tp, ep dividing dp), the tp x ep consecutive ranks of a block
    hold whole ep groups, the ranks that exchange tokens. Blocks go whole onto the nodes in the
    order the bundles name them (bundles in index order within a node); the blocks left over,
    if any, are spread over what remains, one tp group at a time."""
    world_size = len(node_of)
    nodes: list[str] = []
    for node in node_of:
        if node not in nodes:
            nodes.append(node)
    free = {node: [i for i in range(world_size) if node_of[i] == node] for node in nodes}
    order: list[int] = []
    for size in (tp * ep, tp):  # whole blocks first, then what is left by tp group
        for node in nodes:
            while len(free[node]) >= size and len(order) < world_size:
                order.extend(free[node][:size])
                free[node] = free[node][size:]
    if len(order) < world_size:
        counts = {node[:8]: sum(1 for n in node_of if n == node) for node in nodes}
        raise WorkerGroupError(
            f"{role}: a tensor-parallel group of {tp} ranks would span nodes (bundles per node: {counts}); "
            f"give every node a multiple of tp={tp} devices"
        )
    return order


def _bundles_by_node(pg, *, world_size: int, tp: int, ep: int, role: str) -> list[int]:
    node_of = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    return bundle_order([node_of[i] for i in range(world_size)], tp=tp, ep=ep, role=role)


def create_group(
    *,
    role: str,
    world_size: int,
    tp: int,
    pp: int,
    dp: int,
    factory: Callable[..., object],
    kwargs_of_rank: Callable[[int, str, int], dict],
    use_gpus: bool,
    placement_timeout_s: float,
    ep: int = 1,
    cp: int = 1,
) -> WorkerGroup:
    """One placement group (a bundle per rank, PACK so a tp group shares a node where it
    fits), then one actor per bundle (`bundle_order`: tp groups, and ep groups where they fit,
    on one node). Rendezvous: bundle 0's node and a free port there."""
    bundle = {"GPU": 1, "CPU": 1} if use_gpus else {"CPU": 1}
    pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK", name=f"{role}-group")
    try:
        ray.get(pg.ready(), timeout=placement_timeout_s)
    except GetTimeoutError:
        remove_placement_group(pg)
        available = ray.available_resources()
        raise WorkerGroupError(
            f"{role}: could not place {world_size} bundles of {bundle} within {placement_timeout_s:.0f} s; "
            f"the cluster has CPU={available.get('CPU', 0):g} GPU={available.get('GPU', 0):g} available"
        ) from None
    bundle_of_rank = _bundles_by_node(pg, world_size=world_size, tp=tp, ep=ep, role=role)
    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle_of_rank[0])
    master_addr, master_port = ray.get(_node_address_and_port.options(num_cpus=0, scheduling_strategy=strategy).remote())
    actor_cls = ray.remote(_RayWorker)
    actors, names = [], []
    for rank in range(world_size):
        t, p, d = coordinates_of(rank, tp=tp, pp=pp, dp=dp, cp=cp)
        name = f"{role}/tp{t}-pp{p}-dp{d}" + (f"-cp{cp_rank_of(rank, tp=tp, cp=cp)}" if cp > 1 else "")
        options = dict(
            num_cpus=1,
            num_gpus=1 if use_gpus else 0,
            name=f"{name}-{os.getpid()}-{time.time_ns()}",
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle_of_rank[rank]
            ),
        )
        actors.append(actor_cls.options(**options).remote(factory, kwargs_of_rank(rank, master_addr, master_port)))
        names.append(name)
    group = WorkerGroup(role=role, actors=actors, names=names, placement=pg)
    group.processes = group.gather([a.describe.remote() for a in actors])  # surfaces construction errors, naming the rank
    return group
