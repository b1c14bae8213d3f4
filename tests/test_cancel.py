"""Scheduler.cancel through the public Scheduler API only: admit, schedule, complete, cancel.

A cancelled sequence never comes back in a lease, its late result is ignored, and every
worker that holds or computes its KV is told to free it (the next lease's drop_ids)."""

from __future__ import annotations

from qmigrate.wire.protocol import Finish, SeqSpec, pack_i32
from qmigrate.config import RouterConfig
from qmigrate.router.scheduler import Scheduler, WorkerState

TOKEN = 77


def spec(seq_id: int) -> SeqSpec:
    return SeqSpec(seq_id, pack_i32([1, 5, 6, 7]), 4, 64, eos_ids=[2])


def make(**config) -> Scheduler:
    config.setdefault("chain_leases", False)
    s = Scheduler(RouterConfig(heartbeat_timeout_s=1e9, **config))
    s.register(WorkerState("w0", max_seqs=8, max_tokens=4096), 0.0)
    return s


def lease(s: Scheduler, ahead: bool = False):
    return s.schedule("w0", 64, 1 << 20, 0.0, ahead=ahead)


def finish(s: Scheduler, grant, code: Finish = Finish.NONE):
    ids = [r.seq_id for r in grant.rows]
    return s.complete(grant.lease_id, "w0", ids, [1] * len(ids), [TOKEN] * len(ids),
                      [int(code)] * len(ids), 0.0)


def test_a_queued_sequence_is_dropped_and_its_room_given_back():
    s = make(max_queued=3)
    assert s.admit([spec(1), spec(2), spec(3)]) == 3
    assert s.admit([spec(4)]) == 0
    assert s.cancel([2]) == 1
    assert s.admit([spec(4)]) == 1
    grant = lease(s)
    assert [r.seq_id for r in grant.rows] == [1, 3, 4]
    assert grant.drop_ids == []  # nobody held its KV
    assert s.counters["cancelled"] == 1


def test_a_leased_sequence_is_forgotten_and_its_result_ignored():
    s = make()
    s.admit([spec(1), spec(2)])
    first = lease(s)
    assert s.cancel([1]) == 1
    outcome = finish(s, first, Finish.EOS)
    assert outcome.accepted and [sid for sid, _ in outcome.finished] == [2]
    s.admit([spec(3)])
    grant = lease(s)
    assert [r.seq_id for r in grant.rows] == [3]
    assert grant.drop_ids == [1]  # w0 ran a step of it: its KV is freed with this lease


def test_a_sequence_whose_kv_a_worker_holds_is_freed_there():
    s = make()
    s.admit([spec(1), spec(2)])
    finish(s, lease(s))  # w0 now owns both sequences' KV; both are queued again
    assert s.cancel([1]) == 1
    grant = lease(s)
    assert [r.seq_id for r in grant.rows] == [2]
    assert grant.drop_ids == [1]


def test_a_chained_step_of_a_cancelled_sequence_comes_to_nothing():
    s = make(chain_leases=True)
    s.admit([spec(1), spec(2)])
    first = lease(s)
    finish(s, first)
    second = lease(s)
    chained = lease(s, ahead=True)  # the step after `second`, chained to it
    assert chained is not None and {r.seq_id for r in chained.rows} == {1, 2}
    assert s.cancel([1]) == 1
    assert finish(s, second).accepted
    outcome = finish(s, chained, Finish.LENGTH)
    assert [sid for sid, _ in outcome.finished] == [2]
    s.admit([spec(3)])
    grant = lease(s)
    assert [r.seq_id for r in grant.rows] == [3]
    assert grant.drop_ids == [1]


def test_unknown_finished_and_repeated_ids_count_nothing():
    s = make()
    s.admit([spec(1)])
    finish(s, lease(s), Finish.EOS)
    assert s.cancel([1, 99]) == 0
    s.admit([spec(2)])
    assert s.cancel([2, 2]) == 1
    assert s.cancel([2]) == 0
    assert lease(s) is None
    assert s.counters["cancelled"] == 1


def test_cancel_and_replies_are_checked_at_decode():
    import msgpack
    import pytest
    from qmigrate.wire import protocol as P
    from qmigrate.wire import codec

    def wire(msg_type, *fields):
        return msgpack.packb([int(msg_type), *fields], use_bin_type=True)

    assert codec.decode(codec.encode(P.Cancel(P.pack_i64([5])))) == P.Cancel(P.pack_i64([5]))
    bad = [
        wire(P.MsgType.CANCEL, b"\x01\x02\x03"),                                    # not int64s
        wire(P.MsgType.REPLIES, P.pack_i64([1, 2]), P.pack_u8([0]), P.pack_i32([1]), ["a"]),  # lengths differ
        wire(P.MsgType.REPLIES, P.pack_i64([1]), P.pack_u8([7]), P.pack_i32([1]), ["a"]),     # unknown finish
        wire(P.MsgType.REPLIES, P.pack_i64([1]), P.pack_u8([0]), P.pack_i32([-1]), ["a"]),    # negative count
        wire(P.MsgType.REQUEST_META, 1, "r", P.pack_i32([1]), 9),                   # unknown route
    ]
    for data in bad:
        with pytest.raises(P.ProtocolError):
            codec.decode(data)
