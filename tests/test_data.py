"""Tests for mcore_dpo.data.pairs: formats, file types, truncation, bad rows, batching, collate."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from mcore_dpo.data.pairs import (
    DataError,
    DataStats,
    TokenizedPair,
    collate,
    data_notes,
    eval_passes,
    global_batch_order,
    load_pairs,
    padded_seq_len,
    split_at_prompt,
)
from mcore_dpo.driver.defaults import DEFAULT_TOKENIZER_DIR
from tests.helpers.ray_runs import main_in_process

REPO = Path(__file__).resolve().parents[1]
DATA_DOC = (REPO / "docs" / "DATA.md").read_text(encoding="utf-8")

STANDARD_ROWS = [
    {"prompt": "name two fruits .", "chosen": "apple and pear .", "rejected": "cat and dog ."},
    {"prompt": "name two animals .", "chosen": "cat and dog .", "rejected": "red and blue ."},
    {"prompt": "name two colors .", "chosen": "red and blue .", "rejected": "saw and axe ."},
]
CHAT_ROW = {
    "prompt": [
        {"role": "system", "content": "answer with two words ."},
        {"role": "user", "content": "name two fruits ."},
    ],
    "chosen": [{"role": "assistant", "content": "apple and pear ."}],
    "rejected": [{"role": "assistant", "content": "cat and dog ."}],
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER_DIR)


def _write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return str(path)


def _ids(tokenizer, text: str, *, specials: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=specials)["input_ids"])


# ----------------------------------------------------------------------------- formats


def test_standard_format_tokenizes_prompt_with_bos_and_completions_with_eos(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "d.jsonl", STANDARD_ROWS)
    pairs, stats = load_pairs(path, tokenizer=tokenizer, max_length=64)
    assert stats.num_rows == 3 and stats.num_pairs == 3 and stats.num_bad_rows_skipped == 0
    eos = tokenizer.eos_token_id
    for pair, row, line in zip(pairs, STANDARD_ROWS, (1, 2, 3)):
        assert pair.source_line == line  # file order kept
        assert pair.prompt_ids[0] == tokenizer.bos_token_id
        assert list(pair.prompt_ids) == _ids(tokenizer, row["prompt"], specials=True)
        assert list(pair.chosen_ids) == _ids(tokenizer, row["chosen"], specials=False) + [eos]
        assert list(pair.rejected_ids) == _ids(tokenizer, row["rejected"], specials=False) + [eos]
        assert tokenizer.unk_token_id not in pair.prompt_ids + pair.chosen_ids + pair.rejected_ids


def test_eos_not_appended_twice(tmp_path, tokenizer):
    row = {"prompt": "name two fruits .", "chosen": "apple and pear . <eos>", "rejected": "cat ."}
    pairs, _ = load_pairs(_write_jsonl(tmp_path / "d.jsonl", [row]), tokenizer=tokenizer, max_length=64)
    eos = tokenizer.eos_token_id
    assert pairs[0].chosen_ids.count(eos) == 1 and pairs[0].chosen_ids[-1] == eos
    assert pairs[0].rejected_ids[-1] == eos


def test_conversational_format_follows_the_chat_template(tmp_path, tokenizer):
    # The rendered conversation is tokenized without adding special tokens, as TRL (and
    # apply_chat_template(tokenize=True)) does: this template writes no BOS, so there is none.
    pairs, _ = load_pairs(_write_jsonl(tmp_path / "d.jsonl", [CHAT_ROW]), tokenizer=tokenizer, max_length=64)
    pair = pairs[0]
    prompt_text = tokenizer.apply_chat_template(CHAT_ROW["prompt"], add_generation_prompt=True, tokenize=False)
    assert list(pair.prompt_ids) == _ids(tokenizer, prompt_text, specials=False)
    assert tokenizer.bos_token_id not in pair.prompt_ids
    for completion_ids, key in ((pair.chosen_ids, "chosen"), (pair.rejected_ids, "rejected")):
        full_text = tokenizer.apply_chat_template(CHAT_ROW["prompt"] + CHAT_ROW[key], tokenize=False)
        # Prompt + completion is exactly the tokenized full conversation.
        assert list(pair.prompt_ids + completion_ids) == _ids(tokenizer, full_text, specials=False)
        assert list(pair.prompt_ids + completion_ids) == tokenizer.apply_chat_template(
            CHAT_ROW["prompt"] + CHAT_ROW[key], tokenize=True, return_dict=True)["input_ids"]
        assert completion_ids[-1] == tokenizer.eos_token_id  # the template closes the turn
    assert tokenizer.decode(pair.chosen_ids, skip_special_tokens=True).strip() == "apple and pear ."


def test_chat_template_that_writes_bos_gives_a_single_bos(tmp_path, tokenizer):
    own = AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER_DIR)
    own.chat_template = "{{ bos_token }}" + tokenizer.chat_template
    pairs, _ = load_pairs(_write_jsonl(tmp_path / "d.jsonl", [CHAT_ROW]), tokenizer=own, max_length=64)
    assert pairs[0].prompt_ids[0] == own.bos_token_id and pairs[0].prompt_ids[1] != own.bos_token_id


def test_implicit_prompt_from_texts(tmp_path, tokenizer):
    row = {"chosen": "q : name two fruits . a : apple and pear .", "rejected": "q : name two fruits . a : cat and dog ."}
    pairs, _ = load_pairs(_write_jsonl(tmp_path / "d.jsonl", [row]), tokenizer=tokenizer, max_length=64)
    eos = tokenizer.eos_token_id
    assert list(pairs[0].prompt_ids) == _ids(tokenizer, "q : name two fruits . a :", specials=True)
    assert list(pairs[0].chosen_ids) == _ids(tokenizer, "apple and pear .", specials=False) + [eos]
    assert list(pairs[0].rejected_ids) == _ids(tokenizer, "cat and dog .", specials=False) + [eos]


def test_implicit_prompt_never_splits_a_word(tmp_path, tokenizer):
    row = {"chosen": "name two . pear and plum", "rejected": "name two . peach and plum"}
    pairs, _ = load_pairs(_write_jsonl(tmp_path / "d.jsonl", [row]), tokenizer=tokenizer, max_length=64)
    assert list(pairs[0].prompt_ids) == _ids(tokenizer, "name two .", specials=True)
    assert pairs[0].chosen_ids[0] == tokenizer.convert_tokens_to_ids("pear")
    assert pairs[0].rejected_ids[0] == tokenizer.convert_tokens_to_ids("peach")


def test_implicit_prompt_from_conversations(tmp_path, tokenizer):
    row = {"chosen": CHAT_ROW["prompt"] + CHAT_ROW["chosen"], "rejected": CHAT_ROW["prompt"] + CHAT_ROW["rejected"]}
    path_implicit = _write_jsonl(tmp_path / "implicit.jsonl", [row])
    path_explicit = _write_jsonl(tmp_path / "explicit.jsonl", [CHAT_ROW])
    implicit, _ = load_pairs(path_implicit, tokenizer=tokenizer, max_length=64)
    explicit, _ = load_pairs(path_explicit, tokenizer=tokenizer, max_length=64)
    assert implicit == explicit


# ----------------------------------------------------------------------------- the prompt/completion boundary


@pytest.fixture(scope="module")
def merging_tokenizer():
    """A character BPE with one merge, "a" + "b" -> "ab": a prompt ending in "a" followed by a
    completion starting with "b" (no space between) tokenizes differently together than apart."""
    from tests.helpers.data import merging_bpe_tokenizer

    tokenizer = merging_bpe_tokenizer()
    assert tokenizer("x a")["input_ids"] == [2, 7, 9, 4]  # <bos> x ' ' a
    assert tokenizer("x ab")["input_ids"] == [2, 7, 9, 10]  # <bos> x ' ' ab: the merge crosses the boundary
    return tokenizer


def _tokens(tokenizer, ids) -> list[str]:
    return tokenizer.convert_ids_to_tokens(list(ids))


def test_split_at_prompt_cuts_at_the_prefix_shared_with_both_completions():
    assert split_at_prompt([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 5]) == ([1, 2, 3], [4], [5])
    assert split_at_prompt([1, 2, 3], [1, 2, 9, 4], [1, 2, 3, 5]) == ([1, 2], [9, 4], [3, 5])
    assert split_at_prompt([1, 2, 3], [1, 2, 3, 4], [1, 7]) == ([1], [2, 3, 4], [7])
    assert split_at_prompt([1, 2], [8, 4], [1, 2, 5]) == ([], [8, 4], [1, 2, 5])


def test_completion_that_merges_with_the_prompt_is_cut_as_trl_cuts_it(tmp_path, merging_tokenizer):
    """Prompt "x a", chosen "b y" (no leading space: "a"+"b" merge), rejected " c" (no merge).
    The prompt is the longest start the tokenized prompt shares with BOTH tokenized
    prompt+completion strings; each completion is the rest of its string. So the prompt loses its
    "a", the chosen completion starts with the merged "ab" and the rejected one with the "a"."""
    tok = merging_tokenizer
    row = {"prompt": "x a", "chosen": "b y", "rejected": " c"}
    pairs, stats = load_pairs(_write_jsonl(tmp_path / "d.jsonl", [row]), tokenizer=tok, max_length=64)
    pair = pairs[0]
    assert _tokens(tok, pair.prompt_ids) == ["<bos>", "x", " "]
    assert _tokens(tok, pair.chosen_ids) == ["ab", " ", "y", "<eos>"]
    assert _tokens(tok, pair.rejected_ids) == ["a", " ", "c", "<eos>"]
    # The training sequences are exactly the tokenized prompt+completion strings, one BOS, EOS appended.
    assert list(pair.prompt_ids + pair.chosen_ids) == tok("x ab y<eos>")["input_ids"]
    assert list(pair.prompt_ids + pair.rejected_ids) == tok("x a c<eos>")["input_ids"]
    # The loss covers exactly the completion tokens, the merged one included.
    batch = collate(pairs, pad_token_id=tok.pad_token_id, seq_len=padded_seq_len(pairs))
    assert batch.labels[0][batch.loss_mask[0].bool()].tolist() == list(pair.chosen_ids)
    assert batch.labels[1][batch.loss_mask[1].bool()].tolist() == list(pair.rejected_ids)


def test_no_merge_keeps_the_whole_prompt_and_an_eos_string_is_not_doubled(tmp_path, merging_tokenizer):
    tok = merging_tokenizer
    row = {"prompt": "x a", "chosen": " b y<eos>", "rejected": " c"}
    pairs, _ = load_pairs(_write_jsonl(tmp_path / "d.jsonl", [row]), tokenizer=tok, max_length=64)
    assert _tokens(tok, pairs[0].prompt_ids) == ["<bos>", "x", " ", "a"]
    assert _tokens(tok, pairs[0].chosen_ids) == [" ", "b", " ", "y", "<eos>"]
    assert _tokens(tok, pairs[0].rejected_ids) == [" ", "c", "<eos>"]


def test_truncation_and_dropping_use_the_prompt_after_the_cut(tmp_path, merging_tokenizer):
    tok = merging_tokenizer
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x a", "chosen": "b y", "rejected": " c"}])
    pairs, stats = load_pairs(path, tokenizer=tok, max_length=4)  # prompt: 3 tokens after the cut
    assert stats.num_dropped_prompt_too_long == 0
    assert _tokens(tok, pairs[0].prompt_ids) == ["<bos>", "x", " "]
    assert _tokens(tok, pairs[0].chosen_ids) == ["ab"] and _tokens(tok, pairs[0].rejected_ids) == ["a"]
    pairs, stats = load_pairs(path, tokenizer=tok, max_length=3)
    assert pairs == [] and stats.num_dropped_prompt_too_long == 1


def test_conversation_merging_across_the_boundary(tmp_path, merging_tokenizer):
    """A chat template that writes no BOS and no separator after the prompt: nothing is added to
    the rendered text, and the cut follows the same rule as for plain text."""
    tok = copy.deepcopy(merging_tokenizer)
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}"
                         "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}")
    row = {"prompt": [{"role": "user", "content": "x a"}], "chosen": [{"role": "assistant", "content": "b y"}],
           "rejected": [{"role": "assistant", "content": " c"}]}
    pairs, _ = load_pairs(_write_jsonl(tmp_path / "d.jsonl", [row]), tokenizer=tok, max_length=64)
    assert _tokens(tok, pairs[0].prompt_ids) == ["x", " "]
    assert _tokens(tok, pairs[0].chosen_ids) == ["ab", " ", "y", "<eos>"]
    assert _tokens(tok, pairs[0].rejected_ids) == ["a", " ", "c", "<eos>"]


def test_prompt_swallowed_by_a_merge_is_a_bad_row(tmp_path, merging_tokenizer):
    tok = copy.deepcopy(merging_tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    row = {"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "assistant", "content": "b"}],
           "rejected": [{"role": "assistant", "content": "c"}]}
    with pytest.raises(DataError, match=r"d\.jsonl:1: 'prompt' tokenizes to no tokens that prompt \+ completion"):
        load_pairs(_write_jsonl(tmp_path / "d.jsonl", [row]), tokenizer=tok, max_length=64)


# ----------------------------------------------------------------------------- file types


def test_json_array_json_columns_and_parquet_match_jsonl(tmp_path, tokenizer):
    # One file holds one kind of row: the texts, then the conversations, each in every file type.
    reference, _ = load_pairs(_write_jsonl(tmp_path / "d.jsonl", STANDARD_ROWS), tokenizer=tokenizer, max_length=64)
    chat_reference, _ = load_pairs(_write_jsonl(tmp_path / "chat.jsonl", [CHAT_ROW]), tokenizer=tokenizer, max_length=64)
    reference += chat_reference

    array_path = tmp_path / "array.json"
    array_path.write_text("[\n" + ",\n".join(json.dumps(row) for row in STANDARD_ROWS) + "\n]\n")  # row i on line i+1
    chat_array_path = tmp_path / "chat_array.json"
    chat_array_path.write_text("[\n\n" + json.dumps(CHAT_ROW) + "\n]\n")  # on line 3
    columns_path = tmp_path / "columns.json"
    columns_path.write_text(json.dumps({key: [row[key] for row in STANDARD_ROWS] for key in STANDARD_ROWS[0]}))
    parquet_path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(STANDARD_ROWS), str(parquet_path))
    chat_parquet_path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist([CHAT_ROW, CHAT_ROW]), str(chat_parquet_path))

    from_array, _ = load_pairs(str(array_path), tokenizer=tokenizer, max_length=64)
    from_array += load_pairs(str(chat_array_path), tokenizer=tokenizer, max_length=64)[0]
    from_columns, _ = load_pairs(str(columns_path), tokenizer=tokenizer, max_length=64)
    from_parquet, stats = load_pairs(str(parquet_path), tokenizer=tokenizer, max_length=64)
    from_chat_parquet, _ = load_pairs(str(chat_parquet_path), tokenizer=tokenizer, max_length=64)
    assert [p.source_line for p in from_array] == [2, 3, 4, 3]  # the line a row starts on
    assert [(p.prompt_ids, p.chosen_ids, p.rejected_ids) for p in from_array] == [
        (p.prompt_ids, p.chosen_ids, p.rejected_ids) for p in reference
    ]
    assert from_columns == reference[:3]
    assert from_parquet == reference[:3] and stats.num_rows == 3
    assert [p.prompt_ids for p in from_chat_parquet] == [reference[3].prompt_ids] * 2
    assert [p.source_line for p in from_chat_parquet] == [1, 2]


def test_json_file_with_json_lines_is_accepted(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "lines.json", STANDARD_ROWS)
    pairs, stats = load_pairs(path, tokenizer=tokenizer, max_length=64)
    assert stats.num_pairs == 3 and [p.source_line for p in pairs] == [1, 2, 3]


def test_blank_lines_are_not_rows_but_count_as_lines(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(STANDARD_ROWS[0]) + "\n\n   \n" + json.dumps(STANDARD_ROWS[1]) + "\n")
    pairs, stats = load_pairs(str(path), tokenizer=tokenizer, max_length=64)
    assert stats.num_rows == 2 and [p.source_line for p in pairs] == [1, 4]


@pytest.mark.parametrize(
    "name, content, expected",
    [
        ("missing.jsonl", None, "no such file"),
        ("data.csv", "prompt,chosen,rejected\n", "unknown file type '.csv'"),
        ("empty.jsonl", "\n\n", "contains no rows"),
        ("broken.json", '[\n{"prompt": "a"},\n{"prompt": \n', "broken JSON"),
        ("broken.parquet", "not parquet at all", "cannot read Parquet file"),
    ],
)
def test_file_level_problems_raise_one_line_data_error(tmp_path, tokenizer, name, content, expected):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError) as caught:
        load_pairs(str(path), tokenizer=tokenizer, max_length=64)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(path)) and expected in message


def test_conversation_without_chat_template_is_an_error(tmp_path, tokenizer):
    own = AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER_DIR)
    own.chat_template = None
    path = _write_jsonl(tmp_path / "d.jsonl", [CHAT_ROW, CHAT_ROW])
    with pytest.raises(DataError, match=r"d\.jsonl:1: conversational row but the tokenizer has no chat_template"):
        load_pairs(path, tokenizer=own, max_length=64, on_bad_row="skip")


# ----------------------------------------------------------------------------- truncation


def test_truncation_keeps_the_start(tmp_path, tokenizer):
    row = {"prompt": "name two fruits .", "chosen": "apple and pear and plum and mango .", "rejected": "cat ."}
    path = _write_jsonl(tmp_path / "d.jsonl", [row])
    prompt = _ids(tokenizer, row["prompt"], specials=True)
    chosen = _ids(tokenizer, row["chosen"], specials=False) + [tokenizer.eos_token_id]
    rejected = _ids(tokenizer, row["rejected"], specials=False) + [tokenizer.eos_token_id]
    max_length = len(prompt) + 4
    pairs, _ = load_pairs(path, tokenizer=tokenizer, max_length=max_length)
    assert list(pairs[0].prompt_ids) == prompt
    assert list(pairs[0].chosen_ids) == chosen[:4]  # the head survives, the EOS is cut
    assert list(pairs[0].rejected_ids) == rejected  # already short enough: untouched
    assert len(pairs[0].prompt_ids) + len(pairs[0].chosen_ids) == max_length


def test_pairs_whose_prompt_fills_max_length_are_dropped_and_counted(tmp_path, tokenizer):
    short = {"prompt": "hi", "chosen": "apple .", "rejected": "cat ."}
    long = {"prompt": "name two fruits please .", "chosen": "apple .", "rejected": "cat ."}
    path = _write_jsonl(tmp_path / "d.jsonl", [short, long, short])
    long_prompt_len = len(_ids(tokenizer, long["prompt"], specials=True))

    pairs, stats = load_pairs(path, tokenizer=tokenizer, max_length=long_prompt_len)
    assert stats.num_rows == 3 and stats.num_pairs == 2 and stats.num_dropped_prompt_too_long == 1
    assert [p.source_line for p in pairs] == [1, 3]

    pairs, stats = load_pairs(path, tokenizer=tokenizer, max_length=long_prompt_len + 1)
    assert stats.num_dropped_prompt_too_long == 0 and len(pairs[1].chosen_ids) == 1


# ----------------------------------------------------------------------------- bad rows

GOOD_LINE = json.dumps(STANDARD_ROWS[0]).encode()
BAD_LINES = {
    "missing_key": (b'{"prompt": "a", "chosen": "b"}', "missing key 'rejected'"),
    "wrong_type": (b'{"prompt": "a", "chosen": 3, "rejected": "c"}', "'chosen' must be a string or a list"),
    "empty_string": (b'{"prompt": "a", "chosen": "  ", "rejected": "c"}', "'chosen' is an empty string"),
    "null": (b'{"prompt": null, "chosen": "b", "rejected": "c"}', "'prompt' is null"),
    "identical": (b'{"prompt": "a", "chosen": "b", "rejected": "b"}', "'chosen' and 'rejected' are identical"),
    "invalid_utf8": (b'{"prompt": "a\xff\xfe", "chosen": "b", "rejected": "c"}', "invalid UTF-8"),
    "lone_surrogate": (b'{"prompt": "a\\ud800", "chosen": "b", "rejected": "c"}', "not valid UTF-8"),
    "broken_json": (b'{"prompt": "a", "chosen": "b", "rejected": ', "broken JSON"),
    "not_an_object": (b'["a", "b", "c"]', "row must be an object, got list"),
    "completion_not_assistant": (
        json.dumps({**CHAT_ROW, "chosen": [{"role": "user", "content": "x"}]}).encode(),
        "completions must come from 'assistant'",
    ),
    "unknown_role": (
        json.dumps({**CHAT_ROW, "prompt": [{"role": "robot", "content": "x"}]}).encode(),
        "unknown role 'robot'",
    ),
    "message_without_content": (
        json.dumps({**CHAT_ROW, "prompt": [{"role": "user"}]}).encode(),
        "message 1 is not a",
    ),
    "empty_conversation": (json.dumps({**CHAT_ROW, "rejected": []}).encode(), "'rejected' is an empty conversation"),
    "mixed_formats": (json.dumps({**CHAT_ROW, "chosen": "apple ."}).encode(), "mixed formats"),
}


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_bad_row_raises_one_line_error_naming_file_and_line(tmp_path, tokenizer, kind):
    bad_line, expected = BAD_LINES[kind]
    path = tmp_path / "d.jsonl"
    path.write_bytes(GOOD_LINE + b"\n" + GOOD_LINE + b"\n" + bad_line + b"\n" + GOOD_LINE + b"\n")
    with pytest.raises(DataError) as caught:
        load_pairs(str(path), tokenizer=tokenizer, max_length=64)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{path}:3: ") and expected in message


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_bad_row_is_skipped_and_counted(tmp_path, tokenizer, kind):
    bad_line, _ = BAD_LINES[kind]
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join([GOOD_LINE, bad_line, GOOD_LINE, bad_line]) + b"\n")
    pairs, stats = load_pairs(str(path), tokenizer=tokenizer, max_length=64, on_bad_row="skip")
    assert [p.source_line for p in pairs] == [1, 3]
    assert stats.num_rows == 4 and stats.num_pairs == 2
    assert stats.num_bad_rows_skipped == 2 and stats.first_bad_lines == (2, 4)


def test_bad_implicit_rows(tmp_path, tokenizer):
    rows = [
        {"chosen": "apple and pear .", "rejected": "cat and dog ."},  # nothing shared
        {"chosen": CHAT_ROW["chosen"], "rejected": CHAT_ROW["rejected"]},  # no shared message
        {"prompt": "a", "chosen": "b c", "rejected": "b d"},  # format switches mid-file
        {"chosen": "q : a . x", "rejected": "q : a . y"},
    ]
    pairs, stats = load_pairs(
        _write_jsonl(tmp_path / "d.jsonl", rows), tokenizer=tokenizer, max_length=64, on_bad_row="skip"
    )
    assert stats.first_bad_lines == (1, 2, 3) and [p.source_line for p in pairs] == [4]
    with pytest.raises(DataError, match=r"d\.jsonl:1: 'chosen' and 'rejected' share no leading text"):
        load_pairs(str(tmp_path / "d.jsonl"), tokenizer=tokenizer, max_length=64)


def test_explicit_file_row_without_prompt_is_bad(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "d.jsonl", [STANDARD_ROWS[0], {"chosen": "q : a . x", "rejected": "q : a . y"}])
    with pytest.raises(DataError, match=r"d\.jsonl:2: missing key 'prompt'"):
        load_pairs(path, tokenizer=tokenizer, max_length=64)


def test_first_bad_lines_are_capped(tmp_path, tokenizer):
    lines = [b"{broken"] * 25 + [GOOD_LINE]
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(lines))
    pairs, stats = load_pairs(str(path), tokenizer=tokenizer, max_length=64, on_bad_row="skip")
    assert len(pairs) == 1 and stats.num_bad_rows_skipped == 25
    assert stats.first_bad_lines == tuple(range(1, 11))


def test_bad_rows_in_json_array_and_parquet_name_the_row(tmp_path, tokenizer):
    rows = [STANDARD_ROWS[0], {**STANDARD_ROWS[1], "rejected": None}]
    json_path = tmp_path / "d.json"
    json_path.write_text(json.dumps(rows, indent=2))  # JSON arrays: the line the bad row starts on
    start_line = json.dumps(rows, indent=2).splitlines().index("  {", 2) + 1
    parquet_path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), str(parquet_path))  # Parquet: the row number
    for path, where in ((json_path, start_line), (parquet_path, 2)):
        with pytest.raises(DataError, match=rf"^{path}:{where}: 'rejected' is null$"):
            load_pairs(str(path), tokenizer=tokenizer, max_length=64)


def test_invalid_arguments(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "d.jsonl", STANDARD_ROWS)
    with pytest.raises(DataError, match="on_bad_row"):
        load_pairs(path, tokenizer=tokenizer, max_length=64, on_bad_row="ignore")
    with pytest.raises(DataError, match="max_length"):
        load_pairs(path, tokenizer=tokenizer, max_length=1)


# ----------------------------------------------------------------------------- what the run is told


def test_a_prompt_column_under_another_name_is_named_as_unused(tmp_path, tokenizer, monkeypatch):
    """'question' instead of 'prompt': the file is in implicit-prompt format (the prompt is the
    shared start "yes :"), and the one note says the column is not used and what that means."""
    monkeypatch.chdir(tmp_path)
    rows = [{"question": "name two fruits .", "chosen": "yes : apple and pear .", "rejected": "yes : cat and dog ."},
            {"question": "name two tools .", "chosen": "yes : saw and axe .", "rejected": "yes : red and blue ."}]
    pairs, stats = load_pairs(_write_jsonl("prefs.jsonl", rows), tokenizer=tokenizer, max_length=64)
    assert [list(p.prompt_ids) for p in pairs] == [_ids(tokenizer, "yes :", specials=True)] * 2
    assert stats.unused_columns == ("question",) and stats.has_prompt is False
    notes = data_notes("prefs.jsonl", stats, max_length=64)
    assert notes == ["prefs.jsonl: ignoring unused column(s) 'question' (recognised: prompt, chosen, rejected); "
                     "with no 'prompt' column, each prompt is the shared start of 'chosen' and 'rejected'"]
    assert "    " + notes[0] + "\n" in DATA_DOC  # docs/DATA.md quotes the line as it is printed


def test_unused_columns_of_every_row_are_named_first_seen_first(tmp_path, tokenizer):
    rows = [{**STANDARD_ROWS[0], "id": 1}, {**STANDARD_ROWS[1], "score": 2.0, "id": 2}, STANDARD_ROWS[2]]
    _, stats = load_pairs(_write_jsonl(tmp_path / "d.jsonl", rows), tokenizer=tokenizer, max_length=64)
    assert stats.unused_columns == ("id", "score") and stats.has_prompt is True
    assert data_notes("d.jsonl", stats, max_length=64) == [
        "d.jsonl: ignoring unused column(s) 'id', 'score' (recognised: prompt, chosen, rejected)"]
    parquet_path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{**row, "source": "x"} for row in STANDARD_ROWS]), str(parquet_path))
    assert load_pairs(str(parquet_path), tokenizer=tokenizer, max_length=64)[1].unused_columns == ("source",)
    _, stats = load_pairs(_write_jsonl(tmp_path / "plain.jsonl", STANDARD_ROWS), tokenizer=tokenizer, max_length=64)
    assert stats.unused_columns == () and data_notes("plain.jsonl", stats, max_length=64) == []


@pytest.mark.parametrize("on_bad_row", ["error", "skip"])
def test_a_file_that_mixes_texts_and_conversations_is_refused(tmp_path, tokenizer, monkeypatch, on_bad_row):
    monkeypatch.chdir(tmp_path)
    path = _write_jsonl("prefs.jsonl", [STANDARD_ROWS[0], STANDARD_ROWS[1], CHAT_ROW, STANDARD_ROWS[2]])
    with pytest.raises(DataError) as caught:
        load_pairs(path, tokenizer=tokenizer, max_length=64, on_bad_row=on_bad_row)
    assert str(caught.value) == ("prefs.jsonl: mixes plain-text rows (first on line 1) and conversational rows "
                                 "(first on line 3); one file holds one kind (docs/DATA.md)")
    assert f"    error: {caught.value}\n" in DATA_DOC  # docs/DATA.md quotes the refusal as it is printed


def test_mixing_is_found_whichever_kind_comes_first_and_in_implicit_prompt_files(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "d.jsonl", [CHAT_ROW, CHAT_ROW, STANDARD_ROWS[0]])
    with pytest.raises(DataError, match=r"d\.jsonl: mixes plain-text rows \(first on line 3\) and conversational "
                                        r"rows \(first on line 1\)"):
        load_pairs(path, tokenizer=tokenizer, max_length=64)
    implicit_chat = {"chosen": CHAT_ROW["prompt"] + CHAT_ROW["chosen"], "rejected": CHAT_ROW["prompt"] + CHAT_ROW["rejected"]}
    implicit_text = {"chosen": "q : a . x", "rejected": "q : a . y"}
    path = _write_jsonl(tmp_path / "i.jsonl", [implicit_text, implicit_chat])
    with pytest.raises(DataError, match=r"i\.jsonl: mixes plain-text rows \(first on line 1\) and conversational "
                                        r"rows \(first on line 2\)"):
        load_pairs(path, tokenizer=tokenizer, max_length=64)


def test_a_skipped_bad_row_of_the_other_kind_is_not_a_mix(tmp_path, tokenizer):
    bad_chat = {**CHAT_ROW, "prompt": [{"role": "robot", "content": "x"}]}
    path = _write_jsonl(tmp_path / "d.jsonl", [STANDARD_ROWS[0], bad_chat, STANDARD_ROWS[1]])
    pairs, stats = load_pairs(path, tokenizer=tokenizer, max_length=64, on_bad_row="skip")
    assert [p.source_line for p in pairs] == [1, 3] and stats.first_bad_lines == (2,)


def test_truncation_is_counted_in_pairs_and_tokens(tmp_path, tokenizer):
    rows = STANDARD_ROWS + [  # at max_length 10: the standard rows fit, these two do not
        {"prompt": "hi", "chosen": " apple and pear and plum and mango .", "rejected": " cat ."},
        {"prompt": "hi", "chosen": " apple and pear and plum and mango and cat .", "rejected": " red and blue and saw and axe ."},
    ]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    eos = tokenizer.eos_token_id
    max_length = 10
    expected_pairs = expected_tokens = 0
    for row in rows:  # what the cut removes, from the pieces tokenized on their own (no merges in this vocabulary)
        budget = max_length - len(_ids(tokenizer, row["prompt"], specials=True))
        cut = [max(len(_ids(tokenizer, row[key], specials=False)) + 1 - budget, 0) for key in ("chosen", "rejected")]
        expected_pairs += sum(cut) > 0
        expected_tokens += sum(cut)
    assert 0 < expected_pairs < len(rows)  # some pairs are cut, some are not
    pairs, stats = load_pairs(path, tokenizer=tokenizer, max_length=max_length)
    assert stats.num_pairs == len(rows) and stats.num_dropped_prompt_too_long == 0
    assert (stats.num_truncated_pairs, stats.num_truncated_tokens) == (expected_pairs, expected_tokens)
    full, _ = load_pairs(path, tokenizer=tokenizer, max_length=64)
    kept = sum(len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)
    assert sum(len(p.chosen_ids) + len(p.rejected_ids) for p in full) - kept == expected_tokens
    assert all(eos in p.chosen_ids and eos in p.rejected_ids for p in full)
    assert data_notes("d.jsonl", stats, max_length=max_length) == [
        f"d.jsonl: --max-length 10 truncated {expected_pairs} of 5 pairs, dropping {expected_tokens} completion tokens"]


def test_dropped_pairs_are_not_counted_as_truncated(tmp_path, tokenizer):
    long = {"prompt": "name two fruits please .", "chosen": "apple .", "rejected": "cat ."}
    path = _write_jsonl(tmp_path / "d.jsonl", [long, STANDARD_ROWS[0]])
    max_length = len(_ids(tokenizer, long["prompt"], specials=True))
    _, stats = load_pairs(path, tokenizer=tokenizer, max_length=max_length)
    assert stats.num_dropped_prompt_too_long == 1 and stats.num_truncated_pairs == 1
    budget = max_length - len(_ids(tokenizer, STANDARD_ROWS[0]["prompt"], specials=True))
    assert 0 < budget
    lengths = [len(_ids(tokenizer, STANDARD_ROWS[0][key], specials=False)) + 1 for key in ("chosen", "rejected")]
    assert stats.num_truncated_tokens == sum(length - budget for length in lengths)  # only the kept pair's cut


def test_the_documented_truncation_line_is_the_printed_one():
    stats = DataStats(num_rows=2000, num_pairs=2000, num_dropped_prompt_too_long=0, num_bad_rows_skipped=0,
                      first_bad_lines=(), num_truncated_pairs=12, num_truncated_tokens=31)
    assert data_notes("prefs.jsonl", stats, max_length=64) == [
        "prefs.jsonl: --max-length 64 truncated 12 of 2000 pairs, dropping 31 completion tokens"]
    assert "    prefs.jsonl: --max-length 64 truncated 12 of 2000 pairs, dropping 31 completion tokens\n" in DATA_DOC


@pytest.mark.parametrize("name, content, where", [
    ("d.jsonl", '{"prompt": "a\tb", "chosen": "c", "rejected": "d"}\n', 1),
    ("d.json", '[\n{"prompt": "a\tb", "chosen": "c", "rejected": "d"}\n]\n', 2),
])
def test_broken_json_says_at_column_once(tmp_path, tokenizer, name, content, where):
    """json's "Invalid control character at" (a raw tab in a string) gave "... at at column"."""
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError) as caught:
        load_pairs(str(path), tokenizer=tokenizer, max_length=64)
    assert str(caught.value) == f"{path}:{where}: broken JSON (Invalid control character at column 14)"
    path.write_text(content.replace('"d"}', '"d}'))  # json's "Unterminated string starting at"
    with pytest.raises(DataError) as caught:
        load_pairs(str(path), tokenizer=tokenizer, max_length=64)
    assert " at at " not in str(caught.value) and "broken JSON (" in str(caught.value)


