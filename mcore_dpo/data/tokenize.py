"""Preference rows -> token ids in batches, on worker processes, in file order: what fills a token
store (data/store.py). The ids, the splits, the cuts and the counts are those of `load_pairs`,
which stays the single-process reference: both go through pairs.py's `_RowScan` (the format, bad
rows, one kind per file, the fit to max_length), `_pair_texts` and `split_at_prompt`.

    stats = tokenize_source(path, tokenizer=tok, max_length=512, on_bad_row="error", pool=pool,
                            write=lambda line, prompt, chosen, rejected, margin: ...)

How the work is shared:
- the parent reads the file as a stream (JSONL line by line, a row bounded by `max_row_bytes`;
  a saved dataset directory a batch of rows at a time; .json and Parquet are read whole, as
  `load_pairs` reads them), validates each row in order
  with `_RowScan.validate` and sends batches of valid rows to the workers;
- a worker renders the chat template, encodes each batch's texts in one fast-tokenizer call,
  cuts at the prompt and returns int32 arrays;
- the parent takes the batches back in order: the first bad row, in file order, is the error
  (on_bad_row 'error'), and `_RowScan.fit` drops and cuts as `load_pairs` does.
Workers are processes started with "spawn" (forking a driver that imported torch or Ray is not
safe), each given the caller's tokenizer once, pickled: the same object, chat template included.
With one worker everything runs in this process.
"""
from __future__ import annotations

import collections
import math
import os
import pickle
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import numpy as np

from mcore_dpo.data.pairs import DataStats, _check_split, _pair_texts, _RawPair, _RowScan, split_at_prompt
from mcore_dpo.data.sources import DataError, _BadRow, _check_source, _jsonl_row, _read_rows, source_bytes
from mcore_dpo.data.unpaired import unpaired_rows

# A row over max_row_bytes(max_length) is refused (skipped with on_bad_row 'skip'): 1 KiB of
# JSON per token that max_length lets through is far more than any tokenizer needs, and 1 MiB
# is the floor, so a short max_length still takes long rows.
MIN_ROW_BYTES = 1 << 20
ROW_BYTES_PER_TOKEN = 1 << 10
# A batch: this many rows, or fewer when their lines hold this many bytes.
BATCH_ROWS = 256
BATCH_BYTES = 4 << 20
# The default --data-workers: the cores this process may use, at most MAX_DEFAULT_WORKERS, and one
# per WORKER_BYTES of data (a worker costs seconds to start: imports and the tokenizer).
MAX_DEFAULT_WORKERS = 8
WORKER_BYTES = 4 << 20
_SKIP_CHUNK = 1 << 20  # an over-long line is passed over in pieces of this size


def max_row_bytes(max_length: int) -> int:
    """The largest row (its JSONL line's bytes, or the UTF-8 bytes of its texts) that is read."""
    return max(MIN_ROW_BYTES, ROW_BYTES_PER_TOKEN * max_length)


