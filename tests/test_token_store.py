"""Tests for the token store (mcore_dpo/data/store.py, data/tokenize.py): its pairs and DataStats
equal load_pairs' on every data file of the repository and of tests/test_data.py's cases, in this
process and on 2 worker processes; the key; the cache hit; partial and corrupt stores rebuilt; a
race of two builders; the row bound."""
from __future__ import annotations

import copy
import json
import os
import pickle
import re
import shutil
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from mcore_dpo.data import store as store_module
from mcore_dpo.data.pairs import _tokenize_pair, _validate_row, load_pairs
from mcore_dpo.data.sources import DataError
from mcore_dpo.data.store import FORMAT_VERSION, TokenStore, StoreError, open_or_build
from mcore_dpo.data.tokenize import Progress, TokenizerPool, max_row_bytes, tokenize_batch, tokenize_source
from mcore_dpo.driver.defaults import ASSETS_DIR, DEFAULT_TOKENIZER_DIR
from tests.helpers.models import save_tokenizer
from tests.helpers.token_store import build_with_workers
from tests.test_bad_inputs import CHAT_TEMPLATE
from tests.test_data import BAD_LINES, CHAT_ROW, GOOD_LINE, STANDARD_ROWS

REPO = Path(__file__).resolve().parents[1]
DATA_DOC = (REPO / "docs" / "DATA.md").read_text(encoding="utf-8")
CORPUS = REPO / "tests" / "bad_inputs"
REPO_FILES = sorted([*Path(ASSETS_DIR).glob("*.jsonl"), CORPUS / "valid_prefs.jsonl", *(CORPUS / "data").iterdir()])


# ----------------------------------------------------------------------------- tokenizers and files


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    """name -> (tokenizer directory or None, loaded tokenizer)."""
    root = tmp_path_factory.mktemp("tokenizers")
    tiny_dir = root / "tiny"  # the bad-input corpus's word-level tokenizer and chat template
    save_tokenizer(tiny_dir)
    (tiny_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    found = {"default": (DEFAULT_TOKENIZER_DIR, AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER_DIR)),
             "tiny": (str(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir))}
    rejecting = AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER_DIR)
    rejecting.chat_template = "{% if messages|length > 2 %}{{ raise_exception('only one turn') }}{% endif %}" \
                              + rejecting.chat_template
    found["rejecting"] = (DEFAULT_TOKENIZER_DIR, rejecting)
    found["merging"] = (None, _merging_tokenizer())
    return found


