"""Router policy "pinned" (moves off): every sequence runs on the worker it started on; only a
drain or a dead worker moves it, and one evicted for room is recomputed where it was."""

from __future__ import annotations

import random

import pytest

from qmigrate.config import ConfigError, RouterConfig
from scheduler_util import ask, check_invariants, diff_ids, full_ids, give, join, make_sched, migrations, report, \
    row_ids, spec


def test_the_policy_is_a_router_setting_checked_by_name():
    assert RouterConfig(policy="pinned").policy == "pinned"
    with pytest.raises(ConfigError, match="policy: expected one of 'affinity', 'pinned', 'any', got 'stay'"):
        RouterConfig(policy="stay")


def test_nothing_moves_for_load_past_capacity_or_imbalance():
    s = make_sched(policy="pinned", rebalance_threshold=1)
    join(s, "w0", max_seqs=3, inflight=1), join(s, "w1")
    give(s, "w0", list(range(1, 11)))          # 10 sequences, capacity 3: affinity moves 7
    assert ask(s, "w1") is None
    assert not migrations(s) and len(s.workers["w0"].owned) == 10
    check_invariants(s)


def test_the_same_fleet_with_affinity_moves_them():
    """The test above can fail: the same state moves sequences under the default policy."""
    s = make_sched(rebalance_threshold=1)
    join(s, "w0", max_seqs=3, inflight=1), join(s, "w1")
    give(s, "w0", list(range(1, 11)))
    assert full_ids(ask(s, "w1")) and migrations(s).get("migrations_load")


def test_nothing_moves_off_a_worker_short_of_memory():
    s = make_sched(policy="pinned", min_free_vram_fraction=0.05)
    join(s, "w0", gpu_uuid="GPU-a"), join(s, "w1", gpu_uuid="GPU-b")
    give(s, "w0", [1, 2])
    s.set_free_vram("GPU-b", 0.5)
    s.set_free_vram("GPU-a", 0.01)
    assert s.workers["w0"].is_memory_short
    assert ask(s, "w1") is None and not migrations(s)
    assert sorted(diff_ids(ask(s, "w0"))) == [1, 2]


def test_an_evicted_sequence_is_recomputed_on_its_worker_not_elsewhere():
    s = make_sched(policy="pinned")
    join(s, "w0"), join(s, "w1")
    give(s, "w0", [1, 2])
    s.evicted("w0", [2])
    assert s.seqs[2].owner is None and s.counters["evictions"] == 1
    assert ask(s, "w1") is None                # affinity would give it to w1 (below)
    g = ask(s, "w0")
    assert diff_ids(g) == [1] and full_ids(g) == [2] and not migrations(s)
    check_invariants(s)


def test_with_affinity_an_evicted_sequence_goes_to_whoever_asks():
    s = make_sched()
    join(s, "w0"), join(s, "w1")
    give(s, "w0", [1, 2])
    s.evicted("w0", [2])
    assert full_ids(ask(s, "w1")) == [2]


@pytest.mark.parametrize("how", ["drain", "dead"])
def test_a_drained_or_dead_worker_still_gives_its_sequences_up(how):
    s = make_sched(policy="pinned", heartbeat_timeout_s=5.0)
    join(s, "w0"), join(s, "w1")
    give(s, "w0", [1, 2, 3])
    s.evicted("w0", [3])                       # waiting for w0, which is going away
    if how == "drain":
        assert s.drain("w0")
        now = 0.0
    else:
        now = 100.0
        s.touch("w1", now)
        s.expire(now)
        assert not s.workers["w0"].alive
    g = ask(s, "w1", now=now)
    assert sorted(row_ids(g)) == [1, 2, 3]
    assert migrations(s).get(f"migrations_{how}") == 2   # 3 was nobody's: it starts again on w1
    check_invariants(s)


@pytest.mark.parametrize("policy, moves", [("pinned", False), ("affinity", True)])
def test_under_imbalance_and_evictions_each_sequence_runs_on_one_worker(policy, moves):
    """A random run of three workers, work arriving at one of them and sequences evicted at
    random: with "pinned" no sequence is ever leased to a second worker; the default moves
    some (so the check can fail)."""
    r = random.Random(7)
    s = make_sched(policy=policy, rebalance_threshold=2, spread_new_work=False)
    for name in ("w0", "w1", "w2"):
        join(s, name, max_seqs=4, inflight=1)
    ran_on: dict[int, set[str]] = {}
    next_id, now = 1, 0.0
    for step in range(300):
        now += 0.01
        if step < 60:                          # a burst that w0 takes first
            s.admit([spec(next_id, max_new_tokens=r.randint(5, 40))])
            next_id += 1
        for name in (["w0"] if step < 60 else ["w0", "w1", "w2"]):
            g = ask(s, name, now=now, max_seqs=4)
            if g is None:
                continue
            for sid in row_ids(g):
                ran_on.setdefault(sid, set()).add(name)
            report(s, g, now=now)
            owned = sorted(s.workers[name].owned)
            if owned and r.random() < 0.3:
                s.evicted(name, [r.choice(owned)])
        check_invariants(s)
    assert len(ran_on) == next_id - 1
    assert s.counters["evictions"] > 0
    moved = [sid for sid, names in ran_on.items() if len(names) > 1]
    assert bool(moved) is moves, moved
    if not moves:
        assert not migrations(s)


def test_a_row_refused_for_room_waits_for_its_worker_too():
    """A worker without room for a row answers NEED_IDS (its KV is gone): under "pinned" the
    sequence is resent to that worker, not to whoever asks first."""
    from qmigrate.wire.protocol import Finish
    s = make_sched(policy="pinned")
    join(s, "w0"), join(s, "w1")
    give(s, "w0", [1, 2])
    g = ask(s, "w0")
    report(s, g, codes={2: Finish.NEED_IDS})
    assert s.seqs[2].owner is None and s.counters["resends"] == 1
    assert ask(s, "w1") is None
    assert 2 in full_ids(ask(s, "w0")) and not migrations(s)
