"""The token store: data files tokenized once into memory-mapped numpy files that every later run,
resume, restart and rank opens without tokenizing again (docs/DATA.md, "The token store").

    store = open_or_build([path], tokenizer_dir=tok_dir, tokenizer=tok, max_length=512,
                          on_bad_row="error")        # built on a miss, opened on a hit
    len(store); store[i]                             # a TokenizedPair, as load_pairs' list holds
    TokenStore.open(store.path)                      # a rank opens what the driver built

A store is a directory `<cache>/<key>`:

    tokens.bin      int32 token ids of every sequence, back to back (little-endian)
    sequences.npy   int64 [num_sequences, 2]: each sequence's offset and length in tokens.bin
    samples.npy     int64 [num_samples, 5]: SAMPLE_COLUMNS
    fields.npy      float64 [num_samples, F]: per-sample numbers named in meta.json (NaN: absent)
    meta.json       format, version, key and what went into it, counts, each source's DataStats,
                    the files' sizes; written last, so a store without it is no store

A sample is a prompt and its completions, which are consecutive sequences: a preference pair is a
prompt and two completions, chosen then rejected; an unpaired row (a prompt, one completion and a
label field) and a margin (a field) fit the same layout. Pairs are written with their `margin`
field (--objective reward), and unpaired samples for --objective kto (data/unpaired.py: one
completion, a `label` field; `store[i]` gives the sample with its KL completion as rejected_ids).

The key is a digest of everything that changes the ids (`store_key`). A store is built in
`<key>.partial-<random>` beside its final name, fsynced, then renamed; two builders racing both
finish and the second rename fails, so the loser removes its copy and opens the winner's. A store
that fails its checks on opening (`StoreError`) is moved aside and rebuilt, never half-read.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import xxhash

from checkpoint_convert import durable
from checkpoint_convert.integrity import file_checksum
from mcore_dpo.data.pairs import TOKENIZATION_VERSION, DataStats, TokenizedPair, _check_arguments
from mcore_dpo.data.sources import DataError, _check_source, source_bytes, source_checksum
from mcore_dpo.data.tokenize import Progress, TokenizerPool, default_workers, max_row_bytes, tokenize_source
from mcore_dpo.data.unpaired import Unpaired, kl_partner

FORMAT = "mcore_dpo.token_store"
FORMAT_VERSION = 2  # bump with any change of the files' layout (the key changes with it)
SAMPLE_COLUMNS = ("prompt", "first_completion", "num_completions", "source", "source_line")
# fields.npy's columns: a pair's "margin" (--objective reward; NaN without one), an unpaired row's label.
PAIR_FIELDS = ("margin",)
UNPAIRED_FIELDS = ("label",)
TOKEN_DTYPE = np.dtype("<i4")
FILES = ("tokens.bin", "sequences.npy", "samples.npy", "fields.npy", "meta.json")
STALE_PARTIAL_S = 6 * 3600  # a .partial- directory untouched this long is a dead builder's
# Files of a tokenizer directory (often the model's) that are weights, not tokenizer: not hashed.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".npz",
                   ".distcp")


class StoreError(Exception):
    """A store directory that is not a complete store of the expected key; str() is one line."""


# ----------------------------------------------------------------------------- the key


def _text_digest(text: str | None) -> str | None:
    return None if text is None else xxhash.xxh3_128(text.encode("utf-8")).hexdigest()


def _tokenizer_files(tokenizer_dir: str | None) -> dict[str, str]:
    """Digest of every file under the tokenizer directory but weights, by relative path."""
    if tokenizer_dir is None:
        return {}
    found = {}
    for root, dirs, files in os.walk(tokenizer_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith(".") or name.endswith(WEIGHT_SUFFIXES) or ".safetensors.index" in name \
                    or ".bin.index" in name:
                continue
            path = os.path.join(root, name)
            found[os.path.relpath(path, tokenizer_dir)] = file_checksum(path)
    return found


def _tokenizer_fingerprint(tokenizer) -> dict:
    """What of the loaded tokenizer object decides the ids, which its files may not say (a template
    set after loading, a tokenizer built in memory): its class, special tokens, chat template, and
    its fast backend's serialisation without the truncation and padding that every call resets."""
    import tokenizers
    import transformers

    template = getattr(tokenizer, "chat_template", None)  # a text, None, or a dict of named templates
    fingerprint = {
        "class": type(tokenizer).__qualname__,
        "special_tokens": {k: str(v) for k, v in sorted(getattr(tokenizer, "special_tokens_map", {}).items())},
        "eos_token": str(tokenizer.eos_token),
        "chat_template": _text_digest(template if isinstance(template, str) else json.dumps(template, sort_keys=True)),
        "libraries": {"tokenizers": tokenizers.__version__, "transformers": transformers.__version__},
    }
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        state.pop("truncation", None)
        state.pop("padding", None)
        fingerprint["backend"] = _text_digest(json.dumps(state, sort_keys=True))
    else:  # a Python tokenizer: its vocabulary
        fingerprint["vocab"] = _text_digest(json.dumps(sorted(tokenizer.get_vocab().items())))
    return fingerprint


