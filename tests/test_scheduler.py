"""The router's policy as pure bookkeeping: queue, leases, KV owners and migration.

Times are plain floats; nothing here sleeps.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from qmigrate.wire.protocol import CONTINUE, Finish, SeqSpec, pack_i32
from qmigrate.config import RouterConfig
from qmigrate.router.scheduler import Grant, Scheduler, WorkerState, choose_mechanism

TOKEN = 77  # what the fake workers below "sample"


# --- helpers ----------------------------------------------------------------------------

def spec(seq_id: int, prompt_len: int = 4, max_new_tokens: int = 64) -> SeqSpec:
    ids = [1] + [3 + (seq_id * 31 + i) % 1000 for i in range(prompt_len - 1)]
    return SeqSpec(seq_id, pack_i32(ids), prompt_len, max_new_tokens, temperature=0.5, seed=seq_id,
                   stop_ids=[[9, 9]], eos_ids=[2])


def make_sched(**config) -> Scheduler:
    config.setdefault("heartbeat_timeout_s", 1e9)  # tests about death set it themselves
    config.setdefault("chain_leases", False)  # chained leases have tests of their own below
    # so that a test can place work on the worker it names; spreading has tests of its own
    config.setdefault("spread_new_work", False)
    return Scheduler(RouterConfig(**config))


def join(s: Scheduler, name: str, now: float = 0.0, **kw) -> WorkerState:
    kw = {"max_seqs": 8, "max_tokens": 4096, **kw}
    w = WorkerState(name, **kw)
    s.register(w, now)
    return w


def ask(s: Scheduler, name: str, now: float = 0.0, max_seqs: int = 64, max_tokens: int = 1 << 20,
        free_kv_tokens: int | None = None) -> Grant | None:
    return s.schedule(name, max_seqs, max_tokens, now, free_kv_tokens)


def report(s: Scheduler, grant: Grant, now: float = 0.0, codes: dict[int, Finish] | None = None,
           name: str | None = None, skip: tuple[int, ...] = ()):
    """Complete a grant the way a worker would: one token per row unless NEED_IDS."""
    codes = codes or {}
    seq_ids, counts, tokens, status = [], [], [], []
    for row in grant.rows:
        if row.seq_id in skip:
            continue
        code = codes.get(row.seq_id, Finish.NONE)
        seq_ids.append(row.seq_id)
        counts.append(0 if code == Finish.NEED_IDS else 1)
        tokens += [] if code == Finish.NEED_IDS else [TOKEN]
        status.append(int(code))
    return s.complete(grant.lease_id, name or grant.worker, seq_ids, counts, tokens, status, now)


def row_ids(grant: Grant | None) -> list[int]:
    return [] if grant is None else [r.seq_id for r in grant.rows]


def diff_ids(grant: Grant) -> list[int]:
    return [r.seq_id for r in grant.rows if r.spec is None]


def full_ids(grant: Grant) -> list[int]:
    return [r.seq_id for r in grant.rows if r.spec is not None]


def give(s: Scheduler, name: str, seq_ids: list[int], now: float = 0.0, prompt_len: int = 4) -> None:
    """Admit seq_ids and run one step of each on `name` (with whatever it already owns), in
    as many leases as its max_seqs needs."""
    s.admit([spec(i, prompt_len) for i in seq_ids])
    grants = []
    while (grant := ask(s, name, now)) is not None:
        grants.append(grant)
    assert {sid for g in grants for sid in row_ids(g)} >= set(seq_ids)
    for grant in grants:
        assert report(s, grant, now).accepted
    assert s.workers[name].owned >= set(seq_ids)


def migrations(s: Scheduler) -> dict[str, int]:
    return {k: v for k, v in s.counters.items() if k.startswith("migrations_") and v}


def check_invariants(s: Scheduler) -> None:
    """One place at a time, and the owner bookkeeping agrees with itself.

    A lease record may still list a sequence it no longer holds (taken back, finished);
    only the current lease and a chained next lease, both at one worker, hold it."""
    assert set(s.queue) <= set(s.seqs)
    for sid, seq in s.seqs.items():
        holders = [i for i, lease in s.leases.items() if sid in lease.seq_ids
                   and i in (seq.lease_id, seq.next_lease)]
        if seq.lease_id is None:
            assert sid in s.queue and not holders and seq.next_lease is None, f"seq {sid} is lost"
        else:
            assert sid not in s.queue, f"seq {sid} is leased and queued"
            assert seq.lease_id in holders, f"seq {sid}'s lease is gone"
            if seq.next_lease is not None:
                assert seq.next_lease in holders and len(holders) == 2
                assert s.leases[seq.next_lease].worker == s.leases[seq.lease_id].worker
            else:
                assert len(holders) == 1
        if seq.owner is not None:
            assert sid in s.workers[seq.owner].owned
    for name, w in s.workers.items():
        assert all(s.seqs[sid].owner == name for sid in w.owned)
        mine = [lease for lease in s.leases.values() if lease.worker == name]
        assert w.num_leased == sum(len(lease.seq_ids) for lease in mine)
        assert w.num_arriving == sum(lease.num_arriving for lease in mine) >= 0
        assert w.alive or not mine


# --- affinity and plain leasing ---------------------------------------------------------

def test_a_worker_gets_back_its_own_sequences_first():
    s = make_sched()
    join(s, "w0"), join(s, "w1")
    s.admit([spec(1), spec(2)])
    g0, g1 = ask(s, "w0", max_seqs=1), ask(s, "w1", max_seqs=1)
    assert (row_ids(g0), row_ids(g1)) == ([1], [2])
    report(s, g0), report(s, g1)
    s.admit([spec(3)])
    assert list(s.queue) == [1, 2, 3]
    g1 = ask(s, "w1", max_seqs=1)
    assert row_ids(g1) == [2] and diff_ids(g1) == [2]  # its own, though 1 is ahead in the queue
    g1b = ask(s, "w1")
    assert row_ids(g1b) == [3]  # a new one; seq 1 stays with its owner
    g0 = ask(s, "w0")
    assert row_ids(g0) == [1] and diff_ids(g0) == [1]
    assert migrations(s) == {}
    check_invariants(s)


def test_new_sequences_go_to_whoever_asks():
    s = make_sched()
    join(s, "w0"), join(s, "w1")
    s.admit([spec(i) for i in range(1, 5)])
    g1 = ask(s, "w1", max_seqs=3)
    g0 = ask(s, "w0")
    assert row_ids(g1) == [1, 2, 3] and row_ids(g0) == [4]
    assert full_ids(g1) == [1, 2, 3] and full_ids(g0) == [4]
    assert ask(s, "w0") is None  # nothing queued
    check_invariants(s)


# --- new work spread over the workers (spread_new_work) ----------------------------------------

def test_a_burst_is_shared_among_the_workers_that_have_room():
    s = make_sched(spread_new_work=True)
    join(s, "w0", max_seqs=16), join(s, "w1", max_seqs=16)
    s.admit([spec(i) for i in range(1, 13)])
    g0 = ask(s, "w0")
    assert row_ids(g0) == [1, 2, 3, 4, 5, 6]  # its share of 12, not the 12 that fit its step
    assert ask(s, "w0") is None  # asking again (a second batch in flight) gets no more
    g1 = ask(s, "w1")
    assert row_ids(g1) == [7, 8, 9, 10, 11, 12]
    report(s, g0), report(s, g1)
    assert s.workers["w0"].num_arriving == s.workers["w1"].num_arriving == 0
    assert len(s.workers["w0"].owned) == len(s.workers["w1"].owned) == 6
    s.admit([spec(i) for i in range(13, 17)])  # shares count what each holds already
    assert row_ids(ask(s, "w1")) == [7, 8, 9, 10, 11, 12, 13, 14]
    check_invariants(s)


def test_shares_follow_max_seqs_and_only_workers_with_room_count():
    s = make_sched(spread_new_work=True)
    join(s, "w0", max_seqs=8), join(s, "w1", max_seqs=24)
    s.admit([spec(i) for i in range(1, 17)])
    assert len(ask(s, "w0").rows) == 4  # 16 x 8 / 32
    s = make_sched(spread_new_work=True)
    join(s, "w0", max_seqs=8), join(s, "w1", max_seqs=8)
    s.workers["w1"].may_prefill = False  # short of memory: takes no new work, so no share
    s.admit([spec(i) for i in range(1, 9)])
    assert len(ask(s, "w0").rows) == 8
    s = make_sched(spread_new_work=True)
    join(s, "w0", max_seqs=8), join(s, "w1", max_seqs=8, kv_tokens=1024)
    assert ask(s, "w1", free_kv_tokens=16) is None  # its pool is full: no room for new work
    s.admit([spec(i) for i in range(1, 9)])
    assert len(ask(s, "w0").rows) == 8
    s = make_sched(spread_new_work=True)
    join(s, "w0", max_seqs=8), join(s, "w1", max_seqs=8)
    s.drain("w1")
    s.admit([spec(i) for i in range(1, 9)])
    assert len(ask(s, "w0").rows) == 8
    check_invariants(s)


def test_a_worker_alone_or_beside_a_full_one_takes_all_that_fits():
    s = make_sched(spread_new_work=True)
    join(s, "w0", max_seqs=8)
    s.admit([spec(i) for i in range(1, 9)])
    assert len(ask(s, "w0").rows) == 8
    s = make_sched(spread_new_work=True)
    join(s, "w0", max_seqs=4, inflight=1)
    give(s, "w0", [1, 2, 3, 4])  # at its capacity
    join(s, "w1", max_seqs=8)
    s.admit([spec(i) for i in range(5, 11)])
    assert row_ids(ask(s, "w1")) == [5, 6, 7, 8, 9, 10]
    check_invariants(s)


def test_nothing_moves_for_load_while_new_work_waits():
    s = make_sched(spread_new_work=True)
    join(s, "w0", max_seqs=8, inflight=4)
    give(s, "w0", list(range(1, 21)))
    join(s, "w1", max_seqs=8)
    s.admit([spec(21), spec(22)])
    assert s.moves.may_keep(s.workers["w0"])  # no reason to cut w0's leases short either
    g = ask(s, "w1")
    assert row_ids(g) == [21, 22] and s.counters["migrations_load"] == 0
    report(s, g)
    g = ask(s, "w1")  # the new work is placed: now w0's excess over a batch moves, into w1's room
    assert row_ids(g)[:2] == [21, 22] and len(g.rows) == 8 and s.counters["migrations_load"] == 6
    check_invariants(s)


def test_arrivals_are_uncounted_when_a_lease_expires_or_its_worker_dies():
    s = make_sched(spread_new_work=True, lease_timeout_s=5.0)
    join(s, "w0", max_seqs=8), join(s, "w1", max_seqs=8)
    s.admit([spec(i) for i in range(1, 9)])
    ask(s, "w0", now=0.0), ask(s, "w1", now=0.0)
    assert s.workers["w0"].num_arriving == s.workers["w1"].num_arriving == 4
    s.expire(now=6.0)
    assert s.workers["w0"].num_arriving == s.workers["w1"].num_arriving == 0
    check_invariants(s)


def test_rows_carry_length_last_token_and_the_full_form():
    s = make_sched()
    join(s, "w0"), join(s, "w1")
    s.admit([spec(1, prompt_len=5)])
    g = ask(s, "w0")
    (row,) = g.rows
    assert (row.length, row.last_token) == (5, spec(1, 5).ids[-1])
    assert row.spec.ids.tolist() == spec(1, 5).ids.tolist()
    assert (row.spec.prompt_len, row.spec.seed, row.spec.stop_ids) == (5, 1, [[9, 9]])
    report(s, g)
    g = ask(s, "w0")
    (row,) = g.rows
    assert (row.length, row.last_token, row.spec) == (6, TOKEN, None)
    report(s, g)
    s.drain("w0")
    (row,) = ask(s, "w1").rows  # moved: the full form now holds the generated tokens
    assert (row.length, row.last_token) == (7, TOKEN)
    assert row.spec.ids.tolist() == spec(1, 5).ids.tolist() + [TOKEN, TOKEN]


def test_nobody_gets_work_from_an_empty_queue_or_unknown_name():
    s = make_sched()
    join(s, "w0")
    assert ask(s, "w0") is None
    s.admit([spec(1)])
    assert ask(s, "ghost") is None
    assert ask(s, "w0", max_seqs=0) is None
    assert row_ids(ask(s, "w0")) == [1]


# --- results ----------------------------------------------------------------------------

def test_results_on_unknown_leases_are_ignored_and_counted_stale():
    s = make_sched()
    join(s, "w0"), join(s, "w1")
    s.admit([spec(1)])
    g = ask(s, "w0")
    assert not s.complete(999, "w0", [1], [1], [TOKEN], [0], 0.0).accepted
    assert not report(s, g, name="w1").accepted  # someone else's lease
    assert s.counters["stale_results"] == 2
    assert g.lease_id in s.leases  # the real holder may still report
    assert report(s, g).accepted
    assert not report(s, g).accepted  # a duplicate of an accepted result
    assert s.counters["stale_results"] == 3
    assert s.seqs[1].token_ids[-1] == TOKEN and len(s.seqs[1].token_ids) == 5
    check_invariants(s)


def test_finished_sequences_leave_everything():
    s = make_sched(max_queued=4)
    join(s, "w0")
    s.admit([spec(i) for i in range(1, 5)])
    assert s.num_free == 0
    out = report(s, ask(s, "w0"), codes={1: Finish.EOS, 2: Finish.STOP, 3: Finish.LENGTH})
    assert sorted(out.finished) == [(1, Finish.EOS), (2, Finish.STOP), (3, Finish.LENGTH)]
    assert set(s.seqs) == {4} and list(s.queue) == [4]
    assert s.workers["w0"].owned == {4}
    assert s.num_free == 3 and s.counters["finished"] == 3
    out = report(s, ask(s, "w0"), codes={4: Finish.ERROR})
    assert out.finished == [(4, Finish.ERROR)] and not s.seqs and not s.workers["w0"].owned
    check_invariants(s)


def test_need_ids_resends_the_full_form_first():
    s = make_sched()
    join(s, "w0")
    s.admit([spec(1), spec(2)])
    report(s, ask(s, "w0"))
    s.admit([spec(3)])
    g = ask(s, "w0")
    assert diff_ids(g) == [1, 2]
    report(s, g, codes={2: Finish.NEED_IDS})
    assert list(s.queue)[0] == 2
    assert s.seqs[2].owner is None and 2 not in s.workers["w0"].owned
    assert len(s.seqs[2].token_ids) == 5  # nothing appended
    assert s.counters["resends"] == 1
    g = ask(s, "w0")
    assert full_ids(g) == [2] and diff_ids(g) == [1, 3]
    check_invariants(s)


def test_rows_a_worker_failed_to_report_are_requeued_in_front():
    s = make_sched()
    join(s, "w0")
    s.admit([spec(1), spec(2), spec(3)])
    g = ask(s, "w0", max_seqs=2)
    assert report(s, g, skip=(2,)).accepted
    assert list(s.queue) == [2, 3, 1]
    assert s.seqs[2].owner is None and s.seqs[1].owner == "w0"
    check_invariants(s)


# --- leases that expire -----------------------------------------------------------------

def test_tokens_of_a_lapsed_lease_are_late_and_of_no_lease_forged():
    """Tokens a worker sends for a sequence whose lease of its expired (and moved on, even
    finished elsewhere) are late, expected under load; tokens for one never leased to it
    are forged; a cancelled one's from its worker are apart again."""
    s = make_sched(lease_timeout_s=10.0)
    for name in ("w0", "w1", "w2"):
        join(s, name)
    s.admit([spec(1), spec(2), spec(3)])
    g0 = ask(s, "w0", now=0.0, max_seqs=2)
    assert row_ids(g0) == [1, 2]
    assert s.sort_tokens("w0", [1, 2]) == ([True, True], 0, 0, 0)
    assert s.expire(11.0) == [g0.lease_id]
    g1 = ask(s, "w1", now=11.0, max_seqs=2)
    assert sorted(row_ids(g1)) == [1, 2]   # moved to w1
    assert s.sort_tokens("w0", [1, 2]) == ([False, False], 0, 2, 0)
    assert s.sort_tokens("w1", [1, 2]) == ([True, True], 0, 0, 0)
    assert s.sort_tokens("w2", [1, 2, 999]) == ([False, False, False], 0, 0, 3)
    report(s, g1, now=12.0, codes={1: Finish.EOS})
    assert 1 not in s.seqs and s.sort_tokens("w0", [1]) == ([False], 0, 1, 0)   # finished on w1
    g3 = ask(s, "w2", now=12.0, max_seqs=1)
    s.cancel(row_ids(g3))
    assert s.sort_tokens("w2", row_ids(g3)) == ([False], 1, 0, 0)


