"""Benchmark: what virtual pipeline stages (--vpp) buy, per reference mode, simulated and measured.

Simulated: each plan is built and timed by the plan simulator (pipeline/check.py) with free
communication; an op of a v-chunk plan costs 1/v of a whole stage's (`chunk_costs`). Rows:
policy only (what --ref-mode none, precomputed and separate, and the reference-free objectives
run on the policy ranks), sequential, and interleaved (the next batch's reference in the
bubbles: a steady step carrying reference forwards across steps as the engine runs it, at every v,
and without carrying as well). Cost sets: "unit" (F=1, B=2, reference F=1) and
"measured", the per-op medians benchmarks/ref_cost.py recorded on the CPU
(docs/results/ref_cost_balanced.json), when that file has them.

Measured (--measure): the engine's own `step_time_s` and `bubble_fraction` (time blocked in
transfers over the step, mean over ranks) of gloo rank processes (benchmarks/common.py's
launcher, one torch thread per rank) at tp 1, pp 2 (--measure-pp; a core per rank on a 2-core box), for
v 1/2/4 in the modes of `MEASURED_MODES`, beside the simulated ratio of the same plan. The model
(`SHAPE`: 8 layers, so v 4 is one layer per chunk) is sized so that compute dominates the
Python and p2p overhead. Each round builds every (mode, v) worker afresh, v values of a mode
back to back, so the ratio against v = 1 is also taken per round (a slow spell on a shared box
hits neighbours alike); step 1 of every job is warm-up. One launch per (round, m); the JSON is
rewritten after each, so a cut-short run keeps what it measured.

    python benchmarks/vpp.py                                  # simulated: p 2/4/8, m 8/16/32, v 1/2/4
    python benchmarks/vpp.py --stages 2 --microbatches 4 --chunks 1 2 --out /tmp/vpp.json  # smoke size
    python benchmarks/vpp.py --measure --stages 2 --rounds 3 --steps 2  # + measured pp 2, m 8/16/32 (36 min, 2 cores)
    python benchmarks/vpp.py --measure --measure-pp 4 --stages 4 --microbatches 8 --chunks 1 2 --rounds 1  # pp 4
    python benchmarks/vpp.py --measure --tiny --out /tmp/vpp.json --measured-out /tmp/vpp_m.json  # smoke size
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import common  # noqa: E402
from mcore_dpo.pipeline.check import simulate  # noqa: E402
from mcore_dpo.pipeline.interleaved import chunk_costs  # noqa: E402
from mcore_dpo.pipeline.plan import Costs  # noqa: E402
from mcore_dpo.pipeline.schedule import build_plan  # noqa: E402

MEASURED = REPO_ROOT / "docs" / "results" / "ref_cost_balanced.json"
MEASURED_OUT = REPO_ROOT / "docs" / "results" / "vpp_measured.json"

# row name -> build_plan arguments ("interleaved": a steady step as the engine runs it, carrying at every v)
MODES = {
    "policy only (none, precomputed, separate, reference-free)": dict(ref_mode="none"),
    "sequential": dict(ref_mode="sequential"),
    "interleaved": dict(ref_mode="interleaved", carry_in=True, carry_out=True),
    "interleaved, no carrying": dict(ref_mode="interleaved"),
}


def cost_sets(measured: Path = MEASURED) -> dict[str, Costs]:
    """The unit costs, and the measured ones scaled to a policy forward of 1, if recorded."""
    sets = {"unit": Costs()}
    if measured.exists():
        recorded = json.loads(measured.read_text()).get("measured", {}).get("simulated_with_measured_costs", {})
        recorded = recorded.get("costs_ms")
        if recorded:
            fwd = recorded["fwd"]
            sets["measured"] = Costs(fwd=1.0, bwd=recorded["bwd"] / fwd, ref_fwd=recorded["ref_fwd"] / fwd)
    return sets


def policy_bubble_theory(*, num_stages: int, num_microbatches: int, num_chunks: int) -> float:
    """Idle share of the step of policy-only (interleaved) 1F1B: (p-1)/(v*m + p-1)."""
    return (num_stages - 1) / (num_chunks * num_microbatches + num_stages - 1)


def rows(*, stages: list[int], microbatches: list[int], chunks: list[int], costs: dict[str, Costs]) -> list[dict]:
    out = []
    for cost_name, stage_costs in costs.items():
        for p in stages:
            for m in microbatches:
                base: dict[str, float] = {}  # mode -> makespan at v = 1
                for v in chunks:
                    if m % p and v > 1:
                        continue  # megatron-core's interleaved schedule needs a multiple of p
                    op_costs = chunk_costs(stage_costs, v)
                    for mode, kwargs in MODES.items():
                        plan = build_plan(num_stages=p, num_microbatches=m, num_chunks=v, costs=op_costs, **kwargs)
                        run = simulate(plan, costs=op_costs)
                        base.setdefault(mode, run.makespan)
                        row = dict(costs=cost_name, pp=p, m=m, vpp=v, mode=mode, step_time=run.makespan,
                                   bubble_fraction=run.bubble_fraction, vs_vpp1=run.makespan / base[mode],
                                   max_ref_acts_in_flight=run.max_ref_acts_in_flight)
                        if kwargs["ref_mode"] == "none":
                            row["bubble_theory"] = policy_bubble_theory(num_stages=p, num_microbatches=m, num_chunks=v)
                        out.append(row)
    return out


# ----------------------------------------------------------------------------- measured
# Measured rows: TrainConfig fields, and the simulated row (`MODES`) whose plan the engine runs.
MEASURED_MODES = {
    "none": (dict(ref_mode="none"), "policy only (none, precomputed, separate, reference-free)"),
    "orpo (reference-free)": (dict(objective="orpo"), "policy only (none, precomputed, separate, reference-free)"),
    "sequential": (dict(ref_mode="sequential"), "sequential"),
    "interleaved": (dict(ref_mode="interleaved"), "interleaved"),
}
COMPUTE_OPS = ("fwd", "bwd", "ref_fwd")
# 8 layers (pp 2 x vpp 4 = one layer per chunk), hidden 384: a pp-2 stage's forward of one
# microbatch is tens of ms on one thread, well above the per-op Python and gloo overhead; a
# small vocabulary keeps the output layer small (the last stage's ops still took 1.10 s of a
# step against the first's 0.90 s at m 8, v 1: the output layer and the loss).
SHAPE = common.LlamaShape(hidden_size=384, num_layers=8, num_heads=6, num_kv_heads=2, intermediate_size=1024,
                          vocab_size=2048)
TINY_SHAPE = common.LlamaShape(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
                               vocab_size=256)


def _jobs(*, model_dir: Path, pp: int, num_microbatches: int, chunks: list[int], modes: list[str], seq_len: int,
          steps: int) -> list[common.RankJob]:
    jobs = []
    for mode in modes:
        for v in chunks:  # a mode's v values back to back: its per-round ratios see the same load
            config = dict(model=str(model_dir), tp=1, pp=pp, vpp=v, dp=1, micro_batch_size=1,
                          global_batch_size=num_microbatches, max_steps=steps + 1, max_length=seq_len, lr=1e-5,
                          packing=False, **MEASURED_MODES[mode][0])
            jobs.append(common.RankJob(name=f"{mode}|{v}", config=config, num_steps=steps, warmup_steps=1,
                                       trace=True))
    return jobs


def measure(*, shape: common.LlamaShape, pp: int, microbatches: list[int], chunks: list[int], modes: list[str],
            seq_len: int, steps: int, rounds: int, work_dir: Path, out: Path, costs: dict[str, Costs]) -> dict:
    """Step times at `pp` for every (round, m, mode, v); rewrites `out` after each launch."""
    model_dir = common.write_random_llama(work_dir / "model", shape=shape)
    prompt_len = seq_len // 4
    result = {"machine": common.machine(), "shape": shape.__dict__, "seq_len": seq_len, "micro_batch_size": 1,
              "pp": pp, "steps_per_round": steps, "warmup_steps": 1, "rounds": rounds, "launches": [], "cells": []}
    samples: dict[tuple, dict] = {}  # (m, mode, v) -> pooled samples
    started = time.monotonic()
    for r in range(rounds):
        for m in microbatches:
            data = dict(num_pairs=m * (steps + 2), prompt_len=prompt_len, completion_len=seq_len - prompt_len,
                        vocab_size=shape.vocab_size, seed=7)
            jobs = _jobs(model_dir=model_dir, pp=pp, num_microbatches=m, chunks=chunks, modes=modes, seq_len=seq_len,
                         steps=steps)
            load_before = os.getloadavg()[0]
            t0 = time.monotonic()
            ranks = common.run_ranks(world_size=pp, jobs=jobs, data=data, out_dir=work_dir / "ranks")
            result["launches"].append({"round": r, "m": m, "seconds": time.monotonic() - t0,
                                       "loadavg_1min_before": load_before, "loadavg_1min_after": os.getloadavg()[0]})
            for index, job in enumerate(jobs):
                mode, v = job.name.split("|")
                rep = common.reporting(ranks, index)
                cell = samples.setdefault((m, mode, int(v)), {"step_time_s": [], "bubble_fraction": [],
                                                               "round_median_s": [], "loadavg_1min_after": [],
                                                               "busiest_compute_s": [], "busiest_cpu_s": [],
                                                               "ops_per_stage": 0})
                # per measured step: the busier stage's forward/backward/reference seconds
                per_stage = [[sum(end - start for kind, _, _, start, end in trace if kind in COMPUTE_OPS)
                              for trace in rank[index]["traces"]] for rank in ranks]
                cell["busiest_compute_s"] += [max(step) for step in zip(*per_stage)]
                cell["busiest_cpu_s"] += [max(step) for step in zip(*(rank[index]["cpu_s"] for rank in ranks))]
                cell["ops_per_stage"] = max(len(rank[index]["traces"][0]) for rank in ranks)
                cell["step_time_s"] += rep["step_time_s"]
                cell["bubble_fraction"] += rep["bubble_fraction"]
                cell["round_median_s"].append(statistics.median(rep["step_time_s"]))
                cell["loadavg_1min_after"].append(rep["loadavg_1min_after"])
            result["cells"] = _cells(samples, pp=pp, costs=costs)
            result["seconds"] = time.monotonic() - started
            common.write_json(out, result)
            print(f"round {r} m {m}: {result['launches'][-1]['seconds']:.0f} s, load {load_before:.2f} -> "
                  f"{result['launches'][-1]['loadavg_1min_after']:.2f}", flush=True)
    return result


_SIMULATED: dict[tuple, tuple[float, float]] = {}


def _cells(samples: dict[tuple, dict], *, pp: int, costs: dict[str, Costs]) -> list[dict]:
    """Each measured (m, mode, v) with its ratios to v = 1 (of medians; per round) and the
    simulated ratio and bubble of the same plan, per cost set."""
    cells = []
    for (m, mode, v), cell in sorted(samples.items()):
        base = samples.get((m, mode, 1))
        sim_mode = MEASURED_MODES[mode][1]
        row = {"pp": pp, "m": m, "mode": mode, "vpp": v, "step_time_s": common.summary(cell["step_time_s"]),
               "bubble_fraction": common.summary(cell["bubble_fraction"]),
               "busiest_stage_compute_s": common.summary(cell["busiest_compute_s"]),
               "busiest_rank_cpu_s": common.summary(cell["busiest_cpu_s"]),
               "ops_per_stage": cell["ops_per_stage"],
               "loadavg_1min_after": cell["loadavg_1min_after"],
               "bubble_theory_policy_only": policy_bubble_theory(num_stages=pp, num_microbatches=m, num_chunks=v)}
        if base is not None:
            row["vs_vpp1"] = row["step_time_s"]["median"] / statistics.median(base["step_time_s"])
            # the least-disturbed steps of each: on a loaded box the better estimate of the engine
            row["min_vs_vpp1"] = row["step_time_s"]["min"] / min(base["step_time_s"])
            row["cpu_vs_vpp1"] = row["busiest_rank_cpu_s"]["median"] / statistics.median(base["busiest_cpu_s"])
            rounds = min(len(base["round_median_s"]), len(cell["round_median_s"]))
            row["round_vs_vpp1"] = common.summary([cell["round_median_s"][i] / base["round_median_s"][i]
                                                   for i in range(rounds)])
        for name, c in costs.items():
            key = (name, pp, m, v, sim_mode)
            if key not in _SIMULATED:  # plans with the interleaved reference take a while to build
                sim = {r["vpp"]: r for r in rows(stages=[pp], microbatches=[m], chunks=sorted({1, v}), costs={name: c})
                       if r["mode"] == sim_mode}
                _SIMULATED[key] = (sim[v]["vs_vpp1"], sim[v]["bubble_fraction"])
            row[f"simulated_vs_vpp1_{name}"], row[f"simulated_bubble_{name}"] = _SIMULATED[key]
        cells.append(row)
    return cells


def measured_table(cells: list[dict], *, cost_names: tuple[str, ...] = ("unit", "measured")) -> str:
    names = [n for n in cost_names if cells and f"simulated_vs_vpp1_{n}" in cells[0]]
    lines = [f"| mode | pp | m | vpp | step time s | measured vs vpp 1: medians (per round) | of minima "
             f"| simulated vs vpp 1 "
             f"({' / '.join(names)}) | measured bubble | simulated bubble ({names[-1]}) | policy-only theory "
             f"| CPU s per step, busier rank (vs vpp 1) | ops per stage |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        ratio = f"{c['vs_vpp1']:.3f} ({common.fmt(c['round_vs_vpp1'])})" if "vs_vpp1" in c else "-"
        minima = f"{c['min_vs_vpp1']:.3f}" if "min_vs_vpp1" in c else "-"
        sim = " / ".join(f"{c[f'simulated_vs_vpp1_{n}']:.3f}" for n in names)
        lines.append(f"| {c['mode']} | {c['pp']} | {c['m']} | {c['vpp']} | {common.fmt(c['step_time_s'])} | {ratio} | "
                     f"{minima} | {sim} | {common.fmt(c['bubble_fraction'])} | "
                     f"{c[f'simulated_bubble_{names[-1]}']:.3f} | {c['bubble_theory_policy_only']:.3f} | "
                     f"{common.fmt(c['busiest_rank_cpu_s'])} ({c.get('cpu_vs_vpp1', float('nan')):.3f}) | "
                     f"{c['ops_per_stage']} |")
    return "\n".join(lines)


def table(results: list[dict]) -> str:
    lines = ["| costs | pp | m | vpp | mode | step time | vs vpp 1 | bubble | bubble theory |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        theory = f"{r['bubble_theory']:.3f}" if "bubble_theory" in r else "-"
        lines.append(f"| {r['costs']} | {r['pp']} | {r['m']} | {r['vpp']} | {r['mode']} | {r['step_time']:.2f} | "
                     f"{r['vs_vpp1']:.3f} | {r['bubble_fraction']:.3f} | {theory} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--costs", nargs="+", default=None, help="cost sets to use (unit, measured); default: all")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "results" / "vpp_simulated.json")
    parser.add_argument("--measure", action="store_true",
                        help="also measure real runs at --measure-pp (--microbatches, --chunks)")
    parser.add_argument("--measure-pp", type=int, default=2, help="pipeline stages of the measured runs, one rank "
                        "process each (more than the cores oversubscribes them)")
    parser.add_argument("--tiny", action="store_true", help="with --measure: smoke size (4-layer tiny model, m 2, "
                        "v 1/2, none and interleaved, one step)")
    parser.add_argument("--modes", nargs="+", default=None, choices=sorted(MEASURED_MODES), help="measured modes")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds; each builds every worker afresh")
    parser.add_argument("--steps", type=int, default=2, help="measured steps per job and round, after one warm-up")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--measured-out", type=Path, default=MEASURED_OUT)
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if sorted(args.chunks)[0] != 1:
        parser.error("--chunks must include 1 (the baseline)")
    costs = {name: c for name, c in cost_sets().items() if args.costs is None or name in args.costs}
    results = rows(stages=args.stages, microbatches=args.microbatches, chunks=sorted(args.chunks), costs=costs)
    out = {"costs": {name: c.__dict__ for name, c in costs.items()}, "rows": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(table(results))
    if args.measure:
        tiny = args.tiny
        modes = args.modes or (["none", "interleaved"] if tiny else list(MEASURED_MODES))
        work = args.work_dir or Path(tempfile.mkdtemp(prefix="mcore_dpo_vpp_"))
        out["measured"] = measure(shape=TINY_SHAPE if tiny else SHAPE, pp=args.measure_pp,
                                  microbatches=[2] if tiny else args.microbatches,
                                  chunks=[1, 2] if tiny else sorted(args.chunks), modes=modes,
                                  seq_len=16 if tiny else args.seq_len, steps=1 if tiny else args.steps,
                                  rounds=1 if tiny else args.rounds, work_dir=work, out=args.measured_out, costs=costs)
        print(measured_table(out["measured"]["cells"]))
    return out


if __name__ == "__main__":
    main()
