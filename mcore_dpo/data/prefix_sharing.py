"""Shared-prompt rows (`--prefix-sharing`): each pair's prompt computed once for both completions.

A pair (prompt P, chosen C, rejected R) is laid out as one stretch of a row:

    [ p_1 .. p_{P-1} | p_P c_1 .. c_C | p_P r_1 .. r_R ]
      the prompt body  the chosen branch the rejected branch

- The prompt body (every prompt token but the last) is seen by both branches.
- Each branch starts with the prompt's last token again, at the same position P-1, then its
  completion at positions P, P+1, ...: the rejected positions restart where chosen's started.
- A branch sees the body and its own earlier tokens, never the other branch.

The last prompt token is computed once per branch: its copy sees exactly the keys the original
sees (the body and itself, at the same positions), so its hidden state, and the logits that
predict the branch's first completion token, are the ones of the prompt's last position. Each
position then predicts exactly one token, as in an ordinary row, and every per-token quantity
(the log-prob tables, LD-DPO's weights, WPO's, the mean logit) is computed as it is today. A
shared pair costs P + C + R + 1 token positions instead of 2P + C + R.

Segments: the body and the chosen branch are the chosen sequence's segment (j of b pairs), the
rejected branch is segment b + j (as `packing.collate_packed` numbers them), padding is 2b;
`shared_prompt` marks the body. `model.builder.segment_mask` turns these into the attention mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mcore_dpo.data.pairs import Microbatch, TokenizedPair


def shared_pair_tokens(pair: TokenizedPair) -> int:
    """Token positions of a shared pair: the prompt, both completions, the prompt's last token again
    (a pair without a prompt, a row used whole: its two sequences)."""
    return len(pair.prompt_ids) + len(pair.chosen_ids) + len(pair.rejected_ids) + bool(pair.prompt_ids)


def shared_seq_len(pairs: Sequence[TokenizedPair], *, multiple: int) -> int:
    """The longest shared pair of `pairs`, rounded up to a multiple of `multiple`."""
    if not pairs:
        raise ValueError("shared_seq_len: no pairs")
    longest = max(shared_pair_tokens(p) for p in pairs)
    return -(-longest // multiple) * multiple


@dataclass
class RowTensors:
    """The tensors of rows being filled: [rows, W] each (see pairs.Microbatch)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    segment_ids: torch.Tensor
    shared_prompt: torch.Tensor  # bool: the prompt body of a shared pair

    @classmethod
    def empty(cls, rows: int, width: int, *, pad_token_id: int, pad_segment: int) -> RowTensors:
        return cls(tokens=torch.full((rows, width), pad_token_id, dtype=torch.int64),
                   labels=torch.full((rows, width), pad_token_id, dtype=torch.int64),
                   loss_mask=torch.zeros((rows, width), dtype=torch.float32),
                   position_ids=torch.zeros((rows, width), dtype=torch.int64),
                   segment_ids=torch.full((rows, width), pad_segment, dtype=torch.int64),
                   shared_prompt=torch.zeros((rows, width), dtype=torch.bool))


def place_shared_pair(rows: RowTensors, *, row: int, at: int, pair: TokenizedPair, chosen_segment: int,
                      rejected_segment: int) -> int:
    """Write `pair` (module docstring) into `rows` from column `at` of `row`; returns the column after it."""
    if not pair.prompt_ids:  # a row used whole (data/pairs.py `whole_rows`): nothing to share
        for segment, sequence in ((chosen_segment, pair.chosen_ids), (rejected_segment, pair.rejected_ids)):
            m = len(sequence)
            rows.tokens[row, at : at + m] = torch.tensor(sequence, dtype=torch.int64)
            rows.labels[row, at : at + m - 1] = torch.tensor(sequence[1:], dtype=torch.int64)
            rows.loss_mask[row, at : at + m - 1] = 1.0
            rows.position_ids[row, at : at + m] = torch.arange(m)
            rows.segment_ids[row, at : at + m] = segment
            at += m
        return at
    body = pair.prompt_ids[:-1]
    n = len(body)
    if n:
        rows.tokens[row, at : at + n] = torch.tensor(body, dtype=torch.int64)
        rows.labels[row, at : at + n] = torch.tensor(pair.prompt_ids[1:], dtype=torch.int64)  # no loss on them
        rows.position_ids[row, at : at + n] = torch.arange(n)
        rows.segment_ids[row, at : at + n] = chosen_segment
        rows.shared_prompt[row, at : at + n] = True
    at += n
    for segment, completion in ((chosen_segment, pair.chosen_ids), (rejected_segment, pair.rejected_ids)):
        branch = torch.tensor((pair.prompt_ids[-1], *completion), dtype=torch.int64)
        m = len(branch)
        rows.tokens[row, at : at + m] = branch
        # Position t of the branch predicts its token t+1: the prompt's last token predicts the
        # first completion token; the branch's last token predicts nothing.
        rows.labels[row, at : at + m - 1] = branch[1:]
        rows.loss_mask[row, at : at + m - 1] = 1.0
        rows.position_ids[row, at : at + m] = torch.arange(n, n + m)
        rows.segment_ids[row, at : at + m] = segment
        at += m
    return at


def collate_shared(pairs: Sequence[TokenizedPair], *, pad_token_id: int, seq_len: int) -> Microbatch:
    """Padded shared rows: row j holds pair j (module docstring), right-padded to `seq_len`."""
    if not pairs:
        raise ValueError("collate_shared: no pairs")
    b = len(pairs)
    rows = RowTensors.empty(b, seq_len, pad_token_id=pad_token_id, pad_segment=2 * b)
    num_positions = 1
    for j, pair in enumerate(pairs):
        if shared_pair_tokens(pair) > seq_len:
            raise ValueError(f"collate_shared: pair from line {pair.source_line} has {shared_pair_tokens(pair)} "
                             f"shared tokens, more than seq_len {seq_len}")
        end = place_shared_pair(rows, row=j, at=0, pair=pair, chosen_segment=j, rejected_segment=b + j)
        rows.position_ids[j, end:] = torch.arange(seq_len - end)
        num_positions = max(num_positions, len(pair.prompt_ids) + max(len(pair.chosen_ids), len(pair.rejected_ids)),
                            seq_len - end)
    return Microbatch(tokens=rows.tokens, labels=rows.labels, loss_mask=rows.loss_mask, position_ids=rows.position_ids,
                      segment_ids=rows.segment_ids, num_sequences=2 * b, shared_prompt=rows.shared_prompt,
                      num_positions=num_positions)