def test_the_train_command_prints_unused_columns_and_truncation_and_logs_them(tmp_path, tokenizer, ray_cluster):
    """Through the command line (in this process; one step of the tiny default model): the notes
    for the training file (a prompt column named 'question', every pair cut) and the eval file
    are printed, and OUTPUT/data_stats.json holds the same counts. --dtype fp32 is read as float32."""
    import yaml

    train = _write_jsonl(tmp_path / "train.jsonl", [
        {"question": f"name thing {i} .", "chosen": "sure : sheep and rabbit and bear and lion .",
         "rejected": "sure : saw and hammer ."} for i in range(8)])
    evaluate = _write_jsonl(tmp_path / "eval.jsonl", STANDARD_ROWS)
    out = tmp_path / "run"
    proc = main_in_process(["--data", train, "--eval-data", evaluate, "--max-length", "8", "--global-batch-size", "8",
                            "--micro-batch-size", "8", "--max-steps", "1", "--dtype", "fp32", "--output-dir", str(out)],
                           cluster=ray_cluster)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    # the default model's tokenizer is the embedded one
    expected = {name: load_pairs(path, tokenizer=tokenizer, max_length=8)[1]
                for name, path in (("data", train), ("eval_data", evaluate))}
    assert expected["data"].num_truncated_pairs == 8 and expected["eval_data"].num_truncated_pairs > 0
    assert [line for line in lines if "ignoring unused column" in line] == [
        f"{train}: ignoring unused column(s) 'question' (recognised: prompt, chosen, rejected); "
        "with no 'prompt' column, each prompt is the shared start of 'chosen' and 'rejected'"]
    for path, stats in ((train, expected["data"]), (evaluate, expected["eval_data"])):
        note = (f"{path}: --max-length 8 truncated {stats.num_truncated_pairs} of {stats.num_pairs} pairs, "
                f"dropping {stats.num_truncated_tokens} completion tokens")
        assert note in lines, proc.stdout
    logged = json.loads((out / "data_stats.json").read_text())
    for name, path in (("data", train), ("eval_data", evaluate)):
        assert logged[name]["path"] == path
        assert logged[name]["num_truncated_pairs"] == expected[name].num_truncated_pairs
        assert logged[name]["num_truncated_tokens"] == expected[name].num_truncated_tokens
    assert logged["data"]["unused_columns"] == ["question"] and logged["data"]["has_prompt"] is False
    assert yaml.safe_load((out / "config.yaml").read_text())["dtype"] == "float32"


