"""Tokenizer sanity at start-up: does the tokenizer read the data back?

A model directory can hold tokenizer files that load as another class than the ones they were
written for (transformers picks the class from config.json): the embedded tokenizer's files in a
Qwen2 directory load as a `Qwen2Tokenizer` that reads 'hello cat dog . sheep' as `a .`, and every
pair still tokenizes. `check_tokenizer` encodes and decodes a sample of the data first:

- the sample is the first `NUM_SAMPLE_ROWS` usable rows of each data file, read by the same
  readers as training (data/pairs.py), each text as training tokenizes it: the prompt and
  prompt + completion + EOS string with the tokenizer's special tokens, or the conversation
  rendered by the chat template, without. Rows training would refuse are passed over here
  (load_pairs names them);
- a text comes back when its decoded ids equal it in a normal form that forgives what
  tokenizers are allowed to change: special tokens (a BOS added, a template's markers), the
  tokenizer's own normaliser (unicode forms, lowercasing), whitespace (all of it is dropped, and
  SentencePiece's U+2581), and an unknown token in place of any text;
- refused (DataError, one line naming the tokenizer directory, its class and one example) when
  half or more of the sample's texts do not come back, or when most of its tokens are the
  unknown token; fewer texts that do not come back, and a tokenizer with under half as many
  tokens as the model's vocabulary, are one `warning:` line each.

Cost, measured on the default job (`prepare(TrainConfig())`: the embedded tokenizer, 32 rows of
prefs_train.jsonl and 32 of prefs_eval.jsonl, 192 texts) on the 2-core development machine:
14 ms idle, 25-50 ms at load 7, of a prepare() of about 1 s (load_pairs of the 2,000 training rows
alone takes about 0.45 s). A Parquet file is read whole once more (its reader has no row limit);
a saved dataset directory only as far as the sample, a batch of rows at a time.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mcore_dpo.data.pairs import _pair_texts, _validate_row
from mcore_dpo.data.sources import DataError, _BadRow
from mcore_dpo.data.tokenize import SourceRows, max_row_bytes

NUM_SAMPLE_ROWS = 32  # per data file: a few dozen rows, not the data set
_SHOWN_CHARS = 60  # an example's texts are cut to this many characters
_SENTENCEPIECE_SPACE = "\u2581"


@dataclass(frozen=True)
class SampleText:
    text: str
    add_special_tokens: bool  # as training encodes it: True for plain text, False for a rendered conversation


def sample_texts(path: str, tokenizer, *, num_rows: int = NUM_SAMPLE_ROWS) -> list[SampleText]:
    """The texts training tokenizes for the first `num_rows` usable rows of `path` (pairs.py's
    `_pair_texts`, read as the token store reads: a JSONL file or a saved dataset directory only
    as far as the sample, JSONL rows over 1 MiB passed over); [] when the source cannot be read or
    the tokenizer has no EOS (load_pairs reports those, with the line)."""
    texts: list[SampleText] = []
    if tokenizer.eos_token is None:
        return texts
    has_prompt: bool | None = None
    num_used = 0
    try:
        for _, row in SourceRows(path, row_limit=max_row_bytes(1)):
            if num_used >= num_rows:
                break
            if isinstance(row, dict) and has_prompt is None:
                has_prompt = "prompt" in row  # the first object decides the format, as in load_pairs
            try:
                raw = _validate_row(row, has_prompt=bool(has_prompt))
                pair_texts, add_special_tokens = _pair_texts(tokenizer, raw)
            except _BadRow:  # as load_pairs: a bad row, or a conversation the template cannot render
                continue
            texts += [SampleText(text, add_special_tokens=add_special_tokens) for text in pair_texts]
            num_used += 1
    except (DataError, OSError):
        pass
    return texts


def _special_strings(tokenizer) -> list[str]:
    """Every special token's text, longest first (so '<|user|>' goes before a '<' token)."""
    strings = set(tokenizer.all_special_tokens)
    strings.update(token.content for token in getattr(tokenizer, "added_tokens_decoder", {}).values()
                   if token.special)
    return sorted((s for s in strings if s), key=len, reverse=True)


def _special_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special)
    return ids


