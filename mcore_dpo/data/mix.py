"""Several data sources in one run: `--data a.jsonl:0.7 b.parquet:0.3`.

    sources = parse_sources(["a.jsonl:0.7", "b.parquet:0.3"])  # [Source("a.jsonl", 0.7), ...]
    epoch_samples(counts=[1000, 50], weights=[0.7, 0.3], seed=1234, epoch=0)

The sources are tokenized into one token store, their samples one after the other (source 0's,
then source 1's, ...). Without weights an epoch is every sample of every source once: one source
is the single-file run it always was. With weights an epoch has as many samples as the sources
hold together, source i contributing its share w_i / sum(w) of them (largest remainders make the
shares add up): fewer than it holds is a seeded draw without repeats, more is whole seeded
permutations of it, then a part of one. The global batches are then cut from the epoch as from a
single file's (`pairs.global_batch_order`, shuffled by --seed unless --no-shuffle).

Every draw is pure Python (`random.Random` with a string seed), so the same seed gives the same
mix on every host and version, and the weights are part of the run identity (resume_check.py).
"""
from __future__ import annotations

import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    path: str
    weight: float | None  # None: no weight given (then none is)


def as_list(data: str | Sequence[str] | None) -> list[str]:
    """--data as a list: one source is a string, a mix a list."""
    if data is None:
        return []
    return [data] if isinstance(data, str) else list(data)


def parse_sources(data: str | Sequence[str]) -> list[Source]:
    """Each `PATH` or `PATH:WEIGHT` of --data; ValueError (one line, "data: ...") when a weight is
    not a positive number, some sources have one and others not, or a path is given twice. A path
    that exists is a path even when it ends in ':<number>'."""
    sources = []
    for spec in as_list(data):
        path, weight = spec, None
        if ":" in spec and not os.path.exists(spec):
            head, tail = spec.rsplit(":", 1)
            try:
                weight = float(tail)
            except ValueError:
                pass
            else:
                path = head
                if not (math.isfinite(weight) and weight > 0):
                    raise ValueError(f"data: {spec}: the weight must be a positive number, got {tail}")
        sources.append(Source(path=path, weight=weight))
    if not sources:
        raise ValueError("data: no data sources")
    weighted = [s.weight is not None for s in sources]
    if len(sources) > 1 and any(weighted) and not all(weighted):
        unweighted = next(s.path for s in sources if s.weight is None)
        raise ValueError(f"data: {unweighted} has no weight but other sources do; give every source a weight "
                         "(PATH:WEIGHT) or none")
    seen = set()
    for source in sources:
        key = os.path.realpath(source.path)
        if key in seen:
            raise ValueError(f"data: {source.path} is given twice; a weight says how much of it an epoch takes")
        seen.add(key)
    return sources


def weights_of(sources: Sequence[Source]) -> list[float] | None:
    """The sources' weights, or None when none was given (or there is one source: its weight is all)."""
    if len(sources) == 1 or sources[0].weight is None:
        return None
    return [s.weight for s in sources]


def quotas(counts: Sequence[int], weights: Sequence[float]) -> list[int]:
    """Samples of each source in an epoch of sum(counts) samples: shares of the weights, rounded
    by largest remainder (ties to the earlier source) so that they add up."""
    total, weight_sum = sum(counts), sum(weights)
    exact = [total * w / weight_sum for w in weights]
    floors = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (-(exact[i] - floors[i]), i))
    for i in by_remainder[: total - sum(floors)]:
        floors[i] += 1
    return floors


def epoch_samples(*, counts: Sequence[int], weights: Sequence[float] | None, seed: int, epoch: int) -> list[int]:
    """Store indices of one epoch's samples, source after source (module docstring). `counts`:
    each source's samples in the store, in order."""
    total = sum(counts)
    if weights is None:
        return list(range(total))
    samples: list[int] = []
    offset = 0
    for index, (count, quota) in enumerate(zip(counts, quotas(counts, weights))):
        rng = random.Random(f"mix/{seed}/{epoch}/{index}")
        drawn: list[int] = []
        while len(drawn) < quota:  # whole permutations, then a part of one
            order = list(range(count))
            rng.shuffle(order)
            drawn.extend(order[: quota - len(drawn)])
        samples.extend(offset + i for i in drawn)
        offset += count
    return samples
