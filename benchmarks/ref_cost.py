"""Benchmark 1: what the reference forward costs, simulated and measured.

Simulated: the plan simulator (policy F=1, B=2, reference F=1, free communication) times
every --ref-mode for pp in {2,4,8} and microbatches in {4,8,16,32} (interleaved with and
without carrying, and its first step), next to the closed forms of policy-only 1F1B, a
separate reference pass, and reference+policy concatenated in a slot.

Measured: step time on the CPU at tp 1, pp 2 (one torch thread per rank, so each stage has
its own core), 8 microbatches, for interleaved, sequential, precomputed and none
(policy-only), from the engine's own `step_time_s`, on one of the `SHAPES`. Modes take
turns over several rounds (each round builds every mode's worker afresh), so that load from
other processes on a shared box is spread over all modes; the 1-minute load average is
recorded per job, and ratios are also given per round. Step 1 is warm-up and is excluded
for every mode (for interleaved it also computes the current batch's reference, which later
steps get from the previous step). Every step's op timeline is recorded: the JSON has op
costs per stage, and --timeline draws one step per mode.

    python benchmarks/ref_cost.py --rounds 5 --steps 3  # both parts, ~5 min on 2 cores
    python benchmarks/ref_cost.py --shape last-heavy    # the output layer unbalances pp 2
    python benchmarks/ref_cost.py --simulated-only
    python benchmarks/ref_cost.py --tiny --steps 1      # smoke size
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from mcore_dpo.pipeline.plan import Costs
from mcore_dpo.pipeline.check import closed_form_makespans, simulate
from mcore_dpo.pipeline.schedule import build_plan  # noqa: E402

MODES = ("interleaved", "sequential", "precomputed", "none")
SIM_STAGES = (2, 4, 8)
SIM_MICROBATCHES = (4, 8, 16, 32)

# Measured models. Compute dominates the Python and p2p overhead, and a step takes ~2 s.
# "balanced": 5 layers split 3 / 2 (earlier stages take the extra layer), and a vocabulary at
# which the output layer plus log-probs cost about one decoder layer, so both stages carry
# the same work, as a practitioner would split a pipeline. "last-heavy": 4 layers split 2 / 2
# with the output layer on top of stage 1, which makes that stage ~30% slower.
SHAPES = {
    "balanced": common.LlamaShape(hidden_size=512, num_layers=5, num_heads=8, num_kv_heads=4,
                                  intermediate_size=1408, vocab_size=6144),
    "last-heavy": common.SMALL_SHAPE,
}


# What the engine runs: steady-state interleaved steps carry reference forwards into the next
# step's warm-up bubble; the first step also computes its own batch's reference.
_SIM_PLANS = {
    "none": dict(ref_mode="none"),
    "sequential": dict(ref_mode="sequential"),
    "interleaved": dict(ref_mode="interleaved", carry_in=True, carry_out=True),
    "interleaved_no_carry": dict(ref_mode="interleaved"),
    "interleaved_first_step": dict(ref_mode="interleaved", ref_current=True, carry_out=True),
}


def simulated(*, stages=SIM_STAGES, microbatches=SIM_MICROBATCHES) -> list[dict]:
    """Makespans in units of one policy forward (`_SIM_PLANS`)."""
    costs = Costs(fwd=1.0, bwd=2.0, ref_fwd=1.0)
    rows = []
    for p in stages:
        for m in microbatches:
            closed = closed_form_makespans(num_stages=p, num_microbatches=m, costs=costs)
            row = {"pp": p, "m": m, **{f"closed_{k}": v for k, v in closed.items()}}
            for key, kwargs in _SIM_PLANS.items():
                plan = build_plan(num_stages=p, num_microbatches=m, costs=costs, **kwargs)
                row[f"sim_{key}"] = simulate(plan, costs=costs).makespan
            base = row["sim_none"]
            for key in list(row):
                if key.startswith(("sim_", "closed_")):
                    row[f"ratio_{key}"] = row[key] / base
            rows.append(row)
    return rows


def measured(*, shape: common.LlamaShape, seq_len: int, micro_batch_size: int, num_microbatches: int,
             steps_per_round: int, rounds: int, work_dir: Path, modes=MODES) -> dict:
    model_dir = common.write_random_llama(work_dir / "model", shape=shape)
    gbs = micro_batch_size * num_microbatches
    prompt_len = seq_len // 4
    data = dict(num_pairs=gbs * (steps_per_round + 2), prompt_len=prompt_len, completion_len=seq_len - prompt_len,
                vocab_size=shape.vocab_size, seed=7)
    jobs = []
    for _ in range(rounds):  # modes take turns, so load from anything else on the box hits them alike
        for mode in modes:
            config = dict(model=str(model_dir), tp=1, pp=2, dp=1, micro_batch_size=micro_batch_size,
                          global_batch_size=gbs, max_steps=steps_per_round + 1, max_length=seq_len, ref_mode=mode,
                          lr=1e-5, packing=False)
            # the one-off pass covers the pairs the measured steps use
            jobs.append(common.RankJob(name=mode, config=config, num_steps=steps_per_round, warmup_steps=1,
                                       precompute_pairs=data["num_pairs"] if mode == "precomputed" else 0,
                                       trace=True))
    results = common.run_ranks(world_size=2, jobs=jobs, data=data, out_dir=work_dir / "ranks")
    out = {"shape": shape.__dict__, "seq_len": seq_len, "micro_batch_size": micro_batch_size,
           "num_microbatches": num_microbatches, "rounds": rounds, "steps_per_round": steps_per_round, "modes": {}}
    for mode in modes:
        rep = common.pooled(results, mode)
        times = rep["step_time_s"]
        tokens = rep["tokens_per_step"]
        entry = {"step_time_s": common.summary(times),
                 "tokens_per_s": common.summary([t / s for t, s in zip(tokens, times)]),
                 "loadavg_1min_after": rep["loadavg_1min_after"]}
        if mode == "precomputed":
            entry["precompute_s"] = common.summary(rep["precompute_s"])
            entry["precompute_pairs"] = data["num_pairs"]
        entry.update(_trace_stats(results, mode))
        out["modes"][mode] = entry
    # Paired by round: each round's median against the same round's policy-only median, so that
    # a slow spell on a shared box (it hits every mode of a round alike) cancels out.
    if "none" in out["modes"]:
        per_round = [{job["name"]: statistics.median(common.reporting(results, i)["step_time_s"])
                      for i, job in enumerate(results[0]) if i // len(modes) == r} for r in range(rounds)]
        for mode, entry in out["modes"].items():
            entry["round_ratio_vs_none"] = common.summary([row[mode] / row["none"] for row in per_round])
        if "interleaved" in out["modes"] and "sequential" in out["modes"]:
            out["round_interleaved_faster_than_sequential"] = common.summary(
                [1 - row["interleaved"] / row["sequential"] for row in per_round])
    base = out["modes"]["none"]["step_time_s"]["median"] if "none" in out["modes"] else None
    base_min = out["modes"]["none"]["step_time_s"]["min"] if "none" in out["modes"] else None
    for mode, entry in out["modes"].items():
        if base:
            entry["ratio_vs_none"] = entry["step_time_s"]["median"] / base
            entry["ratio_of_minima_vs_none"] = entry["step_time_s"]["min"] / base_min
    if "interleaved" in out["modes"] and "sequential" in out["modes"]:
        inter, seq = out["modes"]["interleaved"], out["modes"]["sequential"]
        out["interleaved_faster_than_sequential"] = 1 - inter["step_time_s"]["median"] / seq["step_time_s"]["median"]
        # No schedule of this work finishes before its busiest stage has run every forward,
        # backward and reference forward: the most any schedule can gain over sequential.
        out["any_schedule_faster_than_sequential_at_most"] = 1 - inter["busiest_stage_compute_s"] / seq["step_time_s"]["median"]
        out["simulated_with_measured_costs"] = _simulate_measured(out["modes"], num_microbatches=num_microbatches)
    return out


COMPUTE_OPS = ("fwd", "bwd", "ref_fwd")
# Transfer ops: each waits until its messages are through (a send until the peer has received it).
WAIT_OPS = ("recv_act", "recv_grad", "recv_ref_act", "send_act", "send_grad", "send_ref_act", "send_kept_ref_act",
            "p2p")


def _trace_stats(results: list[list[dict]], mode: str) -> dict:
    """From every rank's op timelines of `mode`: median op durations per pipeline stage, the
    share of the step each stage spent blocked on receives, and the busiest stage's compute."""
    per_stage: dict[int, dict[str, list[float]]] = {}
    compute_per_step: dict[int, list[float]] = {}
    wait_share: dict[int, list[float]] = {}
    for rank in results:
        for job in rank:
            if job["name"] != mode:
                continue
            stage = job["coordinates"][1]
            for trace in job["traces"]:
                span = max(end for *_, end in trace)
                for kind, _, _, start, end in trace:
                    per_stage.setdefault(stage, {}).setdefault(kind, []).append(end - start)
                compute_per_step.setdefault(stage, []).append(
                    sum(end - start for kind, _, _, start, end in trace if kind in COMPUTE_OPS))
                wait_share.setdefault(stage, []).append(
                    sum(end - start for kind, _, _, start, end in trace if kind in WAIT_OPS) / span)
    # One step to draw: the last round's step closest to that round's median step time.
    last = max(i for i, job in enumerate(results[0]) if job["name"] == mode)
    times = common.reporting(results, last)["step_time_s"]
    k = min(range(len(times)), key=lambda i: abs(times[i] - statistics.median(times)))
    timeline = {str(rank[last]["coordinates"][1]): rank[last]["traces"][k] for rank in results}
    return {
        "timeline": timeline,
        "op_median_ms": {str(s): {k: 1e3 * statistics.median(v) for k, v in sorted(ops.items())}
                         for s, ops in sorted(per_stage.items())},
        "recv_wait_share": {str(s): statistics.median(v) for s, v in sorted(wait_share.items())},
        "busiest_stage_compute_s": max(statistics.median(v) for v in compute_per_step.values()),
    }


