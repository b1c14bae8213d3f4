"""Cache-aware placement at the router: the prefix index kept from workers' reports, and new
sequences started where their prefix is cached unless that worker is full. Pure bookkeeping."""

from __future__ import annotations

import random

from qmigrate.config import RouterConfig
from qmigrate.router.prefix_index import PrefixIndex, seq_keys
from qmigrate.router.records import Seq
from qmigrate.router.scheduler import Scheduler, WorkerState
from qmigrate.wire import protocol as P
from qmigrate.wire.prefix_keys import block_keys

BS = 16
r = random.Random(4)
SYSTEMS = [[1] + [r.randrange(3, 1500) for _ in range(63)] for _ in range(2)]   # 4 blocks each


def prompt(group: int, i: int) -> list[int]:
    return SYSTEMS[group] + [3 + (7 * i + j) % 900 for j in range(10 + i % 5)]


def spec(seq_id: int, ids: list[int], salt: str = "") -> P.SeqSpec:
    return P.SeqSpec(seq_id, P.pack_i32(ids), len(ids), 8, cache_salt=salt)


def make_sched(**config) -> Scheduler:
    config.setdefault("heartbeat_timeout_s", 1e9)
    config.setdefault("chain_leases", False)
    return Scheduler(RouterConfig(**config))


def join(s: Scheduler, name: str, **kw) -> WorkerState:
    w = WorkerState(name, **{"max_seqs": 8, "max_tokens": 1 << 16, "block_size": BS, **kw})
    s.register(w, 0.0)
    return w


def cached_on(s: Scheduler, name: str, ids: list[int], salt: str = "") -> None:
    """name reports the blocks of ids cached."""
    s.cache_report(name, block_keys(ids, BS, salt))


def ask(s: Scheduler, name: str, now: float = 0.0):
    return s.schedule(name, 64, 1 << 20, now, None)


def ids_of(grant) -> list[int]:
    return [] if grant is None else [row.seq_id for row in grant.rows]


# --- the index ------------------------------------------------------------------------------

def test_index_follows_cached_and_evicted_keys_and_stays_bounded():
    index = PrefixIndex(max_keys=6)
    keys = block_keys(SYSTEMS[0], BS)
    index.apply("a", keys)
    index.apply("b", keys[:2])
    assert index.match(keys) == {"a": 4, "b": 2}
    index.apply("a", [~keys[1]])               # a evicted its second block: the rest is no use
    assert index.match(keys) == {"a": 1, "b": 2}
    index.forget("b")
    assert index.match(keys) == {"a": 1}
    index.apply("c", block_keys(SYSTEMS[1], BS))   # past max_keys: the least recently seen go
    assert len(index) <= 6
    assert index.match(block_keys(SYSTEMS[1], BS)) == {"c": 4}


def test_keys_of_a_sequence_leave_its_last_token_and_follow_the_salt():
    seq = Seq(spec(1, SYSTEMS[0]), list(SYSTEMS[0]))
    assert seq_keys(seq, BS) == block_keys(SYSTEMS[0], BS)[:3]    # 64 tokens: the 4th block holds the last
    salted = Seq(spec(2, SYSTEMS[0], salt="t"), list(SYSTEMS[0]))
    assert seq_keys(salted, BS) != seq_keys(seq, BS)


# --- placement ------------------------------------------------------------------------------

def test_new_sequences_go_where_their_prefix_is_cached():
    s = make_sched(spread_new_work=False)
    join(s, "a")
    join(s, "b")
    cached_on(s, "a", SYSTEMS[0])
    cached_on(s, "b", SYSTEMS[1])
    s.admit([spec(i, prompt(i % 2, i)) for i in range(8)])
    # a asks first: it takes group 0 and leaves group 1 for b (which has room)
    assert sorted(ids_of(ask(s, "a"))) == [0, 2, 4, 6]
    assert sorted(ids_of(ask(s, "b"))) == [1, 3, 5, 7]
    assert s.counters["prefix_held_back"] == 4


def test_cache_blind_placement_takes_whatever_is_queued():
    s = make_sched(spread_new_work=False, prefix_aware=False)
    join(s, "a")
    join(s, "b")
    cached_on(s, "b", SYSTEMS[1])
    s.admit([spec(i, prompt(i % 2, i)) for i in range(8)])
    assert ids_of(ask(s, "a")) == list(range(8))


def test_a_hit_does_not_pile_onto_a_full_worker():
    s = make_sched(spread_new_work=False)
    join(s, "a")
    b = join(s, "b", max_seqs=2, inflight=1)
    cached_on(s, "b", SYSTEMS[1])
    s.admit([spec(100 + i, prompt(0, i)) for i in range(2)])
    assert len(ids_of(ask(s, "b"))) == 2          # b is full now
    assert b.load >= b.capacity
    s.admit([spec(i, prompt(1, i)) for i in range(4)])
    assert sorted(ids_of(ask(s, "a"))) == [0, 1, 2, 3]   # b holds the prefix but has no room


