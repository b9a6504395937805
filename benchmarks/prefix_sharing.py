"""Benchmark 16: shared-prompt rows (--prefix-sharing) against packing alone and padding (CPU, tp 1, pp 2).

The model is benchmark 1's "balanced" one (`ref_cost.SHAPES`), the runner benchmark 10's
(`benchmarks/packing.py`: each mode launched afresh in every round, the modes taking turns so
that load from other processes falls on all of them alike). Two length mixes (`MIXES`, their
assumed parameters stated there), each run in all four modes:
- `padded`: --no-packing, rows padded to the global batch's longest sequence;
- `padded_shared`: --no-packing --prefix-sharing, one row per pair, padded to its longest pair;
- `packed`: --packing, budget 2 x micro_batch_size x max_length (benchmark 10's);
- `packed_shared`: --packing --prefix-sharing, the same budget.
Reported per mode: exact token positions per step (from the engine's own step metrics), CPU
seconds per step over both ranks (the work: far less sensitive than wall time to other processes),
forward FLOPs of the rows actually built (exact: with the CPU's masked W x W attention, and
counting only the products the mask allows, what a structure-aware kernel computes), real
tokens/s (the pairs' tokens, the prompt counted twice, whatever the layout), step time and
peak RSS; the ratios of each shared mode to its unshared one, measured beside counted.

    python benchmarks/prefix_sharing.py --rounds 3 --steps 3
    python benchmarks/prefix_sharing.py --tiny --steps 1      # smoke size

`--default-job`: instead, the default job (`python -m mcore_dpo.train` on its embedded default
model and data, benchmarks/engine_regression.py's runner), with `--prefix-sharing` and without,
taking turns (the order swapped on odd rounds), each run a fresh interpreter cut to `--steps`
steps (step 1 left out as warm-up); one untimed run first builds the default model. Both runs
train the same batches in the same order, so step k of one pairs with step k of the other in
the same round: the headline is the median over every pair of off's step time / on's (the
speed of sharing on). Beside it: each round's median tokens/s ratio, the whole runs' wall-time
ratio, the token positions per step and the 1-minute load after each round.

    python benchmarks/prefix_sharing.py --default-job --rounds 5 --steps 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.packing import Lengths, draw_lengths, make_pairs, run_job  # noqa: E402
from benchmarks.ref_cost import SHAPES  # noqa: E402

MODES = ("padded", "padded_shared", "packed", "packed_shared")

# Assumed length mixes, in tokens, scaled down by 4 from the data sets they model so that a CPU
# step takes seconds (prompt and completions log-normal: median, sigma of the log):
# - long_prompt: multi-turn chat and document preference sets (Capybara, Tulu's HelpSteer
#   part), the prompt median 2.7x the completion median: prompt 64 (sigma 0.6), completions 24
#   (sigma 0.6), max_length 192;
# - short_prompt: HH-RLHF-like, a short human turn and longer answers: prompt 12 (sigma 0.8),
#   completions 32 (sigma 0.7), max_length 128.
MIXES = {
    "long_prompt": Lengths(prompt_median=64, prompt_sigma=0.6, completion_median=24, completion_sigma=0.6, minimum=4,
                           max_length=192),
    "short_prompt": Lengths(prompt_median=12, prompt_sigma=0.8, completion_median=32, completion_sigma=0.7,
                            minimum=4, max_length=128),
}
TINY_MIXES = {
    "long_prompt": Lengths(prompt_median=12, prompt_sigma=0.5, completion_median=4, completion_sigma=0.5, minimum=2,
                           max_length=32),
    "short_prompt": Lengths(prompt_median=3, prompt_sigma=0.5, completion_median=8, completion_sigma=0.5, minimum=2,
                            max_length=32),
}


def forward_flops(rows, *, shape: common.LlamaShape) -> dict:
    """Multiply-add FLOPs (x2) of one forward over `rows` (the engine's microbatches): the
    linear layers over every position (padding too), and attention (QK^T and AV) over every
    W x W position pair (`masked`, the CPU's local attention) or over the pairs the mask allows
    (`allowed`, what a kernel that follows the row's structure computes)."""
    from mcore_dpo.model.builder import segment_mask

    h, heads, kv = shape.hidden_size, shape.num_heads, shape.num_kv_heads
    head_dim = h // heads
    per_token_linear = shape.num_layers * 2 * (h * (heads + 2 * kv) * head_dim + h * h + 3 * h * shape.intermediate_size)
    per_token_linear += 2 * h * shape.vocab_size  # output layer
    positions = sum(mb.tokens.numel() for mb in rows)
    masked = sum(mb.tokens.shape[0] * mb.tokens.shape[1] ** 2 for mb in rows)
    allowed = 0
    for mb in rows:
        if mb.segment_ids is None:  # padded rows: each sequence's own causal triangle (pad id 0 is no word)
            allowed += sum(int(n) * (int(n) + 1) // 2 for n in (mb.tokens != 0).sum(-1))
            continue
        blocked = segment_mask(mb.segment_ids, shared_prompt=mb.shared_prompt, num_sequences=mb.num_sequences)
        real = mb.segment_ids < mb.num_sequences
        allowed += int((~blocked[:, 0] & real[:, :, None] & real[:, None, :]).sum())
    attention = lambda pairs: shape.num_layers * 2 * 2 * pairs * h  # noqa: E731
    return {"positions": positions, "linear": positions * per_token_linear,
            "masked": positions * per_token_linear + attention(masked),
            "allowed": positions * per_token_linear + attention(allowed)}


def layout_rows(pairs, *, mode: str, micro_batch_size: int, max_tokens: int):
    from mcore_dpo.data.microbatches import RowLayout

    rows = RowLayout(packing=mode.startswith("packed"), prefix_sharing=mode.endswith("shared"), pad_token_id=0,
                     multiple=8, max_tokens=max_tokens)
    if rows.packing:
        groups = rows.plan_step(pairs, dp=1)[0]
    else:
        groups = [list(range(k, min(k + micro_batch_size, len(pairs)))) for k in range(0, len(pairs), micro_batch_size)]
    return rows.microbatches(pairs, groups)


def _config(mode: str, *, model: Path, gbs: int, mbs: int, max_length: int, steps: int) -> dict:
    config = dict(model=str(model), tp=1, pp=2, dp=1, micro_batch_size=mbs, global_batch_size=gbs,
                  max_steps=steps + 1, max_length=max_length, lr=1e-5, ref_mode="interleaved",
                  prefix_sharing=mode.endswith("shared"))
    if mode.startswith("packed"):
        config.update(packing=True, max_tokens_per_microbatch=2 * mbs * max_length)
    else:
        config.update(packing=False)
    return config


def measured_mix(*, shape, lengths: Lengths, gbs: int, mbs: int, steps: int, rounds: int, work_dir: Path,
                 modes=MODES) -> dict:
    model = common.write_random_llama(work_dir / "model", shape=shape)
    drawn = draw_lengths(gbs * (steps + 2), lengths=lengths, seed=11)
    raw: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(rounds):  # the modes take turns
        for mode in modes:
            job = {"config": _config(mode, model=model, gbs=gbs, mbs=mbs, max_length=lengths.max_length, steps=steps),
                   "lengths": drawn, "vocab_size": shape.vocab_size, "num_steps": steps, "warmup_steps": 1}
            raw[mode].append(run_job(job, out_dir=work_dir / "ranks"))
    pairs = make_pairs(drawn, vocab_size=shape.vocab_size, seed=7)
    measured_batches = [pairs[k * gbs:(k + 1) * gbs] for k in range(1, steps + 1)]
    prompts = sorted(p for p, _, _ in drawn)
    completions = sorted(c for _, c, r in drawn for c in (c, r))
    out = {"lengths": lengths.__dict__, "prompt_median": statistics.median(prompts),
           "completion_median": statistics.median(completions), "modes": {}}
    for mode in modes:
        steps_all, rss, round_medians, cpu = [], [], [], []
        for ranks in raw[mode]:
            rep = next(r for r in ranks if r["reports"])
            steps_all.extend(rep["steps"])
            round_medians.append(statistics.median(s["step_time_s"] for s in rep["steps"]))
            rss.append(max(r["peak_rss_bytes"] for r in ranks))
            # CPU seconds of a step over both ranks: the work, far less sensitive than wall time
            # to other processes on a shared box.
            cpu.extend(sum(steps) for steps in zip(*([row["cpu_s"] for row in r["rank_steps"]] for r in ranks)))
        flops = [forward_flops(layout_rows(b, mode=mode, micro_batch_size=mbs, max_tokens=2 * mbs * lengths.max_length),
                               shape=shape) for b in measured_batches]
        out["modes"][mode] = {
            "step_time_s": common.summary([s["step_time_s"] for s in steps_all]),
            "cpu_s_per_step": common.summary(cpu),
            "round_median_step_time_s": round_medians,
            "real_tokens_per_s": common.summary([s["tokens/real"] / s["step_time_s"] for s in steps_all]),
            "token_positions": common.summary([s["tokens/padded"] for s in steps_all]),
            "tokens_real": common.summary([s["tokens/real"] for s in steps_all]),
            "microbatches": common.summary([s["microbatches"] for s in steps_all]),
            "peak_rss_bytes": common.summary(rss),
            "positions_counted": sum(f["positions"] for f in flops),
            "flops_masked": sum(f["masked"] for f in flops),
            "flops_allowed": sum(f["allowed"] for f in flops),
        }
    m = out["modes"]
    out["ratios"] = {}
    for shared, base in (("packed_shared", "packed"), ("padded_shared", "padded"), ("packed_shared", "padded")):
        if shared in m and base in m:
            a, b = m[base], m[shared]
            out["ratios"][f"{shared}/{base}"] = {
                "real_tokens_per_s": b["real_tokens_per_s"]["median"] / a["real_tokens_per_s"]["median"],
                "cpu_s": a["cpu_s_per_step"]["median"] / b["cpu_s_per_step"]["median"],
                "per_round_speed": common.summary([x / y for x, y in zip(a["round_median_step_time_s"],
                                                                         b["round_median_step_time_s"])]),
                "positions": a["positions_counted"] / b["positions_counted"],
                "flops_masked": a["flops_masked"] / b["flops_masked"],
                "flops_allowed": a["flops_allowed"] / b["flops_allowed"],
                "peak_rss": b["peak_rss_bytes"]["median"] / a["peak_rss_bytes"]["median"],
            }
    return out


def default_job(*, rounds: int, steps: int, work_dir: Path) -> dict:
    """The default job with --prefix-sharing ("on") and without ("off"), taking turns (module docstring)."""
    from benchmarks.engine_regression import run_default_job

    tree, cache = common.REPO_ROOT, work_dir / "cache"
    work_dir.mkdir(parents=True, exist_ok=True)
    args = {"off": (), "on": ("--prefix-sharing",)}
    run_default_job(tree, steps=2, out_dir=work_dir / "warm", cache_dir=cache)  # builds the default model; not timed
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    loads = []
    for r in range(rounds):
        for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
            runs[name].append(run_default_job(tree, steps=steps, out_dir=work_dir / f"run-{name}-{r}", cache_dir=cache,
                                              extra_args=args[name]))
        loads.append(os.getloadavg()[0])
        off, on = (statistics.median(runs[n][-1]["tokens_per_s"]) for n in ("off", "on"))
        print(f"round {r}: off {off:,.0f} tokens/s, on {on:,.0f} tokens/s, ratio {on / off:.3f}, load {loads[-1]:.1f}",
              flush=True)
    out: dict = {"job": f"python -m mcore_dpo.train --max-steps {steps} [--prefix-sharing]", "rounds": rounds,
                 "steps": steps, "loadavg_1min_per_round": loads}
    for name in ("off", "on"):
        out[name] = {"tokens_per_s": common.summary([t for run in runs[name] for t in run["tokens_per_s"]]),
                     "step_time_s": common.summary([t for run in runs[name] for t in run["step_time_s"]]),
                     "wall_s": common.summary([run["wall_s"] for run in runs[name]]),
                     "token_positions_per_step": common.summary([t for run in runs[name] for t in run["tokens_padded"]])}
    out["step_paired_speed_on_over_off"] = common.summary(
        [t_off / t_on for a, b in zip(runs["on"], runs["off"]) for t_on, t_off in zip(a["step_time_s"], b["step_time_s"])])
    out["round_tokens_per_s_on_over_off"] = common.summary(
        [statistics.median(a["tokens_per_s"]) / statistics.median(b["tokens_per_s"]) for a, b in zip(runs["on"], runs["off"])])
    out["wall_off_over_on"] = common.summary([b["wall_s"] / a["wall_s"] for a, b in zip(runs["on"], runs["off"])])
    out["positions_off_over_on"] = (sum(t for run in runs["off"] for t in run["tokens_padded"])
                                    / sum(t for run in runs["on"] for t in run["tokens_padded"]))
    out["raw"] = runs
    print(f"default job, {rounds} rounds taking turns ({out['job']}):")
    for name in ("off", "on"):
        e = out[name]
        print(f"  {name:3s}: {common.fmt(e['tokens_per_s'], digits=0)} tokens/s, step {common.fmt(e['step_time_s'])} s, "
              f"run {common.fmt(e['wall_s'], digits=1)} s, positions/step {e['token_positions_per_step']['median']:.0f}")
    print(f"  speed on/off, step by step on the same batch: {common.fmt(out['step_paired_speed_on_over_off'])}; "
          f"per round (tokens/s): {common.fmt(out['round_tokens_per_s_on_over_off'])}; "
          f"whole run: {common.fmt(out['wall_off_over_on'])}; positions off/on x{out['positions_off_over_on']:.3f}")
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/mcore_dpo_bench/prefix_sharing.json")
    parser.add_argument("--tiny", action="store_true", help="smoke size: tiny model, short sequences")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per mode and round (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each launches every mode afresh")
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=1, help="pairs per padded microbatch")
    parser.add_argument("--mixes", default=",".join(MIXES), help=f"comma-separated subset of {','.join(MIXES)}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--default-job", action="store_true",
                        help="the default job with and without --prefix-sharing, taking turns (--rounds, --steps)")
    args = parser.parse_args(argv)
    if args.default_job:
        work = Path(args.work_dir or tempfile.mkdtemp(prefix="mcore_dpo_prefix_sharing_default_"))
        result = {"machine": common.machine(), "loadavg_1min_before": os.getloadavg()[0],
                  "default_job": default_job(rounds=args.rounds, steps=args.steps, work_dir=work)}
        result["loadavg_1min_after"] = os.getloadavg()[0]
        common.write_json(args.out, result)
        return result
    mixes = [m for m in args.mixes.split(",") if m]
    modes = tuple(m for m in args.modes.split(",") if m)
    if not mixes or any(m not in MIXES for m in mixes):
        parser.error(f"--mixes: expected a comma-separated subset of {','.join(MIXES)}, got {args.mixes!r}")
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes: expected a comma-separated subset of {','.join(MODES)}, got {args.modes!r}")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mcore_dpo_prefix_sharing_"))
    shape = common.TINY_SHAPE if args.tiny else SHAPES["balanced"]
    result = {"machine": common.machine(), "loadavg_1min_before": os.getloadavg()[0], "mixes": {}}
    for mix in mixes:
        lengths = (TINY_MIXES if args.tiny else MIXES)[mix]
        result["mixes"][mix] = r = measured_mix(shape=shape, lengths=lengths, gbs=args.global_batch_size,
                                                mbs=args.micro_batch_size, steps=args.steps,
                                                rounds=1 if args.tiny else args.rounds, work_dir=work / mix, modes=modes)
        print(f"{mix}: prompt median {r['prompt_median']}, completion median {r['completion_median']} tokens")
        for mode, e in r["modes"].items():
            print(f"  {mode:<14} positions/step {e['token_positions']['median']:.0f}  real tokens/s "
                  f"{common.fmt(e['real_tokens_per_s'], digits=0)}  step {common.fmt(e['step_time_s'])} s  "
                  f"cpu {e['cpu_s_per_step']['median']:.2f} s/step  "
                  f"fwd GFLOPs (masked) {e['flops_masked'] / 1e9:.2f}  peak RSS {e['peak_rss_bytes']['median'] / 2**20:.0f} MiB")
        for name, q in r["ratios"].items():
            print(f"  {name}: real tokens/s x{q['real_tokens_per_s']:.3f}, CPU s/step x{q['cpu_s']:.3f} (per round "
                  f"{common.fmt(q['per_round_speed'], digits=3)}); counted: positions x{q['positions']:.3f}, "
                  f"FLOPs x{q['flops_masked']:.3f} masked, x{q['flops_allowed']:.3f} allowed; peak RSS x{q['peak_rss']:.3f}")
    result["loadavg_1min_after"] = os.getloadavg()[0]
    common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
