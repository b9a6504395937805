"""Benchmark 4: data-parallel scaling on the CPU, tokens/s at dp 2 against dp 1.

tp = pp = 1, one torch thread per rank, same global batch (strong scaling: dp 2 gives each
rank half the microbatches), reference interleaved; dp 1 and dp 2 take turns over rounds. Tokens/s is the global batch's tokens
over the engine's `step_time_s` (which includes the gradient all-reduce over gloo); step 1
is warm-up and excluded. On a 2-core machine dp 2 uses both cores.

    python benchmarks/dp_scaling.py             # ~2 min on 2 cores
    python benchmarks/dp_scaling.py --tiny --steps 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

SHAPE = common.SMALL_SHAPE  # the model of benchmark 1, last-heavy split


def run(*, shape: common.LlamaShape, seq_len: int, micro_batch_size: int, global_batch_size: int, num_steps: int,
        rounds: int, dps: tuple[int, ...], ref_mode: str, work_dir: Path) -> dict:
    model_dir = common.write_random_llama(work_dir / "model", shape=shape)
    prompt_len = seq_len // 4
    data = dict(num_pairs=global_batch_size * (num_steps + 2), prompt_len=prompt_len,
                completion_len=seq_len - prompt_len, vocab_size=shape.vocab_size, seed=5)
    out = {"shape": shape.__dict__, "seq_len": seq_len, "micro_batch_size": micro_batch_size,
           "global_batch_size": global_batch_size, "ref_mode": ref_mode, "rounds": rounds,
           "steps_per_round": num_steps, "dp": {}}
    times: dict[int, list[float]] = {dp: [] for dp in dps}
    speeds: dict[int, list[float]] = {dp: [] for dp in dps}
    for round_index in range(rounds):  # dp sizes take turns (the box may be shared)
        for dp in dps:
            config = dict(model=str(model_dir), tp=1, pp=1, dp=dp, micro_batch_size=micro_batch_size,
                          global_batch_size=global_batch_size, max_steps=num_steps + 1, max_length=seq_len,
                          ref_mode=ref_mode, lr=1e-5, packing=False)
            job = common.RankJob(name=f"dp{dp}", config=config, num_steps=num_steps, warmup_steps=1)
            results = common.run_ranks(world_size=dp, jobs=[job], data=data,
                                       out_dir=work_dir / f"ranks_dp{dp}_{round_index}")
            rep = common.reporting(results, 0)
            times[dp].extend(rep["step_time_s"])
            speeds[dp].extend(t / s for t, s in zip(rep["tokens_per_step"], rep["step_time_s"]))
    for dp in dps:
        out["dp"][str(dp)] = {"step_time_s": common.summary(times[dp]), "tokens_per_s": common.summary(speeds[dp])}
    if "1" in out["dp"]:
        base = out["dp"]["1"]["tokens_per_s"]["median"]
        for entry in out["dp"].values():
            entry["speedup_vs_dp1"] = entry["tokens_per_s"]["median"] / base
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/mcore_dpo_bench/dp_scaling.json")
    parser.add_argument("--steps", type=int, default=2, help="measured steps per round (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--ref-mode", default="interleaved")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mcore_dpo_dp_"))
    result = run(shape=common.TINY_SHAPE if args.tiny else SHAPE, seq_len=16 if args.tiny else args.seq_len,
                 micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                 num_steps=args.steps, rounds=1 if args.tiny else args.rounds, dps=(1, 2), ref_mode=args.ref_mode, work_dir=work)
    result["machine"] = common.machine()
    for dp, e in result["dp"].items():
        print(f"dp {dp}: {common.fmt(e['tokens_per_s'], digits=0)} tokens/s, x{e.get('speedup_vs_dp1', 0):.2f} vs dp 1")
    common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
