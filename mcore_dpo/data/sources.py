"""Data sources on disk -> rows: the files and directories a run reads its preference rows from,
each row numbered as its messages name it, without looking at what a row holds (pairs.py does).

    _check_source(path)     the kind: ".jsonl", ".json", ".parquet" or "dataset"; DataError else
    _read_rows(path)        (row number, row) in file order
    source_checksum(path)   the content's digest (a file's, or a saved dataset directory's files')
    source_bytes(path)      the bytes read

.jsonl: one row a line (a line that is not JSON is a _BadRow of that line, not raised); .json:
an array of rows, a column dict or JSON lines; .parquet: read with the `datasets` library; a
directory written by `datasets`' `save_to_disk` (a Dataset, or a DatasetDict's "train" split),
read from its memory-mapped Arrow files in batches. JSON is parsed here, not by `datasets`, so a
broken row is reported with its line number; Parquet and saved-dataset rows are numbered from 1
("row N").
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterator

import xxhash

from checkpoint_convert.integrity import file_checksum


class DataError(ValueError):
    """Bad data or data configuration; str() is one line: 'FILE:LINE: problem'."""


class _BadRow(Exception):
    """One row is unusable; the caller decides whether to raise or skip."""


# ----------------------------------------------------------------------------- reading


def _json_problem(error: json.JSONDecodeError) -> str:
    # Some of json's messages end in "at" ("Invalid control character at"): say it once.
    message = error.msg.removesuffix(" at")
    return f"broken JSON ({message} at column {error.colno})"


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _utf8_problem(raw: bytes) -> tuple[int, str] | None:
    """(byte offset, problem) of the first invalid UTF-8 sequence, or None."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return error.start, f"invalid UTF-8 (byte {raw[error.start]:#04x})"
    return None


def _jsonl_row(raw_line: bytes) -> Any:
    """One JSONL line's row: the parsed value, or a _BadRow (not raised) saying why not."""
    problem = _utf8_problem(raw_line)
    if problem is not None:
        return _BadRow(problem[1])
    try:
        return json.loads(raw_line.decode("utf-8"))
    except json.JSONDecodeError as error:
        return _BadRow(_json_problem(error))


def _jsonl_rows(raw: bytes, *, path: str) -> Iterator[tuple[int, Any]]:
    """Yields (line number, parsed row or _BadRow); blank lines are not rows."""
    for index, raw_line in enumerate(raw.split(b"\n")):
        if raw_line.strip():
            yield index + 1, _jsonl_row(raw_line)


def _json_rows(raw: bytes, *, path: str) -> Iterator[tuple[int, Any]]:
    problem = _utf8_problem(raw)
    if problem is not None:
        offset, message = problem
        line = raw[:offset].count(b"\n") + 1
        raise DataError(f"{path}:{line}: {message}")
    text = raw.decode("utf-8")
    if not text.lstrip().startswith("["):
        try:
            document = json.loads(text)
        except json.JSONDecodeError:
            # Not one document: JSON lines in a .json file, as `datasets` also accepts.
            yield from _jsonl_rows(raw, path=path)
            return
        # A dict of equally long lists is a column table, unless the lists hold messages:
        # then it is one conversational row.
        is_columns = isinstance(document, dict) and document and all(isinstance(v, list) for v in document.values())
        if is_columns and not any(isinstance(item, dict) for v in document.values() for item in v):
            columns = list(document)
            num_rows = len(document[columns[0]])
            if any(len(document[column]) != num_rows for column in columns):
                raise DataError(f"{path}: column lists have different lengths")
            for index in range(num_rows):
                yield index + 1, {column: document[column][index] for column in columns}
            return
        yield 1, document
        return
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise DataError(f"{path}:{error.lineno}: {_json_problem(error)}") from None
    if not isinstance(document, list):
        raise DataError(f"{path}:1: expected a JSON array of rows")
    # Report each row by the line it starts on: decode the array element by element.
    # The document is valid (parsed above); find where each element starts, counting lines as
    # we go so that a large file stays linear.
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    line, counted_to = 1 + text.count("\n", 0, position), position
    for row in document:
        while text[position] in " \t\r\n,":
            position += 1
        line += text.count("\n", counted_to, position)
        counted_to = position
        _, position = decoder.raw_decode(text, position)
        yield line, row


def _import_datasets():
    """The `datasets` module, quiet: imported lazily (it is slow to import and only Parquet and
    saved datasets need it), its log lines and progress bars off (they would break our one-line errors)."""
    import datasets

    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    return datasets


def _parquet_rows(path: str) -> Iterator[tuple[int, Any]]:
    datasets = _import_datasets()
    try:
        table = datasets.Dataset.from_parquet(path, keep_in_memory=True)
    except Exception as error:  # datasets raises many types; the message is what matters
        raise DataError(f"{path}: cannot read Parquet file ({_first_line(error)})") from None
    for index, row in enumerate(table.to_list()):
        yield index + 1, row


# A saved dataset's rows are read this many at a time from its memory-mapped Arrow files.
DATASET_BATCH_ROWS = 1024
_DATASET_FILES = ("dataset_info.json", "state.json")  # what `Dataset.save_to_disk` writes beside its data-*.arrow


def _is_saved_dataset(directory: str) -> bool:
    return all(os.path.isfile(os.path.join(directory, name)) for name in _DATASET_FILES)


def _dataset_directory(path: str) -> str:
    """The directory of the saved Dataset that `path` stands for: `path` itself, or its "train"
    split for a saved DatasetDict. DataError, one line, for a directory that is neither, or a
    DatasetDict without a "train" split."""
    if _is_saved_dataset(path):
        return path
    dict_file = os.path.join(path, "dataset_dict.json")
    if not os.path.isfile(dict_file):
        raise DataError(f"{path}: a directory, not a saved Hugging Face dataset "
                        "(no dataset_info.json/state.json or dataset_dict.json)")
    try:
        with open(dict_file, encoding="utf-8") as handle:
            splits = [str(split) for split in json.load(handle)["splits"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(f"{dict_file}: unreadable ({type(error).__name__}: {_first_line(error)})") from None
    if "train" not in splits:
        example = os.path.join(path, splits[0] if splits else "SPLIT")
        raise DataError(f"{path}: a saved DatasetDict with splits {', '.join(splits) or '(none)'} and no 'train'; "
                        f"give one split's directory (e.g. {example})")
    train = os.path.join(path, "train")
    if not _is_saved_dataset(train):
        raise DataError(f"{train}: the DatasetDict's 'train' split is not a saved dataset "
                        "(no dataset_info.json/state.json)")
    return train


def _dataset_files(directory: str) -> list[tuple[str, str]]:
    """(relative path, path) of the files of a saved dataset's directory, sorted, without hidden
    files and the `cache-*.arrow` files that `datasets` may add beside the data."""
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith(".") or (name.startswith("cache-") and name.endswith(".arrow")):
                continue
            path = os.path.join(root, name)
            found.append((os.path.relpath(path, directory).replace(os.sep, "/"), path))
    return sorted(found)


def _dataset_rows(path: str) -> Iterator[tuple[int, Any]]:
    """The rows of a saved dataset as (row number from 1, row dict), in batches of
    DATASET_BATCH_ROWS from the memory-mapped Arrow files (never the whole set as Python objects);
    conversations come out as lists of dicts, as JSON gives them."""
    directory = _dataset_directory(path)
    datasets = _import_datasets()
    try:
        dataset = datasets.Dataset.load_from_disk(directory, keep_in_memory=False).with_format(None)
        batches = dataset.iter(batch_size=DATASET_BATCH_ROWS)
    except Exception as error:  # datasets raises many types; the message is what matters
        raise DataError(f"{path}: cannot read the saved dataset ({_first_line(error)})") from None
    number = 0
    while True:
        try:
            batch = next(batches, None)
        except Exception as error:
            problem = _first_line(error)
            raise DataError(f"{path}: cannot read the saved dataset after row {number} ({problem})") from None
        if batch is None:
            return
        columns = list(batch)
        for values in zip(*(batch[column] for column in columns)):
            number += 1
            yield number, dict(zip(columns, values))


def source_checksum(path: str) -> str:
    """The digest of a data source's content, as the token store's key takes it: a file's
    `file_checksum` (XXH3-64), or for a saved dataset directory an XXH3-64 digest of the sorted
    relative paths and file checksums of the files of the dataset it reads (`_dataset_files`: a
    DatasetDict's "train" split). A moved or copied source keeps it; any changed row changes it."""
    if not os.path.isdir(path):
        return file_checksum(path)
    digest = xxhash.xxh3_64()
    for relative, file_path in _dataset_files(_dataset_directory(path)):
        digest.update(relative.encode("utf-8") + b"\0" + file_checksum(file_path).encode("ascii") + b"\0")
    return digest.hexdigest()


def source_bytes(path: str) -> int:
    """The bytes of a data source: a file's size, or the sizes of a saved dataset's files together."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(file_path) for _, file_path in _dataset_files(_dataset_directory(path)))


def _check_source(path: str) -> str:
    """The data file's extension (lower case), or "dataset" for a saved Hugging Face dataset
    directory; DataError: no such file, an unknown type, or a directory that is no saved dataset."""
    if os.path.isdir(path):
        _dataset_directory(path)
        return "dataset"
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    extension = os.path.splitext(path)[1].lower()
    if extension not in (".jsonl", ".json", ".parquet"):
        raise DataError(f"{path}: unknown file type {extension or '(none)'!r}; expected .jsonl, .json or .parquet")
    return extension


def _read_rows(path: str) -> Iterator[tuple[int, Any]]:
    extension = _check_source(path)
    if extension == ".parquet":
        return _parquet_rows(path)
    if extension == "dataset":
        return _dataset_rows(path)
    with open(path, "rb") as handle:
        raw = handle.read()
    return _jsonl_rows(raw, path=path) if extension == ".jsonl" else _json_rows(raw, path=path)
