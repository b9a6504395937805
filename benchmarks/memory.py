"""Benchmark 2: memory per rank with the reference colocated, against policy-only.

Two figures per rank and mode:
- exact tensor bytes by category (`mcore_dpo/pipeline/account.py`): run-long categories
  (parameters, grads, optimizer state, reference) plus the step's peak of the activation
  side, the largest over the measured steps. Deterministic: one repeat says it all.
- peak RSS (VmHWM of /proc/self/status) at the end of the run, the old figure: it includes
  the interpreter, torch and megatron-core (~0.4 GB, also recorded right after the imports),
  allocator slack and the model build, and moves by tens of MiB between repeats.

Each (mode, repeat) is a fresh group of rank processes (tp 1, pp 2 by default) that builds
the worker and runs the steps. The difference colocated - policy-only is compared with the
reference's parameter bytes on the rank.

The model is chosen so that parameters, not activations, dominate (hidden 1024, short
sequences): the question is what keeping the reference resident costs.

    python benchmarks/memory.py                 # 5 repeats x 2 modes, ~3 min on 2 cores
    python benchmarks/memory.py --tiny --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

SHAPE = common.LlamaShape(hidden_size=1024, num_layers=4, num_heads=8, num_kv_heads=4,
                          intermediate_size=2816, vocab_size=8192)
GOAL_RATIO = 1.1
SEQ_LEN, NUM_MICROBATCHES = 32, 4  # the benchmark's setting


def _rank_main(rank: int, world_size: int, ports: list[int], configs: list[dict], data: dict,
               steps_per_config: list[int], out_dir: str) -> None:
    """Run `configs` one after another in this rank process; per config and step: the exact
    memory report, the per-microbatch stash bytes and the plan's flags; per config: the
    stage-activation bytes, and peak RSS after the config's steps."""
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch

        torch.set_num_threads(1)
        from mcore_dpo.config import TrainConfig
        from mcore_dpo.pipeline.account import storage_bytes
        from mcore_dpo.model.builder import open_weights
        from mcore_dpo.rank.worker import PolicyWorker, StepBatch

        baseline_rss = common.peak_rss_bytes()
        pairs = common.make_pairs(**data)
        results = []
        for fields, port, num_steps in zip(configs, ports, steps_per_config):
            config = TrainConfig(**fields)
            worker = PolicyWorker(config=config, spec=open_weights(config.model).spec, pad_token_id=common.PAD_ID,
                                  rank=rank, master_addr="127.0.0.1", master_port=port)
            ref_bytes = (sum(p.numel() * p.element_size() for p in worker.reference.model.parameters())
                         if worker.reference.model is not None else 0)
            policy_numel = sum(p.numel() for p in worker.policy.module.parameters())
            policy_buffer_bytes = storage_bytes(list(worker.policy.module.buffers()))
            gbs = config.global_batch_size
            batches = [[(k * gbs + i) % len(pairs) for i in range(gbs)] for k in range(num_steps + 1)]
            if config.ref_mode == "precomputed":
                worker.precompute_reference(pairs)
            rows, seq_len = worker.local_microbatches([pairs[i] for i in batches[0]])[0][0].tokens.shape
            steps = []
            for k in range(num_steps):
                metrics = worker.train_step(StepBatch(step=k + 1, pairs=[pairs[i] for i in batches[k]],
                                                      next_pairs=[pairs[i] for i in batches[k + 1]],
                                                      pair_ids=batches[k]))
                plan = worker.last_plan
                steps.append({
                    "memory": worker.memory_report,
                    "stash_bytes_per_microbatch": sorted(worker.memory.stash_bytes_per_microbatch.values()),
                    "plan": {"ref_mode": plan.ref_mode, "ref_batches": list(plan.ref_batches),
                             "carry_in": plan.carry_in, "carry_out": plan.carry_out,
                             "num_microbatches": plan.num_microbatches},
                    "metrics": metrics,
                })  # fmt: skip
            results.append({
                "ref_mode": config.ref_mode,
                "recompute": config.recompute,
                "recompute_num_layers": config.recompute_num_layers,
                "prefix_sharing": bool(config.prefix_sharing),
                "rows": rows, "seq_len": seq_len,  # of a microbatch: [rows, seq_len] tokens
                "pp_rank": worker.mesh.pp_rank,
                "ref_param_bytes": ref_bytes,
                "policy_numel": policy_numel,
                "policy_buffer_bytes": policy_buffer_bytes,
                "stage_activation_bytes": int(rows * seq_len * worker.spec.hidden_size * worker.dtype.itemsize),
                "steps": steps,
                "baseline_rss_bytes": baseline_rss,
                "peak_rss_bytes": common.peak_rss_bytes(),
            })  # fmt: skip
            worker.shutdown()
            del worker
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    except BaseException:
        Path(out_dir, f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise


def launch(*, model_dir: Path, pp: int, modes: tuple[str, ...], num_microbatches: int, seq_len: int, num_steps: int,
           out_dir: Path, other_modes_steps: int | None = None, timeout_s: float = 1800,
           settings: tuple[dict, ...] = ({},)) -> list[list[dict]]:
    """One group of `pp` rank processes (tp 1, dp 1) that runs each mode in turn, once per
    entry of `settings` (TrainConfig fields added, e.g. --recompute); per rank, one result per
    (setting, mode), in that order (see `_rank_main`). `other_modes_steps`: steps of the modes other than interleaved
    (their plan is the same every step), default `num_steps`."""
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = "1"
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in list(out_dir.glob("rank*.json")) + list(out_dir.glob("error_rank*.txt")):
        stale.unlink()
    shape = json.loads((model_dir / "config.json").read_text())
    prompt_len = seq_len // 4
    data = dict(num_pairs=num_microbatches * (num_steps + 1), prompt_len=prompt_len,
                completion_len=seq_len - prompt_len, vocab_size=shape["vocab_size"], seed=3)
    configs = [dict(model=str(model_dir), tp=1, pp=pp, dp=1, micro_batch_size=1, global_batch_size=num_microbatches,
                    max_steps=num_steps, max_length=seq_len, ref_mode=mode, lr=1e-5, packing=False, **setting)
               for setting in settings for mode in modes]
    ports: list[int] = []
    while len(ports) < len(configs):
        port = common.free_port()
        if port not in ports:
            ports.append(port)
    ctx = mp.get_context("spawn")
    steps = [num_steps if config["ref_mode"] == "interleaved" or other_modes_steps is None else other_modes_steps
             for config in configs]
    procs = [ctx.Process(target=_rank_main, args=(r, pp, ports, configs, data, steps, str(out_dir)))
             for r in range(pp)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout_s)
    errors = sorted(out_dir.glob("error_rank*.txt"))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    if errors:
        raise RuntimeError(f"rank failed: {errors[0].read_text().strip().splitlines()[-1]}")
    if any(proc.exitcode != 0 for proc in procs):
        raise RuntimeError(f"rank processes did not finish cleanly: exit codes {[p.exitcode for p in procs]}")
    return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(pp)]


