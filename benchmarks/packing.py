"""Benchmark 10: packed sequences against padded microbatches (CPU, tp 1, pp 2).

The model is benchmark 1's "balanced" one (`ref_cost.SHAPES`). Pair lengths are drawn from
`LENGTHS`, a log-normal model of a chat preference set (see `docs/BENCHMARKS.md` §11 for where
its parameters come from). Three modes, each launched afresh in every round (so each has its
own peak RSS), taking turns so that load from other processes falls on all of them alike:
- `padded`: `--no-packing`, `--micro-batch-size` pairs per microbatch, every row padded to the
  longest sequence of the global batch (what the engine does without packing);
- `packed`: `--packing` with `--max-tokens-per-microbatch` = 2 x micro_batch_size x max_length,
  the widest microbatch the padded mode can build, so both have the same peak activation size;
- `packed_none`: packed with `--ref-mode none` (policy only): packed / packed_none is
  benchmark 1's reference-cost ratio under packing.
Reported per mode: real (non-pad) tokens/s, padding fraction and microbatches per step (exact,
from the engine's own step metrics), step time and its spread over steps, peak RSS per rank,
and the attention/linear FLOP counts of the rows actually built (exact), with and without
the block-diagonal mask's wasted products (what THD on a GPU does not compute). Per pipeline
stage (`stages`): CPU and system seconds and page faults per step, the op trace's seconds by
kind (fwd, bwd, ref_fwd, transfer, optimizer), exact tensor bytes by category
(memory_account) and RSS after each step. `--modes` runs a subset, or the diagnostic
`packed_fixed_width`; `benchmarks/packing_decompose.py` takes the gaps apart in one process.

    python benchmarks/packing.py --rounds 3 --steps 3 --plot docs/img/packing.png
    python benchmarks/packing.py --tiny --steps 1      # smoke size
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.ref_cost import SHAPES  # noqa: E402

MODES = ("padded", "packed", "packed_none")
# Diagnostic, run only when named in --modes: packed, every row padded to the budget's width
# (one activation size for all microbatches, as padded has), to tell the allocator's
# retention of variable-size blocks from the tensors themselves (docs/BENCHMARKS.md §11).
# Its token metrics and FLOP counts are packed's: the engine's counters do not see the extra padding.
DIAGNOSTIC_MODES = ("packed_fixed_width",)


@dataclass(frozen=True)
class Lengths:
    """Token lengths: prompt and each completion log-normal (median, sigma of the log),
    independent, clipped to [minimum, max_length - prompt] (a sequence fits max_length)."""

    prompt_median: float
    prompt_sigma: float
    completion_median: float
    completion_sigma: float
    minimum: int
    max_length: int


# Assumed, modelled on a chat preference set such as UltraFeedback (binarized): prompt median
# 96 tokens, completion median 192 tokens, heavy right tails (sigma 0.9 and 0.7), scaled down
# by 4 so that a CPU step takes seconds. See docs/BENCHMARKS.md §11.
LENGTHS = Lengths(prompt_median=24, prompt_sigma=0.9, completion_median=48, completion_sigma=0.7, minimum=4,
                  max_length=128)
TINY_LENGTHS = Lengths(prompt_median=6, prompt_sigma=0.9, completion_median=8, completion_sigma=0.7, minimum=2,
                       max_length=32)


def draw_lengths(num_pairs: int, *, lengths: Lengths, seed: int) -> list[tuple[int, int, int]]:
    """(prompt, chosen, rejected) token counts of `num_pairs` pairs."""
    import random

    rng = random.Random(seed)

    def draw(median: float, sigma: float, hi: int) -> int:
        return max(lengths.minimum, min(hi, round(rng.lognormvariate(math.log(median), sigma))))

    out = []
    for _ in range(num_pairs):
        prompt = draw(lengths.prompt_median, lengths.prompt_sigma, lengths.max_length // 2)
        room = lengths.max_length - prompt
        out.append((prompt, draw(lengths.completion_median, lengths.completion_sigma, room),
                    draw(lengths.completion_median, lengths.completion_sigma, room)))
    return out


def make_pairs(lengths: list[tuple[int, int, int]], *, vocab_size: int, seed: int):
    import torch

    from mcore_dpo.data.pairs import TokenizedPair

    gen = torch.Generator().manual_seed(seed)

    def words(n: int) -> tuple[int, ...]:
        return tuple(int(x) for x in torch.randint(common.FIRST_WORD_ID, vocab_size, (n,), generator=gen))

    return [TokenizedPair(prompt_ids=(common.BOS_ID,) + words(p - 1), chosen_ids=words(c - 1) + (common.EOS_ID,),
                          rejected_ids=words(r - 1) + (common.EOS_ID,), source_line=i + 1)
            for i, (p, c, r) in enumerate(lengths)]


# ----------------------------------------------------------------------------- FLOPs (exact counts)
def row_flops(widths: list[int], segments: list[list[int]], *, shape: common.LlamaShape, masked: bool) -> dict:
    """Multiply-add FLOPs (x2) of one forward over rows of `widths` tokens: the linear layers
    (every token position, padding included) and attention scores + weighted sums. `masked`:
    the CPU's local spec computes every row's full W x W product (causal half or not, the
    kernel computes all of it); otherwise only each real sequence's own causal triangle (THD
    with cu_seqlens on a GPU, flash attention)."""
    h, heads, kv = shape.hidden_size, shape.num_heads, shape.num_kv_heads
    head_dim = h // heads
    qkv_out = h * (heads + 2 * kv) * head_dim // heads
    per_token_linear = shape.num_layers * 2 * (h * qkv_out + h * h + 3 * h * shape.intermediate_size)
    per_token_linear += 2 * h * shape.vocab_size  # output layer
    linear = sum(widths) * per_token_linear
    if masked:
        pairs_of_positions = sum(w * w for w in widths)
    else:
        pairs_of_positions = sum(n * (n + 1) // 2 for segs in segments for n in segs)
    attention = shape.num_layers * 2 * 2 * pairs_of_positions * h  # QK^T and AV
    return {"linear": linear, "attention": attention, "total": linear + attention}


def layout_stats(pairs, *, packing: bool, micro_batch_size: int, max_tokens: int, shape: common.LlamaShape) -> dict:
    """Rows the engine builds for one global batch (dp 1) and their FLOPs."""
    from mcore_dpo.data.pairs import padded_seq_len
    from mcore_dpo.data.packing import pair_tokens, plan_packed_step

    if packing:
        groups = plan_packed_step(pairs, dp=1, max_tokens=max_tokens)[0]
        widths, segments = [], []
        for g in groups:
            real = sum(pair_tokens(pairs[i]) for i in g)
            widths.append(-(-real // 8) * 8)
            segments.append([len(pairs[i].prompt_ids) + len(c) for i in g
                             for c in (pairs[i].chosen_ids, pairs[i].rejected_ids)])
    else:
        seq_len = padded_seq_len(pairs, multiple=8)
        widths, segments = [], []
        for k in range(0, len(pairs), micro_batch_size):
            for i in range(k, min(k + micro_batch_size, len(pairs))):
                for c in (pairs[i].chosen_ids, pairs[i].rejected_ids):
                    widths.append(seq_len)
                    segments.append([len(pairs[i].prompt_ids) + len(c)])
    return {"masked": row_flops(widths, segments, shape=shape, masked=True),
            "thd": row_flops(widths, segments, shape=shape, masked=False),
            "widest_row": max(widths), "rows": len(widths)}


# ----------------------------------------------------------------------------- ranks
def op_sums(trace) -> dict[str, float]:
    """Wall seconds of one step's op trace by kind: compute (fwd, bwd, ref_fwd), transfers
    (send/recv/p2p: mostly time blocked on the other stage), optimizer."""
    sums: dict[str, float] = {}
    for kind, _mb, _batch, t0, t1 in trace:
        key = kind if kind in ("fwd", "bwd", "ref_fwd", "optimizer") else "transfer"
        sums[key] = sums.get(key, 0.0) + (t1 - t0)
    return sums


def _rank_main(rank: int, world_size: int, port: int, job: dict, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    try:
        from mcore_dpo.config import TrainConfig
        from mcore_dpo.model.builder import open_weights
        from mcore_dpo.rank.worker import PolicyWorker, StepBatch

        config = TrainConfig(**job["config"])
        if job.get("row_width"):  # packed_fixed_width: every packed row padded to one width
            import mcore_dpo.rank.worker as worker_module
            from mcore_dpo.data.packing import collate_packed

            width = job["row_width"]
            worker_module.collate_packed = lambda pairs, *, pad_token_id, multiple: collate_packed(
                pairs, pad_token_id=pad_token_id, multiple=width)
        spec = open_weights(config.model).spec
        worker = PolicyWorker(config=config, spec=spec, pad_token_id=common.PAD_ID, rank=rank,
                              master_addr="127.0.0.1", master_port=port)
        pairs = make_pairs([tuple(x) for x in job["lengths"]], vocab_size=job["vocab_size"], seed=7)
        gbs = config.global_batch_size
        num_batches = job["warmup_steps"] + job["num_steps"] + 1
        worker.trace_ops = True
        metrics_rows, rank_rows = [], []
        for k in range(num_batches - 1):
            cpu0, usage0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
            metrics = worker.train_step(StepBatch(step=k + 1, pairs=pairs[k * gbs:(k + 1) * gbs],
                                                  next_pairs=pairs[(k + 1) * gbs:(k + 2) * gbs],
                                                  pair_ids=list(range(k * gbs, (k + 1) * gbs))))
            cpu_s, usage = time.process_time() - cpu0, resource.getrusage(resource.RUSAGE_SELF)
            if k < job["warmup_steps"]:
                continue
            rank_rows.append({"cpu_s": cpu_s, "system_s": usage.ru_stime - usage0.ru_stime,
                              "minor_faults": usage.ru_minflt - usage0.ru_minflt,
                              "op_wall_s": op_sums(worker.last_trace),
                              "memory": dict(worker.memory_report), "rss_bytes": common.current_rss_bytes(),
                              "peak_rss_bytes": common.peak_rss_bytes()})
            if metrics is not None:
                metrics_rows.append({key: metrics[key] for key in ("step_time_s", "tokens/real", "tokens/padded",
                                                                   "padding_fraction", "microbatches",
                                                                   "bubble_fraction")})
        result = {"coordinates": worker.coordinates(), "reports": bool(metrics_rows), "steps": metrics_rows,
                  "rank_steps": rank_rows, "peak_rss_bytes": common.peak_rss_bytes(),
                  "loadavg_1min_after": os.getloadavg()[0]}
        worker.shutdown()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    except BaseException:
        Path(out_dir, f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise


def run_job(job: dict, *, out_dir: Path, world_size: int = 2, timeout_s: float = 1800) -> list[dict]:
    """One mode in `world_size` fresh spawned rank processes; each rank's result."""
    import torch.multiprocessing as mp

    from mcore_dpo.parallel.ports import free_port

    os.environ["OMP_NUM_THREADS"] = "1"
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in list(out_dir.glob("rank*.json")) + list(out_dir.glob("error_rank*.txt")):
        stale.unlink()
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, job, str(out_dir))) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any(out_dir.glob("error_rank*.txt")):
            time.sleep(1.0)
            break
        time.sleep(0.2)
    for p in procs:
        if p.is_alive():
            p.kill()
    errors = sorted(out_dir.glob("error_rank*.txt"))
    if errors:
        raise RuntimeError(f"rank failed: {errors[0].read_text().strip().splitlines()[-1]}")
    return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world_size)]