def _merging_tokenizer():
    """tests/test_data.py's character BPE with one merge ("a" + "b"), built in memory, with a
    template that writes no separator after the prompt."""
    from tests.helpers.data import merging_bpe_tokenizer

    return merging_bpe_tokenizer(chat_template="{% for m in messages %}{{ m['content'] }}"
                                               "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}")


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def case_files(tmp_path_factory) -> dict[str, Path]:
    """tests/test_data.py's cases as files: formats, file types, implicit prompts, truncation, bad rows."""
    root = tmp_path_factory.mktemp("cases")
    implicit_chat = {"chosen": CHAT_ROW["prompt"] + CHAT_ROW["chosen"], "rejected": CHAT_ROW["prompt"] + CHAT_ROW["rejected"]}
    long_rows = [{"prompt": "hi", "chosen": " apple and pear and plum and mango .", "rejected": " cat ."},
                 {"prompt": "name two fruits please .", "chosen": "apple .", "rejected": "cat ."}]
    files = {
        "standard": _jsonl(root / "standard.jsonl", STANDARD_ROWS + long_rows),
        "eos_in_text": _jsonl(root / "eos.jsonl", [{"prompt": "name two fruits .", "chosen": "apple and pear . <eos>",
                                                    "rejected": "cat ."}]),
        "chat": _jsonl(root / "chat.jsonl", [CHAT_ROW, {**CHAT_ROW, "chosen": [{"role": "assistant", "content": "saw ."}]}]),
        "implicit_text": _jsonl(root / "implicit.jsonl", [
            {"chosen": "q : name two fruits . a : apple and pear .", "rejected": "q : name two fruits . a : cat and dog ."},
            {"chosen": "name two . pear and plum", "rejected": "name two . peach and plum"}]),
        "implicit_chat": _jsonl(root / "implicit_chat.jsonl", [implicit_chat, implicit_chat]),
        "unused_columns": _jsonl(root / "question.jsonl", [
            {"question": f"name thing {i} .", "chosen": "sure : sheep and rabbit and bear .", "rejected": "sure : saw ."}
            for i in range(5)]),
        "skipped_other_kind": _jsonl(root / "other_kind.jsonl", [
            STANDARD_ROWS[0], {**CHAT_ROW, "prompt": [{"role": "robot", "content": "x"}]}, STANDARD_ROWS[1]]),
        "mixed_kinds_late": _jsonl(root / "mixed.jsonl", [STANDARD_ROWS[0], {"prompt": "a", "chosen": "b", "rejected": "b"},
                                                          STANDARD_ROWS[1], CHAT_ROW]),
    }
    bad = root / "bad_lines.jsonl"  # every bad line of tests/test_data.py between good ones
    bad.write_bytes(b"".join(GOOD_LINE + b"\n" + line + b"\n" for line, _ in BAD_LINES.values()) + GOOD_LINE + b"\n")
    files["bad_lines"] = bad
    blank = root / "blank.jsonl"
    blank.write_text(json.dumps(STANDARD_ROWS[0]) + "\n\n   \n" + json.dumps(STANDARD_ROWS[1]))  # no final newline
    files["blank_lines"] = blank
    array = root / "array.json"
    array.write_text("[\n" + ",\n".join(json.dumps(row) for row in STANDARD_ROWS) + "\n]\n")
    files["json_array"] = array
    columns = root / "columns.json"
    columns.write_text(json.dumps({key: [row[key] for row in STANDARD_ROWS] for key in STANDARD_ROWS[0]}))
    files["json_columns"] = columns
    files["json_lines"] = _jsonl(root / "lines.json", STANDARD_ROWS)
    one = root / "one.json"
    one.write_text(json.dumps(implicit_chat))
    files["json_one_object"] = one
    pq.write_table(pa.Table.from_pylist(STANDARD_ROWS), str(root / "d.parquet"))
    files["parquet"] = root / "d.parquet"
    pq.write_table(pa.Table.from_pylist([CHAT_ROW, CHAT_ROW]), str(root / "chat.parquet"))
    files["chat_parquet"] = root / "chat.parquet"
    (root / "empty.jsonl").write_text("\n\n")
    files["empty"] = root / "empty.jsonl"
    files["merge"] = _jsonl(root / "merge.jsonl", [{"prompt": "x a", "chosen": "b y", "rejected": " c"},
                                                   {"prompt": "x a", "chosen": " b y<eos>", "rejected": " c"}])
    files["merge_chat"] = _jsonl(root / "merge_chat.jsonl", [
        {"prompt": [{"role": "user", "content": "x a"}], "chosen": [{"role": "assistant", "content": "b y"}],
         "rejected": [{"role": "assistant", "content": " c"}]},
        {"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "assistant", "content": "b"}],
         "rejected": [{"role": "assistant", "content": "c"}]}])  # the prompt swallowed by the merge: a bad row
    files["chat_two_turns"] = _jsonl(root / "two_turns.jsonl", [
        CHAT_ROW, {**CHAT_ROW, "prompt": CHAT_ROW["prompt"] + [{"role": "assistant", "content": "ok ."},
                                                               {"role": "user", "content": "more ."}]}, CHAT_ROW])
    return files


# Which tokenizer reads which file, and at which lengths: 64 keeps every pair whole, 8 cuts, 4 drops.
CASE_TOKENIZER = {"merge": "merging", "merge_chat": "merging", "chat_two_turns": "rejecting"}
LENGTHS = (4, 8, 64)


def _load_pairs_outcome(path, tokenizer, *, max_length: int, on_bad_row: str):
    try:
        pairs, stats = load_pairs(str(path), tokenizer=tokenizer, max_length=max_length, on_bad_row=on_bad_row)
    except DataError as error:
        return str(error)
    return pairs, (stats,)


def _store_outcome(build, path, tokenizer_dir, tokenizer, *, max_length: int, on_bad_row: str, cache_dir):
    try:
        store = build([str(path)], tokenizer_dir=tokenizer_dir, tokenizer=tokenizer, max_length=max_length,
                      on_bad_row=on_bad_row, cache_dir=str(cache_dir), log=lambda line: None)
    except DataError as error:
        return str(error)
    return list(store), store.stats


