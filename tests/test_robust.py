"""Malformed messages to a live router and detokenizer: each is dropped with one log line,
and the role goes on serving. The roles run in this process on ipc sockets in a temp dir."""

from __future__ import annotations

import math
import os

import msgpack
import pytest
import zmq

from qmigrate.wire import protocol as P
from qmigrate.wire import codec
from qmigrate.wire import transport
from qmigrate.config import local_topology


@pytest.fixture
def topo(tmp_path, tiny_model_dir):
    return local_topology(1, str(tiny_model_dir), str(tmp_path), output="jsonl")


def _raw(msg_type: P.MsgType, *fields) -> bytes:
    return msgpack.packb([int(msg_type), *fields], use_bin_type=True)


def test_non_finite_numbers_are_refused_at_decode():
    for bad in (math.inf, -math.inf, math.nan):
        with pytest.raises(P.ProtocolError, match="finite"):
            codec.decode(_raw(P.MsgType.WELCOME, 1, bad, 10.0))
        with pytest.raises(P.ProtocolError, match="finite"):
            codec.decode(_raw(P.MsgType.HELLO, "worker", "w9", 1, {"max_seqs": bad}))
    assert codec.decode(_raw(P.MsgType.WELCOME, 1, 0.5, 10)).lease_timeout_s == 10.0


def test_hello_info_is_range_checked():
    assert P.info_int({}, "max_seqs", 64, 1, 100) == 64
    assert P.info_int({"max_seqs": 7}, "max_seqs", 64, 1, 100) == 7
    for bad in (None, "8", 8.0, 0, 101, True):
        with pytest.raises(P.ProtocolError, match="max_seqs"):
            P.info_int({"max_seqs": bad}, "max_seqs", 64, 1, 100)
    with pytest.raises(P.ProtocolError):
        P.info_str({"kv_endpoint": "x" * 600}, "kv_endpoint")


def test_a_live_router_drops_bad_messages_and_goes_on(topo):
    from qmigrate.router.loop import Router
    router = Router(topo)
    client = transport.socket(zmq.DEALER, connect=topo.endpoint("router").connect, identity="w9")
    monitor = transport.socket(zmq.PUB, connect=topo.endpoint("telemetry").connect)
    try:
        bad = [
            _raw(P.MsgType.HELLO, "worker", "w9", 1, {"max_seqs": None}),
            _raw(P.MsgType.HELLO, "worker", "w9", 1, {"inflight": 10**9, "max_tokens": "lots"}),
            _raw(P.MsgType.HELLO, "worker", "w9", 1, {"kv_tokens": -5}),
            _raw(P.MsgType.STEP_RESULT, 1, b"\x01", b"", b"", b""),      # not a whole int64
            _raw(P.MsgType.SUBMIT, [[1, b"\x01\x00\x00\x00", 5, 1]]),    # prompt_len past the ids
            b"\xc1not msgpack", _raw(99), _raw(P.MsgType.STATS, "not a map"),
        ]
        for frame in bad:
            client.send(frame)
        monitor.send(codec.encode(P.VramReport("n", [["GPU-1", 0, "80", 5, 7], ["GPU-2"], [1, 2, 3, 4, 5]])))
        for _ in range(20):
            router.drain_socket()
            router.drain_telemetry()
        assert "w9" not in router.sched.workers  # no bad hello registered a worker
        transport.send(client, P.Hello("worker", "w9", info={"max_seqs": 4, "kv_tokens": 4096}))
        transport.send(client, P.StatsRequest())
        replies = []
        for _ in range(50):
            router.drain_socket()
            got = transport.recv(client, 0.02)
            if got is not None:
                replies.append(got[1])
            if any(isinstance(r, P.Stats) for r in replies):
                break
        assert any(isinstance(r, P.Welcome) for r in replies), replies
        stats = next(r for r in replies if isinstance(r, P.Stats)).counters
        assert stats["workers"] == 1 and router.sched.workers["w9"].max_seqs == 4
    finally:
        client.close(linger=0)
        monitor.close(linger=0)
        router.work.close(linger=0)
        router.telemetry.close(linger=0)
        router.out.detok.close(linger=0)


