"""Benchmark 3: tokens/s of this engine against TRL's DPOTrainer on the same CPU.

Same random Llama, same pairs (fixed length, so neither side pads), same global batch and
microbatch size, fp32, one torch thread each, tp = pp = dp = 1. Each side runs in its own
fresh process, and the two take turns over rounds. Tokens/s = (prompt twice + both
completions) / optimizer-step wall time; the first step of each run is warm-up and excluded.
- this engine: `step_time_s` from `PolicyWorker.train_step`, reference mode interleaved
  (at pp 1 there is no bubble to fill, so the reference forward is simply added).
- TRL: time between consecutive `on_step_end` callbacks, reference forward per batch (its
  default); gradient checkpointing off (TRL's DPOConfig turns it on by default; this engine
  does not recompute), so both sides do the same arithmetic.

TRL is NOT a dependency of the project. Install it for this benchmark only:

    pip install --dry-run trl   # check first: it must not change torch or transformers
    pip install trl             # TRL 1.16.0 adds only trl and accelerate here
    python benchmarks/vs_trl.py             # ~3 min on 2 cores
    python benchmarks/vs_trl.py --tiny --steps 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

SHAPE = common.SMALL_SHAPE  # the model of benchmark 1, last-heavy split
SPECIAL = {0: "<pad>", 1: "<s>", 2: "</s>"}


def _word(token_id: int) -> str:
    return SPECIAL.get(token_id, f"w{token_id}")


def write_tokenizer(directory: Path, *, vocab_size: int) -> None:
    """A word-level tokenizer where token id i is the word `w{i}`: texts round-trip to
    exactly the ids the engine side uses."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {_word(i): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(directory))


def trl_run(*, model_dir: str, data: dict, micro_batch_size: int, global_batch_size: int, num_steps: int,
            precompute: bool) -> dict:
    """One TRL DPOTrainer run in this process; returns optimizer-step wall times (s)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(1)
    pairs = common.make_pairs(**data)
    rows = [{"prompt": " ".join(_word(i) for i in p.prompt_ids),
             "chosen": " " + " ".join(_word(i) for i in p.chosen_ids),
             "rejected": " " + " ".join(_word(i) for i in p.rejected_ids)} for p in pairs]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    step_ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(
            output_dir=out, per_device_train_batch_size=micro_batch_size,
            gradient_accumulation_steps=global_batch_size // micro_batch_size, max_steps=num_steps + 1,
            learning_rate=1e-5, lr_scheduler_type="constant", warmup_steps=0, logging_steps=10**6,
            save_strategy="no", report_to="none", use_cpu=True, dataloader_num_workers=0,
            dataloader_pin_memory=False, gradient_checkpointing=False, max_length=10**6, beta=0.1,
            loss_type=["sigmoid"], precompute_ref_log_probs=precompute, pad_to_multiple_of=None,
            bf16=False, seed=1,
        )  # fmt: skip
        trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=tokenizer, callbacks=[StepClock()])
        trainer.train()
    times = [b - a for a, b in zip(step_ends, step_ends[1:])]  # step 1 (and set-up) excluded
    tokens = common.pair_tokens(pairs[:global_batch_size])  # every batch has the same length
    return {"step_time_s": times, "tokens_per_step": tokens}


def run(*, shape: common.LlamaShape, seq_len: int, micro_batch_size: int, global_batch_size: int,
        num_steps: int, rounds: int, work_dir: Path, precomputed_too: bool) -> dict:
    model_dir = common.write_random_llama(work_dir / "model", shape=shape)
    write_tokenizer(model_dir, vocab_size=shape.vocab_size)
    prompt_len = seq_len // 4
    data = dict(num_pairs=global_batch_size * (num_steps + 2), prompt_len=prompt_len,
                completion_len=seq_len - prompt_len, vocab_size=shape.vocab_size, seed=11)
    ours_modes = ("interleaved", "precomputed") if precomputed_too else ("interleaved",)
    jobs = [common.RankJob(name=mode, config=dict(
        model=str(model_dir), tp=1, pp=1, dp=1, micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size, max_steps=num_steps + 1, max_length=seq_len, ref_mode=mode, lr=1e-5,
        packing=False),
        num_steps=num_steps, warmup_steps=1, precompute_pairs=data["num_pairs"] if mode == "precomputed" else 0)
        for mode in ours_modes]  # fmt: skip
    out = {"shape": shape.__dict__, "seq_len": seq_len, "micro_batch_size": micro_batch_size,
           "global_batch_size": global_batch_size, "rounds": rounds, "steps_per_round": num_steps, "pairs": {}}
    ours: dict[str, list[float]] = {mode: [] for mode in ours_modes}
    theirs: dict[str, list[float]] = {mode: [] for mode in ours_modes}
    for round_index in range(rounds):  # the two engines take turns (the box may be shared)
        results = common.run_ranks(world_size=1, jobs=jobs, data=data, out_dir=work_dir / f"ranks{round_index}")
        for index, mode in enumerate(ours_modes):
            rep = common.reporting(results, index)
            ours[mode].extend(t / s for t, s in zip(rep["tokens_per_step"], rep["step_time_s"]))
            code = (
                "import json; from benchmarks.vs_trl import trl_run; "
                f"print(json.dumps(trl_run(model_dir={str(model_dir)!r}, data={data!r}, "
                f"micro_batch_size={micro_batch_size}, global_batch_size={global_batch_size}, "
                f"num_steps={num_steps}, precompute={mode == 'precomputed'})))"
            )
            trl = common.run_python(code)
            theirs[mode].extend(trl["tokens_per_step"] / s for s in trl["step_time_s"])
    for mode in ours_modes:
        mine, other = common.summary(ours[mode]), common.summary(theirs[mode])
        out["pairs"][mode] = {
            "ours_tokens_per_s": mine,
            "trl_tokens_per_s": other,
            "trl_reference": "precompute_ref_log_probs=True" if mode == "precomputed" else "per batch (default)",
            "ratio": mine["median"] / other["median"],
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/mcore_dpo_bench/vs_trl.json")
    parser.add_argument("--steps", type=int, default=3, help="measured optimizer steps per round (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; each runs both engines afresh")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--no-precomputed", action="store_true", help="skip the precomputed-reference pair")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args(argv)
    try:
        import trl
    except ImportError:
        raise SystemExit("vs_trl: TRL is not installed; `pip install trl` (benchmark only, see the module docstring)")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mcore_dpo_vs_trl_"))
    result = run(shape=common.TINY_SHAPE if args.tiny else SHAPE, seq_len=16 if args.tiny else args.seq_len,
                 micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                 num_steps=args.steps, rounds=1 if args.tiny else args.rounds, work_dir=work, precomputed_too=not args.no_precomputed)
    result["machine"] = common.machine()
    result["trl_version"] = trl.__version__
    for mode, pair in result["pairs"].items():
        print(f"{mode:<12} ours {common.fmt(pair['ours_tokens_per_s'], digits=0)} tokens/s, "
              f"TRL ({pair['trl_reference']}) {common.fmt(pair['trl_tokens_per_s'], digits=0)} tokens/s, "
              f"ratio {pair['ratio']:.2f}")
    common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