def _in_process(sources, **kwargs):
    return open_or_build(sources, workers=1, **kwargs)


def _assert_store_equals_load_pairs(build, path, tokenizer_dir, tokenizer, cache_dir, *, lengths=LENGTHS) -> int:
    compared = 0
    for max_length in lengths:
        for on_bad_row in ("error", "skip"):
            expected = _load_pairs_outcome(path, tokenizer, max_length=max_length, on_bad_row=on_bad_row)
            got = _store_outcome(build, path, tokenizer_dir, tokenizer, max_length=max_length, on_bad_row=on_bad_row,
                                 cache_dir=cache_dir)
            assert got == expected, (path.name, max_length, on_bad_row)
            compared += 1 if isinstance(expected, str) else 1 + len(expected[0])
    return compared


# ----------------------------------------------------------------------------- equal to load_pairs


@pytest.mark.parametrize("path", REPO_FILES, ids=lambda p: p.name)
def test_repository_files_give_load_pairs_pairs_and_stats(path, tokenizers, tmp_path):
    """Every data file of the repository (the embedded sets, the bad-input corpus), in this process,
    at lengths that keep, cut and drop, both --on-bad-row modes: the same pairs and stats, or the
    same one-line error."""
    name = "default" if path.parent.name == "assets" else "tiny"
    tokenizer_dir, tokenizer = tokenizers[name]
    lengths = (16, 64) if path.parent.name == "assets" else LENGTHS
    assert _assert_store_equals_load_pairs(_in_process, path, tokenizer_dir, tokenizer, tmp_path, lengths=lengths)


def test_test_data_cases_give_load_pairs_pairs_and_stats(case_files, tokenizers, tmp_path):
    """tests/test_data.py's cases (conversations, implicit prompts, truncation, bad rows skipped,
    JSON arrays and columns, Parquet, merges across the prompt boundary, a template that rejects)."""
    for name, path in case_files.items():
        tokenizer_dir, tokenizer = tokenizers[CASE_TOKENIZER.get(name, "default")]
        _assert_store_equals_load_pairs(_in_process, path, tokenizer_dir, tokenizer, tmp_path / name)


def test_on_two_workers_the_store_equals_load_pairs(case_files, tokenizers, tmp_path):
    """The same on 2 spawned workers, the tokenizer pickled to them (the one built in memory too):
    the embedded training set cut at 16 tokens (many batches), conversations, bad rows, a merge."""
    cases = [(Path(ASSETS_DIR) / "prefs_train.jsonl", "default", (16,)), (case_files["chat"], "default", (8, 64)),
             (CORPUS / "data" / "some_bad_rows.jsonl", "tiny", (64,)), (case_files["merge_chat"], "merging", (4, 64)),
             (case_files["chat_two_turns"], "rejecting", (64,))]
    for path, name, lengths in cases:
        tokenizer_dir, tokenizer = tokenizers[name]
        _assert_store_equals_load_pairs(build_with_workers, path, tokenizer_dir, tokenizer, tmp_path / name,
                                        lengths=lengths)


def test_one_batched_call_gives_the_ids_of_one_call_per_text(case_files, tokenizers):
    for name, path in case_files.items():
        if name in ("empty", "json_columns", "parquet", "chat_parquet", "bad_lines", "mixed_kinds_late"):
            continue
        _, tokenizer = tokenizers[CASE_TOKENIZER.get(name, "default")]
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
            if path.suffix == ".jsonl" else []
        has_prompt = bool(rows) and "prompt" in rows[0]
        raws = []
        for row in rows:
            try:
                raws.append(_validate_row(row, has_prompt=has_prompt))
            except Exception:
                continue
        batch = tokenize_batch(tokenizer, raws)
        offset = 0
        for index, raw in enumerate(raws):
            try:
                expected = _tokenize_pair(tokenizer, raw)
            except Exception as problem:
                assert batch.problems[index] == str(problem)
                continue
            assert batch.problems[index] is None
            assert [part.tolist() for part in batch.pair(index, offset)] == [list(part) for part in expected]
            offset += int(batch.lengths[index].sum())


