"""Property-based fuzzing of a live fleet: thousands of malformed and adversarial messages to
the router, its telemetry port, the detokenizer and a worker's KV port while they serve real
requests. Every request still equals generate(), and no role dies or restarts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import msgpack
import pytest
import yaml
import zmq

import warm

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from qmigrate.wire import protocol as P  # noqa: E402
from qmigrate.wire import codec  # noqa: E402
from qmigrate.wire import transport  # noqa: E402
from conftest import reserve_ports  # noqa: E402
import helpers as H  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_PER_PORT = 260  # drawn frames per port; each is sent with 4 corruptions: 5,200 messages

values = st.deferred(lambda: st.one_of(
    st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=24), st.binary(max_size=48),
    st.lists(values, max_size=4), st.dictionaries(st.text(max_size=6), values, max_size=3)))


def _wire(msg) -> list:
    return msgpack.unpackb(codec.encode(msg), raw=False)


def _mutate(example: list, where: int, value) -> bytes:
    body = list(example)
    if len(body) > 1:
        body[1 + where % (len(body) - 1)] = value
    return msgpack.packb(body, use_bin_type=True)


def frames_for(examples: list, types: list[int]):
    """Random bytes; a known message type with random fields; a well-formed message with one
    field replaced by a random value (the likeliest to pass the first checks)."""
    return st.one_of(
        st.binary(max_size=96),
        st.tuples(st.sampled_from(types), st.lists(values, max_size=12)).map(
            lambda t: msgpack.packb([t[0], *t[1]], use_bin_type=True)),
        st.tuples(st.sampled_from([_wire(m) for m in examples]), st.integers(0, 15), values).map(
            lambda t: _mutate(*t)),
    )


ids32 = P.pack_i32([5, 6])
ROUTER_EXAMPLES = [
    P.WorkRequest(3, 4, 64), P.Heartbeat("w1", 1, 100, 5, 5, P.pack_i64([1])), P.StatsRequest(),
    P.StepResult(1 << 50, P.pack_i64([9]), P.pack_i32([1]), P.pack_i32([5]), P.pack_u8([0])),
    P.Hello("worker", "w1", 1, {"max_seqs": 2}), P.Submit([P.SeqSpec(9, ids32, 2, 4)], ["x"]),
    P.Drain("w1"), P.Printed(P.pack_i64([1])), P.Resync(1)]
TELEMETRY_EXAMPLES = [P.VramReport("n", [["GPU-1", 0, 80, 5, 75, 3]])]
DETOK_EXAMPLES = [
    P.Tokens(P.pack_i64([1 << 60]), P.pack_i32([0]), P.pack_i32([2]), ids32, P.pack_u8([0])),
    P.RequestMeta(1 << 60, "x", ids32), P.RequestError("x", "bad"), P.InputClosed(3)]
KV_EXAMPLES = [P.KVHeader(1 << 50, 1 << 60, 2, "float32", [2, 2, 2, 1, 4])]
# Well-formed messages that act by design on whoever sends them (a worker joining, a request
# admitted, a drain): keeping them out is the job of authentication, not of these checks.
PRIVILEGED = (P.Hello, P.Submit, P.Drain, P.Resync, P.Printed, P.RequestMeta, P.RequestError, P.InputClosed)


def _is_privileged(frame: bytes) -> bool:
    try:
        return isinstance(codec.decode(frame), PRIVILEGED)
    except P.ProtocolError:
        return False


def _corruptions(frame: bytes) -> list[bytes]:
    """The frame, and the same bytes torn, cut, flipped and padded (cheap next to drawing)."""
    mid = len(frame) // 2
    flipped = frame[:mid] + bytes([frame[mid] ^ 0x5A]) + frame[mid + 1:] if frame else b"\x00"
    return [frame, frame[:-1], frame[:mid], flipped, frame + b"\xc1" * 3]


def _fuzz(strategy, send) -> int:
    sent = [0]

    @settings(max_examples=NUM_PER_PORT, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(frame):
        for variant in _corruptions(frame):
            if not _is_privileged(variant):
                send(variant)
                sent[0] += 1
    run()
    return sent[0]


def _feed(endpoint: str, prompts) -> None:
    lines = [json.dumps(p) for p in prompts]
    while lines:
        ack = transport.request(endpoint, P.FeedLines(lines), timeout_s=30, expect=P.FeedAck)
        lines = lines[ack.num_accepted:]


def test_a_fuzzed_fleet_serves_every_request_exactly(tmp_path, tiny_model_dir):
    from conftest import check_outputs
    ports = reserve_ports(7)
    data = {"transport": "tcp", "model": {"path": str(tiny_model_dir)},
            "nodes": [{"name": "head", "address": "127.0.0.1", "bind": "127.0.0.1", "max_restarts": 0}],
            "router": {"node": "head", "port": ports[0], "telemetry_port": ports[1]},
            "ingest": {"node": "head", "port": ports[2], "reply_port": ports[6], "input": "jsonl"},
            "detokenizer": {"node": "head", "port": ports[3], "output": "jsonl"},
            "workers": [{"name": f"w{i}", "node": "head", "kv_port": ports[3 + i], "max_num_seqs": 2} for i in (1, 2)]}
    path = tmp_path / "topo.yaml"
    path.write_text(yaml.safe_dump(data))
    out, err = open(tmp_path / "out", "a+"), open(tmp_path / "err", "a+")
    node = warm.popen(["node", str(path), "--node", "head"],
                      stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
    router, ingest = f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[2]}"
    ctx = transport.context()
    socks = []
    try:
        deadline = time.monotonic() + 120
        while H.stats(router).get("workers") != 2:
            assert time.monotonic() < deadline and node.poll() is None, "the fleet did not start"
            time.sleep(0.1)
        roles = {t: H.pid_of(node, t) for t in ("qmigrate router", "qmigrate detokenizer", "qmigrate ingest",
                                                 "qmigrate worker w1", "qmigrate worker w2")}
        waves = [H.prompts(21 + k, f"f{k}-", n=3, new_tokens=120) for k in range(4)]
        second = H.prompts(29, "g", n=3, new_tokens=20)
        started = time.monotonic()

        def sender(kind, endpoint, options=()):
            sock = ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            for key, value in options:
                sock.setsockopt(key, value)
            sock.connect(endpoint)
            socks.append(sock)

            def send(frame: bytes):
                try:
                    sock.send(frame, zmq.NOBLOCK)
                except zmq.Again:
                    pass
            return send

        targets = [(ROUTER_EXAMPLES, [int(t) for t in P.MsgType], zmq.DEALER, router, [(zmq.IDENTITY, b"fuzzer")]),
                   (TELEMETRY_EXAMPLES, [int(P.MsgType.VRAM_REPORT)], zmq.PUB, f"tcp://127.0.0.1:{ports[1]}", ()),
                   (DETOK_EXAMPLES, [int(P.MsgType.TOKENS), int(P.MsgType.REQUEST_META)], zmq.PUSH,
                    f"tcp://127.0.0.1:{ports[3]}", ()),
                   (KV_EXAMPLES, [int(P.MsgType.KV_HEADER)], zmq.PUSH, f"tcp://127.0.0.1:{ports[4]}", ())]
        sent = 0
        for wave, (examples, types, kind, endpoint, options) in zip(waves, targets):
            _feed(ingest, wave)  # each port is fuzzed while requests run
            sent += _fuzz(frames_for(examples, types), sender(kind, endpoint, options))
        assert sent >= 5_000, sent
        print(f"fuzzed with {sent} messages in {time.monotonic() - started:.1f} s; router stats {H.stats(router)}")

        _feed(ingest, second)
        everything = [p for wave in waves for p in wave] + second
        deadline = time.monotonic() + 180
        while True:
            out.seek(0)
            text = out.read()
            if text.count('"done": true') >= len(everything):
                break
            assert time.monotonic() < deadline and node.poll() is None, f"unfinished\n{text[-2000:]}"
            time.sleep(0.2)
        assert {t: H.pid_of(node, t) for t in roles} == roles, "a role died or was started again"
    finally:
        for sock in socks:
            sock.close(linger=0)
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGTERM)
            node.wait(30)
    err.seek(0)
    assert "starting it again" not in err.read()
    check_outputs(text, everything, tiny_model_dir)
