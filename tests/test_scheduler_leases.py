"""Chained leases, multi-step leases and revokes.

Times are plain floats; nothing here sleeps.
"""

from __future__ import annotations

import pytest

from qmigrate.router.scheduler import Grant, Scheduler
from qmigrate.wire.protocol import CONTINUE, Finish
from scheduler_util import (
    TOKEN, ask, check_invariants, diff_ids, full_ids, give, join, make_sched, migrations, report,
    row_ids, spec,
)


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


def test_a_chain_its_worker_answers_unrun_is_not_offered_again_on_the_same_step():
    """A worker that no longer holds the step a chain follows (it dropped that lease) answers
    the chain at once, unrun. Offered the same chain again, it would answer again, as fast as
    the two can talk, until the router took the step's lease back; those rows are chained
    again only on their next step."""
    s = chained_fleet()
    running = ask(s, "w0")
    chain = s.schedule("w0", 64, 1 << 20, 0.0, ahead=True)
    assert all(r.length == CONTINUE for r in chain.rows)
    assert s.complete(chain.lease_id, "w0", [1, 2], [0, 0], [], [int(Finish.NEED_IDS)] * 2, 0.0).accepted
    assert s.schedule("w0", 64, 1 << 20, 0.0, ahead=True) is None
    check_invariants(s)
    assert report(s, running).accepted
    nxt = ask(s, "w0")
    assert sorted(diff_ids(nxt)) == [1, 2]
    again = s.schedule("w0", 64, 1 << 20, 0.0, ahead=True)   # the next step chains as before
    assert sorted(row_ids(again)) == [1, 2] and all(r.length == CONTINUE for r in again.rows)
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
