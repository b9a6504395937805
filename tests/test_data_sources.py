"""Tests for a saved Hugging Face dataset directory as a data source (data/pairs.py's "dataset"
kind): its rows, pairs and DataStats equal those of a JSONL file of the same rows, through
load_pairs and through the token store; a DatasetDict through its "train" split; directories that
are no saved dataset refused in one line; `source_checksum` and the store key; the tokenizer check
and a resume's data identity on a directory. Small data sets made in tmp_path, no Ray, no training."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

from checkpoint_convert.integrity import file_checksum
from mcore_dpo.data import sources as sources_module
from mcore_dpo.data.pairs import load_pairs
from mcore_dpo.data.sources import DataError, _read_rows, source_checksum
from mcore_dpo.data.store import open_or_build
from mcore_dpo.data.tokenizer_check import sample_texts
from mcore_dpo.driver.defaults import DEFAULT_TOKENIZER_DIR
from mcore_dpo.driver.resume_check import data_digest, file_sha256
from tests.test_data import CHAT_ROW, STANDARD_ROWS

datasets.disable_progress_bars()

LONG_ROWS = [{"prompt": "hi", "chosen": " apple and pear and plum and mango .", "rejected": " cat ."},
             {"prompt": "name two fruits please .", "chosen": "apple .", "rejected": "cat ."}]
CHAT_ROWS = [CHAT_ROW, {**CHAT_ROW, "chosen": [{"role": "assistant", "content": "saw ."}]},
             {**CHAT_ROW, "prompt": CHAT_ROW["prompt"] + [{"role": "assistant", "content": "ok ."},
                                                          {"role": "user", "content": "more ."}]}]
CASES = {
    "standard": STANDARD_ROWS + LONG_ROWS,
    "chat": CHAT_ROWS,
    "implicit_text": [
        {"chosen": "q : name two fruits . a : apple and pear .", "rejected": "q : name two fruits . a : cat and dog ."},
        {"chosen": "name two . pear and plum", "rejected": "name two . peach and plum"}],
    "implicit_chat": [{"chosen": CHAT_ROW["prompt"] + CHAT_ROW["chosen"],
                       "rejected": CHAT_ROW["prompt"] + CHAT_ROW["rejected"]}] * 2,
    "unused_columns": [{"question": f"name thing {i} .", "chosen": "sure : sheep and rabbit and bear .",
                        "rejected": "sure : saw .", "score": float(i)} for i in range(5)],
}
# Row 3 is bad (chosen equals rejected), rows 1, 2, 4 and 5 are good.
BAD_ROW_3 = [*STANDARD_ROWS[:2], {"prompt": "a", "chosen": "b", "rejected": "b"}, STANDARD_ROWS[2], LONG_ROWS[1]]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER_DIR)


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def _saved(path: Path, rows: list[dict]) -> str:
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


def _outcome(path: str, tokenizer, *, max_length: int, on_bad_row: str):
    """load_pairs' pairs and stats, or its error with the path taken out."""
    try:
        return load_pairs(path, tokenizer=tokenizer, max_length=max_length, on_bad_row=on_bad_row)
    except DataError as error:
        return str(error).replace(path, "PATH")


def _store_outcome(path: str, tokenizer, cache_dir: Path, *, max_length: int, on_bad_row: str):
    """The token store's pairs and stats (as load_pairs gives them), or its error with the path taken out."""
    try:
        store = open_or_build([path], tokenizer_dir=DEFAULT_TOKENIZER_DIR, tokenizer=tokenizer, max_length=max_length,
                              on_bad_row=on_bad_row, cache_dir=str(cache_dir), workers=1, log=lambda line: None)
    except DataError as error:
        return str(error).replace(path, "PATH")
    return list(store), store.stats[0]


# ----------------------------------------------------------------------------- the same rows as JSONL


def _assert_both_refuse(path: str, tokenizer, cache_dir: Path, *, expected: str) -> None:
    """load_pairs and the store's build both raise DataError with exactly `expected`."""
    with pytest.raises(DataError) as caught:
        load_pairs(path, tokenizer=tokenizer, max_length=64)
    assert str(caught.value) == expected
    with pytest.raises(DataError) as caught:
        open_or_build([path], tokenizer_dir=DEFAULT_TOKENIZER_DIR, tokenizer=tokenizer, max_length=64,
                      cache_dir=str(cache_dir), workers=1, log=lambda line: None)
    assert str(caught.value) == expected


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_saved_dataset_gives_the_jsonl_rows_pairs_and_stats(name, tokenizer, tmp_path):
    """Rows (conversations as lists of dicts), pairs and DataStats of a save_to_disk directory equal the
    JSONL file's, through load_pairs and through the token store, at lengths that keep, cut and drop."""
    rows = CASES[name]
    jsonl, directory = _jsonl(tmp_path / "d.jsonl", rows), _saved(tmp_path / "d", rows)
    assert list(_read_rows(directory)) == list(_read_rows(jsonl))
    for max_length in (4, 8, 64):
        expected = _outcome(jsonl, tokenizer, max_length=max_length, on_bad_row="error")
        assert not isinstance(expected, str) and (expected[0] or max_length < 64), (name, max_length, expected)
        assert _outcome(directory, tokenizer, max_length=max_length, on_bad_row="error") == expected
        got = _store_outcome(directory, tokenizer, tmp_path / f"cache{max_length}", max_length=max_length,
                             on_bad_row="error")
        assert got == expected


