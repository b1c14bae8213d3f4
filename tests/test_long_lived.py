"""The long-lived roles under a peer that misbehaves and under many requests: a worker's tokens
count only for its own leases, the router never drops a message for the detokenizer (it stops
admitting work instead), and every per-request structure stays bounded."""

from __future__ import annotations

import time

import pytest
import zmq

from qmigrate.config import local_topology
from qmigrate.wire import protocol as P
from qmigrate.wire import codec
from qmigrate.wire import transport

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def topo(tmp_path, tiny_model_dir):
    return local_topology(2, str(tiny_model_dir), str(tmp_path), output="jsonl")


def _close(*socks) -> None:
    for sock in socks:
        sock.close(linger=0)


def _pump(router, sock, until, tries: int = 200):
    """Run the router until `until(message)` holds for a message on sock; returns it."""
    for _ in range(tries):
        router.drain_socket()
        router.serve_parked(0.0)
        while (got := transport.recv(sock, 0.005)) is not None:
            if until(got[1]):
                return got[1]
    raise AssertionError("no such message")


@pytest.fixture
def two_workers(topo):
    """A router, the detokenizer's and ingest's sockets, and workers w1 and w2 joined (max_seqs 2)."""
    from qmigrate.router.loop import Router
    router = Router(topo)
    detok = transport.socket(zmq.PULL, bind=topo.endpoint("detokenizer").bind)
    ingest = transport.socket(zmq.DEALER, connect=topo.endpoint("router").connect, identity="ingest-1")
    w1 = transport.socket(zmq.DEALER, connect=topo.endpoint("router").connect, identity="w1")
    w2 = transport.socket(zmq.DEALER, connect=topo.endpoint("router").connect, identity="w2")
    try:
        for w in (w1, w2):
            transport.send(w, P.Hello("worker", w.getsockopt(zmq.IDENTITY).decode(), info={"max_seqs": 2}))
            _pump(router, w, lambda m: isinstance(m, P.Welcome))
        yield router, detok, ingest, w1, w2
    finally:
        _close(detok, ingest, w1, w2, router.work, router.telemetry, router.out.detok)


def _tokens(seq_ids, start=0, token=7, finish=0) -> P.Tokens:
    n = len(seq_ids)
    return P.Tokens(P.pack_i64(seq_ids), P.pack_i32([start] * n), P.pack_i32([2] * n),
                    P.pack_i32([token] * 2 * n), P.pack_u8([finish] * n))


def test_tokens_count_only_for_the_senders_leases(two_workers):
    """A listed worker took a lease, then sent tokens for sequences leased to another worker
    and for ones leased to no one: before, the router forwarded them all and the detokenizer
    printed them as those requests' output. Now only its own rows reach the detokenizer; the
    rest are dropped and counted."""
    router, detok, ingest, w1, w2 = two_workers
    specs = [P.SeqSpec(100 + i, P.pack_i32([1, 2, 3]), 3, 8) for i in range(5)]
    transport.send(ingest, P.Submit(specs, [f"r{i}" for i in range(5)]))
    _pump(router, ingest, lambda m: isinstance(m, P.SubmitAck))
    leases = {}
    for name, w in (("w1", w1), ("w2", w2)):
        transport.send(w, P.WorkRequest(1, 2, 64))
        lease = _pump(router, w, lambda m: isinstance(m, P.Lease))
        leases[name] = P.unpack_i64(lease.seq_ids).tolist()
    assert len(leases["w1"]) == len(leases["w2"]) == 2 and not set(leases["w1"]) & set(leases["w2"])
    queued = sorted({s.seq_id for s in specs} - set(leases["w1"]) - set(leases["w2"]))
    # w2 writes its own two rows, w1's two, one queued and one nobody has heard of
    transport.send(w2, _tokens(leases["w2"] + leases["w1"] + queued + [999], finish=int(P.Finish.EOS)))
    transport.send(w2, _tokens(leases["w1"]))  # all of them someone else's: nothing goes on
    transport.send(w1, _tokens(leases["w1"], token=9))  # its own: goes on as sent
    # the three messages come on two sockets, in no set order: run the router until each
    # has been handled, then a little longer, so that a wrongly forwarded row would show
    dropped = 2 + len(queued) + 1 + 2
    got, quiet, deadline = [], 0, time.monotonic() + 10
    while quiet < 20 and time.monotonic() < deadline:
        router.drain_socket()
        router.out.flush_backlog()
        if detok.poll(10):
            if isinstance(msg := codec.decode(detok.recv()), P.Tokens):
                got.append(msg)
            quiet = 0
        elif len(got) >= 2 and router.errors["tokens_never_leased"] >= dropped:
            quiet += 1
    by_rows = {tuple(P.unpack_i64(m.seq_ids).tolist()): m for m in got}
    assert len(got) == 2 and set(by_rows) == {tuple(leases["w2"]), tuple(leases["w1"])}
    own = by_rows[tuple(leases["w2"])]
    assert P.unpack_i32(own.tokens).tolist() == [7] * 4 and P.unpack_u8(own.finish).tolist() == [1, 1]
    assert P.unpack_i32(by_rows[tuple(leases["w1"])].tokens).tolist() == [9] * 4
    assert router.errors["tokens_never_leased"] == dropped


