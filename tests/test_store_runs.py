"""Training runs that read their data from the token store (mcore_dpo/data/store.py) through the
command line: the driver sends pair indices, not tokens; the precomputed reference lives on disk
with the run and is reused by a restart and a resume; a weighted mix of data files.

Every run here is the command line in this process on the session's Ray cluster
(tests/helpers/ray_runs.main_in_process), so the driver's calls to its worker groups can be
counted in this process.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import random
from pathlib import Path

import pytest

from mcore_dpo.driver import defaults
from tests.helpers.cli import train_input_error
from tests.helpers.faults import fault_env
from tests.helpers.ray_runs import main_in_process
from tests.helpers.token_store import prepare_run

TIMING = ("step_time_s", "tokens/s", "bubble_fraction", "eta_s", "elapsed_s", "time")
SMALL = ["--max-length", "160", "--global-batch-size", "4", "--micro-batch-size", "2", "--eval-interval", "0",
         "--no-export-hf"]


def _rows(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _steps(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: {k: v for k, v in row.items() if not any(t in k for t in TIMING) and not k.startswith("memory/")}
            for row in rows}


class _Sent:
    """Counts what the driver hands its worker groups: the pickled bytes of each call's arguments."""

    def __init__(self, monkeypatch):
        from mcore_dpo.driver import ray_workers

        self.calls: list[tuple[str, int]] = []
        submit = ray_workers.WorkerGroup.submit

        def counted(group, method, *args, **kwargs):
            self.calls.append((method, len(pickle.dumps((args, kwargs)))))
            return submit(group, method, *args, **kwargs)

        monkeypatch.setattr(ray_workers.WorkerGroup, "submit", counted)

    def of(self, method: str) -> list[int]:
        return [size for name, size in self.calls if name == method]


@pytest.mark.parametrize("mode", [["--ref-mode", "separate"], ["--packing", "--prefix-sharing"]],
                         ids=["separate-reference", "packed-shared-prompts"])
def test_the_driver_sends_pair_indices_whatever_the_length_of_the_pairs(tmp_path, ray_cluster, monkeypatch, mode):
    """The same pairs, once short and once with every text ten times as long: the driver's
    calls per step (train_step, the reference group's reference_logps, evaluate) pickle to about
    the same few hundred bytes; the ranks read the pairs from the store. The long run's tokens are
    really longer (tokens/real), so the ranks did read other rows."""
    rows = _rows(defaults.DEFAULT_TRAIN_DATA)[:64]
    long_rows = [{"prompt": r["prompt"], "chosen": " ".join([r["chosen"]] * 10),
                  "rejected": " ".join([r["rejected"]] * 10)} for r in rows]
    held_out = _rows(defaults.DEFAULT_EVAL_DATA)[:16]
    long_held_out = [{**r, "chosen": " ".join([r["chosen"]] * 10), "rejected": " ".join([r["rejected"]] * 10)}
                     for r in held_out]
    sent, tokens = {}, {}
    for name, train, evaluate in (("short", rows, held_out), ("long", long_rows, long_held_out)):
        counter = _Sent(monkeypatch)
        out = tmp_path / name
        argv = ["--data", _write(tmp_path / f"{name}.jsonl", train), "--eval-data",
                _write(tmp_path / f"{name}_eval.jsonl", evaluate), "--max-steps", "3", *SMALL, *mode,
                "--output-dir", str(out)]
        result = main_in_process(argv, cluster=ray_cluster)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        sent[name] = {method: counter.of(method) for method in ("train_step", "reference_logps", "evaluate")}
        tokens[name] = [step["tokens/real"] for k, step in sorted(_steps(out).items()) if k > 0]
        monkeypatch.undo()
    assert min(tokens["long"]) > 3 * max(tokens["short"])
    assert len(sent["short"]["train_step"]) == 3
    if "separate" in mode:
        assert len(sent["short"]["reference_logps"]) == 4  # the eval set, then one a step
    # The same number of calls, each of about the same size (a step's plan may group the indices
    # differently when the lengths differ: a few bytes), never growing with the texts.
    assert {m: len(sizes) for m, sizes in sent["long"].items()} == {m: len(sizes) for m, sizes in sent["short"].items()}
    for method, sizes in sent["long"].items():
        assert all(abs(long - short) <= 64 for long, short in zip(sizes, sent["short"][method])), (method, sent)
    assert max(max(sizes, default=0) for sizes in sent["long"].values()) < 4096


def test_precomputed_reference_is_computed_once_and_reused_by_a_restart_and_a_resume(tmp_path, ray_cluster):
    """--ref-mode precomputed writes OUTPUT/reference_logps once: a rank killed at step 3 and
    restarted (--max-restarts 1) maps it again without a reference pass, as does a resume to a
    larger --max-steps in a new command; the store is opened, not tokenized again. The metrics
    equal those of one uninterrupted run of the same steps."""
    data = _write(tmp_path / "train.jsonl", _rows(defaults.DEFAULT_TRAIN_DATA)[:48])
    base = ["--data", data, "--ref-mode", "precomputed", "--save-interval", "1", *SMALL]
    straight = main_in_process([*base, "--max-steps", "5", "--output-dir", str(tmp_path / "straight")],
                               cluster=ray_cluster)
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    assert straight.stdout.count("reference log-probs: computed for 48 pairs") == 1

    out = tmp_path / "run"
    first = main_in_process([*base, "--max-steps", "4", "--max-restarts", "1", "--output-dir", str(out)],
                            cluster=ray_cluster, env=fault_env("step:3"))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "restart 1/1" in first.stdout
    assert first.stdout.count("reference log-probs: computed") == 1
    assert first.stdout.count(f"reference log-probs: reusing {out / 'reference_logps'}") == 1
    assert "data: opened the token store" in first.stdout  # the straight run built it
    table = json.loads((out / "reference_logps" / "meta.json").read_text())
    assert table["num_pairs"] == 48 and table["num_eval_pairs"] is None

    resumed = main_in_process([*base, "--max-steps", "5", "--output-dir", str(out)], cluster=ray_cluster)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "reference log-probs: computed" not in resumed.stdout
    assert "reference log-probs: reusing" in resumed.stdout and "data: tokenizing" not in resumed.stdout
    assert _steps(out) == _steps(tmp_path / "straight")


