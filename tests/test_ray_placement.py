"""Ray placement of the ranks onto bundles (`ray_workers.bundle_order`, a pure function of each
bundle's node): tp groups never span nodes, ep groups stay on one node where the nodes allow."""

from __future__ import annotations

import pytest

from mcore_dpo.driver.ray_workers import WorkerGroupError, bundle_order, coordinates_of


def _nodes_of_groups(order: list[int], node_of: list[str], *, size: int) -> list[set[str]]:
    return [{node_of[b] for b in order[lo : lo + size]} for lo in range(0, len(order), size)]


def test_ep1_keeps_the_node_grouped_order():
    # Bundles interleaved over two nodes: ranks fill node a first, then node b, in bundle order.
    node_of = ["a", "b", "a", "b", "a", "b", "a", "b"]
    assert bundle_order(node_of, tp=2, role="policy") == [0, 2, 4, 6, 1, 3, 5, 7]


def test_expert_groups_land_whole_on_a_node_where_one_fits():
    # 8 ranks, tp 1, ep 4 (dp 8): node a has 2 bundles, node b 6. Node order alone would split
    # both ep groups (ranks 0-1 on a, 2-7 on b); whole blocks first keep ranks 0-3 on b.
    node_of = ["a", "a", "b", "b", "b", "b", "b", "b"]
    order = bundle_order(node_of, tp=1, ep=4, role="policy")
    assert sorted(order) == list(range(8))
    assert _nodes_of_groups(order, node_of, size=4)[0] == {"b"}
    # tp 2 x ep 2 blocks of 4 ranks on nodes of 6 and 10 bundles: 16 ranks, 4 blocks; 1 + 2 fit
    # whole, the last one is spread by tp group (no tp group spans).
    node_of = ["a"] * 6 + ["b"] * 10
    order = bundle_order(node_of, tp=2, ep=2, role="policy")
    blocks = _nodes_of_groups(order, node_of, size=4)
    assert sum(len(nodes) == 1 for nodes in blocks) == 3
    assert all(len(nodes) == 1 for nodes in _nodes_of_groups(order, node_of, size=2))


def test_the_ep_groups_of_megatron_rank_order_are_the_blocks():
    # tp 2, pp 2, dp 4, ep 2 on two nodes of 8: every ep group (same tp and pp rank, dp ranks
    # {0,1} or {2,3}) on one node.
    tp, pp, dp, ep = 2, 2, 4, 2
    node_of = ["a", "b"] * 8
    order = bundle_order(node_of, tp=tp, ep=ep, role="policy")
    groups: dict[tuple[int, int, int], set[str]] = {}
    for rank, bundle in enumerate(order):
        t, p, d = coordinates_of(rank, tp=tp, pp=pp, dp=dp)
        groups.setdefault((t, p, d // ep), set()).add(node_of[bundle])
    assert len(groups) == tp * pp * dp // ep and all(len(nodes) == 1 for nodes in groups.values())


def test_a_tp_group_that_must_span_nodes_is_one_line():
    with pytest.raises(WorkerGroupError, match="a tensor-parallel group of 2 ranks would span nodes"):
        bundle_order(["a", "a", "a", "b"], tp=2, ep=1, role="policy")
