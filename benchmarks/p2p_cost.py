"""Benchmark: step time of the rendezvous-safe transfers against the buffered ones.

"before" is the engine at a given git commit (every transfer on its own, sends not waited
for until the end of the step); "after" is this tree (crossing transfers paired into one
batch_isend_irecv, every transfer waited for). Both run the same jobs: CPU, gloo, tp 1, one
torch thread per rank, --ref-mode interleaved (the most transfers), at pp 2 and pp 4.

The box may be shared, so the two trees take turns: each round runs before, then after
(or the other way round on odd rounds), each in a fresh interpreter, and the result is the
ratio after/before per round (paired), with its median over rounds. Step 1 is warm-up.

    python benchmarks/p2p_cost.py --before-commit b707565 --rounds 3 --out docs/results/p2p_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import common  # noqa: E402

# Runs in a fresh interpreter with PYTHONPATH at one tree; prints one JSON line.
_JOB = """
import json, sys
from pathlib import Path
from benchmarks import common
args = json.loads(sys.argv[1])
work = Path(args["work_dir"])
shape = common.LlamaShape(**args["shape"])
model = work / "model"
if not model.exists():
    common.write_random_llama(model, shape=shape)
gbs = args["micro_batch_size"] * args["num_microbatches"]
data = dict(num_pairs=gbs * (args["steps"] + 2), prompt_len=args["seq_len"] // 4,
            completion_len=args["seq_len"] - args["seq_len"] // 4, vocab_size=shape.vocab_size, seed=7)
config = dict(model=str(model), tp=1, pp=args["pp"], dp=1, micro_batch_size=args["micro_batch_size"],
              global_batch_size=gbs, max_steps=args["steps"] + 1, max_length=args["seq_len"],
              ref_mode="interleaved", lr=1e-5, packing=False)
job = common.RankJob(name="step", config=config, num_steps=args["steps"], warmup_steps=1)
results = common.run_ranks(world_size=args["pp"], jobs=[job], data=data, out_dir=work / f"ranks-{args['tag']}")
print(json.dumps(common.reporting(results, 0)["step_time_s"]))
"""


def _run(tree: Path, args: dict) -> list[float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, "-c", _JOB, json.dumps(args)], capture_output=True, text=True, env=env,
                          timeout=1800, cwd=str(tree))
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: {(done.stderr.strip().splitlines() or ['(no stderr)'])[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _export(commit: str, into: Path) -> Path:
    archive = into / "before.tar"
    subprocess.run(["git", "-C", str(REPO_ROOT), "archive", "-o", str(archive), commit], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "before", filter="data")
    return into / "before"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-commit", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--num-microbatches", type=int, default=8)
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    shape = common.LlamaShape(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=704,
                              vocab_size=2048)
    out: dict = {"machine": common.machine(), "before_commit": opts.before_commit, "shape": shape.__dict__,
                 "seq_len": 128, "micro_batch_size": 2, "num_microbatches": opts.num_microbatches,
                 "steps_per_run": opts.steps, "rounds": opts.rounds, "ref_mode": "interleaved", "pp": {}}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": _export(opts.before_commit, Path(tmp)), "after": REPO_ROOT}
        for pp in opts.pp:
            runs: dict[str, list[list[float]]] = {"before": [], "after": []}
            loads = []
            for r in range(opts.rounds):
                order = ("before", "after") if r % 2 == 0 else ("after", "before")
                for name in order:
                    args = dict(work_dir=str(Path(tmp) / f"pp{pp}"), shape=shape.__dict__, seq_len=128,
                                micro_batch_size=2, num_microbatches=opts.num_microbatches, steps=opts.steps,
                                pp=pp, tag=f"{name}{r}")
                    runs[name].append(_run(trees[name], args))
                loads.append(os.getloadavg()[0])
                print(f"pp {pp} round {r}: before {statistics.median(runs['before'][-1]):.3f} s, "
                      f"after {statistics.median(runs['after'][-1]):.3f} s, load {loads[-1]:.1f}", flush=True)
            ratios = [statistics.median(a) / statistics.median(b) for a, b in zip(runs["after"], runs["before"])]
            out["pp"][str(pp)] = {
                "before_step_time_s": common.summary([t for run in runs["before"] for t in run]),
                "after_step_time_s": common.summary([t for run in runs["after"] for t in run]),
                "paired_ratio_after_over_before": common.summary(ratios),
                "ratios_per_round": ratios,
                "loadavg_1min_per_round": loads,
            }
    text = json.dumps(out, indent=2)
    print(text)
    if opts.out:
        common.write_json(opts.out, out)


if __name__ == "__main__":
    main()
