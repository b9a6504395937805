"""Benchmark 18: the data path at scale: the token store (mcore_dpo/data/store.py) against data size,
and the train command's time to step 1 and driver memory against data size.

Realistic text, made here (no downloads): prompts of about 800 characters (a request and a chunk
of Python-like code) and completions of about 600 (prose about the code, with identifiers and
code lines), tokenized by a byte-level BPE of 32,000 tokens trained locally with the `tokenizers`
library on the same kind of text (cached in the work directory, as are the data files). For each
size (1k, 10k, 30k pairs by default; the issue's full run adds 100k), each measurement in a fresh
interpreter:
- `cold`: open_or_build on an empty cache, at 1 worker and at N (--workers): wall time, pairs/s,
  the process's peak RSS and its growth over the process before the build (the workers'
  memory is their own);
- `warm`: open_or_build again in a new process (a hit: the data file and tokenizer hashed, the
  store checked and mapped), then every pair read once: open time, read time, RSS growth;
- `encode`: one plain batched encode of the same texts (prompt, prompt + chosen + EOS, prompt +
  rejected + EOS, as load_pairs builds them), `tokenizer(texts)` once, timed alone, with the
  tokenizers library's own thread pool off (TOKENIZERS_PARALLELISM=false, as the trainer's
  ranks run) and on (its default: every core);
- `load_pairs`: today's single-process path, up to --load-pairs-max pairs (it is slow);
- `e2e` (on unless --no-e2e): `python -m mcore_dpo.train` in a subprocess on a tiny Llama whose
  vocabulary is the 32k BPE (hidden 64, 2 layers, 4 heads, made in the work directory), with
  `--data FILE --max-length 512 --max-steps 1 --global-batch-size 8 --micro-batch-size 2
  --no-export-hf`, a fresh --output-dir per run and MCORE_DPO_CACHE in the work directory;
  `--data-workers N` (N = --workers) is passed only where the command has that flag (its
  `--help` says). `cold`: MCORE_DPO_CACHE/data deleted first; `warm`: the same command again.
  Per run: the wall time from the start of the subprocess until its metrics.jsonl holds step 1
  (polled), the total wall time, and the driver's peak RSS (VmHWM of the subprocess itself,
  read from /proc every 0.2 s until it exits; Ray's workers are other processes). The median
  of --e2e-repeats runs per (size, cold/warm).

    python benchmarks/data_scale.py                                  # 1k, 10k, 30k; N = 2
    python benchmarks/data_scale.py --sizes 1000 10000 30000 100000 --e2e-repeats 3   # the issue's run
    python benchmarks/data_scale.py --e2e-only --e2e-modes cold      # only the train command, cold
    python benchmarks/data_scale.py --tiny                           # smoke size: 200 pairs, e2e once

Prints markdown tables (the store's, the train command's) and writes every figure to --out
(JSON) and a plot of the train command's figures to --plot (PNG: time to step 1, cold and warm,
and the driver's peak RSS against pairs; default docs/img/data_scale.png, or WORK_DIR/data_scale.png
with --tiny or where docs/img does not exist).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

VOCAB_SIZE = 32_000
PROMPT_CHARS, COMPLETION_CHARS = 800, 600
TOKENIZER_CORPUS_DOCS = 6_000  # about 12 MB of text to train the BPE on
MAX_LENGTH = 512


# ----------------------------------------------------------------------------- text


class TextMaker:
    """Python-like code and prose about it, from a fixed seed: a Zipf-like draw of made-up words
    (so a BPE learns sub-words, not a closed list) and of code keywords and layouts."""

    KEYWORDS = ("def", "return", "if", "else", "for", "in", "while", "import", "from", "class", "self", "None",
                "True", "False", "and", "or", "not", "with", "as", "try", "except", "raise", "lambda", "yield")
    SYLLABLES = tuple(c + v for c in "bcdfghklmnprstvwz" for v in "aeiou") + (
        "ing", "ment", "tion", "er", "ed", "ost", "ex", "con", "pre", "tra", "ul", "an", "in", "str", "sch", "th")
    NUM_WORDS = 60_000

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        words_rng = random.Random(1234)  # one vocabulary for every seed: the tokenizer's and the data's
        words = {"".join(words_rng.choice(self.SYLLABLES) for _ in range(words_rng.randint(1, 4)))
                 for _ in range(self.NUM_WORDS)}
        self.words = sorted(words)
        words_rng.shuffle(self.words)
        self.cum_weights = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(self.words))))

    def word(self) -> str:
        return self.rng.choices(self.words, cum_weights=self.cum_weights)[0]

    def name(self) -> str:
        parts = [self.word() for _ in range(self.rng.randint(1, 3))]
        if self.rng.random() < 0.3:  # camelCase
            return parts[0] + "".join(part.capitalize() for part in parts[1:])
        return "_".join(parts) + (str(self.rng.randint(0, 99)) if self.rng.random() < 0.15 else "")

    def code(self, num_chars: int) -> str:
        lines, size, indent = [], 0, 0
        while size < num_chars:
            r = self.rng.random()
            pad = "    " * indent
            if r < 0.12 or indent == 0:
                line = f"{pad}def {self.name()}({', '.join(self.name() for _ in range(self.rng.randint(0, 3)))}):"
                indent = min(indent + 1, 3)
            elif r < 0.3:
                line = f"{pad}{self.name()} = {self.name()}({self.name()}, {self.rng.randint(0, 999)})"
            elif r < 0.42:
                line = f"{pad}if {self.name()} {self.rng.choice(('>', '<', '==', '!=', 'is', 'in'))} {self.name()}:"
                indent = min(indent + 1, 3)
            elif r < 0.52:
                line = f"{pad}for {self.name()} in range(len({self.name()})):"
                indent = min(indent + 1, 3)
            elif r < 0.62:
                line = f"{pad}# {' '.join(self.word() for _ in range(self.rng.randint(3, 9)))}"
            elif r < 0.74:
                line = f"{pad}return {self.name()}.{self.name()}({self.rng.choice(self.KEYWORDS)})"
                indent = max(indent - 1, 0)
            else:
                target, scale, source = f"{self.name()}.{self.name()}", self.rng.random(), self.name()
                line = f"{pad}{target} += {scale:.3f} * {source}[{self.rng.randint(0, 64)}]"
            lines.append(line)
            size += len(line) + 1
        return "\n".join(lines)

    def prose(self, num_chars: int) -> str:
        parts, size = [], 0
        while size < num_chars:
            words = [self.word() for _ in range(self.rng.randint(6, 18))]
            if self.rng.random() < 0.3:
                words.insert(self.rng.randrange(len(words)), f"`{self.name()}()`")
            sentence = " ".join(words).capitalize() + self.rng.choice((".", ".", ".", "?", ":"))
            if self.rng.random() < 0.15:
                sentence += "\n\n    " + self.code(120).replace("\n", "\n    ") + "\n\n"
            parts.append(sentence)
            size += len(sentence) + 1
        return " ".join(parts)

    def pair(self) -> dict:
        request = self.rng.choice(("Explain what this code does", "Find the bug in this function",
                                   "Rewrite this to be faster", "Add error handling here"))
        prompt = f"{request}:\n\n```python\n{self.code(PROMPT_CHARS - 60)}\n```\n"
        return {"prompt": prompt, "chosen": self.prose(COMPLETION_CHARS), "rejected": self.prose(COMPLETION_CHARS)}


# ----------------------------------------------------------------------------- tokenizer and data


def ensure_tokenizer(work: Path) -> Path:
    """The 32k byte-level BPE, trained once on generated text and saved as a Hugging Face tokenizer."""
    directory = work / "tokenizer"
    if (directory / "tokenizer.json").exists():
        return directory
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    maker = TextMaker(seed=7)
    corpus = [text for _ in range(TOKENIZER_CORPUS_DOCS) for text in maker.pair().values()]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<pad>", "<s>", "</s>"], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    started = time.monotonic()
    backend.train_from_iterator(corpus, trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.save_pretrained(str(directory))
    print(f"trained the {len(tokenizer)}-token BPE in {time.monotonic() - started:.0f} s -> {directory}", flush=True)
    return directory


def ensure_data(work: Path, num_pairs: int) -> Path:
    """num_pairs rows of JSONL; every size is the start of the same sequence of pairs."""
    path = work / f"pairs_{num_pairs}.jsonl"
    if not path.exists():
        maker = TextMaker(seed=2026)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as handle:
            for _ in range(num_pairs):
                handle.write(json.dumps(maker.pair()) + "\n")
        tmp.rename(path)
    return path


# ----------------------------------------------------------------------------- one measurement, in a child


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def child(mode: str, args: dict) -> dict:
    """One measurement in this (fresh) interpreter; returns its figures."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args["tokenizer"])
    rss_before = _status_bytes("VmRSS")
    out: dict = {"mode": mode, "rss_before": rss_before}
    if mode in ("cold", "warm"):
        from mcore_dpo.data.store import open_or_build

        started = time.perf_counter()
        store = open_or_build([args["data"]], tokenizer_dir=args["tokenizer"], tokenizer=tokenizer,
                              max_length=MAX_LENGTH, workers=args.get("workers"), cache_dir=args["cache"],
                              log=lambda line: None, progress_bar=False)
        out["open_s"] = time.perf_counter() - started
        out["built"] = store.built
        out["pairs"] = len(store)
        out["tokens"] = store.num_tokens
        out["rss_after_open"] = _status_bytes("VmRSS")
        if mode == "warm":
            started = time.perf_counter()
            total = sum(len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids) for p in store)
            out["read_all_s"] = time.perf_counter() - started
            out["read_tokens"] = total
        out["store_bytes"] = sum(f.stat().st_size for f in Path(store.path).iterdir())
    elif mode == "encode":
        texts = []
        with open(args["data"], encoding="utf-8") as handle:
            for line in handle:
                row = json.loads(line)
                texts.append(row["prompt"])
                texts.extend(row["prompt"] + row[key] + tokenizer.eos_token for key in ("chosen", "rejected"))
        started = time.perf_counter()
        ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
        out["open_s"] = time.perf_counter() - started
        out["pairs"] = len(texts) // 3
        out["tokens"] = sum(len(x) for x in ids)
    elif mode == "load_pairs":
        from mcore_dpo.data.pairs import load_pairs

        started = time.perf_counter()
        pairs, _ = load_pairs(args["data"], tokenizer=tokenizer, max_length=MAX_LENGTH)
        out["open_s"] = time.perf_counter() - started
        out["pairs"] = len(pairs)
        out["rss_after_open"] = _status_bytes("VmRSS")
    out["rss_peak"] = _status_bytes("VmHWM")
    return out


