"""Packed sequences (padding-free DPO) and token-balanced microbatches: pure functions.

With `--packing`, a training step's global batch is split by tokens, not by pair count:
1. `balance_ranks`: pairs go to data-parallel ranks so that each rank's token total is close
   to the others' (greedy longest-processing-time: heaviest pair first, to the lightest rank).
2. `split_microbatches`: each rank's pairs go into few microbatches that fit the token budget,
   balanced among themselves where possible (the same greedy, into k bins, for the smallest k
   that fits, up to one more than first-fit-decreasing bin packing needs). The count may
   differ between steps and between dp ranks.
3. `collate_packed`: one microbatch is one row. Its sequences (prompt+chosen and
   prompt+rejected of every pair, a pair's two always together) lie end to end; each sequence
   attends only to itself (`segment_ids`) and its positions restart at 0 (`position_ids`).
   The row is right-padded to a multiple of `multiple` tokens; the padding is a segment of its
   own, masked out of the loss.

A pair costs `pair_tokens` = 2 * prompt + chosen + rejected tokens; with `--prefix-sharing` it is
one stretch of the row (`prefix_sharing.place_shared_pair`), its prompt once, costing
`prefix_sharing.shared_pair_tokens`. Every function is
deterministic: every rank of every role computes the same split from the same global batch.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import torch

from mcore_dpo.data.pairs import Microbatch, TokenizedPair
from mcore_dpo.data.prefix_sharing import RowTensors, place_shared_pair, shared_pair_tokens


def pair_tokens(pair: TokenizedPair) -> int:
    """Tokens of a pair's two sequences: prompt+chosen and prompt+rejected."""
    return 2 * len(pair.prompt_ids) + len(pair.chosen_ids) + len(pair.rejected_ids)


def cost_of(prefix_sharing: bool) -> Callable[[TokenizedPair], int]:
    """The token positions a pair takes in a packed row: `pair_tokens`, or with prefix sharing
    `prefix_sharing.shared_pair_tokens` (the prompt once)."""
    return shared_pair_tokens if prefix_sharing else pair_tokens


def _greedy_bins(costs: Sequence[int], items: Sequence[int], *, num_bins: int) -> list[list[int]]:
    """Longest-processing-time greedy: items by decreasing cost (ties: lower index first), each
    to the bin with the smallest total (ties: lower bin). Items within a bin keep their order."""
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    heap = [(0, b) for b in range(num_bins)]
    for item in sorted(items, key=lambda i: (-costs[i], i)):
        total, b = heapq.heappop(heap)
        bins[b].append(item)
        heapq.heappush(heap, (total + costs[item], b))
    return [sorted(members) for members in bins]


def balance_ranks(costs: Sequence[int], *, num_ranks: int) -> list[list[int]]:
    """Indices of `costs` per rank, token totals balanced (greedy LPT). Every rank gets at
    least one item when there are at least `num_ranks` items of positive cost."""
    if num_ranks < 1:
        raise ValueError(f"balance_ranks: num_ranks must be >= 1, got {num_ranks}")
    if len(costs) < num_ranks:
        raise ValueError(f"balance_ranks: {len(costs)} pairs cannot give each of {num_ranks} ranks one")
    if any(c <= 0 for c in costs):
        raise ValueError("balance_ranks: every pair must have a positive token count")
    return _greedy_bins(costs, range(len(costs)), num_bins=num_ranks)


def _first_fit_decreasing(costs: Sequence[int], items: Sequence[int], *, capacity: int) -> list[list[int]]:
    """Bin packing: items by decreasing cost, each into the first bin it fits (at most
    11/9 of the fewest bins, plus one)."""
    bins: list[list[int]] = []
    totals: list[int] = []
    for item in sorted(items, key=lambda i: (-costs[i], i)):
        for b, total in enumerate(totals):
            if total + costs[item] <= capacity:
                bins[b].append(item)
                totals[b] += costs[item]
                break
        else:
            bins.append([item])
            totals.append(costs[item])
    return [sorted(members) for members in bins]