def test_tokens_of_a_cancelled_sequence_from_its_worker_are_no_fault(two_workers):
    """A client that disconnects cancels its sequence while a multi-step lease runs it: the
    worker's tokens for it keep coming until the lease's next step boundary. Before, each
    counted as a worker writing into a sequence not leased to it, with a warning per message.
    Now they are dropped quietly (counted apart); another worker's tokens for it still count
    as a fault, and none reach the detokenizer."""
    router, detok, ingest, w1, w2 = two_workers
    transport.send(ingest, P.Submit([P.SeqSpec(100 + i, P.pack_i32([1 + i, 2, 3]), 3, 8) for i in range(4)],
                                    ["a", "b", "c", "d"]))
    _pump(router, ingest, lambda m: isinstance(m, P.SubmitAck))
    transport.send(w1, P.WorkRequest(1, 2, 64))
    rows = P.unpack_i64(_pump(router, w1, lambda m: isinstance(m, P.Lease)).seq_ids).tolist()
    assert rows == [100, 101]
    transport.send(ingest, P.Cancel(P.pack_i64([100])))
    deadline = time.monotonic() + 10
    while router.sched.counters["cancelled"] < 1 and time.monotonic() < deadline:
        router.drain_socket()
        time.sleep(0.005)
    transport.send(w1, _tokens(rows))        # its own lease: 101 goes on, 100 is late
    transport.send(w2, _tokens([100]))       # never leased to w2: a fault
    got, deadline = [], time.monotonic() + 10
    while time.monotonic() < deadline and not (got and router.errors["tokens_never_leased"] >= 1):
        router.drain_socket()
        router.out.flush_backlog()
        while detok.poll(10):
            if isinstance(msg := codec.decode(detok.recv()), P.Tokens):
                got.append(P.unpack_i64(msg.seq_ids).tolist())
    assert got == [[101]]
    assert router.sched.counters["tokens_after_cancel"] == 1 and router.errors["tokens_never_leased"] == 1


def test_a_detokenizer_that_does_not_read_stops_admission_and_loses_nothing(topo, monkeypatch):
    """Before, the router's backlog to the detokenizer dropped its oldest message past 100k
    held, while ingest's requests, errors and end of input kept coming: a dropped Tokens left
    a gap for good, a dropped InputClosed kept `sim` from ending. Now a full backlog defers
    every Submit (errors and end included) and each message held reaches the detokenizer,
    in order, once it reads."""
    from qmigrate.router import output
    from qmigrate.router.loop import Router
    monkeypatch.setattr(output, "MAX_BACKLOG", 50)
    router = Router(topo)
    router.out.detok.close(linger=0)  # a queue of one message to the detokenizer, so the backlog fills
    router.out.detok = transport.socket(zmq.PUSH, connect=topo.endpoint("detokenizer").connect, hwm=1)
    ingest = transport.socket(zmq.DEALER, connect=topo.endpoint("router").connect, identity="ingest-1")
    detok = None
    try:
        acks, seq_id = [], 0
        for n in range(12):  # 10 requests and 2 errors each; the last says the input ends
            specs = [P.SeqSpec(seq_id + i + 1, P.pack_i32([1, 2]), 2, 4) for i in range(10)]
            seq_id += 10
            transport.send(ingest, P.Submit(specs, [f"r{s.seq_id}" for s in specs],
                                            [[f"e{n}a", "bad"], [f"e{n}b", "bad"]], 144 if n == 11 else -1))
            acks.append(_pump(router, ingest, lambda m: isinstance(m, P.SubmitAck)))
        taken = [a.num_accepted for a in acks]
        deferred = [a.is_deferred for a in acks]
        # 12 messages a Submit: once 50 are held past the socket's queue, no Submit is taken
        num = taken.index(0)
        assert taken == [10] * num + [0] * (12 - num) and deferred == [False] * num + [True] * (12 - num)
        assert router.sched.counters["submits_deferred"] == 12 - num >= 5 and 50 <= len(router.out.backlog) < 62
        assert router.out.outputs.num_requests == -1  # the deferred end of input is ingest's to send again
        held = list(router.out.backlog)
        detok = transport.socket(zmq.PULL, bind=topo.endpoint("detokenizer").bind)
        got = []
        for _ in range(200):
            router.out.flush_backlog()
            while detok.poll(5):
                got.append(detok.recv())
            if len(got) >= len(held) and not router.out.backlog:
                break
        assert got[-len(held):] == held and router.out.backlog_bytes == 0
        kinds = [type(codec.decode(f)).__name__ for f in got]
        assert kinds.count("RequestMeta") == 10 * num and kinds.count("RequestError") == 2 * num
        assert len(got) == 12 * num
        transport.send(ingest, P.Submit([], [], [], 144))  # admitted again now that it reads
        assert not _pump(router, ingest, lambda m: isinstance(m, P.SubmitAck)).is_deferred
    finally:
        _close(ingest, router.work, router.telemetry, router.out.detok, *([detok] if detok else []))


