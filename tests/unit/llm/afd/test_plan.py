"""Which FfnWorker computes what: ranges, shards, holdings, routes, failover choices."""

from __future__ import annotations

import pytest

from dynagraph.llm.afd.plan import RouteTable, assign, parse_ranges, shard_of
from dynagraph.llm.afd.settings import PeerInfo


def peer(name: str, layers: list[int], experts: list[int] | None = None) -> PeerInfo:
    return PeerInfo(instance=name, model="m", tcp="127.0.0.1:1", layers=layers, experts=experts)


def test_parse_ranges() -> None:
    assert parse_ranges("all", 4, "layers") == [0, 1, 2, 3]
    assert parse_ranges("0-1,3", 4, "layers") == [0, 1, 3]
    assert parse_ranges(" 2 ", 4, "layers") == [2]
    assert parse_ranges([3, 1, 1], 4, "layers") == [1, 3]
    for bad in ("4", "1-0", "x", "", [5], []):
        with pytest.raises(ValueError):
            parse_ranges(bad, 4, "layers")


def test_shard_of_covers_everything_once_in_order() -> None:
    assert [shard_of(i, 3, 8) for i in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [shard_of(i, 2, 4) for i in range(2)] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError):
        shard_of(0, 5, 4)


def test_assign_by_worker_index() -> None:
    assert [assign(4, 0, split="layers", shards=2, index=i) for i in range(4)] == [
        ([0, 1], None), ([2, 3], None), ([0, 1], None), ([2, 3], None)]
    assert [assign(4, 4, split="experts", shards=2, index=i)[1] for i in range(3)] == [
        [0, 1], [2, 3], [0, 1]]
    assert assign(4, 4, layers="1-2", experts="0-3") == ([1, 2], None)  # all experts: whole
    assert assign(4, 4, experts=[2]) == ([0, 1, 2, 3], [2])
    with pytest.raises(ValueError, match="dense"):
        assign(4, 0, split="experts", shards=2)
    with pytest.raises(ValueError, match="split"):
        assign(4, 0, shards=2)
    with pytest.raises(ValueError):
        assign(4, 0, split="diagonal")


def test_whole_ffn_routes_to_one_holder_and_fails_over_to_replicas() -> None:
    table = RouteTable([peer("a", [0, 1]), peer("b", [2, 3]), peer("c", [2, 3])],
                       num_layers=4, num_experts=0)
    assert table.missing() == []
    (r,) = table.route(0) or []
    assert r.peer.instance == "a" and r.expert_set is None
    first = (table.route(2, prefer=0) or [])[0].peer.instance
    other = (table.route(2, prefer=1) or [])[0].peer.instance
    assert {first, other} == {"b", "c"}  # engines spread over replicas
    assert (table.route(2, prefer=0, dead={first}) or [])[0].peer.instance == other
    assert table.route(2, dead={"b", "c"}) is None
    assert table.missing(dead={"a"}) == [0, 1]


def test_expert_groups_must_partition_the_experts() -> None:
    peers = [peer("x01", [0, 1], [0, 1]), peer("x23", [0, 1], [2, 3]),
             peer("x0", [0], [0]), peer("x1", [0], [1])]
    table = RouteTable(peers, num_layers=2, num_experts=4)
    parts = table.route(0) or []
    assert sorted(sorted(p.expert_set or []) for p in parts) == [[0, 1], [2, 3]]
    # without the 0-1 holder layer 0 still works from the single-expert workers
    parts = table.route(0, dead={"x01"}) or []
    assert sorted(sorted(p.expert_set or []) for p in parts) == [[0], [1], [2, 3]]
    assert table.route(1, dead={"x01"}) is None
    assert table.missing(dead={"x23"}) == [0, 1]


def test_a_whole_holder_wins_over_expert_groups() -> None:
    table = RouteTable([peer("w", [0]), peer("e", [0], [0, 1])], num_layers=1, num_experts=2)
    (r,) = table.route(0) or []
    assert r.peer.instance == "w" and r.expert_set is None
    (r,) = table.route(0, dead={"w"}) or []  # all experts in one group == the whole FFN
    assert r.peer.instance == "e" and r.expert_set is None


def test_overlapping_expert_groups_are_not_added_twice() -> None:
    table = RouteTable([peer("a", [0], [0, 1]), peer("b", [0], [1, 2])],
                       num_layers=1, num_experts=3)
    assert table.route(0) is None


def test_an_engine_uses_one_replica_for_all_the_layers_it_holds() -> None:
    table = RouteTable([peer("a", [0, 1]), peer("b", [0, 1]), peer("c", [2, 3])],
                       num_layers=4, num_experts=0)
    for prefer in range(6):
        picks = {(table.route(layer, prefer=prefer) or [])[0].peer.instance for layer in (0, 1)}
        assert len(picks) == 1