def test_lease_expiry_requeues_and_schedules_the_old_kv_for_drop():
    s = make_sched(lease_timeout_s=10.0)
    join(s, "w0"), join(s, "w1")
    give(s, "w0", [1])
    s.admit([spec(2)])
    g = ask(s, "w0", now=1.0, max_seqs=1)
    assert diff_ids(g) == [1]
    assert s.expire(10.9) == []
    assert s.expire(11.0) == [g.lease_id]
    assert s.counters["leases_expired"] == 1
    assert list(s.queue) == [1, 2]  # in front
    assert s.seqs[1].owner is None and s.seqs[1].lease_id is None
    assert s.workers["w0"].num_leased == 0 and not s.workers["w0"].owned
    check_invariants(s)
    g1 = ask(s, "w1", now=11.0, max_seqs=1)
    assert full_ids(g1) == [1]  # its KV on w0 is not trusted: recompute
    g0 = ask(s, "w0", now=11.0)
    assert row_ids(g0) == [2] and g0.drop_ids == [1]
    assert ask(s, "w0", now=11.0) is None
    late = report(s, g, now=12.0)
    assert not late.accepted and s.counters["stale_results"] == 1
    assert len(s.seqs[1].token_ids) == 5  # the late token was not taken
    check_invariants(s)