def test_conversations_come_through_as_lists_of_message_dicts(tmp_path):
    directory = _saved(tmp_path / "chat", CHAT_ROWS)
    (number, row), *_ = _read_rows(directory)
    assert number == 1 and row == CHAT_ROW
    assert isinstance(row["prompt"], list) and all(type(message) is dict for message in row["prompt"])


def test_a_saved_format_does_not_change_the_rows(tokenizer, tmp_path):
    """A dataset saved with a numpy format set is still read as Python lists of dicts."""
    directory = tmp_path / "numpy"
    datasets.Dataset.from_list(CHAT_ROWS).with_format("numpy").save_to_disk(str(directory))
    assert [row for _, row in _read_rows(str(directory))] == CHAT_ROWS
    assert load_pairs(str(directory), tokenizer=tokenizer, max_length=64) == \
        load_pairs(_jsonl(tmp_path / "d.jsonl", CHAT_ROWS), tokenizer=tokenizer, max_length=64)


def test_rows_are_read_in_batches_and_numbered_on_across_them(tokenizer, tmp_path, monkeypatch):
    """Batches of 2 rows (5 rows: 3 batches), no whole-set to_list(): row numbers run 1..5."""
    rows = STANDARD_ROWS + LONG_ROWS
    directory = _saved(tmp_path / "d", rows)
    monkeypatch.setattr(sources_module, "DATASET_BATCH_ROWS", 2)

    def refused(self, *args, **kwargs):
        raise AssertionError("to_list() of the whole data set")

    monkeypatch.setattr(datasets.Dataset, "to_list", refused)
    assert [(number, row) for number, row in _read_rows(directory)] == list(enumerate(rows, start=1))
    pairs, stats = load_pairs(directory, tokenizer=tokenizer, max_length=64)
    assert [pair.source_line for pair in pairs] == [1, 2, 3, 4, 5] and stats.num_rows == 5


# ----------------------------------------------------------------------------- bad rows


def test_a_bad_row_is_named_by_its_row_number(tokenizer, tmp_path):
    jsonl, directory = _jsonl(tmp_path / "bad.jsonl", BAD_ROW_3), _saved(tmp_path / "bad", BAD_ROW_3)
    with pytest.raises(DataError) as caught:
        load_pairs(directory, tokenizer=tokenizer, max_length=64)
    assert str(caught.value) == f"{directory}:3: 'chosen' and 'rejected' are identical"
    assert _store_outcome(directory, tokenizer, tmp_path / "cache", max_length=64, on_bad_row="error") == \
        "PATH:3: 'chosen' and 'rejected' are identical"
    expected = _outcome(jsonl, tokenizer, max_length=64, on_bad_row="skip")
    pairs, stats = _outcome(directory, tokenizer, max_length=64, on_bad_row="skip")
    assert (pairs, stats) == expected
    assert stats.first_bad_lines == (3,) and stats.num_bad_rows_skipped == 1
    assert [pair.source_line for pair in pairs] == [1, 2, 4, 5]
    assert _store_outcome(directory, tokenizer, tmp_path / "cache", max_length=64, on_bad_row="skip") == expected


def test_a_null_prompt_in_a_dataset_is_a_bad_row(tokenizer, tmp_path):
    """A dataset has every column in every row: a row without a prompt reads as a null one."""
    rows = [STANDARD_ROWS[0], {"prompt": None, "chosen": "b", "rejected": "c"}, STANDARD_ROWS[1]]
    directory = _saved(tmp_path / "null", rows)
    with pytest.raises(DataError) as caught:
        load_pairs(directory, tokenizer=tokenizer, max_length=64)
    assert str(caught.value) == f"{directory}:2: 'prompt' is null"


# ----------------------------------------------------------------------------- DatasetDict and other directories


def test_a_dataset_dict_is_read_through_its_train_split(tokenizer, tmp_path):
    directory = tmp_path / "dict"
    datasets.DatasetDict({"test": datasets.Dataset.from_list(CHAT_ROWS[:1]),
                          "train": datasets.Dataset.from_list(STANDARD_ROWS)}).save_to_disk(str(directory))
    expected = load_pairs(_jsonl(tmp_path / "d.jsonl", STANDARD_ROWS), tokenizer=tokenizer, max_length=64)
    assert load_pairs(str(directory), tokenizer=tokenizer, max_length=64) == expected
    assert _store_outcome(str(directory), tokenizer, tmp_path / "cache", max_length=64, on_bad_row="error") == expected
    assert source_checksum(str(directory)) == source_checksum(str(directory / "train"))