def _config(mode: str, *, model: Path, gbs: int, mbs: int, max_length: int, steps: int) -> dict:
    config = dict(model=str(model), tp=1, pp=2, dp=1, micro_batch_size=mbs, global_batch_size=gbs,
                  max_steps=steps + 1, max_length=max_length, lr=1e-5,
                  ref_mode="none" if mode == "packed_none" else "interleaved")
    if mode == "padded":
        config.update(packing=False)
    else:
        config.update(packing=True, max_tokens_per_microbatch=2 * mbs * max_length)
    return config


def measured(*, shape: common.LlamaShape, lengths: Lengths, gbs: int, mbs: int, steps: int, rounds: int,
             work_dir: Path, modes=MODES) -> dict:
    model = common.write_random_llama(work_dir / "model", shape=shape)
    num_pairs = gbs * (steps + 2)
    drawn = draw_lengths(num_pairs, lengths=lengths, seed=11)
    raw: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(rounds):  # modes take turns: load from anything else on the box hits them alike
        for mode in modes:
            job = {"config": _config(mode, model=model, gbs=gbs, mbs=mbs, max_length=lengths.max_length,
                                     steps=steps), "lengths": drawn, "vocab_size": shape.vocab_size,
                   "num_steps": steps, "warmup_steps": 1,
                   "row_width": 2 * mbs * lengths.max_length if mode == "packed_fixed_width" else None}
            raw[mode].append({"ranks": run_job(job, out_dir=work_dir / "ranks")})
    pairs = make_pairs(drawn, vocab_size=shape.vocab_size, seed=7)
    out = {"shape": shape.__dict__, "lengths": lengths.__dict__, "global_batch_size": gbs, "micro_batch_size": mbs,
           "max_tokens_per_microbatch": 2 * mbs * lengths.max_length, "rounds": rounds, "steps_per_round": steps,
           "modes": {}}
    for mode in modes:
        steps_all, rss, load = [], [], []
        per_round_median = []
        for run in raw[mode]:
            rep = next(r for r in run["ranks"] if r["reports"])
            steps_all.extend(rep["steps"])
            per_round_median.append(statistics.median(s["step_time_s"] for s in rep["steps"]))
            rss.append(max(r["peak_rss_bytes"] for r in run["ranks"]))
            load.append(rep["loadavg_1min_after"])
        times = [s["step_time_s"] for s in steps_all]
        real_rate = [s["tokens/real"] / s["step_time_s"] for s in steps_all]
        measured_batches = [pairs[k * gbs:(k + 1) * gbs] for k in range(1, steps + 1)]
        flops = [layout_stats(b, packing=mode != "padded", micro_batch_size=mbs,
                              max_tokens=2 * mbs * lengths.max_length, shape=shape) for b in measured_batches]
        out["modes"][mode] = {
            "step_time_s": common.summary(times),
            "step_time_spread": common.summary([(max(t) - min(t)) / statistics.median(t)
                                                for t in _per_round(steps_all, steps)]),
            "step_time_cv": common.summary([statistics.pstdev(t) / statistics.mean(t)
                                            for t in _per_round(steps_all, steps)]),
            "real_tokens_per_s": common.summary(real_rate),
            "padding_fraction": common.summary([s["padding_fraction"] for s in steps_all]),
            "microbatches": common.summary([s["microbatches"] for s in steps_all]),
            "tokens_real": common.summary([s["tokens/real"] for s in steps_all]),
            "tokens_padded": common.summary([s["tokens/padded"] for s in steps_all]),
            "peak_rss_bytes": common.summary(rss),
            "round_median_step_time_s": per_round_median,
            "loadavg_1min_after": load,
            "flops_masked": sum(f["masked"]["total"] for f in flops),
            "flops_masked_attention": sum(f["masked"]["attention"] for f in flops),
            "flops_thd": sum(f["thd"]["total"] for f in flops),
            "widest_row": max(f["widest_row"] for f in flops),
            "bubble_fraction": common.summary([s["bubble_fraction"] for s in steps_all]),
            "stages": _stage_breakdown(raw[mode]),
        }
    m = out["modes"]
    if "padded" in m and "packed" in m:
        pad, pk = m["padded"], m["packed"]
        out["packed_vs_padded"] = {
            "real_tokens_per_s": pk["real_tokens_per_s"]["median"] / pad["real_tokens_per_s"]["median"],
            "per_round_step_time": common.summary([b / a for a, b in zip(pad["round_median_step_time_s"],
                                                                          pk["round_median_step_time_s"])]),
            "peak_rss": pk["peak_rss_bytes"]["median"] / pad["peak_rss_bytes"]["median"],
            # Same work, counted: what the rows cost on this CPU (masked W x W attention) and
            # what they would cost with THD (only each sequence's own causal triangle).
            "flops_ratio_cpu": pad["flops_masked"] / pk["flops_masked"],
            "flops_ratio_thd": pad["flops_masked"] / pk["flops_thd"],
            "flops_ratio_thd_both": pad["flops_thd"] / pk["flops_thd"],
        }
    if "packed" in m and "packed_none" in m:
        out["reference_cost_ratio_packed"] = {
            "medians": m["packed"]["step_time_s"]["median"] / m["packed_none"]["step_time_s"]["median"],
            "per_round": common.summary([a / b for a, b in zip(m["packed"]["round_median_step_time_s"],
                                                               m["packed_none"]["round_median_step_time_s"])]),
        }
    return out