def test_drops_travel_once_with_the_next_grant():
    s = make_sched(lease_timeout_s=1.0)
    join(s, "w0")
    s.admit([spec(1), spec(2)])
    g = ask(s, "w0", max_seqs=1)
    s.expire(5.0)
    g = ask(s, "w0", now=5.0, max_seqs=1)
    assert g.drop_ids == [1] and row_ids(g) == [1]  # dropped, then prefilled from its ids
    assert ask(s, "w0", now=5.0).drop_ids == []


# --- dead workers -----------------------------------------------------------------------

def dead_fleet() -> Scheduler:
    s = make_sched(heartbeat_timeout_s=5.0, lease_timeout_s=10.0, migration="transfer")
    for name in ("w0", "w1"):
        join(s, name, kv_endpoint=f"tcp://{name}:1", kv_bytes_per_token=1000, num_params=10**9)
    return s


def test_dead_worker_sequences_migrate_by_recompute():
    s = dead_fleet()
    give(s, "w0", [1, 2], prompt_len=500)  # long enough that a live owner would ship its KV
    s.touch("w1", 6.0)
    assert s.expire(5.0) == [] and s.workers["w0"].alive  # silent for exactly the timeout
    s.expire(6.0)
    assert not s.workers["w0"].alive and s.workers["w1"].alive
    assert s.counters["workers_lost"] == 1
    assert [(name, held) for name, _, held in s.lost] == [("w0", 2)]  # for the router's log
    assert all(seq.owner is None for seq in s.seqs.values()) and not s.workers["w0"].owned
    check_invariants(s)
    assert ask(s, "w0", now=6.0) is None
    g = ask(s, "w1", now=6.0)
    assert sorted(full_ids(g)) == [1, 2] and g.shipments == []
    assert all(r.spec.kv_from == "" and r.spec.transfer_id == 0 for r in g.rows)
    assert migrations(s) == {"migrations_dead": 2, "migrations_by_recompute": 2}
    check_invariants(s)


def test_dead_worker_loses_its_leases():
    s = dead_fleet()
    give(s, "w0", [1])
    s.admit([spec(2)])
    held = ask(s, "w0", now=1.0)
    assert row_ids(held) == [1, 2]
    s.touch("w1", 6.5)
    assert s.expire(6.5) == []  # taken back as part of the death, before any deadline
    assert held.lease_id not in s.leases and sorted(s.queue) == [1, 2]
    check_invariants(s)
    g = ask(s, "w1", now=6.5)
    assert sorted(full_ids(g)) == [1, 2]
    assert not report(s, held, now=7.0).accepted
    assert report(s, g, now=7.0).accepted
    assert s.workers["w1"].owned == {1, 2}
    check_invariants(s)


def test_heartbeats_and_results_keep_a_worker_alive():
    s = make_sched(heartbeat_timeout_s=5.0, lease_timeout_s=100.0)
    join(s, "w0"), join(s, "w1")
    s.admit([spec(1)])
    g = ask(s, "w1")
    for t in (4.0, 8.0, 12.0):
        s.touch("w0", t)
    report(s, g, now=12.0)
    s.expire(17.0)
    assert s.workers["w0"].alive and s.workers["w1"].alive
    s.expire(17.01)
    assert not s.workers["w0"].alive and not s.workers["w1"].alive
    assert s.counters["migrations_dead"] == 1  # seq 1, owned by w1


def test_pulses_keep_a_worker_alive_through_a_long_step():
    """A worker's loop runs a step longer than the heartbeat timeout; its pulse thread says the
    process lives. No pulse (killed, stopped) is silence; a loop in one step for the lease
    timeout is a hung step, lost at once."""
    s = make_sched(heartbeat_timeout_s=1.0, lease_timeout_s=6.0)
    join(s, "w0"), join(s, "w1")
    give(s, "w0", [1])
    s.admit([spec(2)])
    held = ask(s, "w0", now=0.5)
    for t in (0.9, 1.8, 2.7, 3.6):
        s.pulse("w0", t - 0.5, t)        # the step began at 0.5 and runs on
        s.touch("w1", t)
        assert s.expire(t) == [] and s.workers["w0"].alive
    assert held.lease_id in s.leases and s.counters["workers_lost"] == 0
    assert report(s, held, now=4.0).accepted
    s.touch("w1", 5.0)
    s.expire(5.1)                        # w1 kept talking; w0's pulses stopped (a SIGSTOP)
    assert not s.workers["w0"].alive and s.workers["w1"].alive
    assert [(name, why[:6]) for name, why, _ in s.lost] == [("w0", "silent")]
    s.pulse("w0", 0.0, 5.2)              # a pulse queued before the stop revives nothing
    assert not s.workers["w0"].alive
    check_invariants(s)


def test_a_pulse_from_a_loop_stuck_past_the_lease_timeout_loses_the_worker():
    s = make_sched(heartbeat_timeout_s=1.0, lease_timeout_s=6.0)
    join(s, "w0"), join(s, "w1")
    give(s, "w0", [1])
    s.admit([spec(2)])
    held = ask(s, "w0", now=0.5)
    s.pulse("w0", 5.9, 6.4)
    assert s.workers["w0"].alive
    s.pulse("w0", 6.0, 6.5)
    assert not s.workers["w0"].alive and held.lease_id not in s.leases
    assert s.counters["workers_hung"] == 1 and s.counters["workers_lost"] == 1
    assert [(name, held_) for name, _, held_ in s.lost] == [("w0", 2)]
    assert "in one step for 6.0 s" in s.lost[0][1]
    g = ask(s, "w1", now=6.5)
    assert sorted(full_ids(g)) == [1, 2] and s.counters["migrations_dead"] == 2
    s.pulse("nobody", 0.0, 6.6)          # unknown: ignored
    check_invariants(s)


def test_a_restarted_worker_holds_nothing():
    s = make_sched()
    join(s, "w0"), join(s, "w1")
    give(s, "w0", [1, 2])
    s.admit([spec(3)])
    held = ask(s, "w0", max_seqs=1)
    join(s, "w0", now=1.0)  # same name, new process
    assert not s.workers["w0"].owned and held.lease_id not in s.leases
    g = ask(s, "w0", now=1.0)
    assert sorted(full_ids(g)) == [1, 2, 3]
    check_invariants(s)


# --- drain ------------------------------------------------------------------------------

def test_drain_moves_sequences_then_reports_drained():
    s = make_sched()
    join(s, "w0"), join(s, "w1")
    give(s, "w0", [1, 2, 3])
    g = ask(s, "w0", max_seqs=1)  # one of them is in flight when the drain starts
    assert s.drain("w0") and not s.drain("ghost")
    assert ask(s, "w0") is None
    assert not s.is_drained("w0")
    g1 = ask(s, "w1")
    assert sorted(full_ids(g1)) == [2, 3]
    assert s.counters["migrations_drain"] == 2
    assert not s.is_drained("w0")  # seq 1 is still leased to it
    report(s, g)
    assert not s.is_drained("w0")  # ... and now it holds its KV
    assert full_ids(ask(s, "w1")) == [1]
    assert s.counters["migrations_drain"] == 3
    assert s.is_drained("w0")
    s.retire("w0")
    assert not s.workers["w0"].alive and not s.drain("w0")
    check_invariants(s)


# --- load migration ---------------------------------------------------------------------

