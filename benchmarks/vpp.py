"""Benchmark: what virtual pipeline stages (--vpp) buy, per reference mode, simulated.

Each plan is built and timed by the plan simulator (pipeline/check.py) with free
communication; an op of a v-chunk plan costs 1/v of a whole stage's (`chunk_costs`). Rows:
policy only (what --ref-mode none, precomputed and separate, and the reference-free objectives
run on the policy ranks), sequential, and interleaved (the next batch's reference in the
bubbles: with v = 1 a steady step carries as the engine runs it, and without carrying as well,
since carrying is not built for chunks). Cost sets: "unit" (F=1, B=2, reference F=1) and
"measured", the per-op medians benchmarks/ref_cost.py recorded on the CPU
(docs/results/ref_cost_balanced.json), when that file has them. The measured part of issue 47
(step times of real runs with --vpp) needs the executor to run chunks; not here.

    python benchmarks/vpp.py                                  # p 2/4/8, m 8/16/32, v 1/2/4 (minutes)
    python benchmarks/vpp.py --stages 2 --microbatches 4 --chunks 1 2 --out /tmp/vpp.json  # smoke size
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from mcore_dpo.pipeline.check import simulate  # noqa: E402
from mcore_dpo.pipeline.interleaved import chunk_costs  # noqa: E402
from mcore_dpo.pipeline.plan import Costs  # noqa: E402
from mcore_dpo.pipeline.schedule import build_plan  # noqa: E402

MEASURED = REPO_ROOT / "docs" / "results" / "ref_cost_balanced.json"

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
                        if v > 1:
                            kwargs = {k: val for k, val in kwargs.items() if not k.startswith("carry")}
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
    args = parser.parse_args(argv)
    if sorted(args.chunks)[0] != 1:
        parser.error("--chunks must include 1 (the baseline)")
    costs = {name: c for name, c in cost_sets().items() if args.costs is None or name in args.costs}
    results = rows(stages=args.stages, microbatches=args.microbatches, chunks=sorted(args.chunks), costs=costs)
    out = {"costs": {name: c.__dict__ for name, c in costs.items()}, "rows": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(table(results))
    return out


if __name__ == "__main__":
    main()
