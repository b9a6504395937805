"""Unpaired data (--objective kto): rows {prompt, completion, label}, or preference pairs unpaired,
in the token store (data/store.py) as samples of one completion and a `label` field, read back
as TokenizedPairs whose rejected_ids are the sample's KL completion.

As TRL 1.16's KTOTrainer prepares its data (objective/kto.py's docstring):
- A file whose first object has "chosen" and "rejected" is unpaired in chunks of 1000 rows: the
  chunk's desirable rows (completion = chosen, label true), then its undesirable ones
  (`unpaired_rows`; objective/kto.py `unpair` on whole lists). A prompt is required.
- Each row is tokenized as a pair whose two completions are its one completion
  (pairs.py `_validate_unpaired_row`): EOS text, prompt cut, dropped prompts as TRL's.
- A sample's KL completion is the completion of the previous sample of its chunk of
  `kl_batch_size` samples in store order (objective/kto.py `kl_completion_index`; TRL 1.16's
  per_device_train_batch_size, so --micro-batch-size), the chunk's first taking its last's. The
  store keeps each completion to max_length - 1 tokens; reading cuts both completions to
  max_length with the sample's own prompt, as TRL's collator cuts prompt + completion.

The KL completions follow the store's order, so they pair within one microbatch of a run that
reads the file in order (--no-shuffle, which TRL requires for the KL term); apo_zero_unpaired
reads no KL (kl_batch_size None): its second sequence is the sample's own completion again.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from mcore_dpo.data.sources import _BadRow

# Rows per chunk of `datasets.Dataset.map(batched=True)` (its default batch_size), which is
# what TRL 1.16's unpairing reorders within.
UNPAIR_CHUNK_SIZE = 1000


@dataclass(frozen=True)
class Unpaired:
    """How a token store holds unpaired samples (part of its key)."""

    kl_batch_size: int | None
    """The chunk each KL completion is taken from (--micro-batch-size); None: no KL sequences."""


def unpaired_rows(rows: Iterable[tuple[int, Any]], *, chunk_size: int = UNPAIR_CHUNK_SIZE) -> Iterator[tuple[int, Any]]:
    """(line, row) of a file in the order TRL 1.16 trains its rows: unpaired rows as they come, a
    paired file (its first object has "chosen" and "rejected") unpaired chunk by chunk, each row
    keeping its line. A paired row without both completions comes back as a _BadRow."""
    rows = iter(rows)
    paired = None
    chunk: list[tuple[int, Any]] = []
    for line, row in rows:
        if paired is None and isinstance(row, dict):
            paired = "chosen" in row and "rejected" in row
        if paired is None:  # bad rows before the first object
            yield line, row
        elif not paired:
            yield line, row
        else:
            chunk.append((line, row))
            if len(chunk) == chunk_size:
                yield from _unpair_chunk(chunk)
                chunk = []
    yield from _unpair_chunk(chunk)


def _unpair_chunk(chunk: list[tuple[int, Any]]) -> Iterator[tuple[int, Any]]:
    good = []
    for line, row in chunk:
        if isinstance(row, dict) and "chosen" in row and "rejected" in row:
            good.append((line, row))
        elif isinstance(row, dict):
            missing = [key for key in ("chosen", "rejected") if key not in row]
            yield line, _BadRow(f"missing key '{missing[0]}' (a paired file: every row has chosen and rejected)")
        else:
            yield line, row
    for key, label in (("chosen", True), ("rejected", False)):
        for line, row in good:
            out = {k: v for k, v in row.items() if k not in ("chosen", "rejected")}
            out.update(completion=row[key], label=label)
            yield line, out


def kl_partner(index: int, *, num_samples: int, kl_batch_size: int) -> int:
    """The sample whose completion follows sample `index`'s prompt in its KL sequence
    (objective/kto.py `kl_completion_index`, for one sample)."""
    start = index - index % kl_batch_size
    size = min(kl_batch_size, num_samples - start)
    return start + (index - start - 1) % size
