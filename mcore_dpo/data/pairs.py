"""Preference data: rows on disk -> token ids -> global batches -> microbatch tensors.

Three row formats are accepted (the same ones TRL's DPO accepts); the files they come in are
read by data/sources.py:
  - standard:        {"prompt": str, "chosen": str, "rejected": str}
  - conversational:  the same keys, each a list of {"role", "content"} messages; the
                     prompt is rendered with the chat template and a generation prompt,
                     a completion is the rest of the rendered full conversation;
  - implicit prompt: only "chosen" and "rejected" (texts or conversations); the prompt is
                     their shared beginning.
A file holds texts or conversations, not both; other columns are unused, and named (`data_notes`).

Every process that calls `global_batch_order` with the same arguments gets the same
order, whatever its tp/pp/dp rank, so ranks never disagree on which pairs a step sees.

Over 500 lines: the accepted row formats (plain, conversational, explicit or implicit
prompt) with a one-line error for each way a row can be wrong, as one
reader; the microbatch tensors it ends in are cut by data/microbatches.py.
"""
from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from mcore_dpo.data.sources import DataError, _BadRow, _first_line, _read_rows

ROLES = ("system", "user", "assistant")
COLUMNS = ("prompt", "chosen", "rejected")  # every other column of a file is unused, but:
MARGIN = "margin"  # optional: a number per pair that --objective reward reads (TRL's Bradley-Terry margin)
UNPAIRED_COLUMNS = ("prompt", "completion", "label")  # --objective kto's rows (data/unpaired.py)
MAX_BAD_LINES_RECORDED = 10


@dataclass(frozen=True)
class TokenizedPair:
    prompt_ids: tuple[int, ...]
    chosen_ids: tuple[int, ...]  # completion only, already truncated
    rejected_ids: tuple[int, ...]
    source_line: int  # 1-based line (JSONL) or row (JSON array, Parquet, saved dataset) number in the source
    # An unpaired sample (--objective kto, data/unpaired.py): chosen_ids is its completion, rejected_ids
    # its KL completion, label True for a desirable completion. None: a preference pair.
    label: bool | None = None
    margin: float | None = None  # the row's "margin" (--objective reward), None without one


@dataclass(frozen=True)
class DataStats:
    num_rows: int
    num_pairs: int
    num_dropped_prompt_too_long: int
    num_bad_rows_skipped: int
    first_bad_lines: tuple[int, ...]
    num_truncated_pairs: int = 0  # kept pairs with a completion cut to fit max_length
    num_truncated_tokens: int = 0  # completion tokens those cuts removed (chosen and rejected)
    unused_columns: tuple[str, ...] = ()  # columns of the file that are not in COLUMNS, first seen first
    has_prompt: bool = True  # False: implicit-prompt file, each prompt is the shared start of its completions
    unpaired: bool = False  # rows {prompt, completion, label} (data/unpaired.py), pairs unpaired
    # whole_rows (--objective reward): pairs with a sequence over max_length, dropped (never cut)
    num_dropped_too_long: int = 0


@dataclass
class Microbatch:
    tokens: torch.Tensor  # int64 [2b, S]: rows 0..b-1 prompt+chosen, rows b..2b-1 prompt+rejected
    labels: torch.Tensor  # int64 [2b, S]: labels[:, t] = tokens[:, t+1]; last column is padding
    loss_mask: torch.Tensor  # float32 [2b, S]: 1.0 where labels[:, t] is a completion token
    # Rows of segments only: packed (`packing.collate_packed`: one row [1, W] holding every
    # sequence) or shared-prompt (`prefix_sharing`: rows [b, W] of one pair each, or packed).
    position_ids: torch.Tensor | None = None  # int64 [rows, W]: restart at 0 in each sequence
    segment_ids: torch.Tensor | None = None  # int64 [rows, W]: the token's sequence as an unpacked row; pads 2b
    num_sequences: int | None = None  # 2b
    num_positions: int | None = None  # the largest position + 1
    seq_lens: tuple[int, ...] | None = None  # packed, unshared: segment lengths in layout order (padding last)
    shared_prompt: torch.Tensor | None = None  # bool [rows, W]: a shared pair's prompt body (prefix_sharing)

    @property
    def has_segments(self) -> bool:
        return self.segment_ids is not None