def test_several_sources_keep_their_order_stats_and_source_index(case_files, tokenizers, tmp_path):
    tokenizer_dir, tokenizer = tokenizers["default"]
    sources = [str(case_files["standard"]), str(case_files["implicit_text"])]
    store = open_or_build(sources, tokenizer_dir=tokenizer_dir, tokenizer=tokenizer, max_length=8, workers=1,
                          cache_dir=str(tmp_path), log=lambda line: None)
    expected = [load_pairs(path, tokenizer=tokenizer, max_length=8) for path in sources]
    assert list(store) == expected[0][0] + expected[1][0]
    assert store.stats == tuple(stats for _, stats in expected)
    assert [store.sample(i)["source"] for i in range(len(store))] == [0] * len(expected[0][0]) + [1] * len(expected[1][0])
    assert store[-1] == expected[1][0][-1] and store[1:3] == expected[0][0][1:3]
    assert store.sequence(store.sample(0)["prompt"]).dtype == np.int32


def test_a_store_pickles_as_its_path(case_files, tokenizers, tmp_path):
    """Handed to a Ray actor or a process, a store is opened there, not copied."""
    store = _build(Path(ASSETS_DIR) / "prefs_train.jsonl", tokenizers, tmp_path)
    payload = pickle.dumps(store)
    assert len(payload) < 1000 < store.num_tokens
    again = pickle.loads(payload)
    assert again.path == store.path and again[1999] == store[1999] and again.stats == store.stats


def test_a_store_with_no_pairs_opens(case_files, tokenizers, tmp_path):
    tokenizer_dir, tokenizer = tokenizers["default"]
    store = open_or_build([str(case_files["standard"])], tokenizer_dir=tokenizer_dir, tokenizer=tokenizer,
                          max_length=2, workers=1, cache_dir=str(tmp_path), log=lambda line: None)
    assert len(store) == 0 and store.stats[0].num_dropped_prompt_too_long == 5
    assert len(TokenStore.open(store.path)) == 0


# ----------------------------------------------------------------------------- the cache


def _build(path, tokenizers, cache_dir, *, name="default", max_length=64, on_bad_row="error", lines=None, **kwargs):
    tokenizer_dir, tokenizer = tokenizers[name]
    return open_or_build([str(path)], tokenizer_dir=tokenizer_dir, tokenizer=tokenizer, max_length=max_length,
                         on_bad_row=on_bad_row, workers=1, cache_dir=str(cache_dir),
                         log=(lines.append if lines is not None else lambda line: None), **kwargs)


def test_a_second_open_is_a_hit_that_tokenizes_nothing(case_files, tokenizers, tmp_path, monkeypatch):
    lines: list[str] = []
    first = _build(case_files["standard"], tokenizers, tmp_path, lines=lines)
    assert first.built and any("data: tokenizing" in line for line in lines)

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("a hit tokenized")

    monkeypatch.setattr(store_module, "tokenize_source", no_tokenizing)
    lines.clear()
    fresh = AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER_DIR)  # another load of the same files: the same key
    second = open_or_build([str(case_files["standard"])], tokenizer_dir=DEFAULT_TOKENIZER_DIR, tokenizer=fresh,
                           max_length=64, workers=1, cache_dir=str(tmp_path), log=lines.append)
    assert not second.built and second.path == first.path and list(second) == list(first)
    assert len(lines) == 1 and lines[0].startswith(f"data: opened the token store {first.path}")
    moved = tmp_path / "elsewhere" / "moved.jsonl"  # the content is the key, not the path
    moved.parent.mkdir()
    shutil.copy(case_files["standard"], moved)
    assert _build(moved, tokenizers, tmp_path).path == first.path


def test_the_key_changes_with_data_tokenizer_files_template_length_and_mode(case_files, tokenizers, tmp_path):
    data = tmp_path / "d.jsonl"
    shutil.copy(case_files["standard"], data)
    tok_dir = tmp_path / "tok"
    shutil.copytree(DEFAULT_TOKENIZER_DIR, tok_dir)

    def key(path=data, directory=tok_dir, tokenizer=None, max_length=64, on_bad_row="error"):
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(directory)
        return store_module.store_key(store_module.key_inputs([str(path)], tokenizer_dir=str(directory),
                                                               tokenizer=tokenizer, max_length=max_length,
                                                               on_bad_row=on_bad_row))

    base = key()
    assert key() == base
    (tok_dir / "model.safetensors").write_bytes(b"weights are not the tokenizer")
    assert key() == base
    keys = {base}
    with open(data, "a") as handle:  # one more row
        handle.write(json.dumps(STANDARD_ROWS[0]) + "\n")
    keys.add(key())
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 4096}))
    keys.add(key())
    (tok_dir / "chat_template.jinja").write_text((tok_dir / "chat_template.jinja").read_text() + " ")
    keys.add(key())
    templated = AutoTokenizer.from_pretrained(tok_dir)
    templated.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # as --chat-template sets it
    keys.add(key(tokenizer=templated))
    keys.add(key(max_length=65))
    keys.add(key(on_bad_row="skip"))
    assert len(keys) == 7