def run_child(mode: str, args: dict, *, env: dict | None = None) -> dict:
    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    environment.pop("TOKENIZERS_PARALLELISM", None)  # unset, as in the train command's driver, unless `env` sets it
    environment.update(env or {})
    done = subprocess.run([sys.executable, __file__, "--child", mode, json.dumps(args)], capture_output=True,
                          text=True, env=environment)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} failed: {done.stderr.strip()[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["load_1min"] = os.getloadavg()[0]
    return result


# ----------------------------------------------------------------------------- the train command, end to end


E2E_MODEL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
E2E_FLAGS = ["--max-length", str(MAX_LENGTH), "--max-steps", "1", "--global-batch-size", "8",
             "--micro-batch-size", "2", "--no-export-hf"]
POLL_S = 0.2
E2E_TIMEOUT_S = 3600.0


def ensure_model(work: Path, tokenizer_dir: str) -> Path:
    """A tiny Llama whose vocabulary is the benchmark's BPE, saved as an HF directory (safetensors)
    with that tokenizer."""
    directory = work / "model"
    if (directory / "model.safetensors").exists() and (directory / "tokenizer.json").exists():
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    assert tokenizer.eos_token is not None and tokenizer.pad_token is not None, "the BPE has no eos or pad token"
    assert len(tokenizer) <= VOCAB_SIZE, len(tokenizer)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, max_position_embeddings=MAX_LENGTH, rms_norm_eps=1e-5,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **E2E_MODEL)
    LlamaForCausalLM(config).save_pretrained(str(directory), safe_serialization=True)
    tokenizer.save_pretrained(str(directory))
    return directory


def train_data_flags(workers: int) -> list[str]:
    """The data-path flags the train command has today: `--data-workers N` only where its --help
    lists it (before the token store is wired into the driver it tokenizes in the driver)."""
    done = subprocess.run([sys.executable, "-m", "mcore_dpo.train", "--help"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), cwd=str(REPO_ROOT), check=True)
    return ["--data-workers", str(workers)] if "--data-workers" in done.stdout.split() else []


def _vm_hwm(pid: int) -> int:
    """The process's peak RSS in bytes (VmHWM), 0 once it is gone (or a zombie, which has none)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _reached_step(metrics: Path, step: int) -> bool:
    if not metrics.exists():
        return False
    for line in metrics.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) >= step:
                return True
        except json.JSONDecodeError:  # a line being written
            pass
    return False


def run_train(model: Path, data: str, out_dir: Path, cache: Path, data_flags: list[str]) -> dict:
    """One `python -m mcore_dpo.train` run: the time until metrics.jsonl holds step 1, the total
    time, and the driver's peak RSS (the last VmHWM read, every POLL_S until it exits)."""
    command = [sys.executable, "-m", "mcore_dpo.train", "--model", str(model), "--data", data, *E2E_FLAGS,
               *data_flags, "--output-dir", str(out_dir)]
    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT), MCORE_DPO_CACHE=str(cache))
    environment.pop("TOKENIZERS_PARALLELISM", None)  # the driver's default, as a user runs it
    log = out_dir.with_name(out_dir.name + ".log")  # beside the output directory, which starts empty
    metrics = out_dir / "metrics.jsonl"
    step1_s, peak = None, 0
    with open(log, "w") as handle:
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=environment,
                                   cwd=str(REPO_ROOT))
        while process.poll() is None:
            peak = _vm_hwm(process.pid) or peak
            if step1_s is None and _reached_step(metrics, 1):
                step1_s = time.perf_counter() - started
            if time.perf_counter() - started > E2E_TIMEOUT_S:
                process.kill()
                process.wait()
                raise RuntimeError(f"the train command ran past {E2E_TIMEOUT_S:.0f} s; its log: {log}")
            time.sleep(POLL_S)
        total_s = time.perf_counter() - started
    if step1_s is None and _reached_step(metrics, 1):  # step 1 written in the last poll interval
        step1_s = total_s
    if process.returncode != 0 or step1_s is None:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"the train command exited {process.returncode} (step 1 reached: {step1_s is not None}):"
                           f"\n{tail}")
    return {"step1_s": step1_s, "total_s": total_s, "driver_peak_rss": peak, "step_reached": 1,
            "load_1min": os.getloadavg()[0], "command": command}


