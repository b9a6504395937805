"""Where the experts live with expert parallelism: the expert tensor-parallel rule, the
expert-parallel rank of each (tp, dp) rank, and the converter's shards of an expert-parallel
layout, whose HF round trip is bit-exact."""

from __future__ import annotations

import pytest
import torch

from checkpoint_convert.families import spec_from_hf_config
from checkpoint_convert.gather import expert_parallel_view, mcore_to_hf
from checkpoint_convert.mapping import expert_tp_size, hf_to_mcore_shard
from mcore_dpo.parallel.mesh import Layout
from tests.helpers.models import hub_tensors, mixtral, qwen3_moe


def test_expert_tp_rule_and_ep_ranks():
    assert expert_tp_size(tp=2, ep=1) == 2  # no expert parallelism: split over tp like a dense MLP
    assert expert_tp_size(tp=2, ep=2) == expert_tp_size(tp=4, ep=8) == expert_tp_size(tp=1, ep=2) == 1
    # megatron-core's tp-ep-dp order: the stage's rank index is t + tp * d, its ep rank that mod ep.
    assert [Layout(tp=2, pp=1, dp=1, ep=2).ep_rank_of(tp_rank=t, dp_rank=0) for t in (0, 1)] == [0, 1]
    assert [Layout(tp=1, pp=2, dp=2, ep=2).ep_rank_of(tp_rank=0, dp_rank=d) for d in (0, 1)] == [0, 1]
    layout = Layout(tp=2, pp=1, dp=4, ep=4)
    assert [layout.ep_rank_of(tp_rank=t, dp_rank=d) for d in range(4) for t in range(2)] == [0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize("family,tp,pp,ep", [("qwen3_moe", 2, 1, 2), ("qwen3_moe", 2, 1, 4), ("qwen3_moe", 2, 2, 2),
                                             ("mixtral", 2, 1, 4)])
def test_round_trip_at_expert_parallel_layouts_is_bit_exact(family, tp, pp, ep):
    """HF -> the (tp, pp, ep) shards (experts whole on their ep rank, the same on each tp rank)
    -> HF again through the ep-1 view: every tensor equal bit for bit."""
    model = qwen3_moe(seed=7, num_layers=4) if family == "qwen3_moe" else mixtral(seed=7)
    spec = spec_from_hf_config(model.config.to_dict())
    hub = hub_tensors(model)
    shards = {(t, p, r): hf_to_mcore_shard(spec, tp=tp, tp_rank=t, pp=pp, pp_rank=p, ep=ep, ep_rank=r, get=hub.__getitem__)
              for t in range(tp) for p in range(pp) for r in range(ep)}
    fc1 = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    fc2 = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"
    width = spec.moe_intermediate_size if spec.moe_intermediate_size else spec.intermediate_size
    for r in range(ep):  # whole experts: [gate; up] of expert r E/ep, the same on every tp rank
        expert = r * spec.num_experts // ep
        gate, up = (hub[f"model.layers.0.mlp.experts.{expert}.{p}_proj.weight"] for p in ("gate", "up")) \
            if family == "qwen3_moe" else (hub[f"model.layers.0.block_sparse_moe.experts.{expert}.{p}.weight"] for p in ("w1", "w3"))
        assert shards[(0, 0, r)][fc1].shape == (2 * width, spec.hidden_size)
        assert shards[(0, 0, r)][fc2].shape == (spec.hidden_size, width)
        assert torch.equal(shards[(0, 0, r)][fc1], torch.cat([gate, up]))
        assert all(torch.equal(shards[(t, 0, r)][fc1], shards[(0, 0, r)][fc1]) for t in range(tp))
    view = expert_parallel_view(spec, tp=tp, pp=pp, ep=ep, get_shard=lambda t, p, r: shards[(t, p, r)])
    back = dict(mcore_to_hf(spec, tp=tp, pp=pp, get_shard=view))
    assert set(back) == set(hub)
    assert all(torch.equal(back[n], t) for n, t in hub.items())


def _files_by_rank(layout: Layout) -> tuple[dict, dict]:
    from mcore_dpo.checkpoint.expert_files import file_jobs

    jobs = file_jobs(layout)
    writes, sends = {}, {}
    for job in jobs:
        writes.setdefault(job.writer, []).append((job.tp_rank, job.ep_rank))
        if job.source is not None:
            sends.setdefault(job.source, []).append((job.tp_rank, job.ep_rank))
    return writes, sends


@pytest.mark.parametrize("tp,dp,ep", [(1, 2, 2), (1, 8, 8), (2, 1, 2), (2, 2, 2), (2, 2, 4), (4, 1, 2), (2, 4, 2)])
def test_every_ep_file_has_one_writer_holding_its_dense_part_and_a_holder_of_its_experts(tp, dp, ep):
    """Each (tp rank, ep rank) file of a stage is written once, by a rank of that tp rank; its
    experts come from the writer itself or from a rank of that ep rank; writes are spread."""
    from mcore_dpo.checkpoint.expert_files import file_jobs

    layout = Layout(tp=tp, pp=1, dp=dp, ep=ep)
    jobs = file_jobs(layout)
    assert sorted((j.tp_rank, j.ep_rank) for j in jobs) == [(t, e) for t in range(tp) for e in range(ep)]
    for job in jobs:
        assert job.writer[0] == job.tp_rank
        holder = job.writer if job.source is None else job.source
        assert layout.ep_rank_of(tp_rank=holder[0], dp_rank=holder[1]) == job.ep_rank
        # A transfer only where no rank of the tp rank holds the experts.
        has_own = any(layout.ep_rank_of(tp_rank=job.tp_rank, dp_rank=d) == job.ep_rank for d in range(dp))
        assert (job.source is None) == has_own
    writes, sends = _files_by_rank(layout)
    per_rank = tp * ep / (tp * dp)
    assert max(len(f) for f in writes.values()) == max(1, int(-(-per_rank // 1)))


def test_expert_file_plans_at_tp1_need_no_transfer_and_at_tp2_ep2_swap_halves():
    # tp 1 (the big MoE configs): each dp rank writes its own ep rank's file, nothing is sent.
    writes, sends = _files_by_rank(Layout(tp=1, pp=4, dp=8, ep=8))
    assert writes == {(0, d): [(0, d)] for d in range(8)} and sends == {}
    # tp 2 x ep 2, dp 1: each tp rank writes its own file and the one with the other rank's experts.
    writes, sends = _files_by_rank(Layout(tp=2, pp=1, dp=1, ep=2))
    assert writes == {(0, 0): [(0, 0), (0, 1)], (1, 0): [(1, 0), (1, 1)]}
    assert sends == {(1, 0): [(0, 1)], (0, 0): [(1, 0)]}
    # tp 2 x ep 2, dp 2: one file per rank; the dp-1 ranks write the swapped ones.
    writes, sends = _files_by_rank(Layout(tp=2, pp=1, dp=2, ep=2))
    assert writes == {(0, 0): [(0, 0)], (0, 1): [(0, 1)], (1, 0): [(1, 0)], (1, 1): [(1, 1)]}
    assert sends == {(1, 0): [(0, 1)], (0, 0): [(1, 0)]}