def _rebuilt_after(damage, case_files, tokenizers, tmp_path) -> list[str]:
    first = _build(case_files["standard"], tokenizers, tmp_path)
    expected = list(first)
    damage(Path(first.path))
    lines: list[str] = []
    second = _build(case_files["standard"], tokenizers, tmp_path, lines=lines)
    assert second.built and second.path == first.path and list(second) == expected
    assert not list(tmp_path.glob("*.partial-*"))
    return lines


def test_a_store_without_meta_json_is_rebuilt(case_files, tokenizers, tmp_path):
    lines = _rebuilt_after(lambda path: (path / "meta.json").unlink(), case_files, tokenizers, tmp_path)
    assert lines[0].startswith(f"data: {tmp_path}/") and lines[0].endswith(
        ": no meta.json (an unfinished store); rebuilding the token store")
    assert ": no meta.json (an unfinished store); rebuilding the token store\n" in DATA_DOC


def test_a_truncated_file_is_rebuilt_never_read(case_files, tokenizers, tmp_path):
    def truncate(path: Path) -> None:
        with open(path / "tokens.bin", "r+b") as handle:
            handle.truncate(os.path.getsize(path / "tokens.bin") - 4)

    lines = _rebuilt_after(truncate, case_files, tokenizers, tmp_path)
    assert lines[0].startswith("data: ") and "tokens.bin: " in lines[0] and "meta.json says" in lines[0]
    with pytest.raises(StoreError, match="tokens.bin: .* bytes, meta.json says"):
        path = _build(case_files["standard"], tokenizers, tmp_path).path
        truncate(Path(path))
        TokenStore.open(path)


def test_another_format_version_or_key_is_rebuilt(case_files, tokenizers, tmp_path):
    def bump(path: Path) -> None:
        meta = json.loads((path / "meta.json").read_text())
        (path / "meta.json").write_text(json.dumps({**meta, "version": 0}))

    assert f"not a mcore_dpo.token_store version {FORMAT_VERSION} store" in _rebuilt_after(bump, case_files, tokenizers, tmp_path)[0]
    store = _build(case_files["standard"], tokenizers, tmp_path)
    with pytest.raises(StoreError, match="holds key .*, expected 0123"):
        TokenStore.open(store.path, key="0123")