def test_load_moves_the_excess_over_capacity():
    s = make_sched(rebalance_threshold=100)
    join(s, "w0", max_seqs=3, inflight=1), join(s, "w1")
    s.admit([spec(i) for i in range(1, 6)])
    g_a, g_b = ask(s, "w0"), ask(s, "w0")  # two batches in flight: 3 + 2 sequences
    assert len(g_a.rows) + len(g_b.rows) == 5
    report(s, g_a), report(s, g_b)
    assert len(s.workers["w0"].owned) == 5  # capacity is 3
    g1 = ask(s, "w1")
    assert len(g1.rows) == 2 and full_ids(g1) == row_ids(g1)
    assert migrations(s) == {"migrations_load": 2, "migrations_by_recompute": 2}
    assert len(s.workers["w0"].owned) == 3
    assert ask(s, "w1") is None  # within capacity now
    check_invariants(s)


@pytest.mark.parametrize("threshold, moved", [(8, 5), (10, 5), (11, 0)])
def test_rebalance_when_the_owned_gap_reaches_the_threshold(threshold, moved):
    s = make_sched(rebalance_threshold=threshold)
    join(s, "w0", max_seqs=4, inflight=4), join(s, "w1")  # 10 sequences: more than one batch
    give(s, "w0", list(range(1, 11)))
    g = ask(s, "w1")
    assert len(row_ids(g)) == moved
    assert s.counters["migrations_load"] == moved
    if moved:
        report(s, g)
        assert len(s.workers["w0"].owned) == len(s.workers["w1"].owned) == 5
        assert len(row_ids(ask(s, "w1"))) == 5  # its own; the gap is closed
        assert s.counters["migrations_load"] == moved


def test_load_migration_can_be_switched_off():
    s = make_sched(migrate_on_load=False, rebalance_threshold=1)
    join(s, "w0", max_seqs=16, inflight=1), join(s, "w1")
    give(s, "w0", list(range(1, 11)))
    assert ask(s, "w1") is None


def test_policy_any_moves_sequences_to_any_requester():
    s = make_sched(policy="any")
    join(s, "w0"), join(s, "w1")
    give(s, "w0", [1, 2])
    g = ask(s, "w1")
    assert sorted(full_ids(g)) == [1, 2]
    assert migrations(s) == {"migrations_any": 2, "migrations_by_recompute": 2}
    assert sorted(s.workers["w0"].pending_drops) == [1, 2]  # recompute: the old KV goes
    check_invariants(s)


def test_memory_short_owner_sheds_sequences():
    s = make_sched(min_free_vram_fraction=0.05)
    join(s, "w0", gpu_uuid="GPU-a"), join(s, "w1", gpu_uuid="GPU-b")
    give(s, "w0", [1, 2])
    s.set_free_vram("GPU-a", 0.5)
    s.set_free_vram("GPU-b", 0.01)  # w1 itself being short does not move w0's work
    assert ask(s, "w1") is None
    s.set_free_vram("GPU-a", 0.049)
    s.set_free_vram("GPU-b", 0.5)  # a taker short itself would take no new prefills
    assert s.workers["w0"].is_memory_short
    g = ask(s, "w1")
    assert sorted(full_ids(g)) == [1, 2]
    assert migrations(s) == {"migrations_memory": 2, "migrations_by_recompute": 2}
    s.set_free_vram("GPU-a", 0.3)
    assert not s.workers["w0"].is_memory_short


def test_memory_migration_can_be_switched_off():
    s = make_sched(migrate_on_memory=False)
    join(s, "w0", gpu_uuid="GPU-a"), join(s, "w1", gpu_uuid="GPU-b")
    give(s, "w0", [1, 2])
    s.set_free_vram("GPU-a", 0.0)
    assert ask(s, "w1") is None


# --- admission and batch limits ---------------------------------------------------------

def test_admission_limit_takes_fewer():
    s = make_sched(max_queued=3)
    join(s, "w0")
    assert s.admit([spec(i) for i in range(1, 6)]) == 3
    assert set(s.seqs) == {1, 2, 3} and s.num_free == 0
    assert s.admit([spec(6)]) == 0
    report(s, ask(s, "w0", max_seqs=1), codes={1: Finish.EOS})
    assert s.num_free == 1
    assert s.admit([spec(6), spec(7)]) == 1 and set(s.seqs) == {2, 3, 6}


def test_a_resent_sequence_is_not_queued_twice():
    s = make_sched()
    join(s, "w0")
    assert s.admit([spec(1), spec(2)]) == 2
    assert s.admit([spec(1)]) == 1
    assert list(s.queue) == [1, 2] and len(s.seqs) == 2
    check_invariants(s)


def test_a_spec_without_ids_never_reaches_a_lease():
    """Submit specs come off the wire; one with no token ids must not break the router."""
    s = make_sched()
    join(s, "w0")
    s.admit([SeqSpec(1, b"", 0, 16), spec(2)])
    assert 1 not in s.queue
    assert row_ids(ask(s, "w0")) == [2]
    check_invariants(s)


def test_token_budget_limits_prefill_rows():
    s = make_sched()
    join(s, "w0")
    s.admit([spec(i, prompt_len=10) for i in range(1, 5)])
    assert row_ids(ask(s, "w0", max_tokens=25)) == [1, 2]


def test_token_budget_always_admits_one_row():
    s = make_sched()
    join(s, "w0")
    s.admit([spec(1, prompt_len=100), spec(2, prompt_len=2)])
    assert row_ids(ask(s, "w0", max_tokens=25)) == [1]  # over budget, but alone


def test_worker_limits_cap_the_request():
    s = make_sched()
    join(s, "w0", max_seqs=2, max_tokens=15)
    s.admit([spec(i, prompt_len=6) for i in range(1, 5)])
    assert row_ids(ask(s, "w0", max_seqs=64, max_tokens=1000)) == [1, 2]
    assert row_ids(ask(s, "w0", max_seqs=64, max_tokens=1000)) == [3, 4]
    s2 = make_sched()
    join(s2, "w0", max_tokens=15)
    s2.admit([spec(i, prompt_len=6) for i in range(1, 5)])
    assert row_ids(ask(s2, "w0", max_tokens=1000)) == [1, 2]


def test_decode_rows_cost_one_token_each():
    s = make_sched()
    join(s, "w0")
    give(s, "w0", [1, 2, 3, 4], prompt_len=50)
    assert row_ids(ask(s, "w0", max_tokens=3)) == [1, 2, 3]


def test_free_kv_tokens_limit_rows_that_need_the_full_form():
    s = make_sched()
    join(s, "w0", kv_tokens=1000, block_size=16)
    give(s, "w0", [1, 2])
    s.admit([spec(3), spec(4), spec(5)])
    # two owned sequences keep a block each for growth; a new one costs its 4 ids + a block
    g = ask(s, "w0", free_kv_tokens=2 * 16 + 20)
    assert diff_ids(g) == [1, 2] and full_ids(g) == [3]
    report(s, g)
    g = ask(s, "w0", free_kv_tokens=3 * 16 + 19)
    assert diff_ids(g) == [1, 2, 3] and full_ids(g) == []
    assert row_ids(ask(s, "w0")) == [4, 5]       # an unknown free count does not limit


# --- migration mechanism ----------------------------------------------------------------

# A TinyLlama-1.1B-shaped model in bf16: 22 layers x 4 KV heads x 64 dims x (K, V) x 2 bytes
# = 22528 bytes of KV per token; 1.1e9 parameters, so 2.2e9 FLOPs per token to recompute.
# At 10 Gbit/s: transfer = 1 ms + n * 18.0 us, recompute at 100 TFLOP/s = n * 22 us, so a
# transfer pays off from n = 252 tokens on. At 100 Gbit/s (1.8 us/token) from n = 50 on.
# At 1 Gbit/s (180 us/token) recompute always wins.
LLAMA_KV, LLAMA_PARAMS = 2 * 22 * 4 * 64 * 2, 1_100_000_000


@pytest.mark.parametrize("num_tokens, link_gbps, expected", [
    (251, 10.0, "recompute"), (252, 10.0, "transfer"), (4000, 10.0, "transfer"),
    (49, 100.0, "recompute"), (50, 100.0, "transfer"),
    (100_000, 1.0, "recompute"), (10, 10.0, "recompute"),
])
def test_choose_mechanism(num_tokens, link_gbps, expected):
    assert choose_mechanism(num_tokens, LLAMA_KV, LLAMA_PARAMS, link_gbps, 100.0) == expected