def e2e(work: Path, model: Path, data: str, size: int, *, modes: list[str], repeats: int,
        data_flags: list[str]) -> dict:
    """Every (cold, warm) run of one size, `repeats` times each, and their medians."""
    cache = work / "train_cache"
    runs: dict = {mode: [] for mode in modes}
    for repeat in range(repeats):
        for mode in modes:
            if mode == "cold":
                shutil.rmtree(cache / "data", ignore_errors=True)
            out_dir = work / "runs" / f"{size}_{mode}_{repeat}_{time.time_ns()}"
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            runs[mode].append(run_train(model, data, out_dir, cache, data_flags))
            print(f"  e2e {size} pairs {mode} #{repeat + 1}: step 1 at {runs[mode][-1]['step1_s']:.1f} s, "
                  f"driver peak RSS {runs[mode][-1]['driver_peak_rss'] / 2 ** 20:.0f} MB", flush=True)
    out: dict = {}
    for mode, samples in runs.items():
        out[mode] = {key: statistics.median(run[key] for run in samples)
                     for key in ("step1_s", "total_s", "driver_peak_rss")}
        out[mode]["runs"] = samples
    return out


def plot_e2e(results: dict, path: Path) -> None:
    """Time to step 1 (cold, warm) and the driver's peak RSS against pairs, log x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(int(size) for size, f in results["sizes"].items() if "e2e" in f)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for mode, marker, offset in (("cold", "o", (4, 4)), ("warm", "s", (4, -11))):
        points = [(size, results["sizes"][str(size)]["e2e"][mode]) for size in sizes
                  if mode in results["sizes"][str(size)]["e2e"]]
        if not points:  # a mode not measured (--e2e-modes)
            continue
        for ax, values in ((left, [f["step1_s"] for _, f in points]),
                           (right, [f["driver_peak_rss"] / 2 ** 20 for _, f in points])):
            ax.plot([x for x, _ in points], values, marker=marker, label=mode)
            for (x, _), value in zip(points, values):
                ax.annotate(f"{value:.0f}", (x, value), textcoords="offset points", xytext=offset, fontsize=7)
    for ax, label in ((left, "time to step 1 (s)"), (right, "driver peak RSS (MB)")):
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(sizes, [f"{size:,}" for size in sizes])
        ax.set_xlabel("pairs")
        ax.set_title(label, fontsize=10)
        ax.set_ylim(0, 1.2 * max(max(line.get_ydata()) for line in ax.get_lines()))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"python -m mcore_dpo.train, tiny Llama, 32k BPE, --max-length {MAX_LENGTH}, one step "
                 f"(median of {results['e2e']['repeats']})", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- the table


def print_store_table(rows: list, workers: int) -> None:
    def rate(f: dict) -> str:
        return f"{f['pairs'] / f['open_s']:,.0f}"

    mib = 2 ** 20
    print("\n| pairs | tokens | file MB | cold, 1 worker, 1 thread: s (pairs/s) | cold, 1 worker: s (pairs/s) "
          f"| cold, {workers} workers: s (pairs/s) | one batched encode, 1 thread / all: s (pairs/s) "
          "| load_pairs s | warm open s | read every pair s | RSS growth MB: cold 1 / cold N / warm / load_pairs "
          "| peak RSS MB: cold N / warm | store MB | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for size, f in rows:
        cold_t, cold1, coldn, warm = f["cold_1_one_thread"], f["cold_1"], f[f"cold_{workers}"], f["warm"]
        e1, en = f["encode_one_thread"], f["encode_threads"]
        lp = f.get("load_pairs")
        growth = [f"{(x['rss_after_open'] - x['rss_before']) / mib:.0f}" for x in (cold1, coldn, warm)]
        growth.append(f"{(lp['rss_after_open'] - lp['rss_before']) / mib:.0f}" if lp else "-")
        load_pairs_s = f"{lp['open_s']:.1f}" if lp else "-"
        print(f"| {size:,} | {cold1['tokens'] / 1e6:.1f} M | {f['file_bytes'] / 1e6:.0f} "
              f"| {cold_t['open_s']:.1f} ({rate(cold_t)}) | {cold1['open_s']:.1f} ({rate(cold1)}) "
              f"| {coldn['open_s']:.1f} ({rate(coldn)}) "
              f"| {e1['open_s']:.1f} ({rate(e1)}) / {en['open_s']:.1f} ({rate(en)}) | {load_pairs_s} "
              f"| {warm['open_s']:.3f} | {warm['read_all_s']:.1f} | {' / '.join(growth)} "
              f"| {coldn['rss_peak'] / mib:.0f} / {warm['rss_peak'] / mib:.0f} | {warm['store_bytes'] / 1e6:.0f} "
              f"| {cold_t['load_1min']:.1f}-{f['encode_threads']['load_1min']:.1f} |")


def print_e2e_table(rows: list, repeats: int) -> None:
    def cell(f: dict, mode: str, key: str, fmt: str, scale: float = 1.0) -> str:
        return format(f[mode][key] / scale, fmt) if mode in f else "-"

    mib = 2 ** 20
    print(f"\nThe train command, one step (median of {repeats} runs):\n"
          "\n| pairs | cold: to step 1 s / total s | warm: to step 1 s / total s "
          "| driver peak RSS MB: cold / warm | load |")
    print("|---|---|---|---|---|")
    for size, f in rows:
        loads = [run["load_1min"] for mode in f.values() for run in mode["runs"]]
        print(f"| {size:,} | {cell(f, 'cold', 'step1_s', '.1f')} / {cell(f, 'cold', 'total_s', '.1f')} "
              f"| {cell(f, 'warm', 'step1_s', '.1f')} / {cell(f, 'warm', 'total_s', '.1f')} "
              f"| {cell(f, 'cold', 'driver_peak_rss', '.0f', mib)} / {cell(f, 'warm', 'driver_peak_rss', '.0f', mib)} "
              f"| {min(loads):.1f}-{max(loads):.1f} |")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000, 30_000])
    parser.add_argument("--workers", type=int, default=2,
                        help="N of the N-worker cold build, and the train command's --data-workers where it has it")
    parser.add_argument("--load-pairs-max", type=int, default=10_000, help="run load_pairs up to this many pairs")
    parser.add_argument("--work-dir", default="/tmp/mcore_dpo_data_scale")
    parser.add_argument("--out", default=None, help="JSON of every figure (default: WORK_DIR/data_scale.json)")
    parser.add_argument("--tiny", action="store_true", help="smoke size: 200 pairs, load_pairs included, e2e once")
    parser.add_argument("--e2e", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the train command end to end at each size (default: on; --no-e2e skips it)")
    parser.add_argument("--e2e-only", action="store_true",
                        help="only the train command's runs (no store, encode or load_pairs measurements)")
    parser.add_argument("--e2e-repeats", type=int, default=1, help="train command runs per (size, cold/warm); median")
    parser.add_argument("--e2e-modes", nargs="+", choices=("cold", "warm"), default=["cold", "warm"])
    parser.add_argument("--plot", default=None, help="PNG of the train command's figures (default: "
                        "docs/img/data_scale.png; WORK_DIR/data_scale.png with --tiny or without docs/img)")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "ARGS"), help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child:
        figures = child(options.child[0], json.loads(options.child[1]))
        print(json.dumps(figures))
        return figures
    if options.tiny:
        options.sizes, options.load_pairs_max, options.e2e_repeats = [200], 200, 1
    if options.e2e_only and not options.e2e:
        parser.error("--e2e-only and --no-e2e leave nothing to measure")

    work = Path(options.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = str(ensure_tokenizer(work))
    results: dict = {"machine": {"cpu_count": os.cpu_count(), "load_1min_start": os.getloadavg()[0]},
                     "max_length": MAX_LENGTH, "sizes": {}}
    if options.e2e:
        model = ensure_model(work, tokenizer)
        data_flags = train_data_flags(options.workers)
        results["e2e"] = {"model": {"vocab_size": VOCAB_SIZE, **E2E_MODEL}, "flags": E2E_FLAGS,
                          "data_flags": data_flags, "repeats": options.e2e_repeats, "modes": options.e2e_modes}
    rows, e2e_rows = [], []
    for size in options.sizes:
        data = str(ensure_data(work, size))
        figures: dict = {"file_bytes": os.path.getsize(data)}
        results["sizes"][str(size)] = figures
        if not options.e2e_only:
            # One worker with the tokenizers library's thread pool off (one core) and on (the driver's
            # default: its batches use every core), then N worker processes (their pools off).
            for name, workers, env in (("cold_1_one_thread", 1, {"TOKENIZERS_PARALLELISM": "false"}),
                                       ("cold_1", 1, {}), (f"cold_{options.workers}", options.workers, {})):
                cache = work / f"cache_{size}_{name}_{time.time_ns()}"
                figures[name] = run_child("cold", {"tokenizer": tokenizer, "data": data, "cache": str(cache),
                                                   "workers": workers}, env=env)
                assert figures[name]["built"], "a cold build found a store"
            figures["warm"] = run_child("warm", {"tokenizer": tokenizer, "data": data, "cache": str(cache)})
            assert not figures["warm"]["built"], "a warm open rebuilt"
            figures["encode_one_thread"] = run_child("encode", {"tokenizer": tokenizer, "data": data},
                                                     env={"TOKENIZERS_PARALLELISM": "false"})
            figures["encode_threads"] = run_child("encode", {"tokenizer": tokenizer, "data": data},
                                                  env={"TOKENIZERS_PARALLELISM": "true"})
            if size <= options.load_pairs_max:
                figures["load_pairs"] = run_child("load_pairs", {"tokenizer": tokenizer, "data": data})
            rows.append((size, figures))
        if options.e2e:
            figures["e2e"] = e2e(work, model, data, size, modes=options.e2e_modes, repeats=options.e2e_repeats,
                                 data_flags=data_flags)
            e2e_rows.append((size, figures["e2e"]))
        print(f"{size} pairs done (load {os.getloadavg()[0]:.1f})", flush=True)

    if rows:
        print_store_table(rows, options.workers)
    if e2e_rows:
        print_e2e_table(e2e_rows, options.e2e_repeats)
    out = Path(options.out) if options.out else work / "data_scale.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if e2e_rows:
        images = REPO_ROOT / "docs" / "img"
        default_plot = images / "data_scale.png" if images.is_dir() and not options.tiny else work / "data_scale.png"
        plot = Path(options.plot) if options.plot else default_plot
        plot_e2e(results, plot)
        results["e2e"]["plot"] = str(plot)
        print(f"wrote {plot}")
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nwrote {out}")
    return results

if __name__ == "__main__":
    main()
