"""The data order of a run: several sources with weights (mcore_dpo/data/mix.py) and the steps'
global batches (mcore_dpo/data/order.py), pure functions checked here without a run."""

from __future__ import annotations

from collections import Counter

import pytest

from mcore_dpo.data.mix import Source, epoch_samples, parse_sources, quotas, weights_of
from mcore_dpo.data.order import StepOrder
from mcore_dpo.data.pairs import global_batch_order


def _epochs_concatenated(*, num_pairs, global_batch_size, seed, shuffle, max_steps):
    """The order every run had before mixes: epochs of global_batch_order, back to back."""
    steps, epoch = [], 0
    while len(steps) < max_steps:
        steps += global_batch_order(num_pairs=num_pairs, global_batch_size=global_batch_size, seed=seed,
                                    shuffle=shuffle, epoch=epoch)
        epoch += 1
    return steps[:max_steps]


@pytest.mark.parametrize("shuffle", [True, False])
def test_one_source_keeps_the_order_of_a_single_file(shuffle):
    order = StepOrder(max_steps=23, global_batch_size=8, seed=7, shuffle=shuffle, counts=50)
    assert list(order) == _epochs_concatenated(num_pairs=50, global_batch_size=8, seed=7, shuffle=shuffle, max_steps=23)
    # Unweighted sources are one file: the same order over their concatenation.
    assert list(StepOrder(max_steps=23, global_batch_size=8, seed=7, shuffle=shuffle, counts=[30, 20])) == list(order)


def test_steps_are_read_in_any_order_and_hold_one_epoch():
    order = StepOrder(max_steps=40, global_batch_size=4, seed=1, shuffle=True, counts=[10, 7], weights=[1, 2])
    forward = [order[k] for k in range(40)]
    backward = [order[k] for k in reversed(range(40))][::-1]
    assert forward == backward
    with pytest.raises(IndexError):
        order[40]


def test_quotas_are_the_weights_shares_and_add_up():
    assert quotas([48, 16], [3, 1]) == [48, 16]
    assert quotas([48, 16], [1, 1]) == [32, 32]
    assert quotas([10, 10, 10], [1, 1, 1]) == [10, 10, 10]
    assert quotas([5, 5], [1, 2]) == [3, 7]  # 3.33 and 6.67: the larger remainder gets the extra one
    assert sum(quotas([7, 11, 13], [0.2, 0.3, 0.5])) == 31


def test_a_weighted_epoch_draws_without_repeats_until_a_source_runs_out():
    samples = epoch_samples(counts=[100, 10], weights=[0.5, 0.5], seed=3, epoch=0)
    assert len(samples) == 110
    big = [i for i in samples if i < 100]
    small = Counter(i for i in samples if i >= 100)
    assert len(big) == 55 and len(set(big)) == 55  # half of the big source, no repeats
    assert set(small) == set(range(100, 110)) and all(n in (5, 6) for n in small.values())  # 55 of 10: ~5.5 each
    assert samples == epoch_samples(counts=[100, 10], weights=[0.5, 0.5], seed=3, epoch=0)
    assert samples != epoch_samples(counts=[100, 10], weights=[0.5, 0.5], seed=3, epoch=1)
    assert samples != epoch_samples(counts=[100, 10], weights=[0.5, 0.5], seed=4, epoch=0)


def test_parse_sources(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "odd:0.5"
    a.write_text("{}\n")
    b.write_text("{}\n")
    assert parse_sources(str(a)) == [Source(str(a), None)]
    assert parse_sources([f"{a}:0.7", f"{b}:0.3"]) == [Source(str(a), 0.7), Source(str(b), 0.3)]
    assert parse_sources([str(b)]) == [Source(str(b), None)]  # an existing path is a path
    assert weights_of(parse_sources([f"{a}:2"])) is None  # one source: its weight is all
    assert weights_of(parse_sources([f"{a}:2", f"{b}:1"])) == [2.0, 1.0]
    for bad, message in (([f"{a}:-1", f"{b}:1"], "must be a positive number"),
                         ([f"{a}:nan", f"{b}:1"], "must be a positive number"),
                         ([f"{a}:1", str(b)], "has no weight but other sources do"),
                         ([str(a), f"{a}:1"], "has no weight but other sources do"),
                         ([str(a), str(a)], "is given twice")):
        with pytest.raises(ValueError, match=message):
            parse_sources(bad)