def exact_peak(result: dict) -> dict[str, int]:
    """Per category, the largest peak over the measured steps of one mode on one rank."""
    out: dict[str, int] = {}
    for step in result["steps"]:
        for name, value in step["memory"].items():
            out[name] = max(out.get(name, 0), value)
    return out


def reference_overhead(results: list[list[dict]], *, with_ref: str = "interleaved") -> dict[int, float]:
    """Per rank: (exact total peak with the reference - policy-only) / reference parameter bytes."""
    out = {}
    for rank, per_mode in enumerate(results):
        by_mode = {r["ref_mode"]: r for r in per_mode}
        diff = exact_peak(by_mode[with_ref])["total_peak_bytes"] - exact_peak(by_mode["none"])["total_peak_bytes"]
        out[rank] = diff / by_mode[with_ref]["ref_param_bytes"]
    return out


def run(*, shape: common.LlamaShape, modes: tuple[str, ...], repeats: int, seq_len: int, num_microbatches: int,
        pp: int, work_dir: Path) -> dict:
    model_dir = common.write_random_llama(work_dir / "model", shape=shape)
    rss: dict[str, dict[int, dict[str, list[float]]]] = {m: {} for m in modes}
    exact: dict[str, dict[int, dict[str, int]]] = {m: {} for m in modes}
    ref_bytes: dict[int, int] = {}
    for repeat in range(repeats):
        for mode in modes:  # a fresh process group per mode: peak RSS is per process
            results = launch(model_dir=model_dir, pp=pp, modes=(mode,), num_microbatches=num_microbatches,
                             seq_len=seq_len, num_steps=2, out_dir=work_dir / f"ranks_{mode}_{repeat}")
            for rank, (r,) in enumerate(results):
                entry = rss[mode].setdefault(rank, {"peak_rss_bytes": [], "baseline_rss_bytes": []})
                entry["peak_rss_bytes"].append(r["peak_rss_bytes"])
                entry["baseline_rss_bytes"].append(r["baseline_rss_bytes"])
                exact[mode][rank] = exact_peak(r)  # the same in every repeat
                if r["ref_param_bytes"]:
                    ref_bytes[rank] = r["ref_param_bytes"]
    out = {"shape": shape.__dict__, "seq_len": seq_len, "num_microbatches": num_microbatches, "pp": pp,
           "repeats": repeats, "ranks": {}}
    for rank in sorted(rss[modes[0]]):
        row: dict = {"ref_param_bytes": ref_bytes.get(rank, 0)}
        for mode in modes:
            row[mode] = {k: common.summary(v) for k, v in rss[mode][rank].items()}
            row[mode]["exact"] = exact[mode][rank]
        if "none" in modes and row["ref_param_bytes"]:
            for mode in modes:
                if mode == "none":
                    continue
                diff = row[mode]["peak_rss_bytes"]["median"] - row["none"]["peak_rss_bytes"]["median"]
                exact_diff = exact[mode][rank]["total_peak_bytes"] - exact["none"][rank]["total_peak_bytes"]
                row[f"{mode}_minus_none_bytes"] = diff
                row[f"{mode}_minus_none_over_ref_bytes"] = diff / row["ref_param_bytes"]
                row[f"{mode}_minus_none_exact_bytes"] = exact_diff
                row[f"{mode}_minus_none_exact_over_ref_bytes"] = exact_diff / row["ref_param_bytes"]
        out["ranks"][str(rank)] = row
    return out