# ----------------------------------------------------------------------------- batching


def test_global_batch_order_is_deterministic_and_drops_the_last_partial_batch():
    kwargs = dict(num_pairs=103, global_batch_size=10, seed=7, shuffle=True)
    first = global_batch_order(**kwargs, epoch=0)
    assert first == global_batch_order(**kwargs, epoch=0)
    assert len(first) == 10 and all(len(batch) == 10 for batch in first)
    flat = [index for batch in first for index in batch]
    assert len(set(flat)) == 100 and set(flat) <= set(range(103))
    assert flat != sorted(flat)  # shuffled
    assert global_batch_order(**kwargs, epoch=1) != first
    assert global_batch_order(num_pairs=103, global_batch_size=10, seed=8, shuffle=True, epoch=0) != first


def test_global_batch_order_without_shuffle_keeps_file_order():
    order = global_batch_order(num_pairs=7, global_batch_size=3, seed=1, shuffle=False, epoch=5)
    assert order == [[0, 1, 2], [3, 4, 5]]


def test_global_batch_order_needs_one_full_batch():
    with pytest.raises(DataError, match="fewer than global_batch_size 8"):
        global_batch_order(num_pairs=7, global_batch_size=8, seed=0, shuffle=True, epoch=0)
    assert len(global_batch_order(num_pairs=8, global_batch_size=8, seed=0, shuffle=True, epoch=0)) == 1