def test_a_failed_build_leaves_no_store_and_stale_partials_go(case_files, tokenizers, tmp_path):
    stale = tmp_path / "feed.partial-0000"
    stale.mkdir(parents=True)
    (stale / "tokens.bin").write_bytes(b"0000")
    old = time.time() - store_module.STALE_PARTIAL_S - 60
    os.utime(stale / "tokens.bin", (old, old))
    os.utime(stale, (old, old))
    live = tmp_path / "beef.partial-0000"
    live.mkdir()
    with pytest.raises(DataError, match=r"bad_lines\.jsonl:2: missing key 'rejected'"):
        _build(case_files["bad_lines"], tokenizers, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["beef.partial-0000"]


def test_the_loser_of_a_race_opens_the_winners_store(case_files, tokenizers, tmp_path, monkeypatch):
    winner = _build(case_files["standard"], tokenizers, tmp_path / "winner")
    real_move = store_module.durable.move

    def move_after_the_winner(src, dst):
        shutil.copytree(winner.path, dst)  # the other builder renamed its copy first
        real_move(src, dst)

    monkeypatch.setattr(store_module.durable, "move", move_after_the_winner)
    lines: list[str] = []
    store = _build(case_files["standard"], tokenizers, tmp_path / "loser", lines=lines)
    assert not store.built and list(store) == list(winner)
    assert lines[-1].startswith("data: another process built") and not list((tmp_path / "loser").glob("*.partial-*"))


# ----------------------------------------------------------------------------- a row is bounded


def test_a_row_over_the_bound_is_one_line_read_in_bounded_memory(tokenizers, tmp_path):
    """A 24 MB `chosen` at --max-length 64 (bound 1 MiB): refused in one line naming the file and
    line, or skipped and counted; the reading never holds the row (Python's allocations stay
    within a few MiB)."""
    path = tmp_path / "huge.jsonl"
    with open(path, "w") as handle:
        handle.write(json.dumps(STANDARD_ROWS[0]) + "\n")
        handle.write('{"prompt": "name two animals .", "chosen": "' + "sheep " * 4_000_000 + '", "rejected": "cat ."}\n')
        handle.write(" " * (3 << 20) + "\n")  # a long blank line is no row
        handle.write(json.dumps(STANDARD_ROWS[1]) + "\n")
    assert max_row_bytes(64) == 1 << 20 and max_row_bytes(4096) == 4 << 20
    tracemalloc.start()
    try:
        with pytest.raises(DataError) as caught:
            _build(path, tokenizers, tmp_path / "error")
        store = _build(path, tokenizers, tmp_path / "skip", on_bad_row="skip")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(caught.value) == (f"{path}:2: row is longer than 1,048,576 bytes, the bound at this --max-length "
                                 "(max(1 MiB, 1 KiB x max_length); docs/DATA.md)")
    assert f"    {str(caught.value).replace(str(path), 'prefs.jsonl')}\n" in DATA_DOC  # docs/DATA.md quotes it
    assert peak < 8 << 20, peak
    assert [p.source_line for p in store] == [1, 4]
    assert store.stats[0].num_rows == 3 and store.stats[0].first_bad_lines == (2,)


def test_a_json_row_over_the_bound_is_refused_by_its_texts(tokenizers, tmp_path):
    path = tmp_path / "huge.json"
    path.write_text(json.dumps([STANDARD_ROWS[0], {"prompt": "a", "chosen": "sheep " * 200_000, "rejected": "c"}]))
    with pytest.raises(DataError, match=r"huge\.json:1: row is longer than 1,048,576 bytes"):
        _build(path, tokenizers, tmp_path)


# ----------------------------------------------------------------------------- progress


def test_progress_is_a_plain_line_in_a_log(case_files, tokenizers):
    _, tokenizer = tokenizers["default"]
    lines: list[str] = []
    written = []
    with TokenizerPool(tokenizer, workers=1) as pool:
        stats = tokenize_source(str(Path(ASSETS_DIR) / "prefs_train.jsonl"), tokenizer=tokenizer, max_length=64,
                                on_bad_row="error", pool=pool, write=lambda *pair: written.append(pair[0]),
                                progress=Progress(log=lines.append, bar=False, interval_s=0.0))
    assert stats.num_pairs == len(written) == 2000
    assert lines and all(re.fullmatch(r"data: tokenizing \S+: [\d,]+ pairs of [\d,]+ rows, [\d,]+ pairs/s, "
                                      r"ETA \d+ s \(\d+%\)", line) for line in lines), lines
    assert ": 2,000 pairs of 2,000 rows, " in lines[-1] and lines[-1].endswith("(100%)")
    assert re.search(r"\n    data: tokenizing prefs\.jsonl: [\d,]+ pairs of [\d,]+ rows, [\d,]+ pairs/s, ETA \d+ s "
                     r"\(\d+%\)\n", DATA_DOC)


def test_workers_must_be_a_positive_integer(tokenizers):
    with pytest.raises(DataError, match="data_workers: must be an integer >= 1, got 0"):
        TokenizerPool(tokenizers["default"][1], workers=0)


def test_the_merging_tokenizer_is_exact_in_memory(tokenizers):
    """The in-memory tokenizer has no directory: its key comes from the object alone."""
    _, merging = tokenizers["merging"]
    inputs = store_module.key_inputs([str(CORPUS / "valid_prefs.jsonl")], tokenizer_dir=None, tokenizer=merging,
                                     max_length=8, on_bad_row="error")
    other = copy.deepcopy(merging)
    other.chat_template = None
    assert inputs["tokenizer_files"] == {}
    assert store_module.store_key(inputs) != store_module.store_key(store_module.key_inputs(
        [str(CORPUS / "valid_prefs.jsonl")], tokenizer_dir=None, tokenizer=other, max_length=8, on_bad_row="error"))