def split_microbatches(costs: Sequence[int], items: Sequence[int], *, max_tokens: int,
                       count_multiple: int = 1) -> list[list[int]]:
    """`items` (indices into `costs`) cut into microbatches of at most `max_tokens` each:
    the fewest k for which the greedy balanced split into k fits, tried from the lower bound
    ceil(total / max_tokens) up to one more than first-fit-decreasing bin packing needs (one
    extra microbatch buys even ones); when none fits, first-fit-decreasing's bins.
    Microbatches are ordered by their first item.

    `count_multiple` > 1 (--vpp: megatron-core's interleaved 1F1B runs microbatches in groups of
    pp): k is the fewest multiple of it for which the greedy split fits."""
    if count_multiple > 1:
        return _split_in_multiples(costs, items, max_tokens=max_tokens, count_multiple=count_multiple)
    if not items:
        raise ValueError("split_microbatches: no items")
    too_big = [i for i in items if costs[i] > max_tokens]
    if too_big:
        raise ValueError(f"split_microbatches: pair {too_big[0]} has {costs[too_big[0]]} tokens, more than the "
                         f"budget {max_tokens}")
    packed = _first_fit_decreasing(costs, items, capacity=max_tokens)
    total = sum(costs[i] for i in items)
    for num_bins in range(max(1, -(-total // max_tokens)), min(len(items), len(packed) + 1) + 1):
        bins = _greedy_bins(costs, items, num_bins=num_bins)
        if all(sum(costs[i] for i in b) <= max_tokens for b in bins):
            packed = bins
            break
    return sorted((b for b in packed if b), key=lambda b: b[0])


def _split_in_multiples(costs: Sequence[int], items: Sequence[int], *, max_tokens: int,
                        count_multiple: int) -> list[list[int]]:
    """split_microbatches with a microbatch count that is a multiple of `count_multiple`."""
    too_big = [i for i in items if costs[i] > max_tokens]
    if too_big:
        raise ValueError(f"split_microbatches: pair {too_big[0]} has {costs[too_big[0]]} tokens, more than the "
                         f"budget {max_tokens}")
    lowest = max(1, -(-sum(costs[i] for i in items) // max_tokens))
    for num_bins in range(-(-lowest // count_multiple) * count_multiple, len(items) + 1, count_multiple):
        bins = _greedy_bins(costs, items, num_bins=num_bins)
        if all(sum(costs[i] for i in b) <= max_tokens for b in bins):
            return sorted(bins, key=lambda b: b[0])
    raise ValueError(f"packing: {len(items)} pairs do not fill a multiple of {count_multiple} packed microbatches "
                     f"within the budget of {max_tokens} tokens (--vpp needs the count divisible by pp); give each dp "
                     "rank more pairs or run --no-packing")


def plan_packed_step(pairs: Sequence[TokenizedPair], *, dp: int, max_tokens: int,
                     cost: Callable[[TokenizedPair], int] = pair_tokens, count_multiple: int = 1,
                     ) -> list[list[list[int]]]:
    """For each dp rank, its microbatches as lists of positions in the global batch (a pair
    costs `cost`: `pair_tokens`, or `cost_of(prefix_sharing)`); each rank's count a multiple of
    `count_multiple` (`split_microbatches`)."""
    costs = [cost(p) for p in pairs]
    return [split_microbatches(costs, mine, max_tokens=max_tokens, count_multiple=count_multiple)
            for mine in balance_ranks(costs, num_ranks=dp)]


def collate_packed(pairs: Sequence[TokenizedPair], *, pad_token_id: int, multiple: int = 8,
                   prefix_sharing: bool = False) -> Microbatch:
    """One packed row [1, W] of the pairs' sequences, W = their total rounded up to `multiple`.

    Sequences are laid out pair by pair (chosen, then rejected). `segment_ids` names each
    token's sequence by its row in the unpacked order: chosen of pair j is j, rejected is
    b + j (b pairs), so per-sequence sums come out as [chosen rows; rejected rows] exactly as
    `collate` orders them; padding is segment 2b. `seq_lens` are the segments' lengths in
    layout order (the padding last, when there is any), i.e. the THD layout's cu_seqlens steps.
    With `prefix_sharing` each pair is one shared stretch (`prefix_sharing.place_shared_pair`),
    which cu_seqlens cannot describe: `seq_lens` is None and the row needs its mask.
    """
    if not pairs:
        raise ValueError("collate_packed: no pairs")
    if multiple <= 0:
        raise ValueError(f"collate_packed: multiple must be positive, got {multiple}")
    b = len(pairs)
    real = sum(cost_of(prefix_sharing)(p) for p in pairs)
    width = -(-real // multiple) * multiple
    rows = RowTensors.empty(1, width, pad_token_id=pad_token_id, pad_segment=2 * b)
    seq_lens = []
    at = 0
    for j, pair in enumerate(pairs):
        if prefix_sharing:
            at = place_shared_pair(rows, row=0, at=at, pair=pair, chosen_segment=j, rejected_segment=b + j)
            continue
        for row, completion in ((j, pair.chosen_ids), (b + j, pair.rejected_ids)):
            seq = torch.tensor(pair.prompt_ids + completion, dtype=torch.int64)
            n, prompt_len = len(seq), len(pair.prompt_ids)
            rows.tokens[0, at : at + n] = seq
            # Position t predicts token t+1 of the same sequence; its last token predicts nothing.
            rows.labels[0, at : at + n - 1] = seq[1:]
            rows.loss_mask[0, at : at + n - 1] = 1.0
            rows.loss_mask[0, at : at + prompt_len - 1] = 0.0
            rows.position_ids[0, at : at + n] = torch.arange(n)
            rows.segment_ids[0, at : at + n] = row
            seq_lens.append(n)
            at += n
    if width > real:
        seq_lens.append(width - real)
        rows.position_ids[0, real:] = torch.arange(width - real)
    longest = max(len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) for p in pairs)
    return Microbatch(tokens=rows.tokens, labels=rows.labels, loss_mask=rows.loss_mask,
                      position_ids=rows.position_ids, segment_ids=rows.segment_ids, num_sequences=2 * b,
                      num_positions=max(longest, width - real), seq_lens=None if prefix_sharing else tuple(seq_lens),
                      shared_prompt=rows.shared_prompt if prefix_sharing else None)


def eval_microbatches(costs: Sequence[int], passes: Sequence[tuple[range, Sequence[Sequence[int]]]], *,
                      max_tokens: int) -> list[list[list[int]]]:
    """Packed evaluation: for each held-out chunk of `data.eval_passes` (one dp rank's passes),
    that rank's whole share of the chunk cut by tokens (`split_microbatches`): one forward-only
    pass per chunk, its microbatches as lists of indices into `costs`."""
    shares: dict[tuple[int, int], list[int]] = {}
    for chunk, groups in passes:
        shares.setdefault((chunk.start, chunk.stop), []).extend(i for g in groups for i in g)
    return [split_microbatches(costs, sorted(ids), max_tokens=max_tokens) for ids in shares.values() if ids]