def _simulate_measured(modes: dict, *, num_microbatches: int) -> dict:
    """The plan simulator fed with the measured op durations (mean over stages, free
    communication, no optimizer): what the schedule alone predicts for this model."""
    stages = modes["interleaved"]["op_median_ms"]

    def mean(kind: str) -> float:
        return sum(ops[kind] for ops in stages.values()) / len(stages)

    costs = Costs(fwd=mean("fwd"), bwd=mean("bwd"), ref_fwd=mean("ref_fwd"))
    times = {key: simulate(build_plan(num_stages=len(stages), num_microbatches=num_microbatches, costs=costs,
                                      **kwargs), costs=costs).makespan / 1e3
             for key, kwargs in _SIM_PLANS.items() if key != "interleaved_first_step"}
    return {"costs_ms": costs.__dict__, "makespan_s": times,
            "ratio_vs_none": {mode: t / times["none"] for mode, t in times.items()}}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = sorted({r["pp"] for r in rows})
    fig, axes = plt.subplots(1, len(stages), figsize=(4 * len(stages), 3.6), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, p in zip(axes, stages):
        sub = [r for r in rows if r["pp"] == p]
        ms = [r["m"] for r in sub]
        ax.plot(ms, [r["ratio_sim_interleaved"] for r in sub], "o-", label="interleaved (sim)")
        ax.plot(ms, [r["ratio_sim_interleaved_no_carry"] for r in sub], "^-", alpha=0.6, label="interleaved, no carrying (sim)")
        ax.plot(ms, [r["ratio_sim_sequential"] for r in sub], "s-", label="sequential (sim)")
        ax.plot(ms, [r["ratio_closed_separate_pass"] for r in sub], "--", label="separate pass (closed form)")
        ax.plot(ms, [r["ratio_closed_concatenated"] for r in sub], ":", label="concatenated (closed form)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_title(f"pp = {p}")
        ax.set_xlabel("microbatches")
    axes[0].set_ylabel("step time / policy-only 1F1B")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


TIMELINE_COLORS = {"fwd": "#4c78a8", "bwd": "#f58518", "ref_fwd": "#54a24b", "optimizer": "#b279a2"}


def plot_timeline(measured_result: dict, path: Path) -> None:
    """One measured step per mode, one row per stage: policy forward, backward, reference
    forward and optimizer as bars; the gaps are time blocked on a neighbour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    modes = [m for m in ("none", "sequential", "interleaved") if m in measured_result["modes"]]
    fig, axes = plt.subplots(len(modes), 1, figsize=(10, 1.3 * len(modes) + 0.8), sharex=True, squeeze=False)
    for ax, mode in zip(axes[:, 0], modes):
        timeline = measured_result["modes"][mode]["timeline"]
        for stage, trace in timeline.items():
            y = int(stage)
            for kind, mb, batch, start, end in trace:
                if kind not in TIMELINE_COLORS:
                    continue
                ax.broken_barh([(start, end - start)], (y - 0.4, 0.8), facecolors=TIMELINE_COLORS[kind],
                               edgecolor="white", linewidth=0.5, hatch="//" if batch == 1 else None)
        span = max(end for trace in timeline.values() for *_, end in trace)
        ax.set_yticks(range(len(timeline)), [f"stage {s}" for s in sorted(timeline, key=int)])
        ax.invert_yaxis()
        ax.set_title(f"{mode}: {span:.2f} s", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds from the start of the step")
    handles = [Patch(color=c, label=k) for k, c in TIMELINE_COLORS.items()]
    handles.append(Patch(facecolor="#54a24b", hatch="//", edgecolor="white", label="ref_fwd, next batch"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/mcore_dpo_bench/ref_cost.json")
    parser.add_argument("--plot", default=None, help="PNG of the simulated ratios (e.g. docs/img/ref_cost_sim.png)")
    parser.add_argument("--simulated-only", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="smoke size: tiny model, short sequences")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="balanced", help="measured model (see SHAPES)")
    parser.add_argument("--timeline", default=None, help="PNG of one measured step per mode, op by op, per stage")
    parser.add_argument("--steps", type=int, default=2, help="measured steps per mode and round (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each builds every mode afresh")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=1, help="pairs per microbatch")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args(argv)

    rows = simulated(stages=(2, 4) if args.tiny else SIM_STAGES, microbatches=(4, 8) if args.tiny else SIM_MICROBATCHES)
    result = {"machine": common.machine(), "simulated": rows}
    if args.plot:
        plot(rows, Path(args.plot))
    print("simulated step time / policy-only (F=1, B=2, ref F=1):")
    for r in rows:
        print(f"  pp={r['pp']} m={r['m']:>2}: interleaved {r['ratio_sim_interleaved']:.3f} "
              f"(no carry {r['ratio_sim_interleaved_no_carry']:.3f}, first step {r['ratio_sim_interleaved_first_step']:.3f})"
              f"  sequential {r['ratio_sim_sequential']:.3f}  "
              f"separate {r['ratio_closed_separate_pass']:.3f}  concatenated {r['ratio_closed_concatenated']:.3f}")
    if not args.simulated_only:
        work = Path(args.work_dir or tempfile.mkdtemp(prefix="mcore_dpo_ref_cost_"))
        shape = common.TINY_SHAPE if args.tiny else SHAPES[args.shape]
        seq_len = 16 if args.tiny else args.seq_len
        result["measured"] = measured(shape=shape, seq_len=seq_len, micro_batch_size=args.micro_batch_size,
                                      num_microbatches=4 if args.tiny else args.microbatches,
                                      steps_per_round=args.steps, rounds=1 if args.tiny else args.rounds,
                                      work_dir=work)
        print("measured (tp 1, pp 2, one thread per rank): step_time_s median (min-max), ratio vs none "
              "(of medians; per round: median (min-max))")
        for mode, e in result["measured"]["modes"].items():
            extra = f", one-off pass {common.fmt(e['precompute_s'], digits=2)} s" if "precompute_s" in e else ""
            paired = f"  per round x{common.fmt(e['round_ratio_vs_none'])}" if "round_ratio_vs_none" in e else ""
            print(f"  {mode:<12} {common.fmt(e['step_time_s'])}  x{e.get('ratio_vs_none', float('nan')):.3f}{paired}{extra}")
        m = result["measured"]
        if "interleaved_faster_than_sequential" in m:
            print(f"  interleaved is {100 * m['interleaved_faster_than_sequential']:.1f}% faster than sequential "
                  f"(per round {common.fmt(m['round_interleaved_faster_than_sequential'], scale=100, digits=1)}%); "
                  f"no schedule of this work can be more than {100 * m['any_schedule_faster_than_sequential_at_most']:.1f}%")
            sim = m["simulated_with_measured_costs"]["ratio_vs_none"]
            print(f"  simulator with the measured op costs: interleaved x{sim['interleaved']:.3f}, "
                  f"sequential x{sim['sequential']:.3f}")
        if args.timeline:
            plot_timeline(result["measured"], Path(args.timeline))
    common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