def test_a_sequence_waits_for_its_cache_no_longer_than_prefix_wait_s():
    s = make_sched(spread_new_work=False, prefix_wait_s=1.0)
    join(s, "a")
    join(s, "b")
    cached_on(s, "b", SYSTEMS[1])
    s.admit([spec(1, prompt(1, 1))])
    assert ask(s, "a", now=0.0) is None
    assert ask(s, "a", now=0.5) is None
    assert ids_of(ask(s, "a", now=1.5)) == [1]     # b never asked: a takes it after the wait


def test_the_next_turn_of_a_conversation_returns_to_its_worker():
    s = make_sched(spread_new_work=False)
    join(s, "a")
    join(s, "b")
    turn1 = SYSTEMS[0][:40]
    s.admit([spec(1, turn1)])
    assert ids_of(ask(s, "b")) == [1]
    answer = [5] * 30
    cached_on(s, "b", turn1 + answer)           # b ran it and cached its blocks, answer included
    s.admit([spec(2, turn1 + answer + [9, 9, 9])])
    assert ask(s, "a") is None
    assert ids_of(ask(s, "b")) == [2]


def test_hits_come_first_within_a_worker_s_share():
    s = make_sched(spread_new_work=False)
    join(s, "a", max_seqs=2)
    cached_on(s, "a", SYSTEMS[0])
    s.admit([spec(i, prompt(1, i)) for i in range(3)] + [spec(10 + i, prompt(0, i)) for i in range(2)])
    assert sorted(ids_of(s.schedule("a", 2, 1 << 20, 0.0, None))) == [10, 11]


def test_salted_prefixes_match_only_their_salt():
    s = make_sched(spread_new_work=False)
    join(s, "a")
    join(s, "b")
    cached_on(s, "b", SYSTEMS[0], salt="tenant")
    s.admit([spec(1, prompt(0, 1))])               # no salt: nothing cached anywhere
    assert ids_of(ask(s, "a")) == [1]
    s.admit([spec(2, prompt(0, 2), salt="tenant")])
    assert ask(s, "a") is None and ids_of(ask(s, "b")) == [2]


def test_a_dead_worker_s_cache_is_forgotten():
    s = make_sched(spread_new_work=False, heartbeat_timeout_s=1.0)
    join(s, "a")
    join(s, "b")
    cached_on(s, "b", SYSTEMS[0])
    s.register(WorkerState("b", max_seqs=8, max_tokens=1 << 16, block_size=BS), 0.0)   # restarted: empty
    s.admit([spec(1, prompt(0, 1))])
    assert ids_of(ask(s, "a")) == [1]


def test_results_carry_cache_events_and_cached_counts():
    result = P.StepResult(1, P.pack_i64([5, 6]), P.pack_i32([1, 1]), P.pack_i32([3, 4]), P.pack_u8([0, 0]),
                          prefix_events=P.pack_i64([7, ~7]), cached_tokens=P.pack_i32([32, -1]))
    back = P.decode(P.encode(result))
    assert P.unpack_i64(back.prefix_events).tolist() == [7, ~7]
    assert P.unpack_i32(back.cached_tokens).tolist() == [32, -1]
    bad = P.StepResult(1, P.pack_i64([5, 6]), P.pack_i32([1, 1]), P.pack_i32([3, 4]), P.pack_u8([0, 0]),
                       cached_tokens=P.pack_i32([32]))
    import pytest
    with pytest.raises(P.ProtocolError):
        P.decode(P.encode(bad))


def test_hit_rates_per_worker_and_for_the_fleet_in_prometheus_and_stats():
    from prometheus_client import generate_latest

    from qmigrate.ops.metrics import RouterMetrics
    from qmigrate.ops.observe import WORKER_COLUMNS, FleetObserver, as_dicts
    s = make_sched()
    join(s, "a")
    join(s, "b")
    s.cache_report("a", [], 100, 75)
    s.cache_report("b", [], 300, 0)
    obs, m = FleetObserver(), RouterMetrics()
    m.update(s, obs, {})
    text = generate_latest(m.registry).decode()
    assert 'qmigrate_prefix_cache_hit_rate{worker="a"} 0.75' in text
    assert 'qmigrate_prefix_cache_hit_rate{worker="fleet"} 0.1875' in text
    assert 'qmigrate_prefix_cached_tokens_total{worker="a"} 75.0' in text
    rows = {w["name"]: w for w in as_dicts(WORKER_COLUMNS, obs.snapshot(s)[0])}
    assert (rows["a"]["prompt_tokens"], rows["a"]["cached_tokens"]) == (100, 75)