def key_inputs(sources: Sequence[str], *, tokenizer_dir: str | None, tokenizer, max_length: int,
               on_bad_row: str, unpaired: Unpaired | None = None, whole_rows: bool = False) -> dict:
    """Everything the key covers (kept in meta.json, so two keys can be told apart)."""
    # A pair store's key is unchanged by the unpaired layout's and the overlong rule's arrival.
    return ({} if unpaired is None else {"unpaired": asdict(unpaired)}) | (
        {"whole_rows": True} if whole_rows else {}) | {
        "format_version": FORMAT_VERSION,
        "tokenization_version": TOKENIZATION_VERSION,
        "sources": [source_checksum(path) for path in sources],  # the content only: a moved file still hits
        "tokenizer_files": _tokenizer_files(tokenizer_dir),
        "tokenizer": _tokenizer_fingerprint(tokenizer),
        "max_length": max_length,
        "max_row_bytes": max_row_bytes(max_length),
        "on_bad_row": on_bad_row,
    }


def store_key(inputs: dict) -> str:
    return xxhash.xxh3_128(json.dumps(inputs, sort_keys=True).encode("utf-8")).hexdigest()


# ----------------------------------------------------------------------------- reading


class TokenStore:
    """An opened store: memory maps and meta.json, nothing per sample. `store[i]` and `pair(i)` give
    sample i as a TokenizedPair; `sequence(j)` a read-only int32 view of sequence j."""

    def __init__(self, path: str, meta: dict, *, built: bool = False) -> None:
        self.path = path
        self.meta = meta
        self.built = built  # True when this call tokenized it (a miss), False when it was found
        self.stats: tuple[DataStats, ...] = tuple(
            DataStats(**{**s["stats"], "first_bad_lines": tuple(s["stats"]["first_bad_lines"]),
                         "unused_columns": tuple(s["stats"]["unused_columns"])}) for s in meta["sources"])
        self.field_names: tuple[str, ...] = tuple(meta["fields"])
        num_tokens = meta["num_tokens"]
        # np.memmap refuses an empty file; a store whose rows were all dropped has no tokens.
        self._tokens = (np.memmap(os.path.join(path, "tokens.bin"), dtype=TOKEN_DTYPE, mode="r", shape=(num_tokens,))
                        if num_tokens else np.zeros(0, dtype=TOKEN_DTYPE))
        self._sequences = np.load(os.path.join(path, "sequences.npy"), mmap_mode="r")
        self._samples = np.load(os.path.join(path, "samples.npy"), mmap_mode="r")
        self._fields = np.load(os.path.join(path, "fields.npy"), mmap_mode="r")

    @classmethod
    def open(cls, path: str | os.PathLike, *, key: str | None = None) -> TokenStore:
        """The store at `path`, checked (format, version, key when given, every file's size and the
        arrays' shapes); StoreError, one line, when it is not a complete store."""
        path = str(path)
        meta = _check_store(path, key=key)
        try:
            store = cls(path, meta)
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise StoreError(f"{path}: unreadable token store ({type(error).__name__}: {error})") from None
        store._check_shapes()
        return store

    def _check_shapes(self) -> None:
        meta = self.meta
        expected = {"sequences.npy": (self._sequences, (meta["num_sequences"], 2), np.int64),
                    "samples.npy": (self._samples, (meta["num_samples"], len(SAMPLE_COLUMNS)), np.int64),
                    "fields.npy": (self._fields, (meta["num_samples"], len(meta["fields"])), np.float64)}
        for name, (array, shape, dtype) in expected.items():
            if array.shape != shape or array.dtype != dtype:
                raise StoreError(f"{os.path.join(self.path, name)}: holds {array.dtype} {array.shape}, "
                                 f"meta.json says {np.dtype(dtype)} {shape}")
        if meta["num_sequences"] and int(self._sequences[-1].sum()) != meta["num_tokens"]:
            raise StoreError(f"{self.path}: the last sequence ends at token {int(self._sequences[-1].sum())}, "
                             f"tokens.bin holds {meta['num_tokens']}")

    def __reduce__(self):
        # Pickled (to a Ray actor, a process) as its path and key: the receiver opens the files,
        # where pickling the memory maps would copy the whole data set.
        return _reopen, (self.path, self.meta["key"])

    def __len__(self) -> int:
        return self.meta["num_samples"]

    @property
    def num_tokens(self) -> int:
        return self.meta["num_tokens"]

    def source_counts(self) -> list[int]:
        """The samples of each source, in order (they are stored source after source)."""
        if not len(self):
            return [0] * len(self.stats)
        return [int(n) for n in np.bincount(self._samples[:, 3], minlength=len(self.stats))]

    def sequence(self, index: int) -> np.ndarray:
        offset, length = self._sequences[index]
        return self._tokens[offset:offset + length]

    def sample(self, index: int) -> dict[str, int]:
        """Sample `index`'s row of samples.npy, by SAMPLE_COLUMNS."""
        return dict(zip(SAMPLE_COLUMNS, (int(v) for v in self._samples[index])))

    def field(self, name: str) -> np.ndarray:
        """A per-sample field (float64, NaN where absent), as a read-only view."""
        return self._fields[:, self.field_names.index(name)]

    def pair(self, index: int) -> TokenizedPair:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} of a store of {len(self)}")
        prompt, first, num_completions, _, line = self._samples[index].tolist()
        if num_completions == 1 and "unpaired" in self.meta["key_inputs"]:
            return self._unpaired(index, prompt=prompt, first=first, line=line)
        if num_completions != 2:
            raise ValueError(f"{self.path}: sample {index} has {num_completions} completions, not a pair")
        (start, n_prompt), (chosen_start, n_chosen), (rejected_start, n_rejected) = (
            self._sequences[prompt].tolist(), *self._sequences[first:first + 2].tolist())
        margin = float(self._fields[index, self.field_names.index("margin")]) if "margin" in self.field_names else math.nan
        margin = None if math.isnan(margin) else margin
        if chosen_start == start + n_prompt and rejected_start == chosen_start + n_chosen:  # as written: one read
            ids = self._tokens[start:start + n_prompt + n_chosen + n_rejected].tolist()
            return TokenizedPair(prompt_ids=tuple(ids[:n_prompt]), chosen_ids=tuple(ids[n_prompt:n_prompt + n_chosen]),
                                 rejected_ids=tuple(ids[n_prompt + n_chosen:]), source_line=line, margin=margin)
        return TokenizedPair(prompt_ids=tuple(self.sequence(prompt).tolist()),
                             chosen_ids=tuple(self.sequence(first).tolist()),
                             rejected_ids=tuple(self.sequence(first + 1).tolist()), source_line=line, margin=margin)

    def _unpaired(self, index: int, *, prompt: int, first: int, line: int) -> TokenizedPair:
        """An unpaired sample: its completion, then its KL completion, each cut to max_length with
        the sample's prompt (data/unpaired.py); its own completion again without KL sequences."""
        kl_batch_size = self.meta["key_inputs"]["unpaired"]["kl_batch_size"]
        index %= len(self)
        partner = (index if kl_batch_size is None
                   else kl_partner(index, num_samples=len(self), kl_batch_size=kl_batch_size))
        prompt_ids = tuple(self.sequence(prompt).tolist())
        budget = self.meta["key_inputs"]["max_length"] - len(prompt_ids)
        completion = tuple(self.sequence(first)[:budget].tolist())
        kl = completion if partner == index else tuple(self.sequence(int(self._samples[partner, 1]))[:budget].tolist())
        return TokenizedPair(prompt_ids=prompt_ids, chosen_ids=completion, rejected_ids=kl, source_line=line,
                             label=bool(self._fields[index, self.field_names.index("label")]))

    def __getitem__(self, index: int | slice) -> TokenizedPair | list[TokenizedPair]:
        if isinstance(index, slice):
            return [self.pair(i) for i in range(*index.indices(len(self)))]
        return self.pair(index)

    def __iter__(self):
        return (self.pair(i) for i in range(len(self)))