@pytest.mark.parametrize("num_pairs, gbs, dp, b", [(200, 64, 1, 8), (13, 8, 2, 2), (5, 8, 2, 2), (3, 8, 4, 2),
                                                    (64, 64, 2, 8), (1, 16, 1, 4)])
def test_eval_passes_cover_every_pair_once_in_equal_microbatches(num_pairs, gbs, dp, b):
    seen = []
    for rank in range(dp):
        for chunk, microbatches in eval_passes(num_pairs=num_pairs, global_batch_size=gbs, dp=dp, dp_rank=rank,
                                               micro_batch_size=b):
            assert len({len(ids) for ids in microbatches}) == 1 and 1 <= len(microbatches[0]) <= b
            for ids in microbatches:
                assert all(i in chunk for i in ids) and len(chunk) <= gbs
                seen.extend(ids)
    assert sorted(seen) == list(range(num_pairs))  # the default eval set: all 200, not 192


def test_eval_passes_split_a_full_chunk_as_a_training_step():
    passes = eval_passes(num_pairs=20, global_batch_size=8, dp=2, dp_rank=1, micro_batch_size=2)
    assert passes[0] == (range(0, 8), [[4, 5], [6, 7]])
    assert passes[1] == (range(8, 16), [[12, 13], [14, 15]])
    assert passes[2:] == [(range(16, 20), [[18, 19]])]
    rank0 = eval_passes(num_pairs=13, global_batch_size=8, dp=2, dp_rank=0, micro_batch_size=2)
    assert rank0[1:] == [(range(8, 13), [[8, 9]]), (range(8, 13), [[10]])]  # a smaller last microbatch: own pass


