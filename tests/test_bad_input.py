"""Bad input is a per-request error, decided once: bytes that are not UTF-8, lone surrogates,
numbers past the wire's bounds and deep JSON, on stdin, in JSONL and over HTTP, each get an
error record (a 400 over HTTP) while every other request goes on. A Submit the router cannot
take is answered, and ingest splits it so one bad request never holds back the rest."""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading

import msgpack
import pytest
import yaml
import zmq

import warm

from qmigrate.config import local_topology
from qmigrate.detokenizer import EXIT_REQUESTS_FAILED
from qmigrate.wire import protocol as P
from qmigrate.wire import codec
from qmigrate.wire import transport
from test_http import CHAT, GOOD, make_server, post  # noqa: F401 (make_server: a fixture)

pytestmark = pytest.mark.timeout(240)


def _topology(tmp_path, model_dir, input_mode: str) -> str:
    data = {"transport": "ipc", "ipc_dir": str(tmp_path / "ipc"), "model": {"path": str(model_dir)},
            "nodes": [{"name": "local"}], "router": {"node": "local"},
            "ingest": {"node": "local", "input": input_mode},
            "detokenizer": {"node": "local", "output": "jsonl"},
            "defaults": {"max_new_tokens": 3},
            "workers": [{"name": "w1", "node": "local", "device": "cpu", "max_num_seqs": 8}]}
    path = tmp_path / f"topo-{input_mode}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