def test_an_id_past_the_tokenizer_is_output_and_its_batch_prints(topo, capsys):
    """A model's vocabulary may be larger than its tokenizer's (Qwen2: 151,936 against
    151,665). Before, one such id dropped the whole multi-row Tokens message, and every
    sequence of that batch waited forever. Now it decodes as no text, and every row prints."""
    from qmigrate.detokenizer.loop import Detokenizer
    detok = Detokenizer(topo)
    push = transport.socket(zmq.PUSH, connect=topo.endpoint("detokenizer").connect)
    ids = P.pack_i32
    past = detok.vocab_size + 5  # the tiny model's tokenizer has fewer ids than this
    try:
        for sid in (1, 2, 3):
            transport.send(push, P.RequestMeta(sid, f"r{sid}", ids([1, 42])))
        transport.send(push, P.Tokens(P.pack_i64([1, 2, 3]), ids([0, 0, 0]), ids([2, 2, 2]),
                                      ids([71, 78, 71, past, past, 78]), P.pack_u8([2, 2, 2])))
        transport.send(push, P.InputClosed(3))
        detok.serve_forever(exit_when_done=True)  # returns once all three are done
    finally:
        _close(push, detok.pull, detok.router, detok.replies)
    finals = {r["id"]: r for r in map(__import__("json").loads, capsys.readouterr().out.splitlines())
              if r.get("done")}
    assert {k: v["token_ids"] for k, v in finals.items()} == {"r1": [71, 78], "r2": [71, past], "r3": [past, 78]}
    from qmigrate.detokenizer.decoder import IncrementalDecoder
    decode = lambda xs: "".join(IncrementalDecoder(detok.sink._tokenizer).push([x]) for x in xs)  # noqa: E731
    assert finals["r2"]["text"] == decode([71]) and finals["r3"]["text"] == decode([78])


def test_many_thousands_of_requests_leave_every_structure_bounded(tmp_path):
    """The detokenizer's sink remembered every finished and errored request for good, its
    latency table every cancelled one, the router every error record: each grew with the
    number of requests served. 30,000 requests (finished, errored, cancelled, and tokens for
    requests that never start) through the pure cores: every size stays under its bound."""
    from qmigrate.detokenizer.formats import JsonlSink
    from qmigrate.detokenizer.sinks import MAX_UNSTARTED
    from qmigrate.router.journal import OutputLog
    from tokenizer_util import build_tokenizer
    tok = build_tokenizer()
    out = []
    sink = JsonlSink(tok, out.append, max_done=1000)
    log = OutputLog()
    max_kept = 500
    for n in range(30_000):
        sid = n + 1
        kind = n % 4
        if kind == 3:  # refused at ingest
            sink.error(f"e{n % 7}", "bad", sid)  # request ids may repeat: each error is its own
            log.add(P.Submit([], [], [[f"e{n % 7}", "bad"]], error_ids=P.pack_i64([sid])), 0)
            if n % 8 == 3:  # confirmed printed by the detokenizer: forgotten at once
                log.printed([sid])
        else:
            spec = P.SeqSpec(sid, P.pack_i32([5, 6]), 2, 2)
            log.add(P.Submit([spec], [f"r{n}"]), 1)
            sink.start(sid, f"r{n}", [5, 6])
            sink.tokens(sid, 0, [7])
            if kind == 0:
                sink.tokens(sid, 1, [8])
                sink.finish(sid, "length", 2)
            elif kind == 1:
                sink.cancel(sid)
            else:
                sink.tokens(10**9 + n, 0, [7])  # tokens of a request whose start never comes
                sink.finish(sid, "eos", 1)
            log.printed([sid])
        sink.newly_done.clear()  # taken by report_printed every 0.2 s
        log.trim(max_kept, live=())
        if n % 1000 == 999:
            sizes = sink.sizes
            assert sizes["finished"] <= 1000 and sizes["errored"] <= 1000, sizes
            assert sizes["unstarted"] <= MAX_UNSTARTED and sizes["active"] <= MAX_UNSTARTED, sizes
            assert len(log) == 0 and len(log.errors) <= max_kept, len(log.errors)
        out.clear()
    assert sink.num_done == 30_000 and sink.num_errors == 7_500  # errors under one request id: each counted
    # a request that ended recently is still known: sent again (a router restart), it prints nothing
    sink.start(29_999, "r29998", [5, 6])
    sink.tokens(29_999, 0, [7, 8])
    assert not out and sink.is_done(29_999)