def default_workers(total_bytes: int) -> int:
    """--data-workers when not given (module constants)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_DEFAULT_WORKERS, total_bytes // WORKER_BYTES))


# ----------------------------------------------------------------------------- reading


class SourceRows:
    """The rows of one data file as (line, row or _BadRow), with how far the reading got.

    JSONL is read a line at a time and a line is never held longer than `row_limit` bytes: a longer
    one becomes a _BadRow and the rest of it is passed over in pieces. The other kinds are read by
    pairs.py's readers: .json and Parquet whole (a JSON document is one value; Parquet is read by
    `datasets`), a saved dataset directory in batches of rows from its memory-mapped Arrow files;
    their rows are bounded after parsing, by the bytes of their texts (`oversize`)."""

    def __init__(self, path: str, *, row_limit: int) -> None:
        self.path = path
        self.row_limit = row_limit
        self.is_jsonl = _check_source(path) == ".jsonl"
        self.total_bytes = source_bytes(path)
        self.bytes_read = 0

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        if not self.is_jsonl:
            yield from _read_rows(self.path)
            self.bytes_read = self.total_bytes
            return
        with open(self.path, "rb") as handle:
            line = 0
            while True:
                raw_line = handle.readline(self.row_limit + 1)
                if not raw_line:
                    return
                line += 1
                self.bytes_read += len(raw_line)
                if raw_line.endswith(b"\n"):
                    raw_line = raw_line[:-1]
                elif len(raw_line) > self.row_limit:  # the line goes on: pass over the rest
                    blank = not raw_line.strip()
                    while True:
                        rest = handle.readline(_SKIP_CHUNK)
                        self.bytes_read += len(rest)
                        blank = blank and not rest.strip()
                        if not rest or rest.endswith(b"\n"):
                            break
                    if not blank:  # a line of whitespace is no row, however long
                        yield line, _BadRow(self._too_long())
                    continue
                if raw_line.strip():
                    yield line, _jsonl_row(raw_line)

    def oversize(self, pair: _RawPair) -> _BadRow | None:
        """For rows parsed from a whole file: a _BadRow when the UTF-8 bytes of the pair's texts
        exceed the bound (JSONL rows were bounded as they were read)."""
        if self.is_jsonl:
            return None
        texts = [text for value in (pair.prompt, pair.chosen, pair.rejected)
                 for text in ([value] if isinstance(value, str) else [m["content"] for m in value])]
        if 4 * sum(len(text) for text in texts) <= self.row_limit:  # at most 4 bytes a character
            return None
        if sum(len(text.encode("utf-8")) for text in texts) <= self.row_limit:
            return None
        return _BadRow(self._too_long())

    def _too_long(self) -> str:
        return (f"row is longer than {self.row_limit:,} bytes, the bound at this --max-length "
                "(max(1 MiB, 1 KiB x max_length); docs/DATA.md)")


# ----------------------------------------------------------------------------- tokenizing a batch


@dataclass
class BatchIds:
    """A batch of pairs tokenized: the problem of each pair (None when it tokenized), and its
    prompt, chosen and rejected ids back to back in `ids` with their lengths in `lengths`."""

    problems: list[str | None]
    lengths: np.ndarray  # int64 [pairs, 3]: prompt, chosen, rejected (0 for a pair with a problem)
    ids: np.ndarray  # int32, flat

    def pair(self, index: int, offset: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The ids of pair `index`, which starts at `offset` in `ids`."""
        prompt_end, chosen_end, rejected_end = (offset + int(n) for n in np.cumsum(self.lengths[index]))
        return self.ids[offset:prompt_end], self.ids[prompt_end:chosen_end], self.ids[chosen_end:rejected_end]


def tokenize_batch(tokenizer, pairs: list[_RawPair]) -> BatchIds:
    """The pairs' ids as `load_pairs` gives them (`_tokenize_pair`), with one tokenizer call for
    all the texts that take the tokenizer's special tokens and one for those that do not."""
    problems: list[str | None] = [None] * len(pairs)
    texts: list[tuple[str, str, str] | None] = [None] * len(pairs)
    by_specials: dict[bool, list[int]] = {True: [], False: []}
    for index, pair in enumerate(pairs):
        try:
            texts[index], add_special_tokens = _pair_texts(tokenizer, pair)
        except _BadRow as problem:
            problems[index] = str(problem)
            continue
        by_specials[add_special_tokens].append(index)
    encoded: dict[int, tuple[list[int], list[int], list[int]]] = {}
    for add_special_tokens, indices in by_specials.items():
        if not indices:
            continue
        flat = [text for index in indices for text in texts[index]]
        ids = tokenizer(flat, add_special_tokens=add_special_tokens)["input_ids"]
        for k, index in enumerate(indices):
            encoded[index] = split_at_prompt(*ids[3 * k:3 * k + 3])
    lengths = np.zeros((len(pairs), 3), dtype=np.int64)
    pieces: list[list[int]] = []
    for index in range(len(pairs)):
        if index not in encoded:
            continue
        try:
            _check_split(*encoded[index], unpaired=pairs[index].label is not None, whole=pairs[index].whole)
        except _BadRow as problem:
            problems[index] = str(problem)
            continue
        lengths[index] = [len(part) for part in encoded[index]]
        pieces.extend(encoded[index])
    flat_ids = np.fromiter((token for piece in pieces for token in piece), dtype=np.int32, count=int(lengths.sum()))
    return BatchIds(problems=problems, lengths=lengths, ids=flat_ids)