def _reopen(path: str, key: str) -> TokenStore:
    return TokenStore.open(path, key=key)


def _check_store(path: str, *, key: str | None) -> dict:
    meta_path = os.path.join(path, "meta.json")
    try:
        with open(meta_path, encoding="utf-8") as handle:
            meta = json.load(handle)
    except FileNotFoundError:
        raise StoreError(f"{path}: no meta.json (an unfinished store)") from None
    except (OSError, ValueError) as error:
        raise StoreError(f"{meta_path}: unreadable ({type(error).__name__}: {error})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        found = (meta.get("format"), meta.get("version")) if isinstance(meta, dict) else type(meta).__name__
        raise StoreError(f"{meta_path}: not a {FORMAT} version {FORMAT_VERSION} store (found {found})")
    if key is not None and meta.get("key") != key:
        raise StoreError(f"{meta_path}: holds key {meta.get('key')}, expected {key}")
    for name, size in meta.get("files", {}).items():
        try:
            actual = os.path.getsize(os.path.join(path, name))
        except OSError:
            raise StoreError(f"{os.path.join(path, name)}: missing") from None
        if actual != size:
            raise StoreError(f"{os.path.join(path, name)}: {actual} bytes, meta.json says {size}")
    if set(meta.get("files", {})) != set(FILES) - {"meta.json"}:
        raise StoreError(f"{meta_path}: lists files {sorted(meta.get('files', {}))}")
    return meta


# ----------------------------------------------------------------------------- writing


class _Column:
    """An int64 or float64 table written row by row to a raw file, made a .npy at the end."""

    def __init__(self, path: Path, *, width: int, dtype: str) -> None:
        self.path, self.width, self.dtype = path, width, np.dtype(dtype)
        self.raw_path = path.with_suffix(".raw")
        self.handle = open(self.raw_path, "wb")
        self.rows: list[tuple] = []
        self.num_rows = 0

    def add(self, row: tuple) -> None:
        self.rows.append(row)
        if len(self.rows) >= 65536:
            self.flush()

    def flush(self) -> None:
        if self.rows:
            np.asarray(self.rows, dtype=self.dtype).reshape(len(self.rows), self.width).tofile(self.handle)
            self.num_rows += len(self.rows)
            self.rows = []

    def finish(self) -> None:
        self.flush()
        self.handle.close()
        with open(self.path, "wb") as out:
            header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                      "shape": (self.num_rows, self.width)}
            np.lib.format.write_array_header_1_0(out, header)
            with open(self.raw_path, "rb") as raw:
                shutil.copyfileobj(raw, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
        os.unlink(self.raw_path)


class _StoreWriter:
    def __init__(self, directory: Path, *, fields: tuple[str, ...] = ()) -> None:
        self.directory = directory
        self.field_names = fields
        self.tokens = open(directory / "tokens.bin", "wb", buffering=1 << 20)
        self.num_tokens = 0
        self.sequences = _Column(directory / "sequences.npy", width=2, dtype="<i8")
        self.samples = _Column(directory / "samples.npy", width=len(SAMPLE_COLUMNS), dtype="<i8")
        self.fields = _Column(directory / "fields.npy", width=len(fields), dtype="<f8")

    def _sequence(self, ids: np.ndarray) -> int:
        self.tokens.write(np.ascontiguousarray(ids, dtype=TOKEN_DTYPE).tobytes())
        self.sequences.add((self.num_tokens, len(ids)))
        self.num_tokens += len(ids)
        return self.sequences.num_rows + len(self.sequences.rows) - 1

    def add_pair(self, source: int, line: int, prompt: np.ndarray, chosen: np.ndarray, rejected: np.ndarray,
                 margin: float | None = None) -> None:
        prompt_index = self._sequence(prompt)
        first = self._sequence(chosen)
        self._sequence(rejected)
        self.samples.add((prompt_index, first, 2, source, line))
        self.fields.add((math.nan if margin is None else margin,))

    def add_unpaired(self, source: int, line: int, prompt: np.ndarray, completion: np.ndarray, label: bool) -> None:
        prompt_index = self._sequence(prompt)
        self.samples.add((prompt_index, self._sequence(completion), 1, source, line))
        self.fields.add((float(label),))

    def finish(self, meta: dict) -> None:
        self.tokens.flush()
        os.fsync(self.tokens.fileno())
        self.tokens.close()
        for column in (self.sequences, self.samples, self.fields):
            column.finish()
        meta.update(num_tokens=self.num_tokens, num_sequences=self.sequences.num_rows,
                    num_samples=self.samples.num_rows, sample_columns=list(SAMPLE_COLUMNS),
                    fields=list(self.field_names), token_dtype=TOKEN_DTYPE.str,
                    files={name: os.path.getsize(self.directory / name) for name in FILES if name != "meta.json"})
        durable.write_file(self.directory / "meta.json", json.dumps(meta, indent=1) + "\n")  # last: the store exists
        durable.fsync_dir(self.directory)

    def close(self) -> None:
        for handle in (self.tokens, self.sequences.handle, self.samples.handle, self.fields.handle):
            handle.close()


# ----------------------------------------------------------------------------- open or build


def open_or_build(sources: str | Sequence[str], *, tokenizer_dir: str | None, tokenizer, max_length: int,
                  cache_dir: str | os.PathLike, on_bad_row: str = "error", workers: int | None = None,
                  log: Callable[[str], None] = print, progress_bar: bool | None = None,
                  unpaired: Unpaired | None = None, whole_rows: bool = False) -> TokenStore:
    """The store of `sources` (data files or saved dataset directories, their samples in this
    order) tokenized by `tokenizer` as `load_pairs` tokenizes each: opened when `<cache_dir>/<key>`
    holds a complete one, else built there (the train command's --data-cache, default
    `driver.defaults.default_data_cache()`; workers: default `default_workers`).

    `tokenizer` is the loaded tokenizer, with the chat template it renders (--chat-template is set
    on it before); `tokenizer_dir` the directory it was loaded from (None for one built in memory).
    Raises `load_pairs`' DataError for bad data, before any store is left behind. `unpaired`:
    KTO's rows and their KL pairing (data/unpaired.py), not pairs. `whole_rows`: `load_pairs`'."""
    sources = [sources] if isinstance(sources, str) else list(sources)
    if not sources:
        raise DataError("data: no data files")
    _check_arguments(tokenizer, max_length=max_length, on_bad_row=on_bad_row)
    for path in sources:
        _check_source(path)
    inputs = key_inputs(sources, tokenizer_dir=tokenizer_dir, tokenizer=tokenizer, max_length=max_length,
                        on_bad_row=on_bad_row, unpaired=unpaired, whole_rows=whole_rows)
    key = store_key(inputs)
    root = Path(cache_dir).absolute()
    final = root / key
    if final.exists():
        try:
            store = TokenStore.open(final, key=key)
        except StoreError as error:
            log(f"data: {error}; rebuilding the token store")
            _move_aside(final)
        else:
            log(f"data: opened the token store {final} ({len(store):,} samples, {store.num_tokens:,} tokens)")
            return store
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(root)
    if workers is None:
        workers = default_workers(sum(source_bytes(path) for path in sources))
    pool = TokenizerPool(tokenizer, workers=workers)
    workers = pool.workers
    partial = root / f"{key}.partial-{uuid.uuid4().hex[:12]}"
    partial.mkdir()
    started = time.monotonic()
    log(f"data: tokenizing {', '.join(sources)} into {final} ({workers} worker{'s' if workers > 1 else ''})")
    try:
        writer = _StoreWriter(partial, fields=PAIR_FIELDS if unpaired is None else UNPAIRED_FIELDS)
        try:
            stats = []
            progress = Progress(log=log, bar=progress_bar)
            with pool:
                for index, path in enumerate(sources):
                    def write(line, prompt, chosen, rejected, label, margin, _source=index):
                        if label is None:
                            writer.add_pair(_source, line, prompt, chosen, rejected, margin)
                        else:  # an unpaired row: chosen is rejected, its one completion
                            writer.add_unpaired(_source, line, prompt, chosen, label)

                    stats.append(tokenize_source(path, tokenizer=tokenizer, max_length=max_length,
                                                 on_bad_row=on_bad_row, pool=pool, write=write, progress=progress,
                                                 unpaired=unpaired is not None, whole_rows=whole_rows))
            writer.finish({
                "format": FORMAT, "version": FORMAT_VERSION, "key": key, "key_inputs": inputs,
                "sources": [{"path": path, "stats": asdict(s)} for path, s in zip(sources, stats)],
                "workers": workers, "build_seconds": round(time.monotonic() - started, 3),
            })
        finally:
            writer.close()
        try:
            durable.move(partial, final)
        except OSError:  # another builder renamed its copy first: use the winner's
            shutil.rmtree(partial, ignore_errors=True)
            store = TokenStore.open(final, key=key)
            log(f"data: another process built {final} first; using it")
            return store
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    store = TokenStore.open(final, key=key)
    store.built = True
    seconds = time.monotonic() - started
    log(f"data: tokenized {len(store):,} pairs ({store.num_tokens:,} tokens) in {seconds:.1f} s "
        f"({len(store) / max(seconds, 1e-9):,.0f} pairs/s) into {final}")
    return store


def _move_aside(directory: Path) -> None:
    """Removes a store that failed its checks: renamed first, so no reader finds half of it."""
    aside = directory.with_name(f"{directory.name}.partial-{uuid.uuid4().hex[:12]}")
    try:
        os.replace(directory, aside)
    except FileNotFoundError:  # another process moved it first
        return
    shutil.rmtree(aside, ignore_errors=True)


def _remove_stale_partials(root: Path) -> None:
    """Removes `.partial-` directories nothing has written to for STALE_PARTIAL_S (dead builders)."""
    now = time.time()
    for entry in root.glob("*.partial-*"):
        try:
            newest = max([entry.stat().st_mtime, *(child.stat().st_mtime for child in entry.iterdir())])
        except OSError:  # removed meanwhile
            continue
        if now - newest > STALE_PARTIAL_S:
            shutil.rmtree(entry, ignore_errors=True)
