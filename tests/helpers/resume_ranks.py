"""Training checkpoints written and resumed by policy ranks, without Ray: `run_resume_jobs` runs
jobs one after another on one launch of gloo ranks (each job its own layout of the same world).

A job trains steps `first_step..last_step` (default: its last batch) of its batches, from the
source weights or from the checkpoint `resume` (a checkpoint directory), and writes the checkpoints of the steps in
`save_at` as the driver does (`save_like_the_driver`: every rank writes its part, then rank 0
finishes it in the run's format and commits it under `output_dir`); a step before `first_step`
in `save_at` writes the restored state before any step. The reporting rank writes
`{name}_metrics.json` (the metrics of each step it ran).

`policy_jobs_rank` is the rank loop under it (a PolicyWorker per job, the caller's function on
each), shared by the rank functions of tests that launch policy ranks themselves.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import torch

from tests.helpers.models import PAD
from tests.helpers.ranks import spawn_ranks
from tests.helpers.tiers import launches


def resume_job(name: str, base: dict, *, output_dir: Path, layout: tuple[int, int, int, int], first_step: int = 1,
               resume: Path | None = None, save_at: tuple[int, ...] = (), last_step: int | None = None,
               **config) -> dict:
    """A job of `base`'s model, data and settings (a parity job: `parity.parity_job`) at
    `layout` (tp, pp, dp, ep); `config` adds or overrides TrainConfig fields."""
    tp, pp, dp, ep = layout
    return {
        "name": name,
        "config": {**base["config"], "tp": tp, "pp": pp, "dp": dp, "ep": ep, "output_dir": str(output_dir),
                   "max_steps": len(base["batches"]), **config},
        "batches": base["batches"],
        "first_step": first_step,
        "last_step": last_step or len(base["batches"]),
        "resume": str(resume) if resume else None,
        "save_at": list(save_at),
    }


def save_like_the_driver(worker, config, *, step: int, rank: int) -> None:
    """What driver/outputs.save_checkpoint does with a worker group: every rank writes its part
    into the partial directory, rank 0 finishes it in the run's format and commits it."""
    import torch.distributed as dist

    from mcore_dpo.checkpoint import formats
    from mcore_dpo.checkpoint import layout as checkpoint
    from mcore_dpo.driver.outputs import model_meta

    tmp = checkpoint.root(config.output_dir) / f"{checkpoint.name_of(step, fmt=config.save_format)}.partial-ranks"
    tmp.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    worker.save_checkpoint(str(tmp), step=step)
    dist.barrier()
    if rank == 0:
        meta, aux = model_meta(config, worker.spec, dtype="float32", layer_spec=worker.layer_spec())
        formats.for_run(config).finish(tmp, config=config, spec=worker.spec, meta=meta, aux=aux)
        checkpoint.commit(config.output_dir, tmp, step=step, trainer_state={"step": step}, keep_last=0)
    dist.barrier()


def policy_jobs_rank(rank: int, port: int, jobs: list[dict], out_dir: str, run_job) -> None:
    """One rank's part of a launch of policy jobs, one after another on the same world: for each
    job a PolicyWorker of its config (TrainConfig fields) on this rank, from the checkpoint
    `job["resume"]` when the job names one (the previous job's layout released first when it
    differs), handed to `run_job(worker, config, job, rank=rank, out_dir=out_dir)`; the last
    worker shut down. One thread per rank. An error is written to out_dir/error_rank{rank}.txt
    (what spawn_ranks reports) and raised."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        from mcore_dpo.config import TrainConfig
        from mcore_dpo.model.builder import open_weights
        from mcore_dpo.parallel.mesh import Layout, release_layout
        from mcore_dpo.rank.worker import PolicyWorker

        worker = None
        for job in jobs:
            config = TrainConfig(**job["config"])
            layout = Layout(tp=config.tp, pp=config.pp, dp=config.dp, ep=config.ep)
            if worker is not None and worker.layout != layout:  # another layout, the same world
                release_layout()
            worker = PolicyWorker(config=config, spec=open_weights(config.model).spec, pad_token_id=PAD, rank=rank,
                                  master_addr="127.0.0.1", master_port=port, resume_dir=job.get("resume"))
            run_job(worker, config, job, rank=rank, out_dir=out_dir)
        worker.shutdown()
    except BaseException:
        Path(out_dir, f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise


def _train_and_save(worker, config, job: dict, *, rank: int, out_dir: str) -> None:
    """A resume job's steps on its worker, the checkpoints of `save_at` and the step metrics."""
    from mcore_dpo.rank.worker import StepBatch

    batches, first, metrics = job["batches"], job["first_step"], {}
    if first - 1 in job["save_at"]:  # the restored state, before any step
        save_like_the_driver(worker, config, step=first - 1, rank=rank)
    for k in range(first, job["last_step"] + 1):
        nxt = batches[k] if k < len(batches) else None
        metrics[k] = worker.train_step(StepBatch(step=k, pairs=batches[k - 1], next_pairs=nxt))
        if k in job["save_at"]:
            save_like_the_driver(worker, config, step=k, rank=rank)
    if metrics and all(m is not None for m in metrics.values()):
        Path(out_dir, f"{job['name']}_metrics.json").write_text(json.dumps(metrics))


def _rank_main(rank: int, world_size: int, port: int, jobs: list[dict], out_dir: str) -> None:
    policy_jobs_rank(rank, port, jobs, out_dir, _train_and_save)


@launches("ranks")
def run_resume_jobs(*, world_size: int, jobs: list[dict], out_dir: Path) -> dict[str, dict[int, dict]]:
    """The jobs on one launch of world_size ranks; {job name: {step: metrics}}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spawn_ranks(_rank_main, world_size=world_size, jobs=jobs, out_dir=out_dir)
    out = {}
    for job in jobs:
        path = out_dir / f"{job['name']}_metrics.json"
        assert path.is_file(), f"job {job['name']}: the reporting rank wrote no metrics"
        out[job["name"]] = {int(k): v for k, v in json.loads(path.read_text()).items()}
    return out