def test_choose_mechanism_without_sizes_recomputes():
    assert choose_mechanism(0, LLAMA_KV, LLAMA_PARAMS, 10.0, 100.0) == "recompute"
    assert choose_mechanism(10_000, 0, LLAMA_PARAMS, 10.0, 100.0) == "recompute"
    assert choose_mechanism(10_000, LLAMA_KV, 0, 10.0, 100.0) == "recompute"


def transfer_fleet(**config) -> Scheduler:
    s = make_sched(link_gbps=10.0, prefill_tflops=100.0, **config)
    for name in ("w0", "w1"):
        join(s, name, kv_endpoint=f"tcp://{name}:5601", gpu_uuid=f"GPU-{name}",
             kv_bytes_per_token=LLAMA_KV, num_params=LLAMA_PARAMS)
    return s


def test_transfer_ids_cannot_be_guessed():
    """A receiver takes KV for a migrating sequence by its transfer id; counted ids (1, 2, ...)
    let any worker key guess the next one. They are random 62-bit numbers (a repeat among
    2,000 has a chance of about 1e-12)."""
    from qmigrate.router.leasing import Lessor
    ids = [Lessor.new_transfer_id() for _ in range(2000)]
    assert len(set(ids)) == len(ids) and all(0 < i < 1 << 62 for i in ids)
    assert max(ids) > 1 << 58   # not small numbers counted from somewhere


def test_transfer_migration_ships_kv_from_the_old_owner():
    s = transfer_fleet()
    s.admit([spec(1, prompt_len=400), spec(2, prompt_len=10)])
    report(s, ask(s, "w0"))
    s.set_free_vram("GPU-w0", 0.0)
    g = ask(s, "w1")
    rows = {r.seq_id: r for r in g.rows}
    assert set(rows) == {1, 2}
    ((owner, sid, dest, transfer_id, num_tokens, start, keys),) = g.shipments
    assert (owner, sid, dest, num_tokens) == ("w0", 1, "tcp://w1:5601", 400)  # 401 ids, last one is input
    assert keys == []   # a migration, not a prefix pull
    assert 0 < transfer_id < 1 << 62
    assert (rows[1].spec.kv_from, rows[1].spec.transfer_id) == ("tcp://w0:5601", transfer_id)
    assert (rows[2].spec.kv_from, rows[2].spec.transfer_id) == ("", 0)  # short: recompute
    assert s.workers["w0"].pending_drops == [2]  # the shipped one is dropped by the export
    assert migrations(s) == {"migrations_memory": 2, "migrations_by_transfer": 1,
                             "migrations_by_recompute": 1}
    assert not s.workers["w0"].owned
    check_invariants(s)


def test_a_transferred_row_costs_one_token_of_budget():
    s = transfer_fleet(migration="transfer")
    give(s, "w0", [1, 2], prompt_len=400)
    s.drain("w0")
    g = ask(s, "w1", max_tokens=2)
    assert row_ids(g) == [1, 2] and len(g.shipments) == 2
    assert len({t[3] for t in g.shipments}) == 2  # transfer ids are unique


def test_forced_recompute_and_missing_endpoints_never_transfer():
    s = transfer_fleet(migration="recompute")
    give(s, "w0", [1], prompt_len=400)
    s.drain("w0")
    g = ask(s, "w1")
    assert g.shipments == [] and g.rows[0].spec.kv_from == ""
    s = transfer_fleet(migration="transfer")
    s.workers["w1"].kv_endpoint = ""
    give(s, "w0", [1], prompt_len=400)
    s.drain("w0")
    assert ask(s, "w1").shipments == []


# --- one place at a time, under random operations ---------------------------------------

NAMES = ("w0", "w1", "w2")


class FleetSim:
    """Random admissions, leases, results, expiries, deaths, restarts and drains."""

    def __init__(self, seed: int, **config):
        self.rng = random.Random(seed)
        config.setdefault("chain_leases", False)
        self.s = Scheduler(RouterConfig(max_queued=24, lease_timeout_s=10.0, heartbeat_timeout_s=5.0,
                                           rebalance_threshold=3, link_gbps=10.0, prefill_tflops=100.0,
                                           **config))
        self.now = 0.0
        self.next_id = 1
        self.live: set[int] = set()
        self.grants: dict[int, Grant] = {}
        self.frozen: set[str] = set()
        for name in NAMES:
            self.restart(name)

    def restart(self, name: str) -> None:
        r = self.rng
        self.s.register(WorkerState(name, max_seqs=r.randint(1, 6), max_tokens=r.choice([8, 64, 4096]),
                                    inflight=r.randint(1, 2), kv_endpoint=f"tcp://{name}:1",
                                    gpu_uuid=f"GPU-{name}", kv_bytes_per_token=10_000,
                                    num_params=10**9, kv_tokens=2000, block_size=16), self.now)
        self.frozen.discard(name)

    def op_admit(self) -> None:
        specs = []
        for _ in range(self.rng.randint(1, 3)):
            specs.append(spec(self.next_id, prompt_len=self.rng.randint(2, 150)))
            self.next_id += 1
        room = self.s.num_free
        taken = self.s.admit(specs)
        assert taken == min(room, len(specs))
        self.live |= {sp.seq_id for sp in specs[:taken]}

    def op_schedule(self) -> None:
        name = self.rng.choice(NAMES)
        if name in self.frozen:
            return
        w = self.s.workers[name]
        owners = {sid: seq.owner for sid, seq in self.s.seqs.items()}
        lengths = {sid: len(seq.token_ids) for sid, seq in self.s.seqs.items()}
        free = self.rng.choice([None, None, 60, 400])
        grant = ask(self.s, name, self.now, max_seqs=self.rng.randint(1, 8),
                    max_tokens=self.rng.choice([1, 16, 200, 10_000]), free_kv_tokens=free)
        if not w.alive or w.draining:
            assert grant is None
            return
        if grant is None:
            return
        ids = row_ids(grant)
        assert len(ids) == len(set(ids))
        assert len(ids) <= w.max_seqs
        if free is not None:  # new sequences fit the free KV tokens, a block of headroom each
            assert sum(lengths[i] + w.block_size for i in full_ids(grant)) <= free
        assert not set(grant.drop_ids) & set(diff_ids(grant))
        for row in grant.rows:
            if row.length == CONTINUE:  # the next step of a batch this worker is running
                seq = self.s.seqs[row.seq_id]
                assert row.spec is None and seq.next_lease == grant.lease_id
                assert self.s.leases[seq.lease_id].worker == name
                continue
            assert row.length == lengths[row.seq_id]
            # a diff goes only to the worker that holds the KV
            assert (row.spec is None) == (owners[row.seq_id] == name)
            if row.spec is not None:
                assert row.spec.ids.tolist() == self.s.seqs[row.seq_id].token_ids
        shipped = {sid: (owner, dest, tid, n) for owner, sid, dest, tid, n, _, _ in grant.shipments}
        for row in grant.rows:
            if row.length == CONTINUE:
                continue
            if row.seq_id in shipped:
                owner, dest, tid, n = shipped[row.seq_id]
                assert owner == owners[row.seq_id] and owner != name
                assert (dest, n) == (w.kv_endpoint, lengths[row.seq_id] - 1)
                assert (row.spec.kv_from, row.spec.transfer_id) == (f"tcp://{owner}:1", tid)
            elif row.spec is not None:
                assert (row.spec.kv_from, row.spec.transfer_id) == ("", 0)
        self.grants[grant.lease_id] = grant

    def op_report(self) -> None:
        if not self.grants:
            return
        if self.s.config.chain_leases:
            # Chained batches are reported in the order they were given, as one socket delivers them.
            name = self.rng.choice(sorted({g.worker for g in self.grants.values()}))
            lease_id = min(i for i, g in self.grants.items() if g.worker == name)
        else:
            lease_id = self.rng.choice(sorted(self.grants))
        grant = self.grants.pop(lease_id)
        expected = lease_id in self.s.leases
        held = {r.seq_id for r in grant.rows if r.seq_id in self.s.seqs
                and self.s.seqs[r.seq_id].lease_id == lease_id}
        before = {sid: len(seq.token_ids) for sid, seq in self.s.seqs.items()}
        num_stale = self.s.counters["stale_results"]
        queue = list(self.s.queue)
        codes = {r.seq_id: self.rng.choices(
            [Finish.NONE, Finish.NEED_IDS, Finish.EOS, Finish.LENGTH], [88, 6, 3, 3])[0] for r in grant.rows}
        skip = tuple(r.seq_id for r in grant.rows if self.rng.random() < 0.05)
        out = report(self.s, grant, self.now, codes=codes, skip=skip)
        assert out.accepted == expected
        if not expected:
            assert self.s.counters["stale_results"] == num_stale + 1
            assert list(self.s.queue) == queue
            assert {sid: len(seq.token_ids) for sid, seq in self.s.seqs.items()} == before
            return
        finished = {sid for sid, _ in out.finished}
        assert finished == {sid for sid, c in codes.items() if c.is_finished and sid not in skip
                            and sid in held}
        self.live -= finished
        for sid, code in codes.items():
            if code == Finish.NONE and sid not in skip and sid in held:
                assert len(self.s.seqs[sid].token_ids) == before[sid] + 1
            elif sid not in held and sid in self.s.seqs:
                assert len(self.s.seqs[sid].token_ids) == before[sid]  # not its lease: ignored

    def op_tick(self) -> None:
        self.now += self.rng.uniform(0.2, 3.0)
        for name in NAMES:
            if name not in self.frozen:
                self.s.touch(name, self.now)
        for lease_id in self.s.expire(self.now):
            assert lease_id not in self.s.leases

    def op_freeze(self) -> None:
        self.frozen.add(self.rng.choice(NAMES))  # stops talking: will be declared dead

    def op_restart(self) -> None:
        name = self.rng.choice(NAMES)
        if name in self.frozen or not self.s.workers[name].alive:
            self.restart(name)

    def op_drain(self) -> None:
        self.s.drain(self.rng.choice(NAMES))

    def op_retire(self) -> None:
        for name, w in self.s.workers.items():
            if w.alive and w.draining and self.s.is_drained(name):
                self.s.retire(name)

    def op_vram(self) -> None:
        self.s.set_free_vram(f"GPU-{self.rng.choice(NAMES)}", self.rng.uniform(0.0, 0.3))

    OPS = ("admit", "schedule", "report", "tick", "freeze", "restart", "drain", "retire", "vram")
    WEIGHTS = (10, 35, 30, 12, 1, 3, 1, 3, 4)

    def run(self, num_steps: int) -> None:
        for _ in range(num_steps):
            op = self.rng.choices(self.OPS, self.WEIGHTS)[0]
            getattr(self, f"op_{op}")()
            check_invariants(self.s)
            assert set(self.s.seqs) == self.live

    def finish_everything(self) -> None:
        """Bring every worker back and run to completion: nothing was lost on the way."""
        self.now += 100.0
        self.s.expire(self.now)
        for name in NAMES:
            self.restart(name)
        for _ in range(500):
            if not self.live:
                break
            for name in NAMES:
                grant = ask(self.s, name, self.now)
                if grant is not None:
                    out = report(self.s, grant, self.now, codes={r.seq_id: Finish.EOS for r in grant.rows})
                    self.live -= {sid for sid, _ in out.finished}
                check_invariants(self.s)
        assert not self.live and not self.s.seqs and not self.s.queue and not self.s.leases