def _pair(prompt_len: int, chosen_len: int, rejected_len: int, *, line: int = 1) -> TokenizedPair:
    # Distinct id ranges make prompt, chosen and rejected tokens recognisable in the tensors.
    return TokenizedPair(
        prompt_ids=tuple(range(10, 10 + prompt_len)),
        chosen_ids=tuple(range(100, 100 + chosen_len)),
        rejected_ids=tuple(range(200, 200 + rejected_len)),
        source_line=line,
    )


def test_padded_seq_len_rounds_up_the_longest_pair():
    pairs = [_pair(3, 2, 9), _pair(5, 4, 1)]  # longest: 3 + 9 = 12
    assert padded_seq_len(pairs) == 16
    assert padded_seq_len(pairs, multiple=4) == 12
    assert padded_seq_len(pairs, multiple=1) == 12
    assert padded_seq_len([_pair(4, 4, 4)]) == 8


def test_collate_layout_labels_and_loss_mask():
    pairs = [_pair(3, 2, 5, line=1), _pair(1, 4, 1, line=2)]
    pad = 0
    batch = collate(pairs, pad_token_id=pad, seq_len=8)
    assert batch.tokens.shape == batch.labels.shape == batch.loss_mask.shape == (4, 8)
    assert batch.tokens.dtype == batch.labels.dtype == torch.int64 and batch.loss_mask.dtype == torch.float32

    expected_rows = [
        [10, 11, 12, 100, 101],  # pair 0 chosen
        [10, 100, 101, 102, 103],  # pair 1 chosen
        [10, 11, 12, 200, 201, 202, 203, 204],  # pair 0 rejected
        [10, 200],  # pair 1 rejected
    ]
    for row, expected in enumerate(expected_rows):
        padded = expected + [pad] * (8 - len(expected))
        assert batch.tokens[row].tolist() == padded
        assert batch.labels[row].tolist() == padded[1:] + [pad]
        # A label is a completion token exactly when its id is in the completion ranges (>= 100).
        completion_label = [1.0 if label >= 100 else 0.0 for label in padded[1:] + [pad]]
        assert batch.loss_mask[row].tolist() == completion_label
    assert batch.loss_mask.sum(dim=1).tolist() == [2.0, 4.0, 5.0, 1.0]


