"""The graph cache: per-client isolation, each client's own LRU under its own byte budget, counters."""

from __future__ import annotations

import pytest

from emberlink.errors import ConfigError
from emberlink.graph_replay.cache import GraphCache
from emberlink.graph_replay.canonical import encode_graph, graph_id
from emberlink.graph_replay.ir import Graph, Node, TensorSpec
from emberlink.graph_replay.plan import Plan, compile_plan


def _plan(n: int) -> tuple[bytes, Plan]:
    """A distinct one-node graph per n (the input length differs), compiled."""
    g = Graph((TensorSpec("float32", (n,)),), (), (Node("exp", (0,)),), (1,))
    return graph_id(encode_graph(g)), compile_plan(g)


def _size(n: int) -> int:
    _, plan = _plan(n)
    return len(encode_graph(plan.graph)) + plan.overhead_bytes


def test_a_client_gets_back_what_it_put() -> None:
    cache = GraphCache(1 << 20)
    gid, plan = _plan(1)
    assert cache.put("alice", gid, plan)
    assert cache.get("alice", gid) is plan
    assert cache.stats()["size"] == _size(1)


def test_a_client_never_sees_another_clients_entries() -> None:
    cache = GraphCache(1 << 20)
    gid, plan = _plan(1)
    cache.put("alice", gid, plan)
    assert cache.get("bob", gid) is None
    assert ("bob", gid) not in cache and ("alice", gid) in cache


def test_a_clients_stats_show_only_its_own_entries() -> None:
    cache = GraphCache(1 << 20)
    (gid1, p1), (gid2, p2) = _plan(1), _plan(2)
    cache.put("alice", gid1, p1)
    cache.put("alice", gid2, p2)
    cache.get("alice", gid1)
    cache.get("bob", gid1)
    bob = cache.stats("bob")
    assert (bob["entries"], bob["size"], bob["hits"], bob["misses"]) == (0, 0, 0, 1)
    alice = cache.stats("alice")
    assert (alice["entries"], alice["hits"], alice["misses"]) == (2, 1, 0)
    assert cache.stats()["entries"] == 2 and cache.stats()["misses"] == 1


def test_least_recently_used_is_evicted_first_within_a_client() -> None:
    cache = GraphCache(2 * _size(1))
    (gid1, p1), (gid2, p2), (gid3, p3) = _plan(1), _plan(2), _plan(3)
    cache.put("alice", gid1, p1)
    cache.put("alice", gid2, p2)
    assert cache.get("alice", gid1) is p1  # 1 is now the most recent; 2 is the oldest
    assert cache.put("alice", gid3, p3)
    assert ("alice", gid2) not in cache
    assert ("alice", gid1) in cache and ("alice", gid3) in cache
    assert cache.stats("alice")["evictions"] == 1


def test_another_clients_registrations_never_evict_mine() -> None:
    cache = GraphCache(2 * _size(1))
    (gid1, p1), (gid2, p2) = _plan(1), _plan(2)
    cache.put("alice", gid1, p1)
    cache.put("alice", gid2, p2)
    for n in range(3, 40):
        gid, plan = _plan(n)
        cache.put("mallory", gid, plan)
    assert cache.get("alice", gid1) is p1 and cache.get("alice", gid2) is p2
    alice = cache.stats("alice")
    assert (alice["entries"], alice["evictions"], alice["misses"]) == (2, 0, 0)


def test_past_max_clients_the_least_recently_used_clients_cache_goes() -> None:
    cache = GraphCache(1 << 20, max_clients=2)
    (gid1, p1), (gid2, p2), (gid3, p3) = _plan(1), _plan(2), _plan(3)
    cache.put("a", gid1, p1)
    cache.put("b", gid2, p2)
    cache.get("a", gid1)  # b is now the least recently used client
    cache.put("c", gid3, p3)
    assert ("b", gid2) not in cache
    assert ("a", gid1) in cache and ("c", gid3) in cache
    assert cache.stats()["clients"] == 2 and cache.stats()["entries"] == 2


def test_a_graph_larger_than_the_budget_is_not_stored() -> None:
    gid, plan = _plan(1)
    cache = GraphCache(_size(1) - 1)
    assert cache.put("alice", gid, plan) is False
    assert cache.get("alice", gid) is None
    assert cache.stats()["size"] == 0 and cache.stats()["evictions"] == 0


def test_a_too_large_graph_evicts_nothing_else() -> None:
    cache = GraphCache(_size(1) + 10)
    gid, plan = _plan(1)
    cache.put("alice", gid, plan)
    assert cache.put("alice", b"x" * 16, plan, 10_000) is False
    assert cache.get("alice", gid) is plan


def test_putting_the_same_key_again_replaces_it_without_double_counting() -> None:
    cache = GraphCache(1 << 20)
    gid, plan = _plan(1)
    cache.put("alice", gid, plan)
    cache.put("alice", gid, plan)
    assert cache.stats()["entries"] == 1 and cache.stats()["size"] == _size(1)


def test_an_explicit_size_is_what_the_entry_is_charged() -> None:
    cache = GraphCache(1 << 20)
    gid, plan = _plan(1)
    cache.put("alice", gid, plan, 12_345)
    assert cache.stats()["size"] == 12_345 == cache.stats("alice")["size"]


def test_counters_count_hits_misses_and_evictions() -> None:
    cache = GraphCache(_size(1))
    (gid1, p1), (gid2, p2) = _plan(1), _plan(2)
    cache.put("a", gid1, p1)
    cache.get("a", gid1)
    cache.get("a", gid2)
    cache.put("a", gid2, p2)
    want = {"size": _size(2), "budget": _size(1), "entries": 1, "hits": 1, "misses": 1, "evictions": 1}
    assert cache.stats() == {**want, "clients": 1} and cache.stats("a") == want


def test_forget_drops_only_that_clients_entries() -> None:
    cache = GraphCache(1 << 20)
    (gid1, p1), (gid2, p2) = _plan(1), _plan(2)
    cache.put("a", gid1, p1)
    cache.put("b", gid2, p2)
    assert cache.forget("a") == 1
    assert ("a", gid1) not in cache and ("b", gid2) in cache
    assert cache.stats()["size"] == _size(2) and cache.stats("a")["size"] == 0


def test_a_negative_budget_or_no_clients_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        GraphCache(-1)
    with pytest.raises(ConfigError):
        GraphCache(1 << 20, max_clients=0)