_WORKER_TOKENIZER = None


def _start_worker(tokenizer_bytes: bytes) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the workers are the parallelism
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # one "sequence longer than" warning per worker would be noise
    _WORKER_TOKENIZER = pickle.loads(tokenizer_bytes)  # the parent's own tokenizer, pickled by the parent


def _tokenize_in_worker(pairs: list[_RawPair]) -> BatchIds:
    return tokenize_batch(_WORKER_TOKENIZER, pairs)


class TokenizerPool:
    """Where batches are tokenized: `workers` spawned processes, or this process for one worker.
    A context manager; `submit(pairs)` gives an object whose `result()` is the BatchIds."""

    def __init__(self, tokenizer, *, workers: int) -> None:
        if not isinstance(workers, int) or workers < 1:
            raise DataError(f"data_workers: must be an integer >= 1, got {workers!r}")
        self.tokenizer = tokenizer
        # A spawned process first imports the parent's main script; one it cannot find (`python -`
        # reading stdin) would stop every worker, so such a parent tokenizes in its own process.
        main_path = getattr(sys.modules.get("__main__"), "__file__", None)
        self.workers = 1 if main_path is not None and not os.path.isfile(main_path) else workers
        self._executor: ProcessPoolExecutor | None = None

    def __enter__(self) -> TokenizerPool:
        if self.workers > 1:
            import multiprocessing

            try:
                tokenizer_bytes = pickle.dumps(self.tokenizer)
            except Exception as error:  # a tokenizer class of remote code may not pickle
                raise DataError(f"data: the tokenizer cannot be sent to worker processes ({type(error).__name__}: "
                                f"{error}); use --data-workers 1") from None
            self._executor = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_start_worker, initargs=(tokenizer_bytes,))
        return self

    def __exit__(self, *exc) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def submit(self, pairs: list[_RawPair]) -> Future | _Done:
        if self._executor is None:
            return _Done(tokenize_batch(self.tokenizer, pairs))
        return self._executor.submit(_tokenize_in_worker, pairs)


@dataclass
class _Done:
    value: BatchIds

    def result(self) -> BatchIds:
        return self.value


# ----------------------------------------------------------------------------- one file


Write = Callable[[int, np.ndarray, np.ndarray, np.ndarray, "bool | None", "float | None"], None]


def tokenize_source(path: str, *, tokenizer, max_length: int, on_bad_row: str, pool: TokenizerPool, write: Write,
                    progress: Progress | None = None, unpaired: bool = False, whole_rows: bool = False) -> DataStats:
    """Tokenizes every row of `path` as `load_pairs` does, calling write(line, prompt_ids,
    chosen_ids, rejected_ids, label, margin) for each kept pair in file order (int32 arrays, already
    cut to max_length; label None for a pair, margin None without one). Returns the file's
    DataStats; raises `load_pairs`' DataError for the same rows, and one for a row over
    `max_row_bytes` (on_bad_row 'error'). `unpaired`: the rows are KTO's (data/unpaired.py), each
    written with its one completion twice and its label. `whole_rows`: `load_pairs`'."""
    scan = _RowScan(path=path, tokenizer=tokenizer, max_length=max_length, on_bad_row=on_bad_row, unpaired=unpaired,
                    whole_rows=whole_rows)
    rows = SourceRows(path, row_limit=max_row_bytes(max_length))
    if progress is not None:
        progress.start_source(path, total_bytes=rows.total_bytes)
    try:
        return _tokenize_rows(rows, scan=scan, pool=pool, write=write, progress=progress)
    except BrokenProcessPool:
        raise DataError(f"{path}: a tokenization worker stopped (out of memory, killed, or it could not start or "
                        "load the tokenizer); try fewer --data-workers, or 1") from None
    finally:
        if progress is not None:
            progress.end_source()


