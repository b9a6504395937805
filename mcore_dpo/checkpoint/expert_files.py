"""Who writes which file of an expert-parallel checkpoint (pure: no torch.distributed).

At ep > 1 a checkpoint (and the shards of the hf/ export) is in checkpoint_convert's ep layout:
per stage, one file `tp{t}_pp{p}_ep{e}/model.safetensors` for every tp rank t and ep rank e,
holding tp rank t's part of the dense tensors and ep rank e's experts, whole (expert tp 1),
under their local index. The ranks of a stage are its (tp rank, dp rank) pairs; the rank at
(t, d) holds tp rank t's dense part and the experts of ep rank `layout.ep_rank_of(t, d)`.

A file whose (t, e) some rank holds is written by that rank from its own tensors. Otherwise
(tp > 1: the ep groups then run along tp, so tp rank t holds only some ep ranks' experts) a
rank of tp rank t writes it, and a rank holding ep rank e's experts sends them to it one
tensor at a time. Files are spread over the candidate ranks so that no rank writes more than
it must; no rank ever holds another rank's share of the experts beyond one tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore_dpo.parallel.mesh import Layout


@dataclass(frozen=True)
class FileJob:
    """One file of a stage: tp rank `tp_rank`'s dense part with ep rank `ep_rank`'s experts."""

    tp_rank: int
    ep_rank: int
    writer: tuple[int, int]  # (tp rank, dp rank) of the rank that writes the file
    source: tuple[int, int] | None  # the rank that sends the experts; None: the writer holds them


def file_jobs(layout: Layout) -> list[FileJob]:
    """Every file of one stage (the same for each stage), in the order all ranks process them.
    Writers and senders are chosen least-loaded first (ties: lowest dp rank, then tp rank)."""
    ranks = [(t, d) for d in range(layout.dp) for t in range(layout.tp)]
    ep_of = {(t, d): layout.ep_rank_of(tp_rank=t, dp_rank=d) for t, d in ranks}
    writes = dict.fromkeys(ranks, 0)
    sends = dict.fromkeys(ranks, 0)

    def least(candidates: list[tuple[int, int]], load: dict) -> tuple[int, int]:
        return min(candidates, key=lambda r: (load[r], r[1], r[0]))

    jobs = []
    for t in range(layout.tp):
        for e in range(layout.ep):
            holders = [r for r in ranks if r[0] == t and ep_of[r] == e]
            source = None
            if holders:
                writer = least(holders, writes)
            else:
                writer = least([r for r in ranks if r[0] == t], writes)
                source = least([r for r in ranks if ep_of[r] == e], sends)
                sends[source] += 1
            writes[writer] += 1
            jobs.append(FileJob(tp_rank=t, ep_rank=e, writer=writer, source=source))
    return jobs