def test_the_detokenizer_forgets_the_latency_of_cancelled_requests(topo):
    from qmigrate.detokenizer import loop
    detok = loop.Detokenizer(topo)
    try:
        detok.latency = object()  # timing on: on_meta starts a record, which nothing reads here
        for sid in range(1, 3001):
            detok.on_meta(P.RequestMeta(sid, f"r{sid}", P.pack_i32([1, 2])))
            detok.on_cancel(P.Cancel(P.pack_i64([sid])))
        assert not detok.times
        for sid in range(5001, 5001 + loop.MAX_TIMED + 100):  # never ended here at all
            detok.times[sid] = [0.0, None]
        detok.on_meta(P.RequestMeta(1, "r1", P.pack_i32([1, 2])))
        assert len(detok.times) <= loop.MAX_TIMED
    finally:
        _close(detok.pull, detok.router, detok.replies)


def test_ingest_keeps_a_deferred_submit_whole_and_sends_it_later(topo, monkeypatch):
    """A Submit the router defers (its output to the detokenizer is backed up) is kept by
    ingest as it was: requests, error records and the end of input all go later."""
    from qmigrate.ingest.loop import Ingest
    from qmigrate.ingest.prompts import Prompt
    from qmigrate.router.loop import Router
    from qmigrate.router.output import Output
    router = Router(topo)
    ingest = Ingest(topo, read_stdin=True)
    full = [True]
    monkeypatch.setattr(Output, "is_backlog_full", property(lambda self: full[0]))
    try:
        ingest.enqueue(ingest.id_base | 1, Prompt("a", [1, 2, 3], 2, 0.0, 1.0, 0, 1, []), P.ROUTE_STDOUT)
        ingest.errors.append(("b", "bad", ingest.id_base | 2))
        ingest.num_requests, ingest.stdin_done = 2, True
        ingest.lines.get_nowait = lambda: (_ for _ in ()).throw(__import__("queue").Empty)

        def turn():
            ingest.submit()
            if router.work.poll(5):
                router.drain_socket()
            if ingest.router.poll(5):
                ingest.on_router()
        for _ in range(20):
            turn()
        assert router.sched.counters["submits_deferred"] >= 1 and not router.sched.seqs
        assert len(ingest.pending) == 1 and len(ingest.errors) == 1 and not ingest.closed_sent
        full[0] = False
        for _ in range(200):
            turn()
            if ingest.closed_sent:
                break
        assert len(router.sched.seqs) == 1 and len(router.out.outputs.errors) == 1 and router.out.outputs.num_requests == 2
    finally:
        _close(ingest.router, ingest.feed, ingest.replies, router.work, router.telemetry, router.out.detok)


def test_a_request_cancelled_in_the_hand_off_queue_never_reaches_the_router(topo):
    """The HTTP thread queues a request, its client leaves, and the cancel reaches the ingest
    loop before the request does. Before, the Cancel went to the router (which had never
    heard of it) and the request then ran to its end for nobody. Now it is dropped when
    taken; a request cancelled after it was taken is cancelled as before."""
    import queue
    from types import SimpleNamespace

    from qmigrate.ingest.loop import Ingest
    from qmigrate.ingest.prompts import Prompt
    ingest = Ingest(topo, read_stdin=False)
    try:
        ingest.http = SimpleNamespace(submissions=queue.Queue(), cancels=queue.SimpleQueue())
        ids = [ingest.id_base | n for n in (1, 2, 3)]
        prompt = Prompt("r", [1, 2, 3], 2, 0.0, 1.0, 0, 1, [])
        ingest.http.submissions.put([(ids[0], prompt)])
        ingest.http.submissions.put([(ids[1], prompt), (ids[2], prompt)])   # one request, n=2
        ingest.http.cancels.put(ids[1])
        ingest.take_http()
        assert [spec.seq_id for spec, *_ in ingest.pending] == [ids[0], ids[2]]
        assert ingest.order.num_withdrawn == 1 and not ingest.order.withdrawn
        ingest.http.cancels.put(ids[0])   # taken, not yet sent: cancelled once its Submit is acked
        ingest.take_http()
        assert ingest.cancel_after_ack == {ids[0]} and ingest.order.num_withdrawn == 1
    finally:
        _close(ingest.router, ingest.feed, ingest.replies)
