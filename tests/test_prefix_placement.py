"""Cache-aware placement at the router: the prefix index kept from workers' reports, and new
sequences started where their prefix is cached unless that worker is full. Pure bookkeeping."""

from __future__ import annotations

import random

from qmigrate.config import RouterConfig
from qmigrate.router.prefix_index import PrefixIndex, seq_keys
from qmigrate.router.records import Seq
from qmigrate.router.scheduler import Scheduler, WorkerState
from qmigrate.wire import protocol as P
from qmigrate.wire import codec
from qmigrate.wire.prefix_keys import block_keys
from scheduler_util import report

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
    w = WorkerState(name, **{"max_seqs": 8, "max_tokens": 1 << 16, "block_size": BS, "is_caching": True, **kw})
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


def test_a_prompt_is_keyed_as_it_is_queued_for_the_caching_workers_block_size():
    s = make_sched()
    join(s, "a")
    s.admit([spec(1, prompt(0, 1))])
    assert s.seqs[1].prefix_keys == (BS, len(prompt(0, 1)), block_keys(prompt(0, 1), BS)[:4])
    plain = make_sched()
    join(plain, "a", is_caching=False)
    plain.admit([spec(1, prompt(0, 1))])
    assert plain.seqs[1].prefix_keys is None   # no worker keeps a cache: nothing to key


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
    join(s, "a", is_caching=False)   # no cache of its own: it holds nothing back for one
    join(s, "b")
    cached_on(s, "b", SYSTEMS[1])
    s.admit([spec(i, prompt(i % 2, i)) for i in range(8)])
    assert ids_of(ask(s, "a")) == list(range(8))


def test_a_hit_does_not_pile_onto_a_full_worker():
    s = make_sched(spread_new_work=False)
    join(s, "a")
    b = join(s, "b", max_seqs=2, inflight=1)
    cached_on(s, "b", SYSTEMS[1])
    s.admit([spec(100 + i, [200 + i] * 40) for i in range(2)])
    assert len(ids_of(ask(s, "b"))) == 2          # b is full now
    assert b.load >= b.capacity
    s.admit([spec(i, prompt(1, i)) for i in range(4)])
    # b holds the prefix but has no room: a takes them, the rest once 0 computed it there
    assert ids_of(ask(s, "a")) == [0]
    assert ask(s, "a") is None


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


def test_a_worker_takes_its_hits_past_its_share_of_new_work():
    """Spreading new work gives a busy worker a share of 0; a sequence whose prefix it holds
    (and which the other worker therefore leaves to it) is still its to take, so the two rules
    never leave a hit waiting for nobody until prefix_wait_s runs out."""
    s = make_sched(prefix_wait_s=1.0)
    a = join(s, "a")
    s.admit([spec(100 + i, [200 + i] * 40) for i in range(4)])
    assert len(ids_of(ask(s, "a"))) == 4           # alone: a takes them all
    join(s, "b")
    cached_on(s, "a", SYSTEMS[0])
    s.admit([spec(1, prompt(0, 1))])
    assert s.lessor.moves.admission_room(a) == 0   # a's share of the new work is taken
    assert ask(s, "b") is None                     # b leaves the hit to a, which has room
    assert ids_of(ask(s, "a")) == [1]


def test_hits_come_first_within_a_worker_s_share():
    s = make_sched(spread_new_work=False)
    join(s, "a", max_seqs=2, num_params=10**9)
    cached_on(s, "a", SYSTEMS[0])
    s.admit([spec(i, prompt(1, i)) for i in range(3)] + [spec(10 + i, prompt(0, i)) for i in range(2)])
    assert sorted(ids_of(s.schedule("a", 2, 1 << 20, 0.0, None))) == [10, 11]


def test_a_hit_goes_ahead_of_a_miss_only_by_the_prefill_it_saves():
    """SYSTEMS[0]'s 64 cached tokens of a 1e9-parameter model at 100 TFLOP/s: 1.28 ms of
    prefill. A miss first offered earlier than that goes first; one offered later goes after."""
    saved_s = 64 * 2 * 10**9 / 100e12
    for miss_lead_s, first in ((2 * saved_s, 1), (saved_s / 2, 10)):
        s = make_sched(spread_new_work=False, prefill_tflops=100.0)
        join(s, "a", max_seqs=1, num_params=10**9)
        cached_on(s, "a", SYSTEMS[0])
        s.admit([spec(1, prompt(1, 1))])
        s.seqs[1].offered_at = 0.0
        s.admit([spec(10, prompt(0, 1))])
        s.seqs[10].offered_at = miss_lead_s
        assert ids_of(s.schedule("a", 1, 1 << 20, 1.0, None)) == [first], miss_lead_s


def test_a_stream_of_hits_never_starves_a_miss():
    """One batch place, a new hit offered every step: the miss queued first is taken once it
    has waited longer than a hit's saved prefill, however many hits keep coming."""
    s = make_sched(spread_new_work=False)
    join(s, "a", max_seqs=1, num_params=10**9)
    cached_on(s, "a", SYSTEMS[0])
    s.admit([spec(1, prompt(1, 1))])
    taken, now = [], 0.0
    for step in range(40):
        s.admit([spec(100 + step, prompt(0, step))])
        grant = s.schedule("a", 1, 1 << 20, now, None)
        taken += ids_of(grant)
        report(s, grant, now, codes={row.seq_id: P.Finish.LENGTH for row in grant.rows})   # the place frees
        now += 0.001
        if 1 in taken:
            break
    assert 1 in taken, f"the miss waited behind {len(taken)} hits"


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
    back = codec.decode(codec.encode(result))
    assert P.unpack_i64(back.prefix_events).tolist() == [7, ~7]
    assert P.unpack_i32(back.cached_tokens).tolist() == [32, -1]
    bad = P.StepResult(1, P.pack_i64([5, 6]), P.pack_i32([1, 1]), P.pack_i32([3, 4]), P.pack_u8([0, 0]),
                       cached_tokens=P.pack_i32([32]))
    import pytest
    with pytest.raises(P.ProtocolError):
        codec.decode(codec.encode(bad))


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