@pytest.mark.parametrize("seed, config", [
    (1, {}), (10, {}), (3, {"policy": "any"}), (4, {"migration": "transfer"}),
    (5, {"migration": "recompute", "migrate_on_load": False}), (6, {"min_free_vram_fraction": 0.2}),
    (7, {"chain_leases": True}), (8, {"chain_leases": True, "migration": "transfer"}),
    (9, {"chain_leases": True, "migrate_on_load": False}),
    (10, {"chain_leases": True, "max_lease_steps": 4}), (11, {"max_lease_steps": 1}),
    (12, {"spread_new_work": False}), (13, {"spread_new_work": False, "chain_leases": True, "migration": "transfer"}),
])
def test_one_place_at_a_time_under_random_operations(seed, config):
    sim = FleetSim(seed, **config)
    sim.run(400)
    c = sim.s.counters
    assert c["leases"] > 20 and c["finished"] > 0
    assert c["leases_expired"] + c["workers_lost"] + c["stale_results"] > 0
    sim.finish_everything()


def test_the_random_operations_reach_every_event():
    totals = Counter()
    for seed in range(1, 7):
        sim = FleetSim(seed)
        sim.run(400)
        totals += sim.s.counters
    for key in ("leases_expired", "workers_lost", "stale_results", "resends", "migrations_dead",
                "migrations_drain", "migrations_load", "migrations_memory", "migrations_by_transfer"):
        assert totals[key] > 0, key


def test_sequences_of_a_vanished_worker_are_resent_to_the_detokenizer():
    s = dead_fleet()
    give(s, "w0", [1, 2])
    s.admit([spec(3)])
    held = ask(s, "w0", now=1.0)          # sequence 3's first step, leased when w0 vanishes
    assert 3 in row_ids(held)
    s.touch("w1", 7.0)
    s.expire(7.0)
    g = ask(s, "w1", now=7.0)
    assert sorted(full_ids(g)) == [1, 2, 3]
    assert all(r.spec.resend_from == 0 for r in g.rows)  # tokens w0 reported may be unseen
    assert migrations(s)["migrations_dead"] == 3


def test_an_orderly_migration_does_not_resend():
    s = make_sched(rebalance_threshold=2)
    join(s, "w0", max_seqs=2, inflight=4)
    join(s, "w1")
    give(s, "w0", [1, 2, 3, 4])
    g = ask(s, "w1")
    assert full_ids(g) and all(r.spec.resend_from == -1 for r in g.rows)


# --- chained leases ------------------------------------------------------------------------

def chained_fleet(max_seqs: int = 8, **config) -> Scheduler:
    s = make_sched(chain_leases=True, rebalance_threshold=4, **config)
    join(s, "w0", max_seqs=max_seqs)
    give(s, "w0", [1, 2])
    return s


def test_a_chained_lease_continues_the_batch_in_flight():
    s = chained_fleet()
    a = ask(s, "w0")
    assert sorted(diff_ids(a)) == [1, 2] and not s.queue
    c = ask(s, "w0")  # asked while `a` runs: the next step of the same sequences
    assert sorted(row_ids(c)) == [1, 2] and all(r.length == CONTINUE for r in c.rows)
    assert ask(s, "w0") is None  # one step ahead at most
    check_invariants(s)
    lengths = {sid: len(seq.token_ids) for sid, seq in s.seqs.items()}
    assert report(s, a).accepted
    assert not s.queue and all(seq.lease_id == c.lease_id for seq in s.seqs.values())
    check_invariants(s)
    assert report(s, c).accepted
    assert sorted(s.queue) == [1, 2]
    assert {sid: len(seq.token_ids) for sid, seq in s.seqs.items()} == {k: v + 2 for k, v in lengths.items()}
    check_invariants(s)


def test_new_prompts_fill_the_budget_the_chained_rows_leave():
    """A worker asks ahead while a batch of prompts prefills: the chained lease continues
    every row of that batch (a token each), and new prompts take the rest of the budget; they
    never push a running row out of its next step."""
    s = make_sched(chain_leases=True)
    join(s, "w0", max_seqs=64, max_tokens=100)
    s.admit([spec(i, prompt_len=10) for i in range(1, 41)])
    a = ask(s, "w0", max_tokens=100)
    assert len(full_ids(a)) == 10                  # 10 prompts of 10 tokens fill the budget
    c = ask(s, "w0", max_tokens=100)
    chained = [r.seq_id for r in c.rows if r.length == CONTINUE]
    assert sorted(chained) == sorted(full_ids(a))  # every running row goes on
    assert len(full_ids(c)) == 9                   # 90 tokens left for prompts
    check_invariants(s)


def test_no_chain_for_sequences_that_ought_to_move():
    s = chained_fleet(max_seqs=4)
    give(s, "w0", [3, 4, 5, 6])
    join(s, "w1")                       # owns nothing: a gap of 6 >= 4, 2 over w0's batch
    a = ask(s, "w0")
    b = ask(s, "w0")                    # its other 2, as queued rows: nothing chained
    assert all(r.length != CONTINUE for r in b.rows) and s.num_chainable("w0") == 0
    report(s, a), report(s, b)          # every row comes back to the queue
    moved = ask(s, "w1")
    assert len(full_ids(moved)) == 2 and migrations(s)["migrations_load"] == 2
    s.drain("w0")
    assert s.num_chainable("w0") == 0


def test_a_failed_first_step_cancels_the_chain():
    s = chained_fleet()
    a = ask(s, "w0")
    c = ask(s, "w0")
    report(s, a, codes={1: Finish.NEED_IDS})
    assert list(s.queue) == [1] and s.seqs[1].next_lease is None and s.seqs[1].owner is None
    check_invariants(s)
    before = list(s.seqs[1].token_ids)
    report(s, c)                        # its row for 1 is not its to report any more
    assert s.seqs[1].token_ids == before and sorted(s.queue) == [1, 2]
    check_invariants(s)


