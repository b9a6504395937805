"""Forward-only passes made even over the data-parallel ranks, for expert parallelism.

The experts' all-to-all is a collective of the expert-parallel group: every rank of it must
run the same number of forwards, in the same order. Evaluation splits the held-out pairs by
dp rank, so the shares (and their last microbatches) can differ by a pair, and a rank may
have a pass fewer. `even_passes` gives every dp rank the same number of passes, each with the
same number of microbatches as the largest of that pass over the ranks: the missing ones are
dummy microbatches (copies of rows the rank already runs, so every shape stays as it was),
whose results are dropped. The real microbatches come first and are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

Pass = tuple[range | None, list[list[int]]]  # (chunk or None, microbatches as pair indices)


def even_passes(all_passes: Sequence[Sequence[Pass]], *, dp_rank: int) -> list[tuple[range | None, list[list[int]], int]]:
    """`all_passes[r]`: dp rank r's passes. Returns dp rank `dp_rank`'s passes padded to the
    same count and microbatches per pass on every rank, each as (chunk, microbatches, number of
    real microbatches at the front). A pass the rank lacks is a dummy of pair 0 alone."""
    num_passes = max((len(p) for p in all_passes), default=0)
    mine = list(all_passes[dp_rank])
    out = []
    for k in range(num_passes):
        width = max(len(p[k][1]) for p in all_passes if k < len(p))
        if k < len(mine):
            chunk, groups = mine[k]
            groups = list(groups)
            out.append((chunk, groups + [list(groups[0])] * (width - len(groups)), len(groups)))
        else:
            out.append((range(0, 1), [[0]] * width, 0))
    return out


def rank_passes(passes_of, *, dp: int, dp_rank: int, even: bool) -> list[tuple[range | None, list[list[int]], int]]:
    """This dp rank's forward-only passes as (chunk, microbatches, number of real microbatches):
    `passes_of(r)` are dp rank r's; `even` (expert parallelism) pads them to the same count and
    width on every rank (`even_passes`), whose dummies' results the caller drops."""
    if even:
        return even_passes([passes_of(r) for r in range(dp)], dp_rank=dp_rank)
    return [(chunk, groups, len(groups)) for chunk, groups in passes_of(dp_rank)]
