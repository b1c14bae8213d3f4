"""The pure part of ingest's HTTP hand-off: sequence ids of HTTP front processes, routing the
detokenizer's rows to them, and a cancel that never overtakes its request."""

from __future__ import annotations

import numpy as np

from qmigrate.ingest.handoff import (FRONT_ID_BITS, HTTP_BIT, THREAD_ID_BITS, HandoffOrder, front_base,
                                     front_index, split_by_front)
from qmigrate.wire import protocol as P
from qmigrate.wire import codec

BASE = 0x2A5 << 40   # ingest's random high part


def test_a_fronts_ids_carry_its_index_under_ingests_part_and_never_look_like_stdins():
    ids = [front_base(BASE, k) | n for k in (0, 1, 127) for n in (0, 1, (1 << FRONT_ID_BITS) - 1)]
    assert front_index(np.array(ids)).tolist() == [0] * 3 + [1] * 3 + [127] * 3
    assert all(i >> 40 == BASE >> 40 and i & HTTP_BIT for i in ids)
    stdin_ids = np.array([BASE | 1, BASE | (1 << 39) - 1])
    assert front_index(stdin_ids).tolist() == [-1, -1]


def replies(seq_ids, texts, finish=None, cached=True):
    n = len(seq_ids)
    return P.Replies(P.pack_i64(seq_ids), P.pack_u8(finish or [0] * n), P.pack_i32(range(1, n + 1)), texts,
                     P.pack_i32(range(10, 10 + n)) if cached else b"")


def test_rows_of_one_front_go_as_they_came_and_mixed_rows_are_split_per_front():
    a, b = front_base(BASE, 0), front_base(BASE, 5)
    assert split_by_front(replies([a | 1, a | 2], ["x", "y"])) == {0: None}
    assert split_by_front(replies([BASE | 3], ["stdin"])) == {}
    assert split_by_front(replies([], [])) == {}
    msg = replies([a | 1, BASE | 9, b | 4, a | 2], ["x", "s", "y", "z"], finish=[0, 1, 2, 0])
    parts = split_by_front(msg)
    assert sorted(parts) == [0, 5]
    assert parts[0] == P.Replies(P.pack_i64([a | 1, a | 2]), P.pack_u8([0, 0]), P.pack_i32([1, 4]), ["x", "z"],
                                 P.pack_i32([10, 13]))
    assert parts[5] == P.Replies(P.pack_i64([b | 4]), P.pack_u8([2]), P.pack_i32([3]), ["y"], P.pack_i32([12]))
    no_cached = split_by_front(replies([a | 1, b | 2], ["x", "y"], cached=False))
    assert no_cached[5].cached_tokens == b"" and no_cached[5].texts == ["y"]
    for part in parts.values():
        assert codec.decode(codec.encode(part)) == part


def test_a_cancel_before_its_request_is_taken_drops_the_request_and_after_it_goes_out():
    order = HandoffOrder(FRONT_ID_BITS)
    base = front_base(BASE, 2)
    assert order.cancel([base | 1]) == []            # nothing taken yet
    assert not order.take(base | 1) and order.num_withdrawn == 1 and not order.withdrawn
    assert order.take(base | 2) and order.take(base | 3)
    assert order.cancel([base | 2, base | 3, base | 4]) == [base | 2, base | 3]   # 4: not yet taken
    assert not order.take(base | 4) and order.take(base | 5)


def test_the_order_holds_across_the_counters_wrap():
    order = HandoffOrder(FRONT_ID_BITS)
    base, top = front_base(BASE, 1), (1 << FRONT_ID_BITS) - 1
    assert order.take(base | top - 1) and order.take(base | top)
    assert order.cancel([base | 0, base | top, base | top - 5]) == [base | top, base | top - 5]
    assert not order.take(base | 0) and order.take(base | 1)
    assert order.cancel([base | 1, base | 2]) == [base | 1]


def test_the_in_thread_servers_ids_use_the_wider_counter():
    order = HandoffOrder(THREAD_ID_BITS)
    base = BASE | HTTP_BIT
    assert order.take(base | 1 << 35)
    assert order.cancel([base | 5, base | (1 << 35) + 1]) == [base | 5]