def _stage_breakdown(runs: list[dict]) -> list[dict]:
    """Per pipeline stage, medians over every measured step of every round: the rank's CPU
    seconds per step (process time: the busy part of the step, far less sensitive to other
    processes than wall time), its op trace's wall seconds by kind, and its exact tensor
    bytes by category (memory_account) and RSS, in MiB."""
    out = []
    for stage in range(len(runs[0]["ranks"])):
        rows = [row for run in runs for row in run["ranks"][stage]["rank_steps"]]
        kinds = sorted({k for row in rows for k in row["op_wall_s"]})
        categories = sorted({k for row in rows for k in row["memory"]})
        out.append({
            "cpu_s": statistics.median(row["cpu_s"] for row in rows),
            "system_s": statistics.median(row["system_s"] for row in rows),
            "minor_faults": statistics.median(row["minor_faults"] for row in rows),
            "op_wall_s": {k: statistics.median(row["op_wall_s"].get(k, 0.0) for row in rows) for k in kinds},
            "memory_mib": {k.removesuffix("_peak_bytes"): max(row["memory"][k] for row in rows) / 2**20
                           for k in categories},
            "rss_mib_after_step": statistics.median(row["rss_bytes"] for row in rows) / 2**20,
            "peak_rss_mib": statistics.median(run["ranks"][stage]["peak_rss_bytes"] for run in runs) / 2**20,
            "peak_rss_mib_per_round": [run["ranks"][stage]["peak_rss_bytes"] / 2**20 for run in runs],
            "rss_mib_per_round_and_step": [[round(row["rss_bytes"] / 2**20)
                                            for row in run["ranks"][stage]["rank_steps"]] for run in runs],
        })
    return out