def test_collate_masks_by_position_even_when_a_completion_token_equals_pad():
    pair = TokenizedPair(prompt_ids=(5, 6), chosen_ids=(0, 0), rejected_ids=(7,), source_line=1)
    batch = collate([pair], pad_token_id=0, seq_len=6)
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0, 0, 0], [0, 1, 0, 0, 0, 0]]


def test_collate_rejects_a_pair_longer_than_seq_len():
    with pytest.raises(ValueError, match="line 4 has 9 tokens, more than seq_len 8"):
        collate([_pair(3, 6, 1, line=4)], pad_token_id=0, seq_len=8)


def test_loaded_pairs_collate_to_prompt_masked_batches(tmp_path, tokenizer):
    pairs, _ = load_pairs(_write_jsonl(tmp_path / "d.jsonl", STANDARD_ROWS), tokenizer=tokenizer, max_length=64)
    batch = collate(pairs, pad_token_id=tokenizer.pad_token_id, seq_len=padded_seq_len(pairs))
    for index, pair in enumerate(pairs):
        masked_labels = batch.labels[index][batch.loss_mask[index].bool()].tolist()
        assert masked_labels == list(pair.chosen_ids)
        masked_labels = batch.labels[len(pairs) + index][batch.loss_mask[len(pairs) + index].bool()].tolist()
        assert masked_labels == list(pair.rejected_ids)


def test_json_file_with_one_conversational_object_is_one_row(tmp_path, tokenizer):
    path = tmp_path / "one.json"
    row = {"chosen": CHAT_ROW["prompt"] + CHAT_ROW["chosen"], "rejected": CHAT_ROW["prompt"] + CHAT_ROW["rejected"]}
    path.write_text(json.dumps(row))
    pairs, stats = load_pairs(str(path), tokenizer=tokenizer, max_length=64)
    assert stats.num_rows == 1 and len(pairs) == 1


def test_chat_template_errors_are_bad_rows(tmp_path, tokenizer):
    own = AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER_DIR)
    own.chat_template = "{{ raise_exception('only one turn allowed') }}"
    path = _write_jsonl(tmp_path / "d.jsonl", [CHAT_ROW])
    with pytest.raises(DataError, match=r"d\.jsonl:1: chat template rejected the conversation \(.*only one turn"):
        load_pairs(path, tokenizer=own, max_length=64)
