"""Moves for KV pressure (cause "kv"): a worker whose free KV would last its sequences only a
few more tokens each gives its cheapest ones to a worker with room, before it has to evict.

Times are plain floats; nothing here sleeps. The fleet model at the end grows every sequence
a token a step and reports each worker's free KV as a worker would.
"""

from __future__ import annotations

from collections import Counter

import pytest

from scheduler_util import ask, check_invariants, join, make_sched, migrations, report, row_ids, spec

T = 32   # kv_pressure_steps


def fleet(**config):
    s = make_sched(rebalance_threshold=1000, kv_pressure_steps=T, **config)
    for name in ("w0", "w1"):
        join(s, name, max_seqs=16, kv_tokens=2048, block_size=16)
    return s


def place(s, name: str, lengths: dict[int, int], free: int) -> None:
    """Admit sequences of these prompt lengths, run a step of each on `name`, which then
    reports `free` KV tokens with its next request (and takes its own back for a step)."""
    s.admit([spec(sid, n) for sid, n in lengths.items()])
    grants = []
    while (g := ask(s, name)) is not None:
        grants.append(g)
    for g in grants:
        report(s, g)
    g = ask(s, name, free_kv_tokens=free)
    assert sorted(row_ids(g)) == sorted(lengths)
    report(s, g)


LENGTHS = {1: 300, 2: 40, 3: 260, 4: 20, 5: 280, 6: 200, 7: 240, 8: 260}


def test_a_kv_short_owner_gives_its_shortest_sequences_to_a_worker_with_room():
    s = fleet()
    place(s, "w0", LENGTHS, free=64)              # 8 tokens of growth a sequence: short
    g = ask(s, "w1", free_kv_tokens=2000)
    moved = row_ids(g)
    assert moved and set(moved) <= {2, 4, 6}      # the cheapest first
    assert moved[:2] == [4, 2]
    assert migrations(s) == {"migrations_kv": len(moved), "migrations_by_recompute": len(moved)}
    assert all(r.spec is not None for r in g.rows)    # the whole sequence goes: a recompute here
    assert set(moved) <= set(s.workers["w0"].pending_drops)
    check_invariants(s)


@pytest.mark.parametrize("owner_free, taker_free", [(400, 2000), (64, 300), (64, None)])
def test_nothing_moves_without_pressure_or_without_a_taker_that_keeps_room(owner_free, taker_free):
    """400 free over 8 sequences is 50 tokens each (above T); a taker left with less than
    2T a sequence, or one that has not reported its pool, takes nothing."""
    s = fleet()
    place(s, "w0", LENGTHS, free=owner_free)
    assert ask(s, "w1", free_kv_tokens=taker_free) is None
    assert not migrations(s)


def test_pressure_moves_only_what_brings_the_owner_back_above_twice_the_mark():
    s = fleet()
    place(s, "w0", {i: 100 for i in range(1, 9)}, free=200)     # 25 a sequence: short
    moved = row_ids(ask(s, "w1", free_kv_tokens=2000))
    # 8 x 2T = 512 wanted free; each move frees ~231 (the mean) and takes 2T with it
    assert len(moved) == 2
    w0 = s.workers["w0"]
    assert w0.kv_released == sum(len(s.seqs[i].token_ids) for i in moved)
    # counted free now: (200 + 2 x 101) / 6 = 67 a sequence: no longer short
    assert not s.moves.is_kv_short(w0)
    assert ask(s, "w1", free_kv_tokens=2000) is None


def test_pinned_never_moves_for_kv_and_any_still_moves_everything_as_any():
    s = fleet(policy="pinned")
    place(s, "w0", LENGTHS, free=64)
    assert ask(s, "w1", free_kv_tokens=2000) is None
    s = fleet(policy="any")
    place(s, "w0", LENGTHS, free=64)
    g = ask(s, "w1", free_kv_tokens=2000)
    assert sorted(row_ids(g)) == sorted(LENGTHS)
    assert migrations(s) == {"migrations_any": 8, "migrations_by_recompute": 8}


def test_kv_moves_can_be_switched_off_alone():
    s = fleet(migrate_on_kv=False)
    place(s, "w0", LENGTHS, free=64)
    assert ask(s, "w1", free_kv_tokens=2000) is None


def test_a_kv_short_owner_runs_one_step_leases_while_a_taker_has_room():
    s = fleet(max_lease_steps=16)
    place(s, "w0", LENGTHS, free=1500)
    g = ask(s, "w0", free_kv_tokens=1500)
    assert g.num_steps > 1     # not short: its batch runs on
    report(s, g)
    s.workers["w1"].free_kv_tokens = 2000    # as w1 reported when it last asked
    g = ask(s, "w0", free_kv_tokens=64)
    assert g.num_steps == 1    # short: its sequences come back every step, for w1 to take
    check_invariants(s)


def test_a_moved_sequence_does_not_come_back_within_the_cooldown():
    s = fleet(move_cooldown_s=2.0)
    place(s, "w0", {i: 100 for i in range(1, 9)}, free=200)
    moved = row_ids(g := ask(s, "w1", 0.0, free_kv_tokens=2000))
    report(s, g)
    g = ask(s, "w1", 0.0, free_kv_tokens=20)            # w1 short now (10 a sequence), w0 with room
    report(s, g)
    g = ask(s, "w0", 1.0, free_kv_tokens=2000)
    assert not set(row_ids(g)) & set(moved)
    g2 = ask(s, "w1", 1.0, free_kv_tokens=20)
    report(s, g2)
    if g is not None:
        report(s, g)
    g = ask(s, "w0", 2.5, free_kv_tokens=2000)          # past the cooldown they may
    assert set(row_ids(g)) & set(moved)
    assert migrations(s)["migrations_kv"] == len(moved) + len(set(row_ids(g)) & set(moved))


