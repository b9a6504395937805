"""Benchmark: the default job at two commits, taking turns, so that a slower default shows.

The job is the README's first command, `python -m mcore_dpo.train` on its embedded default
(tiny Llama, shipped data), cut to `--steps` steps. "before" is a git commit checked out with
`git worktree`; "after" is this working tree (or `--after COMMIT`). Each round runs both, each in
a fresh interpreter with its own output directory and its own model cache, the order swapped on
odd rounds; one untimed run per tree first builds that tree's default model. The figures are
the ranks' tokens/s per step (metrics.jsonl, step 1 left out as warm-up) and each run's wall
time. Both trees train the same batches in the same order, so step k of one run pairs with step
k of the other in the same round: the headline is the median over every such pair of the
step-time ratio before/after (how much faster "after" is on the same batch; per-batch length
differences cancel). The ratio of each round's median tokens/s is kept beside it.

`--floor` adds the compute a step cannot avoid, timed in one process with no engine: the same
padded microbatches of the default job through the Hugging Face model, policy forward and
backward, reference forward, one AdamW step. The engine's step time over it says what the
engine adds (Ray, the plan executor, metrics) on top of the arithmetic.

    python benchmarks/engine_regression.py --before b707565 --rounds 5 --floor --out docs/results/engine_regression_b707565.json
    python benchmarks/engine_regression.py --before HEAD              # the working tree against its last commit
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import common  # noqa: E402


def checkout(commit: str, into: Path) -> Path:
    """A detached `git worktree` of `commit` at `into` (removed by `remove_checkout`)."""
    subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", "-q", str(into), commit],
                   check=True, capture_output=True, text=True)
    return into


def remove_checkout(path: Path) -> None:
    subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(path)],
                   capture_output=True, text=True)


def commit_of(ref: str) -> str:
    return subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", ref], check=True,
                          capture_output=True, text=True).stdout.strip()


def run_default_job(tree: Path, *, steps: int, out_dir: Path, cache_dir: Path, extra_args: tuple[str, ...] = ()) -> dict:
    """One run of the default job from `tree` (with `extra_args` added to its command line):
    per-step tokens/s, step times and token positions (step 1 left out), and the whole
    command's wall time."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree), MCORE_DPO_CACHE=str(cache_dir))
    command = [sys.executable, "-m", "mcore_dpo.train", "--max-steps", str(steps), "--output-dir", str(out_dir),
               *extra_args]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=str(out_dir.parent), env=env, capture_output=True, text=True, timeout=1800)
    wall_s = time.perf_counter() - start
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        raise RuntimeError(f"{tree}: the default job exited {done.returncode}: {tail}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_rows = [r for r in rows if r.get("step", 0) >= 2 and "tokens/s" in r]
    return {"tokens_per_s": [r["tokens/s"] for r in steps_rows], "step_time_s": [r["step_time_s"] for r in steps_rows],
            "tokens_padded": [r.get("tokens/padded") for r in steps_rows], "wall_s": wall_s}


def compute_floor(*, steps: int, cache_dir: Path) -> dict:
    """Step time of the default job's arithmetic alone, in this process: every microbatch of a
    step through the HF model (policy forward + backward, reference forward), then AdamW."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    os.environ["MCORE_DPO_CACHE"] = str(cache_dir)
    torch.set_num_threads(1)
    from mcore_dpo.config import TrainConfig
    from mcore_dpo.data.pairs import collate, padded_seq_len
    from mcore_dpo.data.order import StepOrder
    from mcore_dpo.driver.run import prepare

    prep = prepare(TrainConfig(max_steps=steps))
    config = prep.config
    policy = AutoModelForCausalLM.from_pretrained(config.model, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(config.model, dtype=torch.float32).eval()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=config.lr)
    b = config.micro_batch_size

    def summed_logps(model, micro) -> torch.Tensor:
        logits = model(input_ids=micro.tokens).logits.float()
        token_logps = torch.gather(logits.log_softmax(-1), 2, micro.labels.unsqueeze(2)).squeeze(2)
        return (token_logps * micro.loss_mask).sum(-1)

    times = []
    for ids in StepOrder.of(config, prep.train_data.source_counts()):
        pairs = [prep.train_data[i] for i in ids]
        seq_len = padded_seq_len(pairs)
        micros = [collate(pairs[k:k + b], pad_token_id=prep.pad_token_id, seq_len=seq_len) for k in range(0, len(pairs), b)]
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for micro in micros:
            with torch.no_grad():
                ref = summed_logps(reference, micro)
            logps = summed_logps(policy, micro)
            n = logps.shape[0] // 2
            margin = (logps[:n] - ref[:n]) - (logps[n:] - ref[n:])
            loss = -torch.nn.functional.logsigmoid(config.beta * margin).sum() / len(pairs)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), config.clip_grad)
        optimizer.step()
        times.append(time.perf_counter() - start)
    return {"step_time_s": times[1:]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="commit to compare against (e.g. b707565, HEAD)")
    parser.add_argument("--after", default=None, help="commit of the second tree (default: this working tree)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running both trees (default: 3)")
    parser.add_argument("--steps", type=int, default=16, help="steps of each run; step 1 is warm-up (default: 16)")
    parser.add_argument("--floor", action="store_true", help="also time the one-process compute floor")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    opts = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped benchmark still removes its worktree
    result: dict = {"machine": common.machine(), "job": f"python -m mcore_dpo.train --max-steps {opts.steps}",
                    "rounds": opts.rounds, "before": commit_of(opts.before),
                    "after": commit_of(opts.after) if opts.after else f"working tree at {commit_of('HEAD')}"}
    with tempfile.TemporaryDirectory(prefix="engine-regression-") as tmp_name:
        tmp = Path(tmp_name)
        trees = {"before": checkout(opts.before, tmp / "tree-before")}
        trees["after"] = checkout(opts.after, tmp / "tree-after") if opts.after else REPO_ROOT
        try:
            for name, tree in trees.items():  # builds each tree's default model; not timed
                run_default_job(tree, steps=2, out_dir=tmp / f"warm-{name}", cache_dir=tmp / f"cache-{name}")
            runs: dict[str, list[dict]] = {"before": [], "after": []}
            loads = []
            for r in range(opts.rounds):
                for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
                    runs[name].append(run_default_job(trees[name], steps=opts.steps, out_dir=tmp / f"run-{name}-{r}",
                                                      cache_dir=tmp / f"cache-{name}"))
                loads.append(os.getloadavg()[0])
                b, a = (statistics.median(runs[n][-1]["tokens_per_s"]) for n in ("before", "after"))
                print(f"round {r}: before {b:,.0f} tokens/s, after {a:,.0f} tokens/s, ratio {a / b:.3f}, "
                      f"load {loads[-1]:.1f}", flush=True)
            ratios = [statistics.median(a["tokens_per_s"]) / statistics.median(b["tokens_per_s"])
                      for a, b in zip(runs["after"], runs["before"])]
            step_ratios = [tb / ta for a, b in zip(runs["after"], runs["before"])
                           for ta, tb in zip(a["step_time_s"], b["step_time_s"])]
            for name in ("before", "after"):
                result[name + "_tokens_per_s"] = common.summary([t for run in runs[name] for t in run["tokens_per_s"]])
                result[name + "_step_time_s"] = common.summary([t for run in runs[name] for t in run["step_time_s"]])
                result[name + "_wall_s"] = common.summary([run["wall_s"] for run in runs[name]])
            result["step_paired_speed_ratio"] = common.summary(step_ratios)
            result["ratio_after_over_before"] = common.summary(ratios)
            result["ratios_per_round"] = ratios
            result["loadavg_1min_per_round"] = loads
            if opts.floor:
                floor = compute_floor(steps=opts.steps, cache_dir=tmp / "cache-after")
                result["floor_step_time_s"] = common.summary(floor["step_time_s"])
                result["after_step_over_floor"] = (result["after_step_time_s"]["median"]
                                                   / result["floor_step_time_s"]["median"])
        finally:
            for name, tree in trees.items():
                if tree != REPO_ROOT:
                    remove_checkout(tree)
    print(f"default job, {opts.rounds} rounds taking turns ({result['job']}):")
    for name in ("before", "after"):
        print(f"  {name:6s} {result[name]:>28s}: {common.fmt(result[name + '_tokens_per_s'], digits=0)} tokens/s, "
              f"step {common.fmt(result[name + '_step_time_s'])} s, run {common.fmt(result[name + '_wall_s'], digits=1)} s")
    print(f"  speed after/before, step by step on the same batch (before's step time / after's): "
          f"{common.fmt(result['step_paired_speed_ratio'])}")
    print(f"  ratio after/before (median tokens/s of each round's runs): {common.fmt(result['ratio_after_over_before'])}")
    if opts.floor:
        print(f"  one-process compute floor: {common.fmt(result['floor_step_time_s'])} s per step; "
              f"the engine's step is {result['after_step_over_floor']:.2f}x it")
    if opts.out:
        common.write_json(opts.out, result)
    return result


if __name__ == "__main__":
    main()