@dataclass(frozen=True)
class _RawPair:
    prompt: str | list[dict[str, str]]
    chosen: str | list[dict[str, str]]
    rejected: str | list[dict[str, str]]
    is_conversation: bool
    label: bool | None = None  # an unpaired row: chosen and rejected are its one completion
    margin: float | None = None
    whole: bool = False  # its sequences are used whole (`load_pairs`' whole_rows): it needs no prompt


# ----------------------------------------------------------------------------- validation


def _check_text(value: str, *, what: str) -> str:
    if not value.strip():
        raise _BadRow(f"{what} is an empty string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _BadRow(f"{what} is not valid UTF-8 (lone surrogate escape)") from None
    return value


def _check_messages(value: list, *, key: str) -> list[dict[str, str]]:
    if not value:
        raise _BadRow(f"'{key}' is an empty conversation")
    messages = []
    for number, message in enumerate(value, start=1):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise _BadRow(f"'{key}' message {number} is not a {{\"role\", \"content\"}} object")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise _BadRow(f"'{key}' message {number} has unknown role {role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise _BadRow(f"'{key}' message {number} content must be a string, got {type(content).__name__}")
        _check_text(content, what=f"'{key}' message {number} content")
        messages.append({"role": role, "content": content})
    return messages


def _check_value(row: dict, *, key: str) -> str | list[dict[str, str]]:
    if key not in row:
        raise _BadRow(f"missing key '{key}'")
    value = row[key]
    if value is None:
        raise _BadRow(f"'{key}' is null")
    if isinstance(value, str):
        return _check_text(value, what=f"'{key}'")
    if isinstance(value, list):
        return _check_messages(value, key=key)
    raise _BadRow(f"'{key}' must be a string or a list of messages, got {type(value).__name__}")


def _check_completion_roles(messages: list[dict[str, str]], *, key: str) -> None:
    for number, message in enumerate(messages, start=1):
        if message["role"] != "assistant":
            raise _BadRow(f"'{key}' message {number} has role {message['role']!r}; completions must come from 'assistant'")


def _split_implicit_text(chosen: str, rejected: str, *, whole: bool = False) -> tuple[str, str, str]:
    shared = 0
    for chosen_char, rejected_char in zip(chosen, rejected):
        if chosen_char != rejected_char:
            break
        shared += 1
    # Cut at the last whitespace of the shared part, so no completion starts mid-word
    # and the space before the first differing word goes with the completion.
    cut = shared - 1
    while cut >= 0 and not chosen[cut].isspace():
        cut -= 1
    if cut <= 0 or not chosen[:cut].strip():
        if whole:  # sequences used whole need no prompt
            return "", chosen, rejected
        raise _BadRow("'chosen' and 'rejected' share no leading text to use as the prompt")
    return chosen[:cut], chosen[cut:], rejected[cut:]


def _split_implicit_messages(
    chosen: list[dict[str, str]], rejected: list[dict[str, str]], *, whole: bool = False
) -> tuple[list[dict[str, str]], list[dict[str, str]], list[dict[str, str]]]:
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0 and not whole:  # sequences used whole need no prompt
        raise _BadRow("'chosen' and 'rejected' share no leading messages to use as the prompt")
    for key, messages in (("chosen", chosen), ("rejected", rejected)):
        if len(messages) == shared:
            raise _BadRow(f"'{key}' has no messages after the prompt it shares with the other completion")
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _validate_row(row: Any, *, has_prompt: bool, whole: bool = False) -> _RawPair:
    if isinstance(row, _BadRow):
        raise row
    if not isinstance(row, dict):
        raise _BadRow(f"row must be an object, got {type(row).__name__}")
    if not has_prompt and "prompt" in row:
        raise _BadRow("has 'prompt' but the file's first row has none (implicit-prompt format)")
    keys = ("prompt", "chosen", "rejected") if has_prompt else ("chosen", "rejected")
    missing = [key for key in keys if key not in row]
    if missing:
        raise _BadRow("missing key " + ", ".join(f"'{key}'" for key in missing))
    values = {key: _check_value(row, key=key) for key in keys}
    kinds = {key: isinstance(value, list) for key, value in values.items()}
    if len(set(kinds.values())) > 1:
        described = ", ".join(f"'{key}' is {'a conversation' if kind else 'a string'}" for key, kind in kinds.items())
        raise _BadRow(f"mixed formats: {described}")
    if values["chosen"] == values["rejected"]:
        raise _BadRow("'chosen' and 'rejected' are identical")
    is_conversation = kinds["chosen"]
    if has_prompt:
        prompt, chosen, rejected = values["prompt"], values["chosen"], values["rejected"]
    elif is_conversation:
        prompt, chosen, rejected = _split_implicit_messages(values["chosen"], values["rejected"], whole=whole)
    else:
        prompt, chosen, rejected = _split_implicit_text(values["chosen"], values["rejected"], whole=whole)
    if is_conversation and not whole:  # a reward model scores any conversation
        _check_completion_roles(chosen, key="chosen")
        _check_completion_roles(rejected, key="rejected")
    return _RawPair(prompt=prompt, chosen=chosen, rejected=rejected, is_conversation=is_conversation,
                    margin=_check_margin(row[MARGIN]) if MARGIN in row else None, whole=whole)


def _check_margin(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _BadRow(f"'margin' must be a finite number, got {value!r}")
    return float(value)


def _validate_unpaired_row(row: Any) -> _RawPair:
    """An unpaired row {prompt, completion, label} (data/unpaired.py) as a _RawPair whose chosen and
    rejected are its completion: tokenized as a pair, each is cut at its own prompt, as TRL's KTO."""
    if isinstance(row, _BadRow):
        raise row
    if not isinstance(row, dict):
        raise _BadRow(f"row must be an object, got {type(row).__name__}")
    missing = [key for key in UNPAIRED_COLUMNS if key not in row]
    if missing:
        raise _BadRow("missing key " + ", ".join(f"'{key}'" for key in missing))
    label = row["label"]
    if not isinstance(label, bool):
        raise _BadRow(f"'label' must be true or false, got {type(label).__name__} {label!r}")
    prompt, completion = (_check_value(row, key=key) for key in ("prompt", "completion"))
    is_conversation = isinstance(completion, list)
    if isinstance(prompt, list) != is_conversation:
        raise _BadRow(f"mixed formats: 'prompt' is {'a conversation' if isinstance(prompt, list) else 'a string'}, "
                      f"'completion' is {'a conversation' if is_conversation else 'a string'}")
    if is_conversation:
        _check_completion_roles(completion, key="completion")
    return _RawPair(prompt=prompt, chosen=completion, rejected=completion, is_conversation=is_conversation,
                    label=label)


# ----------------------------------------------------------------------------- tokenizing


# Part of every token store's key (data/store.py): bump it with any change here, or in
# `_RowScan`, that could change a pair's ids, its split, its cut or the counts.
TOKENIZATION_VERSION = 2  # 2: the "margin" column


def _encode(tokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def _common_prefix_length(ids: Sequence[int], other_ids: Sequence[int]) -> int:
    length = 0
    for token, other_token in zip(ids, other_ids):
        if token != other_token:
            break
        length += 1
    return length


def split_at_prompt(
    prompt_ids: Sequence[int], prompt_chosen_ids: Sequence[int], prompt_rejected_ids: Sequence[int]
) -> tuple[list[int], list[int], list[int]]:
    """(prompt, chosen, rejected) ids from the tokenized prompt and the tokenized prompt+completion
    strings, cut as TRL's DPOTrainer cuts them.

    The prompt is the longest start that the tokenized prompt shares with BOTH tokenized
    prompt+completion sequences; each completion is the rest of its sequence. So prompt +
    completion is always exactly the tokenized prompt+completion string. When a token merges
    across the boundary (a completion with no leading space) the cut falls before the merged
    token: the prompt loses its last token(s), and the completion begins with text of the prompt.
    """
    cut = min(_common_prefix_length(prompt_ids, prompt_chosen_ids), _common_prefix_length(prompt_ids, prompt_rejected_ids))
    return list(prompt_ids[:cut]), list(prompt_chosen_ids[cut:]), list(prompt_rejected_ids[cut:])


def _render(tokenizer, messages: list[dict[str, str]], *, add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    except Exception as error:  # jinja raises for roles or orders the template rejects
        raise _BadRow(f"chat template rejected the conversation ({_first_line(error)})") from None


def _pair_texts(tokenizer, pair: _RawPair) -> tuple[tuple[str, str, str], bool]:
    """The texts a pair is tokenized from, (prompt, prompt + chosen, prompt + rejected), and whether
    the tokenizer adds its special tokens to them. load_pairs encodes them one by one, the token
    store (data/tokenize.py) in batches: the same ids."""
    if pair.is_conversation:
        # As TRL (and apply_chat_template(tokenize=True)): the rendered text is tokenized without
        # adding special tokens; the template writes the BOS if the model wants one. No prompt
        # messages (a row used whole): no prompt text.
        texts = (_render(tokenizer, pair.prompt, add_generation_prompt=True) if pair.prompt else "",
                 *(_render(tokenizer, pair.prompt + messages, add_generation_prompt=False)
                   for messages in (pair.chosen, pair.rejected)))
        return texts, False
    # As TRL: the EOS *string* closes each completion unless it already ends with it; the
    # tokenizer's own special tokens (the BOS) come once, at the start of the prompt.
    eos = tokenizer.eos_token
    texts = (pair.prompt, *(pair.prompt + (text if text.endswith(eos) else text + eos)
                            for text in (pair.chosen, pair.rejected)))
    return texts, True


def _check_split(prompt_ids: Sequence[int], chosen_ids: Sequence[int], rejected_ids: Sequence[int], *,
                 unpaired: bool = False, whole: bool = False) -> None:
    if not len(prompt_ids) and not whole:
        # Without a prompt token nothing predicts the first completion token.
        raise _BadRow("'prompt' tokenizes to no tokens that prompt + completion also starts with")
    named = (("completion", chosen_ids),) if unpaired else (("chosen", chosen_ids), ("rejected", rejected_ids))
    for key, ids in named:
        if not len(ids):
            raise _BadRow(f"'{key}' tokenizes to no tokens after the prompt")


def _tokenize_pair(tokenizer, pair: _RawPair) -> tuple[list[int], list[int], list[int]]:
    """(prompt, chosen, rejected) ids of a valid pair, or _BadRow (the template rejects it, or a
    part tokenizes to nothing)."""
    texts, add_special_tokens = _pair_texts(tokenizer, pair)
    ids = split_at_prompt(*(_encode(tokenizer, text, add_special_tokens=add_special_tokens) for text in texts))
    _check_split(*ids, whole=pair.whole)
    return ids


def _check_tokenizer(tokenizer) -> None:
    if tokenizer.eos_token_id is None:
        raise DataError("tokenizer: has no eos_token; plain-text completions need one")


def load_pairs(
    path: str, *, tokenizer, max_length: int, on_bad_row: str = "error", whole_rows: bool = False
) -> tuple[list[TokenizedPair], DataStats]:
    """Reads, validates and tokenizes every row of `path`, keeping file order.

    Tokenized as TRL's DPOTrainer does (docs/DATA.md): prompt + completion as one string, cut
    where it stops matching the tokenized prompt (`split_at_prompt`). A pair whose prompt alone
    has >= max_length tokens is dropped and counted; the others are cut to max_length tokens,
    keeping the start (the prompt, then the completion's head); the cuts are counted. A file
    that mixes plain-text and conversational rows is refused (DataError, whatever on_bad_row).
    `whole_rows` (a reward model's data, as TRL's RewardTrainer reads it: each sequence, prompt
    + completion, is scored whole): a row needs no prompt (an implicit-prompt row whose
    completions share no leading text, or no leading message, has an empty one), nothing is
    cut, and a pair whose prompt + chosen or prompt + rejected has more than max_length tokens is
    dropped and counted. The single-process reference of the token store (data/store.py), which gives
    the same pairs.
    """
    _check_arguments(tokenizer, max_length=max_length, on_bad_row=on_bad_row)
    scan = _RowScan(path=path, tokenizer=tokenizer, max_length=max_length, on_bad_row=on_bad_row,
                    whole_rows=whole_rows)
    pairs: list[TokenizedPair] = []
    for line, row in _read_rows(path):
        try:
            raw = scan.validate(line, row)
            prompt_ids, chosen_ids, rejected_ids = _tokenize_pair(tokenizer, raw)
        except _BadRow as problem:
            scan.bad_row(line, problem)
            continue
        fitted = scan.fit(prompt_ids, chosen_ids, rejected_ids)
        if fitted is not None:
            chosen_ids, rejected_ids = fitted
            pairs.append(TokenizedPair(prompt_ids=tuple(prompt_ids), chosen_ids=tuple(chosen_ids),
                                       rejected_ids=tuple(rejected_ids), source_line=line, margin=raw.margin))
    return pairs, scan.stats()


def _check_arguments(tokenizer, *, max_length: int, on_bad_row: str) -> None:
    if on_bad_row not in ("error", "skip"):
        raise DataError(f"on_bad_row: must be 'error' or 'skip', got {on_bad_row!r}")
    if not isinstance(max_length, int) or max_length < 2:
        raise DataError(f"max_length: must be an integer >= 2, got {max_length!r}")
    _check_tokenizer(tokenizer)


@dataclass
class _RowScan:
    """What reading one file's rows in order decides and counts, shared by load_pairs and the token
    store so that both keep, skip, drop and cut the same rows: the format (the first object
    decides whether rows have a prompt), the unused columns, one kind of row per file, bad rows
    (raised or recorded), and the fit to max_length."""

    path: str
    tokenizer: Any
    max_length: int
    on_bad_row: str
    unpaired: bool = False  # rows {prompt, completion, label} (data/unpaired.py), not pairs
    whole_rows: bool = False  # sequences used whole: no prompt needed, a pair over max_length dropped (`load_pairs`)
    num_dropped_too_long: int = 0
    num_rows: int = 0
    num_pairs: int = 0
    num_dropped: int = 0
    num_truncated_pairs: int = 0
    num_truncated_tokens: int = 0
    has_prompt: bool | None = None
    bad_lines: list[int] = field(default_factory=list)
    unused: dict[str, None] = field(default_factory=dict)  # an ordered set: the columns not in COLUMNS
    first_line_of_kind: dict[bool, int] = field(default_factory=dict)  # is_conversation -> line of the first such row

    def validate(self, line: int, row: Any) -> _RawPair:
        """Counts the row and checks it: _BadRow for a bad row, DataError for a file that mixes kinds
        or a conversation the tokenizer cannot render."""
        self.num_rows += 1
        if isinstance(row, dict):
            if self.has_prompt is None:
                # The first object decides the format, so a row that lost its prompt is an error.
                self.has_prompt = "prompt" in row
            columns = UNPAIRED_COLUMNS if self.unpaired else (*COLUMNS, MARGIN)
            self.unused.update((str(key), None) for key in row if key not in columns)
        raw = (_validate_unpaired_row(row) if self.unpaired else
               _validate_row(row, has_prompt=bool(self.has_prompt), whole=self.whole_rows))
        _check_one_kind(self.first_line_of_kind, is_conversation=raw.is_conversation, line=line, path=self.path)
        if raw.is_conversation and not getattr(self.tokenizer, "chat_template", None):
            raise DataError(f"{self.path}:{line}: conversational row but the tokenizer has no chat_template; "
                            "pass --chat-template FILE (a Jinja template, see docs/DATA.md)")
        return raw

    def bad_row(self, line: int, problem: object) -> None:
        """DataError naming the file and line (on_bad_row 'error'), else the row is counted as skipped."""
        if self.on_bad_row == "error":
            raise DataError(f"{self.path}:{line}: {problem}") from None
        self.bad_lines.append(line)

    def fit(self, prompt_ids: Sequence[int], chosen_ids: Sequence[int],
            rejected_ids: Sequence[int]) -> tuple[Sequence[int], Sequence[int]] | None:
        """The completions cut to max_length with their prompt (the cut counted), or None when the
        prompt alone fills max_length (the pair is dropped and counted); with whole_rows, the
        completions whole, or None when a sequence is over max_length (dropped and counted)."""
        if self.whole_rows:
            if len(prompt_ids) + max(len(chosen_ids), len(rejected_ids)) > self.max_length:
                self.num_dropped_too_long += 1
                return None
            self.num_pairs += 1
            return chosen_ids, rejected_ids
        completion_budget = self.max_length - len(prompt_ids)
        if completion_budget <= 0:
            self.num_dropped += 1
            return None
        if self.unpaired:
            # chosen is rejected, the one completion, kept to max_length - 1 tokens: another row's KL
            # sequence, with a shorter prompt, may take more of it (data/unpaired.py cuts on reading).
            cut = max(len(chosen_ids) - completion_budget, 0)
            self.num_truncated_pairs += bool(cut)
            self.num_truncated_tokens += cut
            self.num_pairs += 1
            kept = chosen_ids[:self.max_length - 1]
            return kept, kept
        cut = max(len(chosen_ids) - completion_budget, 0) + max(len(rejected_ids) - completion_budget, 0)
        if cut:
            self.num_truncated_pairs += 1
            self.num_truncated_tokens += cut
        self.num_pairs += 1
        return chosen_ids[:completion_budget], rejected_ids[:completion_budget]

    def stats(self) -> DataStats:
        if self.num_rows == 0:
            raise DataError(f"{self.path}: contains no rows")
        return DataStats(
            num_rows=self.num_rows,
            num_pairs=self.num_pairs,
            num_dropped_prompt_too_long=self.num_dropped,
            num_bad_rows_skipped=len(self.bad_lines),
            first_bad_lines=tuple(self.bad_lines[:MAX_BAD_LINES_RECORDED]),
            num_truncated_pairs=self.num_truncated_pairs,
            num_truncated_tokens=self.num_truncated_tokens,
            unused_columns=tuple(self.unused),
            has_prompt=bool(self.has_prompt),
            unpaired=self.unpaired,
            num_dropped_too_long=self.num_dropped_too_long,
        )


def _check_one_kind(first_line_of_kind: dict[bool, int], *, is_conversation: bool, line: int, path: str) -> None:
    """One file holds plain texts or conversations, not both (docs/DATA.md): a file that mixes
    them is refused, naming the first row of each kind. Records the first row of each kind."""
    first_line_of_kind.setdefault(is_conversation, line)
    if len(first_line_of_kind) == 2:
        where = "row" if path.lower().endswith(".parquet") or os.path.isdir(path) else "line"
        raise DataError(
            f"{path}: mixes plain-text rows (first on {where} {first_line_of_kind[False]}) and conversational rows "
            f"(first on {where} {first_line_of_kind[True]}); one file holds one kind (docs/DATA.md)"
        )


def data_notes(path: str, stats: DataStats, *, max_length: int) -> list[str]:
    """What the driver prints about one data file: unused columns, and what --max-length and
    --on-bad-row took away. Empty when the file is used whole."""
    notes = []
    if stats.unused_columns:
        named = ", ".join(repr(column) for column in stats.unused_columns)
        recognised = UNPAIRED_COLUMNS if stats.unpaired else COLUMNS
        note = f"{path}: ignoring unused column(s) {named} (recognised: {', '.join(recognised)})"
        if not stats.has_prompt:
            note += "; with no 'prompt' column, each prompt is the shared start of 'chosen' and 'rejected'"
        notes.append(note)
    if stats.num_dropped_prompt_too_long or stats.num_bad_rows_skipped:
        notes.append(f"{path}: dropped {stats.num_dropped_prompt_too_long} pairs whose prompt fills max_length; "
                     f"skipped {stats.num_bad_rows_skipped} bad rows (first lines {list(stats.first_bad_lines)})")
    if stats.num_dropped_too_long:
        notes.append(f"{path}: dropped {stats.num_dropped_too_long} pairs with a sequence longer than --max-length "
                     f"{max_length} (a reward model's pairs are not cut)")
    if stats.num_truncated_pairs:
        notes.append(f"{path}: --max-length {max_length} truncated {stats.num_truncated_pairs} of {stats.num_pairs} "
                     f"pairs, dropping {stats.num_truncated_tokens} completion tokens")
    return notes


# ----------------------------------------------------------------------------- batching


def global_batch_order(
    *, num_pairs: int, global_batch_size: int, seed: int, shuffle: bool, epoch: int
) -> list[list[int]]:
    """Pair indices of each global batch of one epoch; the last incomplete batch is dropped."""
    if global_batch_size <= 0:
        raise DataError(f"global_batch_size: must be positive, got {global_batch_size}")
    if num_pairs < global_batch_size:
        raise DataError(
            f"data: {num_pairs} usable pairs is fewer than global_batch_size {global_batch_size}"
        )
    order = list(range(num_pairs))
    if shuffle:
        # random.Random is pure Python: the same permutation on every host and version. A string
        # seed (hashed with SHA-512) keeps every (seed, epoch) apart; seed + epoch would give
        # seed 1 epoch 1 the order of seed 2 epoch 0.
        random.Random(f"{seed}/{epoch}").shuffle(order)
    num_batches = num_pairs // global_batch_size
    return [order[i * global_batch_size : (i + 1) * global_batch_size] for i in range(num_batches)]


def eval_passes(
    *, num_pairs: int, global_batch_size: int, dp: int, dp_rank: int, micro_batch_size: int
) -> list[tuple[range, list[list[int]]]]:
    """How one data-parallel rank evaluates `num_pairs` held-out pairs: every pair once over all
    ranks, the last chunk possibly partial.

    The pairs are taken in chunks of global_batch_size (the last one may be smaller); each rank
    takes a contiguous share of a chunk (shares differ by at most one pair) and cuts it into
    microbatches of micro_batch_size. Returns one entry per forward-only pass: the chunk (its
    pairs set the padded length) and the pass's microbatches (pair indices), all of one size,
    since pipeline receive buffers are sized by the first microbatch. A full chunk is one pass,
    split exactly as a training step splits a global batch; a share that does not fill its last
    microbatch runs it as a second pass of its own.
    """
    if global_batch_size <= 0 or micro_batch_size <= 0 or dp <= 0 or not 0 <= dp_rank < dp:
        raise ValueError(f"eval_passes: bad sizes (global_batch_size={global_batch_size}, "
                         f"micro_batch_size={micro_batch_size}, dp={dp}, dp_rank={dp_rank})")
    passes = []
    for lo in range(0, num_pairs, global_batch_size):
        chunk = range(lo, min(lo + global_batch_size, num_pairs))
        share, extra = divmod(len(chunk), dp)
        start = lo + dp_rank * share + min(dp_rank, extra)
        mine = list(range(start, start + share + (1 if dp_rank < extra else 0)))
        num_full = len(mine) // micro_batch_size * micro_batch_size
        full = [mine[k : k + micro_batch_size] for k in range(0, num_full, micro_batch_size)]
        for microbatches in (full, [mine[num_full:]] if num_full < len(mine) else []):
            if microbatches:
                passes.append((chunk, microbatches))
    return passes


def padded_seq_len(pairs: Sequence[TokenizedPair], *, multiple: int = 8) -> int:
    """Longest prompt+completion among `pairs`, rounded up to a multiple of `multiple`."""
    if not pairs:
        raise ValueError("padded_seq_len: no pairs")
    if multiple <= 0:
        raise ValueError(f"padded_seq_len: multiple must be positive, got {multiple}")
    longest = max(len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) for p in pairs)
    return -(-longest // multiple) * multiple


def seq_len_multiple(*, tp: int, sequence_parallel: bool, cp: int = 1) -> int:
    """What padded_seq_len (and a packed row) rounds up to: 8, and a multiple of tp when the
    sequence is split over the tp ranks (sequence parallelism), of 2cp chunks with context
    parallelism (each chunk then a multiple of tp under sequence parallelism). The extra
    positions are padding (loss mask 0)."""
    split = tp if sequence_parallel else 1
    return math.lcm(8, split if cp == 1 else 2 * cp * split)


def collate(pairs: Sequence[TokenizedPair], *, pad_token_id: int, seq_len: int) -> Microbatch:
    """Stacks chosen rows then rejected rows, right-padded to seq_len."""
    if not pairs:
        raise ValueError("collate: no pairs")
    num_pairs = len(pairs)
    tokens = torch.full((2 * num_pairs, seq_len), pad_token_id, dtype=torch.int64)
    loss_mask = torch.zeros((2 * num_pairs, seq_len), dtype=torch.float32)
    for index, pair in enumerate(pairs):
        for row, completion in ((index, pair.chosen_ids), (num_pairs + index, pair.rejected_ids)):
            prompt_len = len(pair.prompt_ids)
            total_len = prompt_len + len(completion)
            if total_len > seq_len:
                raise ValueError(
                    f"collate: pair from line {pair.source_line} has {total_len} tokens, more than seq_len {seq_len}"
                )
            tokens[row, :prompt_len] = torch.tensor(pair.prompt_ids, dtype=torch.int64)
            tokens[row, prompt_len:total_len] = torch.tensor(completion, dtype=torch.int64)
            # Position t predicts token t+1, so completion tokens at [P, P+C) are labels at [P-1, P+C-1)
            # (no prompt, a row used whole: the first token has no label).
            loss_mask[row, max(prompt_len - 1, 0) : total_len - 1] = 1.0
    labels = torch.full_like(tokens, pad_token_id)
    labels[:, :-1] = tokens[:, 1:]
    return Microbatch(tokens=tokens, labels=labels, loss_mask=loss_mask)