def test_a_weighted_mix_of_two_files_draws_its_shares_and_is_part_of_the_run(tmp_path, ray_cluster):
    """--data a.jsonl:3 b.jsonl:1 over 48 and 16 pairs: each epoch holds 64 samples, 48 of a and
    16 of b (a's are every a pair once, b's every b pair once); data_stats.json lists both with
    their weights; a resume with other weights is refused as a change of --data."""
    from mcore_dpo.command_line import resolve
    from mcore_dpo.data.order import StepOrder
    from mcore_dpo.driver import run

    pool = _rows(defaults.DEFAULT_TRAIN_DATA)
    a = _write(tmp_path / "a.jsonl", pool[:48])
    b = _write(tmp_path / "b.jsonl", pool[100:116])
    argv = ["--data", f"{a}:3", f"{b}:1", "--max-steps", "2", *SMALL]
    config, _ = resolve(argv)
    assert config.data == [f"{a}:3", f"{b}:1"]
    prep = run.prepare(config)
    assert prep.train_data.source_counts() == [48, 16]
    steps = list(StepOrder.of(dataclasses.replace(config, max_steps=16), [48, 16], [3.0, 1.0]))
    epoch = sorted(i for batch in steps for i in batch)
    assert epoch == list(range(64))  # quotas 48 and 16: every pair once

    # Weights 1:1 over the same files: 32 of each, a drawn without repeats, b twice over.
    halves = list(StepOrder.of(dataclasses.replace(config, max_steps=16), [48, 16], [1.0, 1.0]))
    drawn = [i for batch in halves for i in batch]
    from_a = [i for i in drawn if i < 48]
    assert len(from_a) == 32 and len(set(from_a)) == 32
    assert sorted(i for i in drawn if i >= 48) == sorted(list(range(48, 64)) * 2)

    out = tmp_path / "mix"
    result = main_in_process([*argv, "--output-dir", str(out)], cluster=ray_cluster)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    stats = json.loads((out / "data_stats.json").read_text())["data"]
    assert [(s["path"], s["weight"], s["num_pairs"]) for s in stats] == [(a, 3.0, 48), (b, 1.0, 16)]
    changed = main_in_process(["--data", f"{a}:1", f"{b}:1", "--max-steps", "3", *SMALL, "--output-dir", str(out)],
                              cluster=ray_cluster)
    assert changed.returncode == 2 and "--data (its content or weights) changed" in changed.stderr, changed.stderr


@pytest.mark.parametrize("argv, message", [
    (["--data", "{a}:0.7", "{b}"], "data: {b} has no weight but other sources do"),
    (["--data", "{a}:0", "{b}:1"], "data: {a}:0: the weight must be a positive number"),
    (["--data", "{a}", "{a}"], "data: {a} is given twice"),
    (["--data", "{a}", "--data-workers", "0"], "data_workers: must be a positive integer"),
    (["--data", "{a}", "--data-cache", "{a}"], "data_cache: {a} is a file, not a directory"),
], ids=["weight-missing", "weight-zero", "twice", "workers-zero", "cache-a-file"])
def test_bad_data_flags_are_one_line(tmp_path, capsys, argv, message):
    rows = _rows(defaults.DEFAULT_TRAIN_DATA)[:8]
    paths = {"a": _write(tmp_path / "a.jsonl", rows), "b": _write(tmp_path / "b.jsonl", rows)}
    assert message.format(**paths) in train_input_error(capsys, [arg.format(**paths) for arg in argv])


def test_data_workers_and_data_cache_from_the_command_line(tmp_path):
    """--data-cache puts the store there (not under $MCORE_DPO_CACHE) and --data-workers 2
    tokenizes with two worker processes; the pairs equal load_pairs'."""
    from mcore_dpo.command_line import resolve
    from mcore_dpo.data.pairs import load_pairs
    from transformers import AutoTokenizer

    rows = _rows(defaults.DEFAULT_TRAIN_DATA)
    random.Random(0).shuffle(rows)
    data = _write(tmp_path / "d.jsonl", rows[:300])
    lines: list[str] = []
    config, _ = resolve(["--data", data, "--data-workers", "2", "--data-cache", str(tmp_path / "stores")])
    prep = prepare_run(config, log=lines.append)
    assert Path(prep.train_data.path).parent == tmp_path / "stores"
    assert any("(2 workers)" in line for line in lines), lines
    tokenizer = AutoTokenizer.from_pretrained(defaults.DEFAULT_TOKENIZER_DIR)
    expected, _ = load_pairs(data, tokenizer=tokenizer, max_length=config.max_length)
    assert list(prep.train_data) == expected