def test_expiry_takes_back_both_the_lease_and_its_chain():
    s = chained_fleet(lease_timeout_s=5.0)
    a = ask(s, "w0", now=0.0)
    c = ask(s, "w0", now=1.0)
    s.touch("w0", 5.5)
    s.expire(5.5)                       # `a` expired; `c` (deadline 6.0) has nothing left to run
    assert sorted(s.queue) == [1, 2] and all(seq.next_lease is None for seq in s.seqs.values())
    assert all(seq.resync for seq in s.seqs.values())
    check_invariants(s)
    assert not report(s, a, now=5.5).accepted
    report(s, c, now=5.5)
    assert sorted(s.queue) == [1, 2]
    check_invariants(s)


def test_new_sequences_stop_at_the_workers_free_kv_tokens():
    s = make_sched()
    join(s, "w0", kv_tokens=64, block_size=16)
    s.admit([spec(i, prompt_len=10) for i in range(1, 6)])
    g = ask(s, "w0", free_kv_tokens=80)
    assert len(row_ids(g)) == 3          # 26 tokens each (10 ids + a block): three fit in 80
    assert ask(s, "w0", free_kv_tokens=80) is None  # the first three are still prefilling
    report(s, g)
    g2 = ask(s, "w0", free_kv_tokens=32)
    assert sorted(row_ids(g2)) == sorted(row_ids(g)) and not full_ids(g2)  # its own, no new ones
    join(s, "w1", kv_tokens=64, block_size=16)
    assert sorted(row_ids(ask(s, "w1", free_kv_tokens=64))) == [4, 5]


def test_evicted_sequences_lose_their_owner_and_are_recomputed():
    s = make_sched()
    join(s, "w0")
    give(s, "w0", [1, 2])
    s.evicted("w0", [2, 99])             # 99 is unknown: ignored
    assert s.seqs[1].owner == "w0" and s.seqs[2].owner is None
    assert s.counters["evictions"] == 1
    g = ask(s, "w0")
    assert diff_ids(g) == [1] and full_ids(g) == [2]
    check_invariants(s)


def test_a_request_sent_ahead_gets_a_chain_or_a_full_batch_never_a_part():
    s = make_sched()                                   # chaining off: only a full batch will do
    join(s, "w0", max_seqs=4)
    s.admit([spec(i) for i in range(1, 7)])
    first = ask(s, "w0")
    assert len(row_ids(first)) == 4
    assert s.schedule("w0", 4, 1 << 20, 0.0, ahead=True) is None       # 2 queued: half a batch
    assert len(row_ids(ask(s, "w0"))) == 2                              # an ordinary ask takes them
    chained = make_sched(chain_leases=True)
    join(chained, "w0", max_seqs=4)
    chained.admit([spec(i) for i in range(1, 3)])
    ask(chained, "w0")
    g = chained.schedule("w0", 4, 1 << 20, 0.0, ahead=True)
    assert sorted(row_ids(g)) == [1, 2] and all(r.length == CONTINUE for r in g.rows)


def test_heartbeats_renew_the_leases_a_worker_names_and_no_others():
    s = make_sched(lease_timeout_s=5.0)
    join(s, "w0")
    join(s, "w1")
    s.admit([spec(1), spec(2)])
    a = ask(s, "w0", now=0.0, max_seqs=1)
    b = ask(s, "w1", now=0.0, max_seqs=1)
    for t in (2.0, 4.0, 6.0, 8.0):
        s.touch("w0", t)
        s.touch("w1", t)
        s.renew("w0", [a.lease_id, b.lease_id], t)   # w1's lease is not w0's to renew
    assert s.expire(9.0) == [b.lease_id]
    assert a.lease_id in s.leases and report(s, a, now=9.0).accepted
    check_invariants(s)


# --- multi-step leases and revokes -------------------------------------------------------

def revoked(s: Scheduler) -> dict[int, list[int]]:
    """lease id -> rows named, for the revokes the router would send now (checked)."""
    out = {}
    for worker, lease_id, seq_ids in s.take_revokes():
        assert s.leases[lease_id].worker == worker and s.leases[lease_id].is_revoked
        assert set(seq_ids) <= set(s.leases[lease_id].seq_ids)
        out[lease_id] = seq_ids
    return out


def steady(s: Scheduler, name: str, seq_ids: list[int]) -> Grant:
    """Give seq_ids to name and return its next lease: decodes only, nothing queued."""
    give(s, name, seq_ids)
    grant = ask(s, name)
    assert sorted(diff_ids(grant)) == sorted(seq_ids) and not s.queue
    return grant


def test_a_lease_covers_several_steps_only_while_nothing_waits():
    s = make_sched(max_lease_steps=6)
    join(s, "w0")
    s.admit([spec(1), spec(2, max_new_tokens=8)])
    first = ask(s, "w0")
    assert first.num_steps == 6  # new prompts: their first tokens stream after the first step
    report(s, first)
    grant = ask(s, "w0")
    assert grant.num_steps == 6 and not revoked(s)
    # every row may come back with up to six tokens
    out = s.complete(grant.lease_id, "w0", [1, 2], [6, 3], [TOKEN] * 9, [0, 0], 0.0)
    assert out.accepted and [len(s.seqs[i].token_ids) for i in (1, 2)] == [4 + 1 + 6, 4 + 1 + 3]
    # Queued behind a full batch: the lease ends when its first row can end (seq 2 has 4
    # tokens to go), when a place frees for the waiting one.
    s.workers["w0"].max_seqs = 2
    s.admit([spec(3)])
    behind = ask(s, "w0")
    assert sorted(row_ids(behind)) == [1, 2] and behind.num_steps == 4
    report(s, behind)
    # A prompt that does not fit this lease's token budget keeps the lease to one step.
    s.workers["w0"].max_seqs = 8
    assert ask(s, "w0", max_tokens=2).num_steps == 1
    check_invariants(s)


def test_a_full_form_carries_every_token_so_far():
    s = make_sched()
    join(s, "w0"), join(s, "w1")
    s.admit([spec(1, prompt_len=6)])
    first = ask(s, "w0")
    assert first.rows[0].spec.token_ids == spec(1, prompt_len=6).token_ids   # not run yet: as it came
    report(s, first)
    s.drain("w0")
    moved = ask(s, "w1").rows[0].spec
    assert moved.ids.tolist() == s.seqs[1].token_ids and len(moved.ids) == 7   # the prompt and its token


def test_a_lease_that_moves_a_sequence_covers_one_step():
    s = make_sched(max_lease_steps=6)
    join(s, "w0"), join(s, "w1")
    give(s, "w0", [1, 2])
    s.drain("w0")
    moved = ask(s, "w1")
    assert sorted(full_ids(moved)) == [1, 2] and moved.num_steps == 1
    report(s, moved)
    assert ask(s, "w1").num_steps == 6   # its own now: decodes that nothing waits to join
    check_invariants(s)


@pytest.mark.parametrize("config", [{"max_lease_steps": 1}, {"policy": "any"}])
def test_single_step_leases_when_configured_or_when_any_step_may_move(config):
    s = make_sched(**config)
    join(s, "w0")
    assert steady(s, "w0", [1, 2]).num_steps == 1


def test_new_requests_end_a_multi_step_lease_of_a_worker_with_room():
    s = make_sched(max_lease_steps=8)
    join(s, "w0")
    grant = steady(s, "w0", [1, 2])
    assert grant.num_steps == 8
    s.admit([spec(3)])
    assert revoked(s) == {grant.lease_id: []}
    s.admit([spec(4)])  # already ending: no second revoke
    assert revoked(s) == {}
    report(s, grant)  # the worker stopped after one step
    nxt = ask(s, "w0")
    assert sorted(row_ids(nxt)) == [1, 2, 3, 4] and sorted(full_ids(nxt)) == [3, 4]
    check_invariants(s)


