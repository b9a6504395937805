"""Rank spawners: real gloo ranks in processes of their own, the only way tests start them
(tests/helpers/tiers.py marks a test that reaches one of these `ranks`).

- `run_ranks(world_size=, jobs=, out_dir=)`: PolicyWorker ranks run parity jobs (a job: a
  TrainConfig's fields, the batches of every step, the eval pairs); each rank writes its
  gradients and weights per job (and its adapters, with LoRA), the reporting rank the metrics
  (`load_rank_tensors` reads them).
- `spawn_ranks(target, ...)`: the same forked ranks running a rank function of the caller's.
- `spawn_processes(fn, nprocs=, args=)`: `fn(rank, *args)` on forked (or spawned) processes;
  `start_forked(target, nprocs=, args_of=)`: forked processes the caller joins.
- `rank_context()`: where all of them come from: forked on a CPU-only machine, spawned where
  CUDA is visible (the CPU suite on a GPU machine).
- `verify(argv)`, `run_benchmark(function, ...)`: product entry points that spawn their own ranks.
"""

from __future__ import annotations

import importlib
import json
import os
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from mcore_dpo.parallel.ports import free_port
from tests.helpers.models import PAD
from tests.helpers.tiers import launches


def _ref_tables(out_dir: str, j: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The reference group's [pairs, 2] tables of job j: one per step, and the eval pairs'."""
    files = sorted(Path(out_dir).glob(f"job{j}_ref_step*.safetensors"), key=lambda f: int(f.stem.rsplit("step", 1)[1]))
    eval_file = Path(out_dir, f"job{j}_ref_eval.safetensors")
    return [load_file(str(f))["table"] for f in files], load_file(str(eval_file))["table"] if eval_file.exists() else None


def _ref_rank_main(rank: int, world_size: int, port: int, jobs: list[dict], out_dir: str) -> None:
    """One rank of the reference group (--ref-mode separate): it writes, for every separate job,
    the reference log-prob tables the driver would hand to the policy group."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        from mcore_dpo.config import TrainConfig
        from mcore_dpo.model.builder import open_weights
        from mcore_dpo.rank.worker import ReferenceWorker

        worker = None
        for j, job in enumerate(jobs):
            if job["config"]["ref_mode"] != "separate":
                continue
            config = TrainConfig(**job["config"])
            spec = open_weights(config.model).spec
            worker = ReferenceWorker(config=config, spec=spec, pad_token_id=PAD, rank=rank, master_addr="127.0.0.1",
                                     master_port=port)
            named = [(f"step{k + 1}", pairs) for k, pairs in enumerate(job["batches"])]
            named += [("eval", job["eval_pairs"])] if job.get("eval_pairs") else []
            for name, pairs in named:
                table = worker.reference_logps(pairs)
                if table is not None:
                    save_file({"table": table.contiguous()}, os.path.join(out_dir, f"job{j}_ref_{name}.safetensors"))
        if worker is not None:
            worker.shutdown()
    except BaseException:
        Path(out_dir, f"error_ref_rank{rank}.txt").write_text(traceback.format_exc())
        raise


def _rank_main(rank: int, world_size: int, port: int, jobs: list[dict], out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    # fp32 means fp32 on a GPU too (settings of the parent process do not reach these ranks).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        from mcore_dpo.config import TrainConfig
        from mcore_dpo.model.builder import open_weights
        from mcore_dpo.rank.worker import PolicyWorker, StepBatch

        worker = None
        for j, job in enumerate(jobs):
            config = TrainConfig(**job["config"])
            spec = open_weights(config.model).spec
            # A test's own instruments in the rank (a module with install(job, rank, out_dir) and
            # report(job_index, rank, out_dir)), e.g. tests/helpers/host_sync_guard.py.
            instruments = importlib.import_module(job["setup"]) if job.get("setup") else None
            if instruments is not None:
                instruments.install(job, rank, out_dir)
            if worker is not None and worker.layout != _policy_layout(config):  # another layout, the same world
                from mcore_dpo.parallel.mesh import release_layout

                release_layout()
            worker = PolicyWorker(config=config, spec=spec, pad_token_id=PAD, rank=rank,
                                  master_addr="127.0.0.1", master_port=port)
            batches = job["batches"]
            ids = job["batch_ids"]
            eval_pairs = job.get("eval_pairs") or []
            ref_steps, ref_eval = _ref_tables(out_dir, j) if config.ref_mode == "separate" else ([None] * len(batches), None)
            if config.ref_mode == "precomputed":
                worker.precompute_reference(job["all_pairs"], eval_pairs)
            metrics = []
            tp, pp, dp = worker.coordinates()
            # --cp: cp rank 0 writes the (tp, pp, dp) files, the other cp ranks their own ("_cp{c}").
            tag = f"job{j}_tp{tp}_pp{pp}_dp{dp}" + (f"_cp{worker.mesh.cp_rank}" if worker.mesh.cp_rank else "")
            for k, pairs in enumerate(batches):
                nxt = batches[k + 1] if k + 1 < len(batches) else None
                metrics.append(worker.train_step(StepBatch(step=k + 1, pairs=pairs, next_pairs=nxt, pair_ids=ids[k],
                                                           ref_logps=ref_steps[k])))
                save_file(worker.grad_shard(), os.path.join(out_dir, f"{tag}_grads{k + 1}.safetensors"))
            save_file(worker.policy_shard() or {}, os.path.join(out_dir, f"{tag}_weights.safetensors"))
            if config.lora:  # every rank's adapters (at ep > 1 the dp ranks of a stage hold different experts)
                from mcore_dpo.model.lora import adapter_parameters

                save_file({n: p.detach().cpu().clone() for n, p in adapter_parameters(worker.policy.module).items()},
                          os.path.join(out_dir, f"{tag}_adapters.safetensors"))
            if eval_pairs:
                metrics.append(worker.evaluate(eval_pairs, ref_eval))
            if metrics[0] is not None:
                Path(out_dir, f"job{j}_metrics.json").write_text(json.dumps(metrics))
            if instruments is not None:
                instruments.report(j, rank, out_dir)
        worker.shutdown()
    except BaseException:
        Path(out_dir, f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise


def _policy_layout(config):
    from mcore_dpo.parallel.mesh import Layout

    return Layout(tp=config.tp, pp=config.pp, dp=config.dp, ep=config.ep, cp=config.cp, vpp=config.vpp)


# Rank processes fork from a server that has imported torch, megatron-core and the worker once
# (about 10 s of CPU per process otherwise, paid by every rank of every launch); each still
# starts with a fresh interpreter state of its own and the caller's environment at launch time.
_PRELOAD = ["torch", "megatron.core", "mcore_dpo.rank.worker", "tests.helpers.ranks"]


def _with_environment(environ: dict, target, *args) -> None:
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


def cuda_visible() -> bool:
    """Whether this machine shows a CUDA device. torch asks NVML (conftest sets
    PYTORCH_NVML_BASED_CUDA_CHECK=1), so the asking initialises no CUDA in this process."""
    return torch.cuda.device_count() > 0


def rank_context(preferred: str = "forkserver"):
    """Where rank processes come from. On a CPU-only machine: forked, from the server that
    preloaded _PRELOAD ("forkserver", once per pytest run) or from this process ("fork").
    Wherever CUDA may be initialised, fresh interpreters ("spawn"): a process forked from one
    that touched CUDA cannot use it ("Cannot re-initialize CUDA in forked subprocess"), and
    megatron-core's import of Transformer Engine queries the device in the preloading server."""
    if cuda_visible():
        return mp.get_context("spawn")
    ctx = mp.get_context(preferred)
    if preferred == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


@launches("ranks")
def spawn_ranks(target, *, world_size: int, jobs: list[dict], out_dir: Path) -> None:
    """`target(rank, world_size, port, jobs, out_dir)` on world_size forked ranks; the first
    rank error file (error_*rank*.txt in out_dir) or a non-zero exit fails the caller."""
    ctx = rank_context()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_with_environment, args=(environ, target, r, world_size, port, jobs, str(out_dir)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    errors = sorted(out_dir.glob("error_*rank*.txt"))
    if errors:
        raise AssertionError(errors[0].read_text())
    for p in procs:
        if p.exitcode != 0:
            for q in procs:
                q.kill()
            raise AssertionError(f"rank process exited with {p.exitcode}")


@launches("ranks")
def run_ranks(*, world_size: int, jobs: list[dict], out_dir: Path) -> None:
    """Run the jobs on world_size policy ranks. Jobs with --ref-mode separate first get their
    reference tables from a reference group of their own layout (ref_tp x ref_pp x ref_dp ranks),
    as the driver feeds them to the policy group."""
    out_dir.mkdir(parents=True, exist_ok=True)
    separate = [job["config"] for job in jobs if job["config"]["ref_mode"] == "separate"]
    if separate:
        ref_worlds = {c.get("ref_tp", 1) * c.get("ref_pp", 1) * c.get("ref_dp", 1) for c in separate}
        assert len(ref_worlds) == 1, "all separate jobs of one run share the reference group's size"
        spawn_ranks(_ref_rank_main, world_size=ref_worlds.pop(), jobs=jobs, out_dir=out_dir)
    spawn_ranks(_rank_main, world_size=world_size, jobs=jobs, out_dir=out_dir)


def check_ran_packed(out_dir: Path, *, padded: int, packed: int) -> None:
    """Job `packed` of a launch really ran packed rows: every training step the same real tokens
    as job `padded` (the same batches), fewer token positions, more microbatches."""
    on, off = (json.loads((out_dir / f"job{j}_metrics.json").read_text()) for j in (packed, padded))
    steps = [(a, b) for a, b in zip(on, off) if a is not None and "tokens/real" in a]  # not the evaluation
    assert steps, f"job {packed}: no training step metrics"
    for a, b in steps:
        assert a["tokens/real"] == b["tokens/real"] and a["tokens/padded"] < b["tokens/padded"], (a, b)
        assert a["microbatches"] > b["microbatches"], (a, b)


def load_rank_tensors(out_dir: Path, job: int, kind: str, *, layout: tuple[int, int, int], cp_rank: int = 0
                      ) -> dict[tuple[int, int, int], dict[str, torch.Tensor]]:
    """Every rank's file of one kind (of context-parallel rank `cp_rank`); a missing rank file is
    an error, not a smaller comparison."""
    tp, pp, dp = layout[:3]
    expected = {(t, p, d) for t in range(tp) for p in range(pp) for d in range(dp)}
    out = {}
    for path in out_dir.glob(f"job{job}_tp*_{kind}.safetensors"):
        parts = path.name.split("_")
        if (int(parts[4][2:]) if parts[4].startswith("cp") else 0) != cp_rank:
            continue
        out[(int(parts[1][2:]), int(parts[2][2:]), int(parts[3][2:]))] = load_file(str(path))
    missing = sorted(expected - set(out))
    assert not missing and set(out) == expected, f"job {job} {kind}: no file from ranks (tp, pp, dp) {missing}"
    return out


def _rank_of_processes(environ: dict, fn, rank: int, args: tuple, error_file: str) -> None:
    os.environ.clear()
    os.environ.update(environ)
    try:
        fn(rank, *args)
    except BaseException:
        Path(error_file).write_text(traceback.format_exc())
        raise


@launches("ranks")
def spawn_processes(fn, *, nprocs: int, args: tuple, start_method: str = "forkserver") -> None:
    """`fn(rank, *args)` in nprocs processes, joined; a rank's exception fails the caller with its
    traceback. "forkserver": forked from the preloaded server, with the caller's environment (as
    spawn_ranks; fresh interpreters where CUDA is visible, `rank_context`); "spawn": fresh
    interpreters always (the GPU checks, which keep CUDA out of any server)."""
    if start_method == "spawn":
        mp.start_processes(fn, args=args, nprocs=nprocs, start_method="spawn")
        return
    import tempfile

    ctx, environ = rank_context(), dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="ranks-") as errors:
        procs = [ctx.Process(target=_rank_of_processes, args=(environ, fn, r, args, f"{errors}/rank{r}.txt"))
                 for r in range(nprocs)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout=900)
        failed = sorted(Path(errors).glob("rank*.txt"))
        if failed:
            for proc in procs:
                proc.kill()
            raise AssertionError(f"{failed[0].stem} failed:\n{failed[0].read_text()}")
        for proc in procs:
            if proc.exitcode != 0:
                for other in procs:
                    other.kill()
                raise AssertionError(f"a rank process exited with {proc.exitcode}")


@launches("ranks")
def start_forked(target, *, nprocs: int, args_of) -> list:
    """`target(*args_of(rank))` in nprocs processes of `rank_context("fork")`, started; the
    caller joins them (and makes any queue they share from the same context)."""
    ctx = rank_context("fork")
    procs = [ctx.Process(target=target, args=args_of(rank)) for rank in range(nprocs)]
    for proc in procs:
        proc.start()
    return procs


@launches("ranks")
def verify(argv: list[str]) -> int:
    """`checkpoint_convert verify ARGV` in this process, with mcore_dpo's runner registered (not
    looked up in the installed entry points). Its ranks (torch.multiprocessing.spawn's fresh
    interpreters in the command line) fork from the preloaded server here, which saves each rank
    the imports of torch and megatron-core; they run the same rank function. The command line's
    own spawn, and its entry point lookup, run in tests/test_terminal_output.py and
    scripts/gpu_checks.sh's wiring."""
    import torch.multiprocessing

    from checkpoint_convert.__main__ import main
    from checkpoint_convert.verify import register_runner
    from mcore_dpo.tools.verify_runner import megatron_logits

    def forked_spawn(fn, args=(), nprocs=1, join=True, **_):
        assert join, "verify joins its ranks"
        spawn_processes(fn, nprocs=nprocs, args=args)

    spawn = torch.multiprocessing.spawn
    torch.multiprocessing.spawn = forked_spawn
    previous = register_runner(megatron_logits)
    try:
        return main(["verify", *argv])
    finally:
        register_runner(previous)
        torch.multiprocessing.spawn = spawn


@launches("ranks")
def run_benchmark(function, *args, **kwargs):
    """`function(*args, **kwargs)` of benchmarks/ (a main, or a launch), which spawns ranks (or
    commands) of its own; returns its result."""
    return function(*args, **kwargs)