def test_a_dataset_dict_without_train_is_refused_naming_its_splits(tokenizer, tmp_path):
    directory = tmp_path / "dict"
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(STANDARD_ROWS),
                          "test": datasets.Dataset.from_list(STANDARD_ROWS)}).save_to_disk(str(directory))
    expected = (f"{directory}: a saved DatasetDict with splits validation, test and no 'train'; "
                f"give one split's directory (e.g. {directory / 'validation'})")
    _assert_both_refuse(str(directory), tokenizer, tmp_path / "cache", expected=expected)
    assert not (tmp_path / "cache").exists()  # refused before any store directory is made
    assert load_pairs(str(directory / "validation"), tokenizer=tokenizer, max_length=64)[1].num_pairs == 3


@pytest.mark.parametrize("contents", [{}, {"prefs.jsonl": json.dumps(STANDARD_ROWS[0]) + "\n"},
                                      {"state.json": "{}"}])
def test_a_directory_that_is_no_saved_dataset_is_refused_in_one_line(contents, tokenizer, tmp_path):
    directory = tmp_path / "not_a_dataset"
    directory.mkdir()
    for name, text in contents.items():
        (directory / name).write_text(text)
    expected = (f"{directory}: a directory, not a saved Hugging Face dataset "
                "(no dataset_info.json/state.json or dataset_dict.json)")
    _assert_both_refuse(str(directory), tokenizer, tmp_path / "cache", expected=expected)
    assert sample_texts(str(directory), tokenizer) == []
    data_doc = (Path(__file__).resolve().parents[1] / "docs" / "DATA.md").read_text(encoding="utf-8")
    assert f"    error: {expected.replace(str(directory), 'prefs')}\n" in data_doc  # docs/DATA.md quotes it


def test_an_unreadable_saved_dataset_is_one_line(tokenizer, tmp_path):
    directory = Path(_saved(tmp_path / "d", STANDARD_ROWS))
    for arrow in directory.glob("data-*.arrow"):
        arrow.write_bytes(b"not arrow")
    with pytest.raises(DataError) as caught:
        load_pairs(str(directory), tokenizer=tokenizer, max_length=64)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{directory}: cannot read the saved dataset (")


# ----------------------------------------------------------------------------- checksums and the store key


def test_source_checksum_follows_the_rows_not_the_place(tokenizer, tmp_path):
    jsonl = _jsonl(tmp_path / "d.jsonl", STANDARD_ROWS)
    assert source_checksum(jsonl) == file_checksum(jsonl)  # a file's key input is what it always was
    directory = _saved(tmp_path / "a", STANDARD_ROWS)
    checksum = source_checksum(directory)
    copied = tmp_path / "copied"
    shutil.copytree(directory, copied)
    (copied / ".lock").write_text("")  # hidden files and datasets' cache files are not the data
    (copied / "cache-0123abcd.arrow").write_bytes(b"cached")
    assert source_checksum(str(copied)) == checksum

    def build(path):
        return open_or_build([path], tokenizer_dir=DEFAULT_TOKENIZER_DIR, tokenizer=tokenizer, max_length=64,
                             cache_dir=str(tmp_path / "cache"), workers=1, log=lambda line: None)

    first = build(directory)
    again = build(str(copied))
    assert first.built and not again.built and again.path == first.path
    changed_rows = [*STANDARD_ROWS[:2], {**STANDARD_ROWS[2], "chosen": "blue and red ."}]
    changed = _saved(tmp_path / "changed", changed_rows)
    assert source_checksum(changed) != checksum
    other = build(changed)
    assert other.built and other.path != first.path
    assert other[2].chosen_ids != first[2].chosen_ids and other[:2] == first[:2]


def test_a_resume_tells_a_changed_dataset_directory_apart(tmp_path):
    jsonl = _jsonl(tmp_path / "d.jsonl", STANDARD_ROWS)
    assert data_digest(jsonl) == file_sha256(jsonl)  # checkpoints written before keep their identity
    directory = _saved(tmp_path / "a", STANDARD_ROWS)
    changed = _saved(tmp_path / "b", [*STANDARD_ROWS[:2], {**STANDARD_ROWS[2], "rejected": "saw ."}])
    assert data_digest(directory) == data_digest(directory) != data_digest(changed)


# ----------------------------------------------------------------------------- the tokenizer check


@pytest.mark.parametrize("name", ["standard", "chat"])
def test_the_tokenizer_check_samples_a_dataset_directory(name, tokenizer, tmp_path):
    rows = CASES[name]
    jsonl, directory = _jsonl(tmp_path / "d.jsonl", rows), _saved(tmp_path / "d", rows)
    texts = sample_texts(directory, tokenizer, num_rows=2)
    assert len(texts) == 6 and texts == sample_texts(jsonl, tokenizer, num_rows=2)