# The model table's bytes: a Llama-3-8B layer at tp 4 with sequence parallelism, flash attention,
# bf16 (configs/llama3_8b.yaml): what one microbatch's stash weighs against one stage activation.
TABLE_LAYERS = 32
TABLE_STAGES = (2, 4, 8)
TABLE_MICROBATCHES = (4, 8, 16, 32)
TABLE_PLANS = {
    "sequential": dict(ref_mode="sequential"),
    "interleaved, first step": dict(ref_mode="interleaved", ref_current=True, carry_out=True),
    "interleaved, carrying": dict(ref_mode="interleaved", carry_in=True, carry_out=True),
    "interleaved, no carry": dict(ref_mode="interleaved"),
}


def stash_over_activation(*, layers_per_stage: float) -> float:
    """One microbatch's policy stash on a stage over one stage-boundary activation, for the
    Llama-3-8B layer of configs/llama3_8b.yaml (mcore_dpo/tools/memory_estimate.py)."""
    from mcore_dpo.tools.memory_estimate import LayerShape, layer_activation_bytes

    shape = LayerShape(hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256)
    kw = dict(seq_len=2048, rows=2, tp=4, sequence_parallel=True, attention="flash", dtype_bytes=2)
    boundary = 2048 * 2 * 4096 * 2 / 4  # [s/tp, b, h] in bf16
    return layers_per_stage * layer_activation_bytes(shape, **kw) / boundary


