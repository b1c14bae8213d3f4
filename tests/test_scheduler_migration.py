"""The router's moves for load and memory, and the choice between KV transfer and recompute.

Times are plain floats; nothing here sleeps.
"""

from __future__ import annotations

import pytest

from qmigrate.router.records import Seq
from qmigrate.router.scheduler import Scheduler, choose_mechanism
from scheduler_util import (
    ask, check_invariants, full_ids, give, join, make_sched, migrations, report, row_ids, spec,
)


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


def test_a_move_is_costed_at_the_prefill_rate_its_destination_measured():
    """A 4,000-token sequence of TinyLlama's shape: at the prefill_tflops setting (100 TFLOP/s)
    recomputing it takes 88 ms, shipping its KV over 10 Gb/s 73 ms; a destination that timed
    100,000 prompt tokens a second at its start recomputes it in 40 ms."""
    s = transfer_fleet(migration="auto")
    owner, dest = s.workers["w0"], s.workers["w1"]
    seq = Seq(spec(1, 4000), list(range(4001)), owner="w0")
    assert s.moves.mechanism(seq, dest, 0.0) == "transfer"
    dest.prefill_tokens_per_s = 100_000
    assert s.moves.mechanism(seq, dest, 0.0) == "recompute"
    owner.prefill_tokens_per_s, dest.prefill_tokens_per_s = 100_000, 0   # the owner's rate is not the cost
    assert s.moves.mechanism(seq, dest, 0.0) == "transfer"


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


def test_choose_mechanism_counts_what_each_end_already_has_to_do():
    """1,000 tokens: 19 ms over a free 10 Gbit/s link against 22 ms of prefill, so transfer;
    behind 5 ms of shipments already on the link, recompute; behind 5 ms of recomputes on
    the taker as well, transfer again."""
    args = (1000, LLAMA_KV, LLAMA_PARAMS, 10.0, 100.0)
    assert choose_mechanism(*args) == "transfer"
    assert choose_mechanism(*args, link_wait_s=5e-3) == "recompute"
    assert choose_mechanism(*args, link_wait_s=5e-3, prefill_wait_s=5e-3) == "transfer"


def test_a_drain_of_many_sequences_splits_them_between_the_link_and_recompute():
    """Twenty sequences of 1,000 tokens leave a draining worker at once. Each alone would go
    by transfer (19 ms against 22), but the owner's one link ships them in turn: all twenty
    by transfer would keep the last waiting 380 ms. The router counts what it has put on the
    link and on the taker's prefill, so about half go each way and both are done near the
    same time, in about half of that. Once the link's work is done, a move ships again."""
    s = make_sched(link_gbps=10.0, prefill_tflops=100.0)
    for name in ("w0", "w1"):
        join(s, name, max_seqs=32, max_tokens=1 << 16, kv_endpoint=f"tcp://{name}:5601", gpu_uuid=f"GPU-{name}",
             kv_bytes_per_token=LLAMA_KV, num_params=LLAMA_PARAMS)
    give(s, "w0", list(range(1, 21)), prompt_len=1000)
    s.drain("w0")
    g = ask(s, "w1", now=10.0, max_seqs=64)
    assert sorted(row_ids(g)) == list(range(1, 21))
    shipped = {t[1] for t in g.shipments}
    assert 8 <= len(shipped) <= 12, len(shipped)
    assert all((r.spec.kv_from != "") == (r.seq_id in shipped) for r in g.rows)
    w0, w1 = s.workers["w0"], s.workers["w1"]
    link_s, prefill_s = w0.link_free_at - 10.0, w1.recompute_free_at - 10.0
    assert 0.15 < link_s < 0.25 and 0.15 < prefill_s < 0.25, (link_s, prefill_s)
    assert abs(link_s - prefill_s) <= 0.022
    assert migrations(s) == {"migrations_drain": 20, "migrations_by_transfer": len(shipped),
                             "migrations_by_recompute": 20 - len(shipped)}
    check_invariants(s)
    # later, the link idle again: a sequence moved alone goes by transfer
    report(s, g, now=10.5)
    s.drain("w1")
    join(s, "w2", now=11.0, kv_endpoint="tcp://w2:5601", gpu_uuid="GPU-w2",
         kv_bytes_per_token=LLAMA_KV, num_params=LLAMA_PARAMS)
    g2 = ask(s, "w2", now=11.0, max_seqs=1)
    assert len(g2.rows) == 1 and len(g2.shipments) == 1


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
