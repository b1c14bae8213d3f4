"""What one HTTP client can take from the API's other clients: a prompt near the body limit
is refused before it is tokenized and never on the event loop, a connection that does not
finish its request in time is closed, one address holds a bounded number of connections,
and a request aiohttp cannot parse is one log line. /health answers throughout."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time

import pytest

from qmigrate.config import IngestConfig
from qmigrate.hub.tokenizer_info import max_token_chars
from qmigrate.ingest.http import HttpServer
from qmigrate.ingest.prompts import Defaults, PromptError, parse_request
from test_http import FakeIngest, free_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server(tiny_chat_model_dir):
    made = []

    def make(**settings) -> HttpServer:
        cfg = IngestConfig(node="local", http_port=free_port(), model_name="tiny", **settings)
        srv = HttpServer(cfg, str(tiny_chat_model_dir), Defaults(max_new_tokens=8))
        srv.start()
        srv.num_serving = 1
        made.append(FakeIngest(srv, ["ok"]))
        return srv
    yield make
    for fake in made:
        fake.stopping.set()


def _health_s(srv: HttpServer, source: str = "127.0.0.1", timeout_s: float = 30) -> float:
    """Seconds /health took to answer (from `source`, an address on the loopback)."""
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", srv.cfg.http_port, timeout=timeout_s,
                                      source_address=(source, 0))
    conn.request("GET", "/health")
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    resp.read()
    conn.close()
    return time.monotonic() - started


def _post(srv: HttpServer, body: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.cfg.http_port, timeout=60)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def test_no_text_is_fewer_tokens_than_its_characters_over_the_longest_token(tiny_chat_model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    per_token = max_token_chars(tok)
    longest = max(tok.get_vocab(), key=len)
    assert per_token == len(longest) >= 2
    import random
    r = random.Random(3)
    alphabet = "abc xyz\n\t.,;é漢字🙂" + "".join(longest)
    for _ in range(200):
        text = "".join(r.choice(alphabet) for _ in range(r.randrange(1, 400)))
        for repeat in (1, 7):
            t = (longest * repeat) if repeat > 1 else text
            assert len(tok.encode(t, add_special_tokens=False)) * per_token >= len(t)


class _NoEncode:
    """A tokenizer that must not be asked to encode."""

    def __init__(self, tok):
        self.tok = tok

    def get_vocab(self):
        return self.tok.get_vocab()

    def __len__(self):
        return len(self.tok)

    def encode(self, *args, **kw):
        raise AssertionError("tokenized a prompt surely past the context")

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.mark.parametrize("kind", ["prompt", "messages"])
def test_a_prompt_surely_past_the_context_is_refused_untokenized(tiny_chat_model_dir, kind):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    per_token, max_context = max_token_chars(tok), 64
    text = "a" * (max_context * per_token + 1)
    obj = {"prompt": text} if kind == "prompt" else {"messages": [{"role": "user", "content": text}]}
    with pytest.raises(PromptError, match="the model's context is 64"):
        parse_request(obj, "r", tokenizer=_NoEncode(tok), max_context=max_context)
    short = "a" * (max_context * per_token)  # not surely past: tokenized and counted
    obj = {"prompt": short} if kind == "prompt" else {"messages": [{"role": "user", "content": short}]}
    with pytest.raises(AssertionError, match="tokenized"):
        parse_request(obj, "r", tokenizer=_NoEncode(tok), max_context=max_context)


def test_twenty_prompts_near_the_body_limit_leave_health_answering(server):
    srv = server(max_body_bytes=1 << 20)
    words = ("hello world the quick brown fox " * 40000)[: (1 << 20) - 200]
    body = json.dumps({"model": "tiny", "prompt": words, "max_tokens": 4}).encode()
    assert len(body) < 1 << 20
    results, worst = [], [0.0]
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            worst[0] = max(worst[0], _health_s(srv))
            time.sleep(0.02)
    poller = threading.Thread(target=poll)
    poller.start()
    posts = [threading.Thread(target=lambda: results.append(_post(srv, body))) for _ in range(20)]
    try:
        for t in posts:
            t.start()
        for t in posts:
            t.join(60)
    finally:
        stop.set()
        poller.join()
    assert [status for status, _ in results] == [400] * 20
    assert all(r["error"]["code"] == "context_length_exceeded" for _, r in results)
    assert worst[0] < 1.0, f"/health took {worst[0]:.2f} s while the prompts were parsed"
    status, ok = _post(srv, json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 4}).encode())
    assert status == 200 and ok["choices"][0]["text"] == "ok"


def _half_sent(port: int, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(data)
    return s


def _closed_within(s: socket.socket, timeout_s: float, answer: list | None = None) -> bool:
    """Whether the server closed the connection within timeout_s (any answer, then EOF);
    what it answered is appended to `answer`."""
    s.settimeout(timeout_s)
    deadline = time.monotonic() + timeout_s
    got = b""
    try:
        while time.monotonic() < deadline:
            data = s.recv(65536)
            if not data:
                return True
            got += data
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    finally:
        if answer is not None:
            answer.append(got)
    return False


def test_half_sent_requests_are_closed_after_the_read_timeout(server):
    srv = server(http_read_timeout_s=1.0)
    port = srv.cfg.http_port
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    slow = [_half_sent(port, head[:n]) for n in (0, 10, len(head))]             # headers never end
    body = b'{"model": "tiny", "prompt": "Hel'
    slow.append(_half_sent(port, head + b"Content-Length: 1000\r\n\r\n" + body))   # the body never ends
    try:
        assert _health_s(srv) < 1.0   # while they wait
        started = time.monotonic()
        answers = []
        closed = [_closed_within(s, 10, answers) for s in slow]
        assert closed == [True] * len(slow), closed
        assert answers[:3] == [b"", b"", b""] and answers[3].startswith(b"HTTP/1.1 408"), answers
        assert 0.8 <= time.monotonic() - started < 6
        assert _health_s(srv) < 1.0
    finally:
        for s in slow:
            s.close()


def test_one_address_holds_a_bounded_number_of_connections(server):
    srv = server(http_max_connections_per_client=4, http_read_timeout_s=60)
    port = srv.cfg.http_port
    held = [_half_sent(port, b"GET /hea") for _ in range(4)]
    extra = [_half_sent(port, b"GET /hea") for _ in range(3)]
    try:
        assert all(_closed_within(s, 5) for s in extra)          # closed at once, not at the timeout
        assert not any(_closed_within(s, 0.3) for s in held)      # the first four wait their turn
        assert _health_s(srv, source="127.0.0.2") < 1.0           # another address is served
        assert srv.client_limit.num_refused == 3
    finally:
        for s in held + extra:
            s.close()
    deadline = time.monotonic() + 5
    while srv.client_limit.open.get("127.0.0.1") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _health_s(srv) < 1.0   # their slots are free again


def test_a_request_aiohttp_cannot_parse_is_one_short_log_line(server, caplog):
    from qmigrate.ops import logs
    srv = server()
    logs.dropped.reset()
    with caplog.at_level(logging.WARNING):
        for _ in range(30):
            s = _half_sent(srv.cfg.http_port, b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            _closed_within(s, 5)
            s.close()
        assert _health_s(srv) < 1.0

    lines = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert 10 <= len(lines) <= 11, [r.getMessage()[:100] for r in lines]
    assert all(r.exc_info is None and "\n" not in r.getMessage() for r in lines)
    assert "LineTooLong" in lines[0].getMessage() or "too long" in lines[0].getMessage().lower(), lines[0].getMessage()