def model_table() -> list[dict]:
    """Per (stages, microbatches) and plan: the worst stage's reference activations in flight +
    carried, in stage activations, and the peak-activation overhead over policy-only 1F1B."""
    from mcore_dpo.pipeline.memory import plan_memory
    from mcore_dpo.pipeline.schedule import build_plan

    rows = []
    for p in TABLE_STAGES:
        ratio = stash_over_activation(layers_per_stage=TABLE_LAYERS / p)
        for m in TABLE_MICROBATCHES:
            base = plan_memory(build_plan(num_stages=p, num_microbatches=m, ref_mode="none"))
            base_peak = max(st.policy_stash * ratio for st in base)
            row = {"pp": p, "m": m, "stash_stage0": base[0].policy_stash, "stash_over_activation": ratio}
            for name, kwargs in TABLE_PLANS.items():
                peaks = plan_memory(build_plan(num_stages=p, num_microbatches=m, **kwargs))
                row[name] = {
                    "in_flight": max(st.reference_in_flight for st in peaks),
                    "carried": max(st.carried for st in peaks),
                    "extra": max(st.reference_in_flight + st.carried for st in peaks),
                    "overhead": max(st.policy_stash * ratio + st.reference_in_flight + st.carried for st in peaks)
                    / base_peak - 1,
                }
            rows.append(row)
    return rows


def format_model_table(rows: list[dict]) -> str:
    names = list(TABLE_PLANS)
    head = ("| pp | m | 1F1B stash, stage 0 (microbatches) | "
            + " | ".join(f"{n}: in flight + carried (overhead)" for n in names) + " |")
    lines = [head, "|" + "---|" * (3 + len(names))]
    for r in rows:
        cells = [f"{r[n]['in_flight']} + {r[n]['carried']} ({100 * r[n]['overhead']:.2f} %)" for n in names]
        lines.append(f"| {r['pp']} | {r['m']} | {r['stash_stage0']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/mcore_dpo_bench/memory.json")
    parser.add_argument("--modes", default="interleaved,none", help="comma list of ref modes; include none")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--microbatches", type=int, default=NUM_MICROBATCHES)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--model-table", action="store_true",
                        help="print the plan memory model's table (no processes) and exit")
    args = parser.parse_args(argv)
    if args.model_table:
        rows = model_table()
        print(format_model_table(rows))
        return {"model_table": rows}
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mcore_dpo_memory_"))
    modes = tuple(m.strip() for m in args.modes.split(","))
    result = run(shape=common.TINY_SHAPE if args.tiny else SHAPE, modes=modes, repeats=args.repeats,
                 seq_len=16 if args.tiny else args.seq_len, num_microbatches=args.microbatches, pp=args.pp,
                 work_dir=work)
    result["machine"] = common.machine()
    mib = 1 / 2**20
    for rank, row in result["ranks"].items():
        print(f"rank {rank}: reference parameters {row['ref_param_bytes'] * mib:.1f} MiB")
        for mode in modes:
            exact = row[mode]["exact"]
            print(f"  {mode:<12} peak RSS MiB {common.fmt(row[mode]['peak_rss_bytes'], digits=1, scale=mib)}; "
                  f"exact tensor peak MiB {exact['total_peak_bytes'] * mib:.2f}")
            print("    " + ", ".join(f"{k.removesuffix('_peak_bytes')} {v * mib:.2f}" for k, v in exact.items()
                                     if k != "total_peak_bytes"))
            if f"{mode}_minus_none_bytes" in row:
                print(f"  {mode} - none: RSS {row[f'{mode}_minus_none_bytes'] * mib:.1f} MiB "
                      f"= {row[f'{mode}_minus_none_over_ref_bytes']:.2f} x reference bytes; exact "
                      f"{row[f'{mode}_minus_none_exact_bytes'] * mib:.2f} MiB "
                      f"= {row[f'{mode}_minus_none_exact_over_ref_bytes']:.4f} x (goal <= {GOAL_RATIO})")
    common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