class _Sim:
    """`qmigrate sim` on a topology with `stdin`, running from here on (a thread feeds it and
    reads its output); result() waits for it."""

    def __init__(self, config: str, stdin: bytes):
        self.proc = warm.popen(["sim", config], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.output = (b"", b"")
        self.thread = threading.Thread(target=self._communicate, args=(stdin,), daemon=True)
        self.thread.start()

    def _communicate(self, stdin: bytes) -> None:
        self.output = self.proc.communicate(stdin)

    def result(self, timeout: float = 180) -> tuple[int, list[dict], str]:
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.stop()
            pytest.fail(f"qmigrate sim hung\n{self.output[1].decode(errors='replace')[-3000:]}")
        out, err = self.output
        records = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
        return self.proc.returncode, records, err.decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
        self.thread.join(30)


def _text_lines() -> list[bytes]:
    junk = random.Random(7).randbytes(1500)
    return [b"Hello there", b"hello \xff world", b"\xc3\x28", b"Good morning"] + junk.split(b"\n") + [b"The end"]


_BAD = {
    "topk": '{"id": "topk", "prompt": "x", "top_k": 2147483648}',
    "topk64": '{"id": "topk64", "prompt": "x", "top_k": 18446744073709551616}',
    "stops": json.dumps({"id": "stops", "prompt": "x", "stop": [[5]] * 65}),
    "stoplen": json.dumps({"id": "stoplen", "prompt": "x", "stop": [[5] * 65]}),
    "sur": '{"id": "sur", "prompt": "a\\ud800b"}',
    "deep": '{"id": "deep", "prompt": "x", "stop": ' + "[" * 1000 + "]" * 1000 + "}",
}


def _jsonl_lines() -> list[bytes]:
    good = [json.dumps({"id": f"g{i}", "prompt_ids": [1, 7 + i, 9], "max_new_tokens": 3}) for i in range(3)]
    dup = '{"id": "dup", "prompt": " "}'  # two errors under one id: before, the second was lost and sim never ended
    lines = [line.encode() for line in (good[0], *_BAD.values(), good[1], "\\xff", good[2], dup, dup)]
    r = random.Random(21)
    for _ in range(50):
        if r.random() < 0.2:
            lines.append(r.randbytes(r.randrange(1, 40)).replace(b"\n", b"\xff"))
        else:
            lines.append(_fuzz_line(r).encode("utf-8", "surrogatepass"))
    lines.append(json.dumps({"id": "last", "prompt_ids": [1, 4, 8], "max_new_tokens": 2}).encode())
    return lines


@pytest.fixture(scope="module")
def sims(tmp_path_factory, tiny_model_dir):
    """Both simulations of the two tests below, started together (each spends most of its
    start in its one worker, on one core)."""
    tmp = tmp_path_factory.mktemp("sims")
    started = {}
    try:
        for key, mode, lines in (("text", "text", _text_lines()), ("jsonl", "jsonl", _jsonl_lines()),
                                 ("errors", "jsonl", [b"\xff", b'{"id": "e", "prompt": ""}', b"{"])):
            (tmp / key).mkdir()
            started[key] = _Sim(_topology(tmp / key, tiny_model_dir, mode), b"\n".join(lines) + b"\n")
        yield started
    finally:
        for sim in started.values():
            sim.stop()


def test_sim_survives_bytes_that_are_not_utf8(sims):
    """`printf 'hello \\xff world\\n' | qmigrate sim` ended in a traceback and no output; now
    that line is an error record and the others answer. Random bytes likewise."""
    lines = _text_lines()
    rc, records, err = sims["text"].result()
    assert rc == EXIT_REQUESTS_FAILED and "Traceback" not in err, err[-3000:]  # some lines failed
    finals = {r["id"]: r for r in records if r.get("done")}
    assert set(finals) == {str(i) for i in range(1, len(lines) + 1)}, sorted(finals)
    for good in ("1", "4", str(len(lines))):
        assert "error" not in finals[good] and len(finals[good]["token_ids"]) == 3, finals[good]
    assert "not valid UTF-8" in finals["2"]["error"] and "not valid UTF-8" in finals["3"]["error"]


def test_sim_exits_non_zero_when_every_request_failed(sims):
    rc, records, err = sims["errors"].result()
    assert rc == EXIT_REQUESTS_FAILED and "Traceback" not in err, err[-3000:]
    assert len(records) == 3 and all(r["done"] and r["error"] for r in records), records
    assert "3 of 3 requests failed" in err, err[-3000:]


def test_sim_jsonl_past_the_wire_bounds(sims):
    """Each of these passed ingest before, and then was dropped by the router (resent forever,
    holding back everything), crashed ingest (OverflowError, a surrogate) or raised a
    RecursionError. Each is now its request's error; the requests around them answer. Then
    fuzzed lines and random bytes: the node runs to the end and every line has its record."""
    lines = _jsonl_lines()
    rc, records, err = sims["jsonl"].result()
    assert rc == EXIT_REQUESTS_FAILED and "Traceback" not in err, err[-3000:]
    finals = {r["id"]: r for r in records if r.get("done")}
    for i in range(3):
        assert "error" not in finals[f"g{i}"] and len(finals[f"g{i}"]["token_ids"]) == 3, finals
    errors = {r["id"]: r["error"] for r in records if "error" in r}
    assert [r["id"] for r in records if "error" in r].count("dup") == 2
    # "sur" and "deep" are refused as JSON, and keep the id each line gives
    assert {"topk", "topk64", "stops", "stoplen", "sur", "deep", "9"} <= set(errors), errors
    assert "top_k" in errors["topk"] and "top_k" in errors["topk64"] and "surrogate" in errors["sur"]
    assert "nested" in errors["deep"] and "at most 64" in errors["stops"] and "at most 64" in errors["stoplen"]
    assert len(finals["last"]["token_ids"]) == 2
    # a cancel line ends no request and is no record of its own; every other line has one
    num_finals = sum(1 for rec in records if rec.get("done"))
    assert num_finals >= len(lines) - sum(b'"cancel"' in line for line in lines), num_finals


@pytest.fixture
def topo(tmp_path, tiny_model_dir):
    return local_topology(1, str(tiny_model_dir), str(tmp_path), input="jsonl", output="jsonl")


def _close(*socks) -> None:
    for sock in socks:
        sock.close(linger=0)


def test_the_router_answers_a_submit_it_cannot_decode(topo):
    from qmigrate.router.loop import Router
    router = Router(topo)
    client = transport.socket(zmq.DEALER, connect=topo.endpoint("router").connect, identity="ingest-1")
    try:
        spec = P.SeqSpec(5, P.pack_i32([1, 2]), 2, 3)
        body = msgpack.unpackb(codec.encode(P.Submit([spec], ["a"])), raw=False)
        body[1][0][6] = 1 << 31  # top_k past the wire's bound
        client.send(msgpack.packb(body, use_bin_type=True))
        reply = None
        for _ in range(100):
            router.drain_socket()
            if (got := transport.recv(client, 0.02)) is not None:
                reply = got[1]
                break
        assert isinstance(reply, P.Reject) and "top_k" in reply.reason and not reply.is_unknown_peer, reply
        assert not router.sched.seqs and router.errors["submit_refused"] == 1
    finally:
        _close(client, router.work, router.telemetry, router.out.detok)


def test_ingest_splits_a_refused_submit_and_the_rest_go_on(topo):
    """A request that slipped past ingest's checks does not hold back the ones sent with it:
    the Submit is halved on each refusal until the bad one is alone, and that one becomes
    an error record; the other requests are all admitted."""
    from qmigrate.ingest.loop import Ingest
    from qmigrate.ingest.prompts import Prompt
    from qmigrate.router.loop import Router
    router = Router(topo)
    ingest = Ingest(topo, read_stdin=False)
    try:
        for i in range(12):
            prompt = Prompt(f"r{i}", [1, 2, 3], 2, 0.0, 1.0, 0, 1, [])
            ingest.enqueue(ingest.id_base | (i + 1), prompt, P.ROUTE_STDOUT)
        bad = ingest.pending[7][0]
        ingest.pending[7] = (P.SeqSpec(bad.seq_id, bad.token_ids, 3, 2, top_k=1 << 31), "r7", P.ROUTE_STDOUT, "")
        ingest.num_requests = 12
        for _ in range(400):
            ingest.submit()
            if router.work.poll(5):
                router.drain_socket()
            if ingest.router.poll(5):
                ingest.on_router()
            if not ingest.pending and not ingest.awaiting_ack and not ingest.errors:
                break
        admitted = {router.out.outputs.req_ids[s] for s in router.sched.seqs}
        assert admitted == {f"r{i}" for i in range(12)} - {"r7"}, admitted
        (req_id, message), = router.out.outputs.errors.values()
        assert req_id == "r7" and "top_k" in message
    finally:
        _close(ingest.router, ingest.feed, ingest.replies, router.work, router.telemetry, router.out.detok)


# --- fuzz: random values for every key, random bytes ---------------------------------------

_KEYS = ["id", "prompt", "prompt_ids", "messages", "max_new_tokens", "temperature", "top_p", "top_k",
         "seed", "stop", "ignore_eos", "min_tokens", "cancel", "model", "max_tokens", "stream", "n"]


def _value(r: random.Random, depth: int = 0):
    kind = r.randrange(12 if depth < 3 else 8)
    if kind == 0:
        return r.choice([0, 1, -1, 3, 2**30, 2**30 + 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30])
    if kind == 1:
        return r.choice([0.0, 0.5, 1.0, 2.5, -1e-9, 1e4, 1e4 + 1, 1e308, 5e-324])
    if kind == 2:
        return r.choice(["", "x", "Hello", "\ud800", "a\udfffb", "\U0001f600", "\x00", "é" * 300, "stop"])
    if kind == 3:
        return r.choice([True, False, None])
    if kind == 4:
        return [r.randrange(-2, 600) for _ in range(r.randrange(0, 80))]
    if kind == 5:
        return [[r.randrange(0, 512)] * r.randrange(1, 70)] * r.randrange(1, 70)
    if kind == 6:
        n = r.randrange(1, 200)
        return json.loads("[" * n + "]" * n)
    if kind == 7:
        return [{"role": r.choice(["user", "system", "bot"]), "content": r.choice(["hi", "\udc00", 5])}]
    if kind < 10:
        return [_value(r, depth + 1) for _ in range(r.randrange(0, 4))]
    return {r.choice(_KEYS): _value(r, depth + 1) for _ in range(r.randrange(0, 3))}


def _fuzz_line(r: random.Random) -> str:
    if r.random() < 0.15:
        return r.randbytes(r.randrange(1, 60)).decode("utf-8", "replace").replace("\n", " ")
    obj = {r.choice(_KEYS): _value(r) for _ in range(r.randrange(1, 5))}
    if r.random() < 0.5:
        obj["prompt_ids"] = [1, 5, 9]
        obj.pop("prompt", None), obj.pop("messages", None)
    obj["max_new_tokens"] = r.choice([None, 2, 0, "3", 2**64])  # nothing runs long
    return json.dumps(obj, ensure_ascii=r.random() < 0.5)


def test_fuzzed_lines_are_a_prompt_or_an_error_and_every_prompt_fits_the_wire(tiny_model_dir):
    """Thousands of random requests through ingest's parser: each is a Prompt that the codec
    takes, a cancel, or a PromptError; nothing else escapes (no TypeError, OverflowError,
    RecursionError, UnicodeEncodeError)."""
    from qmigrate.hub.tokenizer_info import load_tokenizer_info
    from qmigrate.ingest.prompts import CancelRequest, Prompt, PromptError, check_prompt, parse_line
    tok, max_context, eos = load_tokenizer_info(str(tiny_model_dir))
    r = random.Random(25)
    kinds = {"prompt": 0, "error": 0, "cancel": 0}
    for line_no in range(1, 1501):
        line = _fuzz_line(r)
        try:
            got = parse_line(line, mode=r.choice(["jsonl", "jsonl", "text"]), line_no=line_no, tokenizer=tok,
                             max_context=max_context, eos_ids=eos)
        except PromptError as exc:
            kinds["error"] += 1
            assert exc.req_id and exc.message
            continue
        if isinstance(got, CancelRequest):
            kinds["cancel"] += 1
            continue
        assert isinstance(got, Prompt)
        check_prompt(got, eos)
        kinds["prompt"] += 1
    assert kinds["prompt"] > 100 and kinds["error"] > 100, kinds


def test_http_bad_input_is_a_400_and_the_server_goes_on(make_server):
    """A lone surrogate was a 500 with a traceback, JSON 1,000 deep a 500 (RecursionError),
    top_k past 2**30 or 2**64 passed and then wedged ingest. Each is now a 400 naming it."""
    server, _ = make_server(["Hel", "lo"])
    cases = [
        (None, b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}', "surrogate"),
        (None, b'{"model": "tiny", "prompt": "x", "stop": ' + b"[" * 1000 + b"]" * 1000 + b"}", "nested"),
        ({**GOOD, "top_k": 2**31}, None, "top_k"),
        ({**GOOD, "top_k": 2**64}, None, "top_k"),
        ({**GOOD, "seed": 2**64}, None, "seed"),
        ({**GOOD, "stop": ["x " * 70]}, None, "stop"),
        ({**CHAT, "messages": [{"role": "user", "content": "\udc00"}]}, None, "surrogate"),
    ]
    for body, raw, word in cases:
        if body is not None:
            raw = json.dumps(body).encode("utf-8", "surrogatepass")
        status, reply = post(server, "/v1/completions" if b"messages" not in raw else "/v1/chat/completions",
                             None, raw)
        assert status == 400 and word in reply["error"]["message"], (raw[:80], status, reply)
        status, ok = post(server, "/v1/completions", GOOD)
        assert status == 200 and ok["choices"][0]["text"] == "Hello"


def test_fuzzed_bodies_into_the_http_api(make_server):
    """Random bodies and bytes: never a 5xx, and good requests answer between them."""
    server, _ = make_server(["ok"])
    r = random.Random(5)
    for i in range(150):
        if r.random() < 0.2:
            raw = r.randbytes(r.randrange(0, 200))
        else:
            body = {k: _value(r) for k in r.sample(_KEYS, r.randrange(1, 6))}
            body.setdefault("model", "tiny")
            body.pop("max_tokens", None)
            raw = json.dumps(body, ensure_ascii=r.random() < 0.5).encode("utf-8", "surrogatepass")
        path = r.choice(["/v1/completions", "/v1/chat/completions"])
        status, reply = post(server, path, None, raw)
        assert status < 500, (raw[:200], status, reply)
        if i % 30 == 0:
            assert post(server, "/v1/completions", GOOD)[0] == 200


def test_warnings_for_malformed_frames_are_rate_limited(topo, caplog):
    """Each dropped frame logged one warning: 200,000 fuzzed frames made 16 MB of stderr.
    Now the first ten are logged, then one line an interval with the count left out."""
    import logging

    from qmigrate.ops import logs
    from qmigrate.router.loop import Router
    logs.dropped.reset()  # one throttle per process: what earlier tests dropped counts there
    router = Router(topo)
    client = transport.socket(zmq.DEALER, connect=topo.endpoint("router").connect, identity="fuzz")
    try:
        with caplog.at_level(logging.WARNING):
            for i in range(3000):
                client.send(b"\xc1junk" + bytes([i % 256]))
                if i % 500 == 499:
                    while router.work.poll(20):
                        router.drain_socket()
        lines = [r for r in caplog.records if "malformed" in r.getMessage()]
        assert router.errors["malformed"] == 3000
        assert 10 <= len(lines) <= 12, len(lines)
    finally:
        _close(client, router.work, router.telemetry, router.out.detok)


def test_throttled_logs_the_first_then_one_an_interval():
    import logging

    from qmigrate.ops.logs import Throttled
    now = [0.0]
    seen = []
    logger = logging.getLogger("throttle-test")
    logger.warning = lambda fmt, *args: seen.append(fmt % args)  # noqa: E731
    warn = Throttled(logger, first=3, interval_s=10.0, clock=lambda: now[0])
    for i in range(1000):
        now[0] = i * 0.1  # 100 s in all
        warn.warning("dropped %d", i)
    assert seen[:3] == ["dropped 0", "dropped 1", "dropped 2"] and 12 <= len(seen) <= 14
    assert seen[4].endswith("(and 99 more like it not logged)"), seen[4]


def _flood_lines(caplog, text: str, flood) -> int:
    import logging

    from qmigrate.ops import logs
    logs.dropped.reset()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        flood()
    return sum(text in r.getMessage() for r in caplog.records)


def test_a_frame_flood_into_any_role_logs_a_bounded_number_of_lines(topo, caplog):
    """Each of these paths logged one line per frame (50,000 frames: 50,000 lines). Through
    ops/logs.dropped: the first ten of a kind, then one line per 10 s."""
    import torch

    from qmigrate.detokenizer.loop import Detokenizer
    from qmigrate.router.loop import Router
    from qmigrate.worker.loop import _kv_tensor
    n = 2000
    router = Router(topo)
    client = transport.socket(zmq.DEALER, connect=topo.endpoint("router").connect, identity="flood")

    def into_router():
        for i in range(n):
            client.send(codec.encode(P.Reject("no role receives this at the router")))
            if i % 500 == 499:
                while router.work.poll(50):
                    router.drain_socket()
        while router.work.poll(50):
            router.drain_socket()
    try:
        assert 10 <= _flood_lines(caplog, "no handler for Reject", into_router) <= 11
        assert router.errors["unexpected_message"] == n
    finally:
        _close(client, router.work, router.telemetry, router.out.detok)

    detok = Detokenizer(topo)
    try:
        frame = codec.encode(P.Reject("not for the detokenizer"))
        assert 10 <= _flood_lines(caplog, "dropped a message", lambda: [detok.receive(frame) for _ in range(n)]) <= 11
    finally:
        _close(detok.pull, detok.router, detok.replies)

    bad_dtype = P.KVHeader(1, 2, 3, "no-such-dtype", [2, 1, 3, 1, 4], 0)
    short = P.KVHeader(1, 2, 3, "float32", [2, 1, 3, 1, 4], 0)
    assert 10 <= _flood_lines(caplog, "KV shipment with bad dtype",
                              lambda: [_kv_tensor(bad_dtype, b"") for _ in range(n)]) <= 11
    assert 10 <= _flood_lines(caplog, "KV shipment of 7 bytes",
                              lambda: [_kv_tensor(short, b"1234567") for _ in range(n)]) <= 11
    assert _kv_tensor(short, bytes(2 * 3 * 4 * 4)).shape == torch.Size([2, 1, 3, 1, 4])


def test_a_flood_of_one_kind_hides_no_other_kind():
    import logging

    from qmigrate.ops.logs import Throttled
    seen = []
    logger = logging.getLogger("throttle-kinds")
    logger.warning = lambda fmt, *args: seen.append(fmt % args)  # noqa: E731
    warn = Throttled(logger, first=3, interval_s=10.0, clock=lambda: 0.0)
    for i in range(1000):
        warn.warning("flood %d", i)
    warn.warning("other %d", 1)
    assert seen == ["flood 0", "flood 1", "flood 2", "flood 3", "other 1"]  # then one per 10 s


def test_a_submit_lost_with_a_router_that_restarted_goes_again_without_waiting_for_its_ack(topo, monkeypatch):
    """Ingest learns the router's incarnation from its acks and stats. A Submit sent to a router
    that then dies is sent again as soon as a router of another incarnation answers a stats
    request (asked for while the ack is late), not after ACK_TIMEOUT_S: requests typed while
    the router restarted do not wait that long."""
    from qmigrate.ingest import loop as ingest_loop
    from qmigrate.ingest.prompts import Prompt
    from qmigrate.router.loop import Router
    monkeypatch.setattr(ingest_loop, "ACK_TIMEOUT_S", 1e9)   # the ack timeout never fires here
    ingest = ingest_loop.Ingest(topo, read_stdin=False)
    router = Router(topo)
    second = None

    def offer(r: int, router) -> None:
        ingest.enqueue(ingest.id_base | r, Prompt(f"r{r}", [1, 2, 3], 2, 0.0, 1.0, 0, 1, []), P.ROUTE_STDOUT)

    def run_until(router, done, rounds: int = 400) -> bool:
        for _ in range(rounds):
            ingest.submit()
            if router.work.poll(5):
                router.drain_socket()
            if ingest.router.poll(5):
                ingest.on_router()
            if done():
                return True
        return False

    try:
        offer(1, router)
        assert run_until(router, lambda: not ingest.pending and not ingest.awaiting_ack)
        assert ingest.router_incarnation == router.incarnation
        offer(2, router)
        ingest.submit()
        assert ingest.awaiting_ack
        _close(router.work, router.telemetry, router.out.detok)   # it dies with the Submit unread
        second = Router(topo)
        assert second.incarnation != router.incarnation
        assert run_until(second, lambda: len(second.sched.seqs) == 1 and not ingest.awaiting_ack)
        assert {second.out.outputs.req_ids[s] for s in second.sched.seqs} == {"r2"}
    finally:
        _close(ingest.router, ingest.feed, ingest.replies)
        if second is not None:
            _close(second.work, second.telemetry, second.out.detok)