def test_a_live_detokenizer_drops_bad_tokens_and_finishes_the_rest(topo, capsys):
    from qmigrate.detokenizer.loop import Detokenizer
    detok = Detokenizer(topo)
    push = transport.socket(zmq.PUSH, connect=topo.endpoint("detokenizer").connect)
    ids = lambda xs: P.pack_i32(xs)
    try:
        transport.send(push, P.RequestMeta(1, "r1", ids([1, 42])))
        for tokens in ([-1], [-(2 ** 31)]):  # not token ids (an id past the tokenizer is: test_detok)
            transport.send(push, P.Tokens(P.pack_i64([1]), ids([0]), ids([1]), ids(tokens), P.pack_u8([0])))
        transport.send(push, P.Tokens(P.pack_i64([1]), ids([-3]), ids([1]), ids([5]), P.pack_u8([0])))
        transport.send(push, P.Tokens(P.pack_i64([1]), ids([0]), ids([2]), ids([5]), P.pack_u8([0])))  # counts
        transport.send(push, P.Tokens(P.pack_i64([1]), ids([0]), ids([2]), ids([71, 78]), P.pack_u8([2])))
        transport.send(push, P.InputClosed(1))
        detok.serve_forever(exit_when_done=True)  # returns once r1 is done
    finally:
        push.close(linger=0)
        detok.pull.close(linger=0)
        detok.router.close(linger=0)
    out = capsys.readouterr().out
    final = [line for line in out.splitlines() if '"done": true' in line]
    assert len(final) == 1 and '"token_ids": [71, 78]' in final[0], out


def test_a_worker_skips_stale_rejects_while_it_says_hello(topo):
    """After a router restart, Rejects that answer messages queued before it can arrive
    before the Welcome: the worker must skip them, and stop only on a real refusal."""
    import threading

    from qmigrate.worker.loop import Worker
    router = transport.socket(zmq.ROUTER, bind=topo.endpoint("router").bind)
    worker = Worker(topo, "w1")
    outcome: list = []

    def say_hello():
        try:
            worker.hello()
            outcome.append("welcomed")
        except SystemExit as exc:
            outcome.append(str(exc.code))

    try:
        for answers, expected in (
                ([P.Reject("unknown worker: say hello first", is_unknown_peer=True)] * 3
                 + [P.Welcome(P.PROTOCOL_VERSION, 0.25, 10.0)], "welcomed"),
                ([P.Reject("protocol version 0; router speaks 1")], "router refused: protocol version")):
            outcome.clear()
            thread = threading.Thread(target=say_hello)
            thread.start()
            sender, hello = transport.recv(router, 10.0)
            assert isinstance(hello, P.Hello) and hello.name == "w1"
            for answer in answers:
                transport.send(router, answer, to=sender)
            thread.join(10.0)
            assert not thread.is_alive() and outcome and expected in outcome[0], outcome
        assert worker.heartbeat_s == 0.25
    finally:
        router.close(linger=0)
        for sock in (worker.router, worker.kv_in):
            sock.close(linger=0)


def _close_router(router) -> None:
    for sock in (router.work, router.telemetry, router.out.detok):
        sock.close(linger=0)