# --- the prefill a lease is charged ---------------------------------------------------------

SHARED = [1] + [r.randrange(3, 1500) for _ in range(1023)]     # 64 blocks


def question(i: int) -> list[int]:
    return SHARED + [3 + (11 * i + j) % 1400 for j in range(128)]


def serve(s: Scheduler, name: str, max_tokens: int) -> tuple[int, int]:
    """Run name's leases a step each, as a worker whose cache holds every block it computed
    (reported with the step's result) and whose sequences end after one token: (steps,
    prompts that found none of the shared prefix cached, so computed it)."""
    cache: set[int] = set()
    steps = misses = 0
    while (grant := s.schedule(name, 64, max_tokens, 0.0, None)) is not None:
        steps += 1
        events = []
        for row in grant.rows:
            ids = P.unpack_i32(row.spec.token_ids).tolist()
            keys = block_keys(ids, BS, max_blocks=(len(ids) - 1) // BS)
            misses += keys[0] not in cache
            events += [k for k in keys if k not in cache and k not in events]
        cache.update(events)
        s.cache_report(name, events)
        n = len(grant.rows)
        s.complete(grant.lease_id, name, [row.seq_id for row in grant.rows], [1] * n, [7] * n,
                   [int(P.Finish.LENGTH)] * n, 0.0)
    return steps, misses


def test_prompts_sharing_a_prefix_are_charged_what_they_miss_and_wait_for_its_first_computation():
    # 16 prompts of 1,152 tokens sharing 1,024, a budget of 4,096 tokens a step. Charged in
    # full, 3 fit a step: 6 steps, and the 3 of the first all compute the prefix. Charged
    # what they miss, with the others waiting a step for the first: 1 then 15 (128 each).
    s = make_sched(spread_new_work=False)
    join(s, "a", max_seqs=64)
    s.admit([spec(i, question(i)) for i in range(16)])
    assert serve(s, "a", 4096) == (2, 1)
    assert s.counters["prefix_waits"] == 15


def test_a_worker_without_a_cache_is_charged_whole_prompts_and_nothing_waits():
    s = make_sched(spread_new_work=False)
    join(s, "a", max_seqs=64, is_caching=False)
    s.admit([spec(i, question(i)) for i in range(16)])
    assert serve(s, "a", 4096) == (6, 3)


def test_prompts_sharing_less_than_two_blocks_do_not_wait():
    s = make_sched(spread_new_work=False)
    join(s, "a", max_seqs=64)
    s.admit([spec(i, SHARED[:BS] + question(i)[-128:]) for i in range(4)])
    assert ids_of(ask(s, "a")) == [0, 1, 2, 3]


def step_done(s: Scheduler, grant, ids_done: bool, keys: list[int]) -> None:
    """a reports grant's rows: a token each (ids_done) or none (prompts still filling), and
    the blocks it cached."""
    n = len(grant.rows)
    s.cache_report("a", keys)
    s.complete(grant.lease_id, "a", [r.seq_id for r in grant.rows], [int(ids_done)] * n,
               [7] * (n if ids_done else 0), [0] * n, 0.0)


def test_a_prompt_waits_while_a_step_in_flight_or_a_prompt_filling_over_steps_computes_its_prefix():
    s = make_sched(spread_new_work=False)
    join(s, "a", max_seqs=64)
    s.admit([spec(i, question(i)) for i in range(2)])
    first = ask(s, "a")
    assert ids_of(first) == [0]
    assert ask(s, "a") is None                  # 0's step is in flight: 1 waits for it
    keys = block_keys(question(0), BS, max_blocks=71)
    step_done(s, first, False, keys[:32])       # 0 ran its first 512 tokens only
    second = ask(s, "a")
    assert ids_of(second) == [0]                # 0 goes on; 1 still waits for the rest
    step_done(s, second, True, keys[32:])
    assert ids_of(ask(s, "a")) == [0, 1]         # 0 decodes; 1 starts on the cached prefix
    assert s.seqs[1].num_waits == 2             # leases it sat out (the None was none)


def test_a_prompt_waits_for_a_prefix_computed_elsewhere_a_bounded_number_of_leases():
    from qmigrate.router.prefix_index import MAX_WAIT_LEASES
    s = make_sched(spread_new_work=False)
    join(s, "a", max_seqs=64)
    s.admit([spec(i, question(i)) for i in range(2)])
    leases = 0
    while ids_of(grant := ask(s, "a")) == [0]:
        leases += 1
        step_done(s, grant, False, [])          # 0 never gets on (as if stuck)
    assert ids_of(grant) == [0, 1] and leases == MAX_WAIT_LEASES


def test_hits_are_charged_the_tokens_they_compute_and_their_whole_kv():
    # A cached block nobody references counts as free in the worker's report and leaves it
    # when a sequence takes it: the blocks a hit starts on are charged KV like any others.
    s = make_sched(spread_new_work=False)
    join(s, "a", max_seqs=64, kv_tokens=1 << 20)
    cached_on(s, "a", SHARED)
    s.admit([spec(i, question(i)) for i in range(2)])
    kv = 1152 + BS
    assert ids_of(s.schedule("a", 64, 256, 0.0, 2 * kv - 1)) == [0]
    s.admit([spec(2, question(2))])
    # 0 is on its way (charged in full), and 1 and 2 compute 128 tokens each
    assert ids_of(s.schedule("a", 64, 256, 0.0, 3 * kv)) == [1, 2]