def run_fleet(policy: str, steps: int = 70, pool: int = 1024, n: int = 16, prompt: int = 40):
    """n sequences start on w0; each step every sequence grows a token, and each worker asks
    for work reporting its pool less what its sequences hold. Returns (the least free KV
    each worker had, moves per sequence)."""
    s = make_sched(policy=policy, rebalance_threshold=1000, kv_pressure_steps=16, max_lease_steps=1)
    for name in ("w0", "w1"):
        join(s, name, max_seqs=32, kv_tokens=pool, block_size=16)
    s.admit([spec(i, prompt, max_new_tokens=10_000) for i in range(1, n + 1)])
    report(s, ask(s, "w0", free_kv_tokens=pool))
    least, moves = {"w0": pool, "w1": pool}, Counter()
    for step in range(steps):
        now = step * 0.01
        for name in ("w0", "w1"):
            free = pool - sum(len(s.seqs[i].token_ids) for i in s.workers[name].owned)
            least[name] = min(least[name], free)
            g = ask(s, name, now, free_kv_tokens=free)
            if g is not None:
                moves.update(r.seq_id for r in g.rows if r.spec is not None)
                report(s, g, now)
        check_invariants(s)
    return least, moves, s


def test_a_growing_fleet_moves_before_a_pool_overflows_and_never_back_and_forth():
    """16 sequences of 40 tokens grow to 111: one pool of 1,024 overflows at step 25, the
    two together never. Pinned runs w0 out of KV (a worker would evict); the default moves
    some to w1 in time, each at most once, and neither pool runs out."""
    least, moves, _ = run_fleet("pinned")
    assert least["w0"] < 0 and least["w1"] == 1024
    least, moves, s = run_fleet("affinity")
    assert moves and max(moves.values()) == 1
    assert min(least.values()) >= 0, least
    assert s.counters["migrations_kv"] == len(moves)
    assert not s.counters["migrations_load"]


def test_a_kv_short_owners_multi_step_lease_gives_back_its_shortest_rows():
    """w0 runs its sequences in a multi-step lease when it falls short: w1, with nothing
    queued to take, has that lease revoked for the shortest of them."""
    s = fleet(max_lease_steps=16)
    s.admit([spec(sid, n) for sid, n in LENGTHS.items()])
    g = ask(s, "w0")
    report(s, g)
    g = ask(s, "w0", free_kv_tokens=1500)
    assert g.num_steps > 1
    s.workers["w0"].free_kv_tokens = 64       # as it reports with its next request, ahead
    assert ask(s, "w1", free_kv_tokens=2000) is None    # nothing queued: it waits for the revoke
    (worker, lease_id, rows), = s.take_revokes()
    assert (worker, lease_id) == ("w0", g.lease_id) and rows and set(rows) <= {2, 4, 6}


def test_a_kv_short_worker_leaves_new_work_to_a_worker_with_room():
    own = {1: 300, 2: 40}
    for free, takes_new in ((40, False), (1500, True)):    # 20 a sequence: short; 750: not
        s = fleet()
        place(s, "w0", own, free=1500)
        s.config.spread_new_work = True        # new work from now on is shared
        s.workers["w1"].free_kv_tokens = 2000   # as w1 last reported
        s.admit([spec(sid) for sid in (21, 22, 23)])
        g = ask(s, "w0", free_kv_tokens=free)
        assert set(own) & set(row_ids(g))       # its own (short, it may leave some to w1)
        assert bool({21, 22, 23} & set(row_ids(g))) == takes_new, free


def test_a_kv_short_owner_leaves_its_shortest_queued_sequences_for_a_taker():
    s = fleet()
    place(s, "w0", LENGTHS, free=1500)
    s.workers["w1"].free_kv_tokens = 2000     # as w1 last reported
    g = ask(s, "w0", free_kv_tokens=64)
    left = set(LENGTHS) - set(row_ids(g))
    assert left and left <= {2, 4, 6} and 4 in left
    s.workers["w1"].free_kv_tokens = 100      # no taker with room: it runs them all
    report(s, g)
    g = ask(s, "w0", free_kv_tokens=64)
    assert sorted(row_ids(g)) == sorted(LENGTHS)


def test_a_kv_short_owner_runs_what_it_took_within_the_cooldown():
    """Sequences that just moved to a worker are not left in the queue when it falls short:
    nobody may take them, and they would stall."""
    s = fleet(move_cooldown_s=2.0)
    place(s, "w0", {i: 100 for i in range(1, 9)}, free=200)
    g = ask(s, "w1", 0.0, free_kv_tokens=2000)
    moved = set(row_ids(g))
    report(s, g)
    s.workers["w0"].free_kv_tokens = 2000
    g = ask(s, "w1", 1.0, free_kv_tokens=20)      # short, with a taker that has room
    assert set(row_ids(g)) == moved
    report(s, g, 1.0)
    g = ask(s, "w1", 3.0, free_kv_tokens=20)      # past it, the shortest wait for w0 again
    assert moved - set(row_ids(g))
