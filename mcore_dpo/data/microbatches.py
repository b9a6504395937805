"""One way to cut pairs into microbatches, for the training step, evaluation and the
reference passes alike: packed rows (`packing.collate_packed`), or padded rows of one length
per pass (`data.collate`)."""

from __future__ import annotations

from collections.abc import Sequence

from mcore_dpo.data.pairs import Microbatch, TokenizedPair, collate, padded_seq_len
from mcore_dpo.data.packing import collate_packed


def microbatches(pairs: Sequence[TokenizedPair], groups: Sequence[Sequence[int]], *, packing: bool, pad_token_id: int,
                 multiple: int, pad_over: Sequence[int] | None = None) -> list[Microbatch]:
    """The microbatch of each group (indices into `pairs`). Packed: one row per group, its
    sequences end to end. Padded: every row as long as the longest pair of `pad_over` (default:
    the groups' own pairs), rounded up to `multiple`; pipeline receive buffers are sized by the
    first microbatch, so one pass shares one length."""
    if packing:
        return [collate_packed([pairs[i] for i in ids], pad_token_id=pad_token_id, multiple=multiple)
                for ids in groups]
    over = pad_over if pad_over is not None else [i for ids in groups for i in ids]
    seq_len = padded_seq_len([pairs[i] for i in over], multiple=multiple)
    return [collate([pairs[i] for i in ids], pad_token_id=pad_token_id, seq_len=seq_len) for ids in groups]