def test_a_client_that_stops_reading_cannot_stall_the_router(topo):
    """15,000 requests whose answers are never read: the router drops what that peer's queue
    cannot take, never blocks, and goes on answering another client."""
    from qmigrate.router.loop import Router
    router = Router(topo)
    deaf = transport.socket(zmq.DEALER, connect=topo.endpoint("router").connect, identity="deaf", hwm=10)
    other = transport.socket(zmq.DEALER, connect=topo.endpoint("router").connect, identity="other")
    try:
        frame = codec.encode(P.StatsRequest())
        sent = 0
        while sent < 15_000:
            try:
                deaf.send(frame, zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                router.drain_socket()  # would block for good here if a reply could block
        while router.work.poll(0):
            router.drain_socket()
        assert transport.num_dropped > 0, "the deaf client's queue never filled; the test proves nothing"
        transport.send(other, P.StatsRequest())
        got = None
        for _ in range(100):
            router.drain_socket()
            if (got := transport.recv(other, 0.02)) is not None:
                break
        assert got is not None and isinstance(got[1], P.Stats) and got[1].counters["dropped_sends"] > 0
    finally:
        deaf.close(linger=0)
        other.close(linger=0)
        _close_router(router)


def test_fifty_thousand_prompts_keep_the_router_bounded(topo):
    """Overload: 50,000 prompts offered to a router that can queue 64 (no worker runs them).
    It takes 64, refuses the rest (ingest keeps them, and stops reading its input), and its
    resident memory stays flat: it grew by under 1 MiB here, and the bound is 16 MiB."""
    from qmigrate.router.loop import Router

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    topo.router.max_queued = 64
    router = Router(topo)
    ingest = transport.socket(zmq.DEALER, connect=topo.endpoint("router").connect, identity="ingest-1")
    ids = P.pack_i32(list(range(1, 33)))
    taken = offered = 0
    try:
        while offered < 50_000:
            if offered == 5_000:
                base = rss()  # after the first offer has filled the router
            batch = [P.SeqSpec(offered + i + 1, ids, 32, 16) for i in range(5_000)]
            transport.send(ingest, P.Submit(batch, [f"q{s.seq_id}" for s in batch]))
            offered += len(batch)
            del batch
            for _ in range(500):
                router.drain_socket()
                if (got := transport.recv(ingest, 0.01)) is not None:
                    break
            assert got is not None and isinstance(got[1], P.SubmitAck)
            taken += got[1].num_accepted
        grown = rss() - base
    finally:
        ingest.close(linger=0)
        _close_router(router)
    assert taken == 64 and len(router.sched.seqs) == 64 and len(router.out.outputs) == 64
    assert router.out.outputs.specs.keys() == router.sched.seqs.keys()
    assert grown < 16 << 20, f"the process grew by {grown >> 20} MiB while the router refused prompts"


def test_ingest_holds_prompts_until_the_fleet_has_joined(topo, tmp_path):
    """`sim` starts ingest with the other roles, so it loads its tokenizer while workers load
    the model, but it submits nothing until every worker has joined: a short run is then
    spread over the whole fleet instead of the first worker up."""
    import subprocess
    import sys
    import time

    import yaml

    from qmigrate.router.loop import Router
    path = tmp_path / "topo.yaml"
    data = topo.to_dict()
    data["ingest"]["input"] = "jsonl"
    path.write_text(yaml.safe_dump(data))
    router = Router(topo)
    asked = []
    on_stats = router.handlers[P.StatsRequest]
    router.handlers[P.StatsRequest] = lambda sender, msg: (asked.append(sender), on_stats(sender, msg))
    ingest = subprocess.Popen([sys.executable, "-m", "qmigrate", "role", "ingest", "ingest", "--config", str(path),
                               "--stdin", "--wait-for-workers", "1"], stdin=subprocess.PIPE, text=True,
                              stderr=subprocess.PIPE)
    worker = transport.socket(zmq.DEALER, connect=topo.endpoint("router").connect, identity="w1")

    def pump(seconds: float, until=lambda: False) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not until():
            if router.work.poll(20):
                router.drain_socket()

    try:
        ingest.stdin.write('{"id": "a", "prompt_ids": [1, 5, 6], "max_new_tokens": 3}\n')
        ingest.stdin.flush()
        pump(60, until=lambda: len(asked) >= 3)  # it is up and asking
        pump(0.5)
        assert len(asked) >= 3, "ingest never asked how many workers joined"
        assert not router.sched.seqs, "ingest submitted before any worker joined"
        transport.send(worker, P.Hello("worker", "w1", info={"max_seqs": 4}))
        pump(30, until=lambda: bool(router.sched.seqs))
        assert len(router.sched.seqs) == 1, "ingest never submitted after the worker joined"
    finally:
        ingest.kill()
        ingest.communicate()
        worker.close(linger=0)
        _close_router(router)