def _per_round(rows: list[dict], steps: int) -> list[list[float]]:
    times = [s["step_time_s"] for s in rows]
    return [times[i:i + steps] for i in range(0, len(times), steps) if len(times[i:i + steps]) > 1] or [times]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = result["modes"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    panels = (("real_tokens_per_s", "real tokens/s", 1.0), ("padding_fraction", "padding fraction", 1.0),
              ("step_time_s", "step time (s)", 1.0))
    for ax, (key, label, scale) in zip(axes, panels):
        stats = [modes[m][key] for m in modes]
        med = [s["median"] * scale for s in stats]
        ax.bar(list(modes), med, yerr=[[s["median"] - s["min"] for s in stats], [s["max"] - s["median"] for s in stats]],
               capsize=4, color="#4c78a8")
        ax.set_title(label, fontsize=10)
    fig.suptitle("CPU, tp 1, pp 2, balanced model (benchmark 1): packed vs padded (shared, loaded box)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/mcore_dpo_bench/packing.json")
    parser.add_argument("--plot", default=None, help="PNG of the three modes' medians (e.g. docs/img/packing.png)")
    parser.add_argument("--tiny", action="store_true", help="smoke size: tiny model, short sequences")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per mode and round (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each launches every mode afresh")
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=1, help="pairs per padded microbatch")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated subset of {','.join(MODES + DIAGNOSTIC_MODES)}")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    if not modes or any(m not in MODES + DIAGNOSTIC_MODES for m in modes):
        parser.error(f"--modes: expected a comma-separated subset of {','.join(MODES + DIAGNOSTIC_MODES)}, "
                     f"got {args.modes!r}")

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mcore_dpo_packing_"))
    shape = common.TINY_SHAPE if args.tiny else SHAPES["balanced"]
    result = {"machine": common.machine(), "loadavg_1min_before": os.getloadavg()[0],
              "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k == "LD_PRELOAD"}}
    result["measured"] = measured(shape=shape, lengths=TINY_LENGTHS if args.tiny else LENGTHS,
                                  gbs=args.global_batch_size, mbs=args.micro_batch_size, steps=args.steps,
                                  rounds=1 if args.tiny else args.rounds, work_dir=work, modes=modes)
    m = result["measured"]
    print("measured (tp 1, pp 2, one thread per rank; the box may be shared): median (min-max)")
    for mode, e in m["modes"].items():
        print(f"  {mode:<12} real tokens/s {common.fmt(e['real_tokens_per_s'], digits=0)}  "
              f"padding {common.fmt(e['padding_fraction'])}  microbatches {common.fmt(e['microbatches'], digits=0)}  "
              f"step {common.fmt(e['step_time_s'])} s  spread {common.fmt(e['step_time_spread'])}  "
              f"peak RSS {e['peak_rss_bytes']['median'] / 2**20:.0f} MiB")
    for mode, e in m["modes"].items():
        for stage, st in enumerate(e["stages"]):
            ops = "  ".join(f"{k} {v:.3f}" for k, v in st["op_wall_s"].items())
            print(f"  {mode:<12} stage {stage}: cpu {st['cpu_s']:.3f} s/step (system {st['system_s']:.3f}, "
                  f"{st['minor_faults']:.0f} page faults)  ops (wall s) {ops}  exact peak "
                  f"{st['memory_mib'].get('total', 0):.1f} MiB (stash {st['memory_mib'].get('policy_stash', 0):.2f})"
                  f"  peak RSS {st['peak_rss_mib']:.0f} MiB")
    if "packed_vs_padded" in m:
        r = m["packed_vs_padded"]
        print(f"  packed / padded: real tokens/s x{r['real_tokens_per_s']:.2f}, peak RSS x{r['peak_rss']:.3f}; "
              f"FLOPs padded/packed x{r['flops_ratio_cpu']:.2f} (masked attention, CPU), "
              f"x{r['flops_ratio_thd']:.2f} (THD)")
    if "reference_cost_ratio_packed" in m:
        print(f"  reference-cost ratio, packed: x{m['reference_cost_ratio_packed']['medians']:.3f}")
    if args.plot:
        plot(m, Path(args.plot))
    common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
