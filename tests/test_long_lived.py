"""The long-lived roles under a peer that misbehaves and under many requests: a worker's tokens
count only for its own leases, the router never drops a message for the detokenizer (it stops
admitting work instead), and every per-request structure stays bounded."""

from __future__ import annotations

import pytest
import zmq

from qmigrate.config import parse_topology
from qmigrate.wire import protocol as P
from qmigrate.wire import transport

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def topo(tmp_path, tiny_model_dir):
    return parse_topology({
        "transport": "ipc", "ipc_dir": str(tmp_path), "model": {"path": str(tiny_model_dir)},
        "nodes": [{"name": "local"}], "router": {"node": "local"}, "ingest": {"node": "local"},
        "detokenizer": {"node": "local", "output": "jsonl"},
        "workers": [{"name": "w1", "node": "local"}, {"name": "w2", "node": "local"}]})


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


def _tokens(seq_ids, start=0, token=7, finish=0) -> P.Tokens:
    n = len(seq_ids)
    return P.Tokens(P.pack_i64(seq_ids), P.pack_i32([start] * n), P.pack_i32([2] * n),
                    P.pack_i32([token] * 2 * n), P.pack_u8([finish] * n))


def test_tokens_count_only_for_the_senders_leases(topo):
    """A listed worker took a lease, then sent tokens for sequences leased to another worker
    and for ones leased to no one: before, the router forwarded them all and the detokenizer
    printed them as those requests' output. Now only its own rows reach the detokenizer; the
    rest are dropped and counted."""
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
        for _ in range(20):
            router.drain_socket()
            router.flush_backlog()
        got = []
        while detok.poll(200):
            msg = P.decode(detok.recv())
            if isinstance(msg, P.Tokens):
                got.append(msg)
        assert [P.unpack_i64(m.seq_ids).tolist() for m in got] == [leases["w2"], leases["w1"]]
        first = got[0]
        assert P.unpack_i32(first.tokens).tolist() == [7] * 4 and P.unpack_u8(first.finish).tolist() == [1, 1]
        assert P.unpack_i32(got[1].tokens).tolist() == [9] * 4
        assert router.errors["tokens_not_leased"] == 2 + len(queued) + 1 + 2
    finally:
        _close(detok, ingest, w1, w2, router.work, router.telemetry, router.detok)
