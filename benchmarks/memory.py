"""Benchmark 2: peak memory per rank with the reference colocated, against policy-only.

Each (mode, repeat) is a fresh pair of rank processes (tp 1, pp 2) that builds the worker and
runs two steps; every rank reads its own peak RSS (VmHWM in /proc/self/status) at the end.
RSS includes the interpreter, torch and megatron-core (~0.4 GB here, also recorded right
after the imports); that baseline is the same in every mode and cancels in the difference
colocated - policy-only, which is compared with the reference's parameter bytes on the rank.

The model is chosen so that parameters, not activations, dominate (hidden 1024, short
sequences): the question is what keeping the reference resident costs.

    python benchmarks/memory.py                 # 5 repeats x 2 modes, ~3 min on 2 cores
    python benchmarks/memory.py --tiny --repeats 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

SHAPE = common.LlamaShape(hidden_size=1024, num_layers=4, num_heads=8, num_kv_heads=4,
                          intermediate_size=2816, vocab_size=8192)
GOAL_RATIO = 1.1


def run(*, shape: common.LlamaShape, modes: tuple[str, ...], repeats: int, seq_len: int, num_microbatches: int,
        work_dir: Path) -> dict:
    model_dir = common.write_random_llama(work_dir / "model", shape=shape)
    micro_batch_size = 1
    gbs = micro_batch_size * num_microbatches
    prompt_len = seq_len // 4
    data = dict(num_pairs=gbs * 3, prompt_len=prompt_len, completion_len=seq_len - prompt_len,
                vocab_size=shape.vocab_size, seed=3)
    samples: dict[str, dict[int, dict[str, list[float]]]] = {m: {} for m in modes}
    ref_bytes: dict[int, int] = {}
    for repeat in range(repeats):
        for mode in modes:  # modes alternate so that slow drift hits them alike
            config = dict(model=str(model_dir), tp=1, pp=2, dp=1, micro_batch_size=micro_batch_size,
                          global_batch_size=gbs, max_steps=2, max_length=seq_len, ref_mode=mode, lr=1e-5)
            job = common.RankJob(name=mode, config=config, num_steps=1, warmup_steps=1)
            results = common.run_ranks(world_size=2, jobs=[job], data=data, out_dir=work_dir / f"ranks_{mode}_{repeat}")
            for rank, per_job in enumerate(results):
                r = per_job[0]
                entry = samples[mode].setdefault(rank, {"peak_rss_bytes": [], "baseline_rss_bytes": []})
                entry["peak_rss_bytes"].append(r["peak_rss_bytes"])
                entry["baseline_rss_bytes"].append(r["baseline_rss_bytes"])
                if r["ref_param_bytes"]:
                    ref_bytes[rank] = r["ref_param_bytes"]
    out = {"shape": shape.__dict__, "seq_len": seq_len, "num_microbatches": num_microbatches, "repeats": repeats,
           "ranks": {}}
    for rank in sorted(samples[modes[0]]):
        row = {"ref_param_bytes": ref_bytes.get(rank, 0)}
        for mode in modes:
            row[mode] = {k: common.summary(v) for k, v in samples[mode][rank].items()}
        if "none" in modes:
            base = row["none"]["peak_rss_bytes"]["median"]
            for mode in modes:
                if mode == "none":
                    continue
                diff = row[mode]["peak_rss_bytes"]["median"] - base
                row[f"{mode}_minus_none_bytes"] = diff
                row[f"{mode}_minus_none_over_ref_bytes"] = diff / row["ref_param_bytes"] if row["ref_param_bytes"] else None
        out["ranks"][str(rank)] = row
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/mcore_dpo_bench/memory.json")
    parser.add_argument("--modes", default="interleaved,none", help="comma list of ref modes; include none")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mcore_dpo_memory_"))
    modes = tuple(m.strip() for m in args.modes.split(","))
    result = run(shape=common.TINY_SHAPE if args.tiny else SHAPE, modes=modes, repeats=args.repeats,
                 seq_len=16 if args.tiny else args.seq_len, num_microbatches=args.microbatches, work_dir=work)
    result["machine"] = common.machine()
    mib = 1 / 2**20
    for rank, row in result["ranks"].items():
        print(f"rank {rank}: reference parameters {row['ref_param_bytes'] * mib:.1f} MiB")
        for mode in modes:
            print(f"  {mode:<12} peak RSS MiB {common.fmt(row[mode]['peak_rss_bytes'], digits=1, scale=mib)}")
            if f"{mode}_minus_none_bytes" in row:
                print(f"  {mode} - none = {row[f'{mode}_minus_none_bytes'] * mib:.1f} MiB "
                      f"= {row[f'{mode}_minus_none_over_ref_bytes']:.2f} x reference bytes (goal <= {GOAL_RATIO})")
    common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
