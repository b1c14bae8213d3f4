"""The router's policy as pure bookkeeping: leasing, results, expiry, dead workers, drains
and admission. Migration, random operations and chained or multi-step leases have files of
their own (test_scheduler_*.py).

Times are plain floats; nothing here sleeps.
"""

from __future__ import annotations

from qmigrate.wire.protocol import Finish, SeqSpec
from scheduler_util import (
    TOKEN, ask, check_invariants, dead_fleet, diff_ids, full_ids, give, join, make_sched,
    migrations, report, row_ids, spec,
)


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