def test_a_chain_withdrawn_unstarted_gives_its_rows_to_the_lease_that_admits_new_work():
    # a multi-step lease, its chain granted ahead; a new request revokes both, the worker
    # answers the chain at once with no token, and its next request gets the new prompt with
    # the next step of the running rows (chained), so the prompt starts behind that step
    s = chained_fleet(max_lease_steps=8)
    running = ask(s, "w0")
    chain = s.schedule("w0", 64, 1 << 20, 0.0, ahead=True)
    assert running.num_steps == 8 and chain.num_steps == 8 and all(r.length == CONTINUE for r in chain.rows)
    s.admit([spec(3)])
    assert revoked(s) == {running.lease_id: [], chain.lease_id: []}
    lengths = {sid: len(s.seqs[sid].token_ids) for sid in (1, 2)}
    unrun = s.complete(chain.lease_id, "w0", [1, 2], [0, 0], [], [0, 0], 0.0)
    assert unrun.accepted and chain.lease_id not in s.leases
    assert all(s.seqs[sid].next_lease is None and s.seqs[sid].lease_id == running.lease_id for sid in (1, 2))
    check_invariants(s)
    joined = s.schedule("w0", 64, 1 << 20, 0.0, ahead=True)
    assert full_ids(joined) == [3] and sorted(r.seq_id for r in joined.rows if r.length == CONTINUE) == [1, 2]
    assert joined.num_steps == 8
    check_invariants(s)
    assert report(s, running).accepted   # the revoked lease ends: its rows go on in `joined`
    assert all(s.seqs[sid].lease_id == joined.lease_id for sid in (1, 2)) and not s.queue
    assert report(s, joined).accepted
    assert {sid: len(s.seqs[sid].token_ids) for sid in (1, 2)} == {k: v + 2 for k, v in lengths.items()}
    assert len(s.seqs[3].token_ids) == 5
    check_invariants(s)


def test_a_chain_withdrawn_after_the_step_before_it_ended_puts_its_rows_back():
    s = chained_fleet(max_lease_steps=8)
    running = ask(s, "w0")
    chain = s.schedule("w0", 64, 1 << 20, 0.0, ahead=True)
    assert report(s, running).accepted
    assert all(s.seqs[sid].lease_id == chain.lease_id for sid in (1, 2))
    s.admit([spec(3)])
    assert s.complete(chain.lease_id, "w0", [1, 2], [0, 0], [], [0, 0], 0.0).accepted
    assert sorted(s.queue) == [1, 2, 3] and all(s.seqs[sid].owner == "w0" for sid in (1, 2))
    nxt = ask(s, "w0")
    assert sorted(diff_ids(nxt)) == [1, 2] and full_ids(nxt) == [3]
    check_invariants(s)


def test_a_full_worker_keeps_its_multi_step_lease_when_requests_arrive():
    s = make_sched(max_lease_steps=8)
    join(s, "w0", max_seqs=2)
    grant = steady(s, "w0", [1, 2])
    s.admit([spec(3)])
    assert revoked(s) == {} and grant.lease_id in s.leases


def test_drain_and_memory_pressure_end_multi_step_leases():
    s = make_sched(max_lease_steps=8, migrate_on_load=False)
    join(s, "w0", gpu_uuid="GPU-0"), join(s, "w1", gpu_uuid="GPU-1")
    g0 = steady(s, "w0", [1, 2])
    g1 = steady(s, "w1", [3, 4])
    assert revoked(s) == {g0.lease_id: []}  # w1's requests arrived while w0 had room
    g0 = ask(s, "w0") if report(s, g0).accepted else None
    s.set_free_vram("GPU-1", 0.5)
    assert revoked(s) == {} and g0.num_steps == 8
    s.set_free_vram("GPU-1", 0.01)
    assert revoked(s) == {g1.lease_id: []}
    s.set_free_vram("GPU-1", 0.01)  # still short: nothing new to end
    assert revoked(s) == {}
    assert s.drain("w0")
    assert revoked(s) == {g0.lease_id: []}
    report(s, g0)
    report(s, g1)
    assert ask(s, "w0") is None  # draining
    join(s, "w2")
    taken = ask(s, "w2")
    assert sorted(row_ids(taken)) == [1, 2, 3, 4]
    assert migrations(s) == {"migrations_drain": 2, "migrations_memory": 2, "migrations_by_recompute": 4}
    check_invariants(s)


def test_an_idle_worker_gets_rows_revoked_from_a_busy_one():
    s = make_sched(max_lease_steps=8, rebalance_threshold=4)
    join(s, "w0", max_seqs=8)
    give(s, "w0", list(range(1, 13)))  # prefills: 8 + 4
    a, b = ask(s, "w0"), ask(s, "w0")  # more than a batch: two multi-step leases take turns
    assert (len(a.rows), len(b.rows), a.num_steps, b.num_steps) == (8, 4, 8, 8)
    join(s, "w1", max_seqs=8)  # joins while w0 runs them
    assert ask(s, "w1", now=2.0) is None  # nothing queued for it...
    ends = revoked(s)  # ...so w0's excess over one batch (4) comes back at its next step
    moving = {sid for ids in ends.values() for sid in ids}
    assert len(moving) == 4
    assert set(ends) == {i for i, lease in s.leases.items() if moving & set(lease.seq_ids)} == {b.lease_id}
    report(s, b)  # the revoked lease ends after one step; `a` runs on
    taken = ask(s, "w1", now=2.5)
    assert set(full_ids(taken)) == moving
    assert migrations(s)["migrations_load"] == 4
    assert list(s.move_delays) == [("load", 0.5)] * 4  # from the revoke to the new worker's lease
    check_invariants(s)


def test_the_queue_keeps_the_routers_order_across_owners():
    s = make_sched(max_lease_steps=1)
    join(s, "w0"), join(s, "w1")
    give(s, "w0", [1, 2])
    give(s, "w1", [3])
    s.admit([spec(4)])
    assert list(s.queue) == [1, 2, 3, 4]
    grant = ask(s, "w0")
    report(s, grant, codes={1: Finish.NEED_IDS})  # a resend goes to the front
    assert list(s.queue) == [1, 3, 2, 4] or list(s.queue)[0] == 1
    assert 1 in s.queue and 5 not in s.queue and len(s.queue) == 4
    check_invariants(s)


def test_the_delay_from_a_decision_to_move_to_the_new_workers_lease_is_recorded():
    s = make_sched(max_lease_steps=8, migrate_on_load=False, heartbeat_timeout_s=5.0)
    join(s, "w0", gpu_uuid="GPU-0"), join(s, "w1", gpu_uuid="GPU-1"), join(s, "w2")
    give(s, "w0", [1])
    give(s, "w1", [2])
    s.drain("w0", now=10.0)
    assert row_ids(ask(s, "w2", now=10.25)) == [1]
    s.set_free_vram("GPU-1", 0.01, now=11.0)
    assert row_ids(ask(s, "w2", now=11.5)) == [2]
    assert list(s.move_delays) == [("drain", 0.25), ("memory", 0.5)]
    s.set_free_vram("GPU-1", 0.5, now=11.5)  # memory back: w1 takes new prefills again
    give(s, "w1", [3], now=11.5)
    for name in ("w0", "w2"):
        s.touch(name, 20.0)
    s.expire(20.0)  # w1 silent since 11.5: found dead at 20.0
    assert row_ids(ask(s, "w2", now=20.125)) == [3]
    assert list(s.move_delays)[-1] == ("dead", 0.125)


def test_a_drained_workers_sequences_go_before_the_takers_own_queue():
    """With every place full, sequences of a draining worker would otherwise wait behind the
    other workers' own queued work for as long as there is any: the drain would never end."""
    s = make_sched(max_lease_steps=1, migration="recompute")
    join(s, "w0"), join(s, "w1")
    give(s, "w0", [1, 2])
    give(s, "w1", [3, 4])
    s.drain("w0", now=1.0)
    g = ask(s, "w1", now=1.5, max_seqs=2)
    assert sorted(row_ids(g)) == [1, 2] and sorted(full_ids(g)) == [1, 2]  # w1's own 3, 4 wait a step
    assert migrations(s) == {"migrations_drain": 2, "migrations_by_recompute": 2}
    report(s, g, now=1.5)
    assert s.is_drained("w0")
    assert sorted(row_ids(ask(s, "w1", now=2.0, max_seqs=4))) == [1, 2, 3, 4]
    check_invariants(s)


def test_a_memory_short_taker_keeps_its_own_work_first():
    """A worker that may take no new prefill takes nothing new, drained or not: its own
    sequences still run."""
    s = make_sched(max_lease_steps=1, migration="recompute")
    join(s, "w0", gpu_uuid="GPU-0"), join(s, "w1", gpu_uuid="GPU-1")
    give(s, "w0", [1])
    give(s, "w1", [2])
    s.drain("w0", now=1.0)
    s.set_free_vram("GPU-1", 0.02, now=1.0)  # below the admission watermark only
    assert not s.workers["w1"].may_prefill
    assert row_ids(ask(s, "w1", now=1.5)) == [2]