class _Reader:
    """One tokenizer's round trip and the normal form texts are compared in."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.unk_id = tokenizer.unk_token_id
        self.specials = _special_strings(tokenizer)
        self.special_ids = _special_ids(tokenizer) - {self.unk_id}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.normalizer = getattr(backend, "normalizer", None)

    def encode(self, sample: SampleText) -> list[int]:
        return list(self.tokenizer(sample.text, add_special_tokens=sample.add_special_tokens)["input_ids"])

    def normal_form(self, text: str) -> str:
        for special in self.specials:
            text = text.replace(special, "")
        if self.normalizer is not None:
            text = self.normalizer.normalize_str(text)
        else:  # a tokenizer without a backend: forgive case, as an uncased one changes it
            text = text.casefold()
        text = unicodedata.normalize("NFKC", text)
        return "".join(char for char in text if not char.isspace() and char != _SENTENCEPIECE_SPACE)

    def comes_back(self, text: str, ids: Sequence[int]) -> bool:
        """Whether the decoded ids spell `text` in normal form; an unknown token stands for any text."""
        pieces, segment = [], []
        for token_id in [*ids, None]:
            if token_id is None or token_id == self.unk_id:
                pieces.append(self.normal_form(self.tokenizer.decode(segment, skip_special_tokens=True)))
                segment = []
            else:
                segment.append(token_id)
        return _matches(pieces, self.normal_form(text))

    def shown(self, ids: Sequence[int]) -> str:
        """The decoded ids as an example shows them: special tokens left out, the unknown token kept."""
        return self.tokenizer.decode([i for i in ids if i not in self.special_ids], skip_special_tokens=False)


def _matches(pieces: list[str], text: str) -> bool:
    """`text` is pieces[0] + anything + pieces[1] + ... + anything + pieces[-1]."""
    if len(pieces) == 1:
        return pieces[0] == text
    first, *middle, last = pieces
    if len(first) + len(last) > len(text) or not text.startswith(first) or not text.endswith(last):
        return False
    position, end = len(first), len(text) - len(last)
    for piece in middle:
        found = text.find(piece, position, end)
        if found < 0:
            return False
        position = found + len(piece)
    return True


def _cut(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def check_tokenizer(tokenizer, *, tokenizer_dir: str, data_paths: Sequence[str | None], vocab_size: int,
                    warn: Callable[[str], object] = print) -> None:
    """Refuse a tokenizer that does not read a sample of the data back (DataError); `warn` one
    line each for a partial loss and for a tokenizer with under half the model's vocabulary."""
    name = f"the tokenizer ({type(tokenizer).__name__})"
    advice = "check --tokenizer / the model directory's tokenizer files"
    if len(tokenizer) < vocab_size / 2:
        warn(f"warning: {tokenizer_dir}: {name} has {len(tokenizer)} tokens, under half of the model's vocab_size "
             f"{vocab_size}; {advice}")
    samples = [sample for path in data_paths if path for sample in sample_texts(path, tokenizer)]
    if not samples:
        return
    reader = _Reader(tokenizer)
    encoded = [reader.encode(sample) for sample in samples]
    num_tokens = sum(len(ids) for ids in encoded)
    num_unknown = sum(ids.count(reader.unk_id) for ids in encoded) if reader.unk_id is not None else 0
    if num_unknown * 2 > num_tokens:
        index = max(range(len(samples)), key=lambda i: encoded[i].count(reader.unk_id))
        raise DataError(
            f"{tokenizer_dir}: {name} reads most of the data as its unknown token {tokenizer.unk_token!r} "
            f"({num_unknown} of {num_tokens} tokens of a sample): {_cut(samples[index].text)!r} -> "
            f"{_cut(reader.shown(encoded[index]))!r}; {advice}")
    lost = [i for i, (sample, ids) in enumerate(zip(samples, encoded)) if not reader.comes_back(sample.text, ids)]
    if not lost:
        return
    example = f"{_cut(samples[lost[0]].text)!r} -> {_cut(reader.shown(encoded[lost[0]]))!r}"
    if len(lost) * 2 >= len(samples):
        raise DataError(f"{tokenizer_dir}: {name} does not read the data back: {example}; {advice}")
    warn(f"warning: {tokenizer_dir}: {name} does not read {len(lost)} of {len(samples)} sampled texts back, "
         f"e.g. {example}")