def _tokenize_rows(rows: SourceRows, *, scan: _RowScan, pool: TokenizerPool, write: Write,
                   progress: Progress | None) -> DataStats:
    window = 2 * pool.workers  # batches in flight: the parent reads ahead, bounded
    pending: collections.deque = collections.deque()
    slots: list[tuple[int, int | str]] = []  # (line, index into the batch's pairs, or a bad row's problem)
    batch: list[_RawPair] = []
    batch_bytes = 0
    fatal: DataError | None = None  # a file-level error: raised once every row before it is taken

    def take(done_slots: list[tuple[int, int | str]], done_batch: list[_RawPair], future) -> None:
        result: BatchIds = future.result()
        offsets = np.concatenate([[0], np.cumsum(result.lengths.sum(axis=1))])
        for line, what in done_slots:
            if isinstance(what, str):
                scan.bad_row(line, what)
                continue
            if result.problems[what] is not None:
                scan.bad_row(line, result.problems[what])
                continue
            prompt_ids, chosen_ids, rejected_ids = result.pair(what, int(offsets[what]))
            fitted = scan.fit(prompt_ids, chosen_ids, rejected_ids)
            if fitted is not None:
                write(line, prompt_ids, *fitted, done_batch[what].label, done_batch[what].margin)
        if progress is not None:
            progress.update(rows=scan.num_rows, pairs=scan.num_pairs, bytes_read=rows.bytes_read)

    def send() -> None:
        nonlocal slots, batch, batch_bytes
        pending.append((slots, batch, pool.submit(batch)))
        slots, batch, batch_bytes = [], [], 0
        while len(pending) > window:
            take(*pending.popleft())

    try:
        bytes_before = 0
        for line, row in unpaired_rows(rows) if scan.unpaired else rows:
            try:
                raw = scan.validate(line, row)
                too_long = rows.oversize(raw)
                if too_long is not None:
                    raise too_long
            except _BadRow as problem:
                slots.append((line, str(problem)))
            else:
                slots.append((line, len(batch)))
                batch.append(raw)
            batch_bytes += rows.bytes_read - bytes_before
            bytes_before = rows.bytes_read
            if len(slots) >= BATCH_ROWS or batch_bytes >= BATCH_BYTES:
                send()
    except DataError as error:  # a kind mixed in, no chat template, or an unreadable .json/Parquet/dataset
        fatal = error
    if slots:
        send()
    while pending:
        take(*pending.popleft())
    if fatal is not None:
        raise fatal
    return scan.stats()


# ----------------------------------------------------------------------------- progress


class Progress:
    """Tokenization progress: a bar redrawn on a terminal (stderr), else a line through `log` every
    `interval_s` seconds. Rate in pairs/s; ETA from the bytes of the file read so far."""

    def __init__(self, *, log: Callable[[str], None], bar: bool | None = None, interval_s: float = 10.0) -> None:
        self.log = log
        self.bar = sys.stderr.isatty() if bar is None else bar
        self.interval_s = 0.2 if self.bar else interval_s
        self.path = ""
        self.total_bytes = 0
        self.started = self.last_shown = time.monotonic()

    def start_source(self, path: str, *, total_bytes: int) -> None:
        self.path, self.total_bytes = path, total_bytes
        self.started = self.last_shown = time.monotonic()

    def update(self, *, rows: int, pairs: int, bytes_read: int) -> None:
        now = time.monotonic()
        if now - self.last_shown < self.interval_s:
            return
        self.last_shown = now
        elapsed = max(now - self.started, 1e-9)
        fraction = bytes_read / self.total_bytes if self.total_bytes else 0.0
        eta = elapsed * (1 - fraction) / fraction if fraction > 0 else math.inf
        eta_text = f"ETA {eta:.0f} s" if math.isfinite(eta) else "ETA ?"
        text = f"{self.path}: {pairs:,} pairs of {rows:,} rows, {pairs / elapsed:,.0f} pairs/s, {eta_text}"
        if self.bar:
            filled = int(30 * min(fraction, 1.0))
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {100 * fraction:3.0f}% {text}\x1b[K")
            sys.stderr.flush()
        else:
            self.log(f"data: tokenizing {text} ({100 * fraction:.0f}%)")

    def end_source(self) -> None:
        if self.bar and self.last_shown > self.started:  # a bar was drawn: end its line
            sys.stderr.write("\n")
            sys.stderr.flush()
