"""How pairs become microbatch rows, for the training step, evaluation and the reference passes
alike: `RowLayout` says whether rows are packed (`packing.collate_packed`) or padded to one
length per pass (`pairs.collate`), and whether each pair's prompt is computed once for both
completions (`prefix_sharing`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from mcore_dpo.data.pairs import Microbatch, TokenizedPair, collate, padded_seq_len
from mcore_dpo.data.packing import collate_packed, cost_of, plan_packed_step
from mcore_dpo.data.prefix_sharing import collate_shared, shared_seq_len


@dataclass(frozen=True)
class RowLayout:
    """The rows of a run's microbatches. `max_tokens` is a packed microbatch's token budget."""

    packing: bool
    prefix_sharing: bool
    pad_token_id: int
    multiple: int
    max_tokens: int
    # A training step's packed microbatch count is a multiple of this (--vpp: pp, the interleaved
    # 1F1B schedule's microbatch group).
    count_multiple: int = 1

    def cost(self, pair: TokenizedPair) -> int:
        """The token positions `pair` takes in a packed row."""
        return cost_of(self.prefix_sharing)(pair)

    def padded(self) -> RowLayout:
        """This layout with padded rows (passes that cut pairs by count, not by tokens)."""
        return dataclasses.replace(self, packing=False)

    def plan_step(self, pairs: Sequence[TokenizedPair], *, dp: int) -> list[list[list[int]]]:
        """Packed: each dp rank's microbatches of a step's `pairs` (`packing.plan_packed_step`)."""
        return plan_packed_step(pairs, dp=dp, max_tokens=self.max_tokens, cost=self.cost,
                                count_multiple=self.count_multiple)

    def microbatches(self, pairs: Sequence[TokenizedPair], groups: Sequence[Sequence[int]], *,
                     pad_over: Sequence[int] | None = None) -> list[Microbatch]:
        """The microbatch of each group (indices into `pairs`). Packed: one row per group, its
        pairs end to end. Padded: every row as long as the longest pair of `pad_over` (default:
        the groups' own pairs), rounded up to `multiple`; pipeline receive buffers are sized by
        the first microbatch, so one pass shares one length."""
        if self.packing:
            return [collate_packed([pairs[i] for i in ids], pad_token_id=self.pad_token_id, multiple=self.multiple,
                                   prefix_sharing=self.prefix_sharing) for ids in groups]
        over = [pairs[i] for i in (pad_over if pad_over is not None else [i for ids in groups for i in ids])]
        if self.prefix_sharing:
            seq_len = shared_seq_len(over, multiple=self.multiple)
            return [collate_shared([pairs[i] for i in ids], pad_token_id=self.pad_token_id, seq_len=seq_len)
                    for ids in groups]
        seq_len = padded_seq_len(over, multiple=self.multiple)
        return [collate([pairs[i] for i in ids], pad_token_id=self.pad_token_id, seq_len=seq_len) for ids in groups]

    def token_stats(self, pairs: Sequence[TokenizedPair], *, dp: int, micro_batch_size: int) -> dict[str, float]:
        """Token metrics of one training step's global batch over all dp ranks: real tokens
        (the pairs' two sequences, prompt twice, however they are laid out), token positions
        computed (`tokens/padded`: real, less what prefix sharing saves, plus padding),
        `padding_fraction` (the positions that compute nothing), and the number of microbatches."""
        real = sum(len(p.prompt_ids) * 2 + len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)
        placed = sum(self.cost(p) for p in pairs)
        if self.packing:
            groups = [mb for rank in self.plan_step(pairs, dp=dp) for mb in rank]
            positions = sum(-(-sum(self.cost(pairs[i]) for i in mb) // self.multiple) * self.multiple for mb in groups)
            count = len(groups)
        else:
            count = -(-len(pairs) // micro_batch_size)
            if self.prefix_sharing:
                positions = len(pairs) * shared_seq_len(pairs, multiple=self.multiple)
            else:
                positions = 2 * len(pairs) * padded_seq_len(pairs, multiple=self.multiple)
        return {"tokens/real": float(real), "tokens/padded": float(positions), "padding_fraction": 1.0 - placed / positions,
                "microbatches": float(count)}
