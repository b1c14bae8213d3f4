"""The HTTP server in-process, with a fake ingest loop on the other side of its handoff:
bad input gets 4xx and the server keeps serving, a full handoff is a 429, silence is a 503,
and a client that goes away mid-stream cancels its request."""

from __future__ import annotations

import http.client
import itertools
import json
import queue
import socket
import threading

import pytest

from qmigrate.config import IngestConfig
from qmigrate.ingest.prompts import Defaults
from qmigrate.ingest.http import HttpServer


def free_port() -> int:
    from conftest import reserve_ports
    return reserve_ports(1)[0]   # outside the ephemeral range (helpers.free_port)


LONG = 100


FAIL_ID = 99  # a prompt ending in this id fails, as one a worker cannot run


class FakeIngest:
    """Takes requests off the server's handoff and answers each with `words`, one per event,
    and with `tag`, "<last prompt id>" as a last word. The choices of one request take turns,
    a word each, one event per turn."""

    def __init__(self, server: HttpServer, words: list[str] | None, tag: bool = False, gap_s: float = 0.0):
        self.server, self.words, self.tag, self.gap_s = server, words, tag, gap_s
        self.cancelled: queue.Queue = queue.Queue()
        self.submitted: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        threading.Thread(target=self.run, daemon=True).start()

    def run(self) -> None:
        while not self.stopping.is_set():
            while not self.server.cancels.empty():
                self.cancelled.put(self.server.cancels.get())
            if self.words is None:  # a stalled router: take nothing
                self.stopping.wait(0.01)
                continue
            try:
                choices = self.server.submissions.get(timeout=0.01)
            except queue.Empty:
                continue
            self.submitted.put(choices)
            streams = []
            for seq_id, prompt in choices:
                words = self.words + [f"<{prompt.prompt_ids[-1]}>"] if self.tag else self.words
                rows = [(seq_id, w, 0, i + 1) for i, w in enumerate(words)]
                if prompt.prompt_ids[-1] == FAIL_ID:
                    rows.append((seq_id, "", 5, len(words), 0))
                elif prompt.max_new_tokens < LONG:  # a long request never ends unless cancelled
                    rows.append((seq_id, "", 2, len(words), 0))
                streams.append(rows)
            for turn in itertools.zip_longest(*streams):
                self.server.deliver([row for row in turn if row is not None])
                self.stopping.wait(self.gap_s)   # a step apart: each turn its own event


@pytest.fixture(scope="module")
def make_server(tiny_chat_model_dir):
    started = []

    def make(words, max_pending=8, timeout_s=30.0, tag=False, gap_s=0.0):
        cfg = IngestConfig(node="local", http_port=free_port(), max_pending=max_pending,
                           http_timeout_s=timeout_s, max_body_bytes=4096, model_name="tiny")
        server = HttpServer(cfg, str(tiny_chat_model_dir), Defaults(max_new_tokens=8))
        server.start()
        fake = FakeIngest(server, words, tag, gap_s)
        started.append(fake)
        return server, fake
    yield make
    for fake in started:
        fake.stopping.set()


def post(server, path: str, body, raw: bytes | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", server.cfg.http_port, timeout=30)
    data = raw if raw is not None else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, resp.read()
    conn.close()
    return out[0], json.loads(out[1]) if out[1].startswith(b"{") else out[1]


GOOD = {"model": "tiny", "prompt": "Hello", "max_tokens": 8}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def test_answers_and_bad_input_gets_4xx_while_the_server_keeps_serving(make_server):
    server, _ = make_server(["Hel", "lo"])
    status, body = post(server, "/v1/completions", GOOD)
    assert status == 200 and body["choices"][0]["text"] == "Hello"
    assert body["usage"]["completion_tokens"] == 2
    cases = [
        ("/v1/completions", None, b"{not json", 400),
        ("/v1/completions", None, b"\xff\xfe", 400),
        ("/v1/completions", {**GOOD, "max_tokens": "many"}, None, 400),
        ("/v1/completions", {**GOOD, "model": "other"}, None, 404),
        ("/v1/completions", {**GOOD, "max_tokens": 0}, None, 400),
        ("/v1/completions", {**GOOD, "n": 129}, None, 400),
        ("/v1/completions", {**GOOD, "prompt": [[5]] * 3, "n": 200}, None, 400),
        ("/v1/completions", {**GOOD, "prompt": ["Hello", [5] * 600], "n": 2}, None, 400),
        ("/v1/chat/completions", {**CHAT, "messages": []}, None, 400),
        ("/v1/completions", {**GOOD, "prompt": "x" * 5000}, None, 413),
        ("/v1/nothing", GOOD, None, 404),
    ]
    for path, body, raw, expected in cases:
        status, reply = post(server, path, body, raw)
        assert status == expected, (path, body, raw, reply)
        assert reply["error"]["message"], reply
        status, ok = post(server, "/v1/chat/completions", CHAT)
        assert status == 200 and ok["choices"][0]["message"]["content"] == "Hello"


def test_a_stream_has_an_event_for_every_step_that_made_tokens_text_or_none(make_server):
    server, _ = make_server(["a", "", "b", ""], gap_s=0.1)
    for body, text_of in ((GOOD, lambda c: c["text"]), (CHAT, lambda c: c["delta"].get("content"))):
        status, raw = post(server, "/v1/completions" if body is GOOD else "/v1/chat/completions",
                           {**body, "stream": True})
        events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
        middle = [text_of(e["choices"][0]) for e in events if e["choices"][0]["finish_reason"] is None]
        assert status == 200 and middle == ["a", "", "b", ""], (body, middle)
        assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_a_full_handoff_is_a_429_and_silence_a_503(make_server):
    server, fake = make_server(None, max_pending=1, timeout_s=1.0)
    first = []
    waiter = threading.Thread(target=lambda: first.append(post(server, "/v1/completions", GOOD)))
    waiter.start()
    while server.submissions.empty():  # the first request waits in the handoff
        waiter.join(0.01)
    status, body = post(server, "/v1/completions", GOOD)
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"
    waiter.join()
    status, body = first[0]
    assert status == 503 and "no output within 1 s" in body["error"]["message"]
    assert fake.cancelled.get(timeout=5) > 0  # a request given up on is cancelled


def test_a_client_that_leaves_mid_stream_cancels_its_request(make_server):
    server, fake = make_server(["a", "b"])
    conn = http.client.HTTPConnection("127.0.0.1", server.cfg.http_port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({**GOOD, "max_tokens": LONG, "stream": True}))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    assert resp.readline().startswith(b"data: {")  # the stream is running and will never end
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    seq_id = fake.cancelled.get(timeout=10)
    assert seq_id not in server.streams


def test_models_and_health(make_server):
    server, _ = make_server(["x"])
    conn = http.client.HTTPConnection("127.0.0.1", server.cfg.http_port, timeout=10)
    conn.request("GET", "/v1/models")
    models = json.loads(conn.getresponse().read())
    assert [m["id"] for m in models["data"]] == ["tiny"]
    conn.request("GET", "/health")
    resp = conn.getresponse()
    assert (resp.status, json.loads(resp.read())["status"]) == (503, "starting")  # no worker yet
    server.num_serving = 1  # as the ingest loop sets it from the router's answer
    conn.request("GET", "/health")
    resp = conn.getresponse()
    assert (resp.status, json.loads(resp.read())["status"]) == (200, "ok")
    conn.close()


def test_an_api_key_is_needed_on_v1_but_not_for_health(tiny_chat_model_dir):
    cfg = IngestConfig(node="local", http_port=free_port(), model_name="tiny", api_key="s3cret")
    server = HttpServer(cfg, str(tiny_chat_model_dir), Defaults(max_new_tokens=8))
    server.start()
    fake = FakeIngest(server, ["ok"])
    try:
        for headers, expected in [({}, 401), ({"Authorization": "Bearer wrong"}, 401),
                                  ({"Authorization": "Basic s3cret"}, 401), ({"Authorization": "Bearer s3cret"}, 200)]:
            conn = http.client.HTTPConnection("127.0.0.1", cfg.http_port, timeout=30)
            conn.request("POST", "/v1/completions", json.dumps(GOOD), headers)
            resp = conn.getresponse()
            body = json.loads(resp.read())
            assert resp.status == expected, (headers, body)
            if expected == 401:
                assert body["error"]["code"] == "invalid_api_key"
            conn.request("GET", "/health")
            assert conn.getresponse().status == 503  # no key needed; no worker in this test
            conn.close()
    finally:
        fake.stopping.set()


def test_a_port_in_use_is_one_clear_line(tiny_chat_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cfg = IngestConfig(node="local", http_port=taken.getsockname()[1], model_name="tiny")
        with pytest.raises(SystemExit, match=f"cannot serve HTTP on http://127.0.0.1:{cfg.http_port}"):
            HttpServer(cfg, str(tiny_chat_model_dir), Defaults()).start()


def test_a_stream_cut_by_shutdown_ends_with_an_error_event_and_done(make_server):
    server, fake = make_server(["a", "b"])
    conn = http.client.HTTPConnection("127.0.0.1", server.cfg.http_port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({**GOOD, "max_tokens": LONG, "stream": True}))
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: {")  # running, and would never end
    waiting = []
    plain = threading.Thread(target=lambda: waiting.append(post(server, "/v1/completions", {**GOOD, "max_tokens": LONG})))
    plain.start()
    while len(server.streams) < 2:
        plain.join(0.01)
    server.shutdown()
    events = [line for line in resp.read().split(b"\n") if line.startswith(b"data: ")]
    conn.close()
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["code"] == "shutdown" and "shutting down" in error["message"]
    plain.join(10)
    status, body = waiting[0]
    assert status == 503 and body["error"]["code"] == "shutdown"
    assert not server.streams


def events(resp) -> list[bytes]:
    return [line.removeprefix(b"data: ") for line in resp.read().split(b"\n") if line.startswith(b"data: ")]


def test_n_and_a_batch_of_prompts_fan_out_into_choices_in_index_order(make_server):
    server, fake = make_server(["Hel", "lo"], tag=True)
    status, body = post(server, "/v1/completions", {**GOOD, "prompt": [[5, 6], [7]], "n": 2})
    assert status == 200, body
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == \
        [(0, "Hello<6>", "length"), (1, "Hello<6>", "length"), (2, "Hello<7>", "length"), (3, "Hello<7>", "length")]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    choices = fake.submitted.get(timeout=5)
    assert len(choices) == 4 and len({seq_id for seq_id, _ in choices}) == 4  # one submission, 4 requests
    assert not server.streams
    status, body = post(server, "/v1/chat/completions", {**CHAT, "n": 3})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert len({c["message"]["content"] for c in body["choices"]}) == 1


def test_a_fanned_out_stream_interleaves_choices_each_ending_alone_then_one_usage_and_done(make_server):
    server, _ = make_server(["a", "b"], tag=True)
    conn = http.client.HTTPConnection("127.0.0.1", server.cfg.http_port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({**GOOD, "prompt": [[5], [6]], "n": 2, "stream": True,
                                                        "stream_options": {"include_usage": True}}))
    got = events(conn.getresponse())
    conn.close()
    assert got[-1] == b"[DONE]" and got.count(b"[DONE]") == 1
    chunks = [json.loads(e) for e in got[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert chunks[-1]["usage"]["prompt_tokens"] == 2
    texts, ends = {}, {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        i = choice["index"]
        assert i not in ends, "text after its choice's finish chunk"
        texts[i] = texts.get(i, "") + choice["text"]
        if choice["finish_reason"]:
            ends[i] = choice["finish_reason"]
    assert texts == {0: "ab<5>", 1: "ab<5>", 2: "ab<6>", 3: "ab<6>"} and ends == dict.fromkeys(range(4), "length")
    order = [c["choices"][0]["index"] for c in chunks[:-1]]
    assert order[:4] == [0, 1, 2, 3]  # the choices' first words came together: one chunk each, by index

    conn = http.client.HTTPConnection("127.0.0.1", server.cfg.http_port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps({**CHAT, "n": 2, "stream": True}))
    chat = [json.loads(e) for e in events(conn.getresponse())[:-1]]
    conn.close()
    assert [c["choices"][0]["delta"] for c in chat[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert [c["choices"][0]["index"] for c in chat[:2]] == [0, 1]
    assert sum(1 for c in chat if c["choices"][0]["finish_reason"]) == 2


def test_a_client_that_leaves_cancels_every_choice(make_server):
    server, fake = make_server(["a", "b"])
    conn = http.client.HTTPConnection("127.0.0.1", server.cfg.http_port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({**GOOD, "max_tokens": LONG, "n": 3, "stream": True}))
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: {")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    submitted = {seq_id for seq_id, _ in fake.submitted.get(timeout=5)}
    cancelled = {fake.cancelled.get(timeout=10) for _ in range(3)}
    assert cancelled == submitted and not server.streams


def test_a_choice_the_worker_cannot_run_fails_the_request_and_cancels_the_others(make_server):
    server, fake = make_server(["a"], tag=True)
    status, body = post(server, "/v1/completions", {**GOOD, "prompt": [[5], [FAIL_ID]], "max_tokens": LONG})
    assert status == 500 and "choice 1" in body["error"]["message"]
    (first, _), (failed, _) = fake.submitted.get(timeout=5)
    assert fake.cancelled.get(timeout=10) == first  # choice 0 would run on: it is cancelled, 1 has ended
    assert fake.cancelled.empty() and not server.streams


def test_the_api_holds_prompts_to_the_workers_max_model_len(tiny_chat_model_dir):
    cfg = IngestConfig(node="n", http_port=1)
    full = HttpServer(cfg, str(tiny_chat_model_dir), Defaults()).max_context
    assert HttpServer(cfg, str(tiny_chat_model_dir), Defaults(), max_model_len=16).max_context == 16 < full
    assert HttpServer(cfg, str(tiny_chat_model_dir), Defaults(), max_model_len=full + 100).max_context == full


def get(server, path: str):
    conn = http.client.HTTPConnection("127.0.0.1", server.cfg.http_port, timeout=30)
    conn.request("GET", path)
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def test_a_model_by_id_tokenize_detokenize_and_version_in_vllms_shapes(make_server):
    server, _ = make_server(["x"])
    assert get(server, "/v1/models/tiny") == (200, {**get(server, "/v1/models")[1]["data"][0],
                                                   "created": get(server, "/v1/models/tiny")[1]["created"]})
    status, body = get(server, "/v1/models/gpt-9")
    assert (status, body["error"]["code"], body["error"]["param"]) == (404, "model_not_found", "model")
    assert get(server, "/version")[1]["version"]
    tok = server.tokenizer
    status, body = post(server, "/tokenize", {"model": "tiny", "prompt": "Hello world"})
    assert status == 200 and body["tokens"] == tok.encode("Hello world") and body["count"] == len(body["tokens"])
    assert (body["max_model_len"], body["token_strs"]) == (server.max_context, None)
    bare = post(server, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False,
                                      "return_token_strs": True})[1]
    assert bare["tokens"] == tok.encode("Hello world", add_special_tokens=False)
    assert bare["token_strs"] == tok.convert_ids_to_tokens(bare["tokens"])
    # the ids a chat request of these messages runs on (its usage counts them)
    status, chat = post(server, "/tokenize", {"model": "tiny", "messages": CHAT["messages"]})
    _, done = post(server, "/v1/chat/completions", CHAT)
    assert status == 200 and chat["count"] == done["usage"]["prompt_tokens"]
    closed = post(server, "/tokenize", {"messages": CHAT["messages"], "add_generation_prompt": False})[1]
    assert closed["count"] < chat["count"] and chat["tokens"][:closed["count"]] == closed["tokens"]
    assert post(server, "/detokenize", {"model": "tiny", "tokens": body["tokens"]}) == \
        (200, {"prompt": tok.decode(body["tokens"])})
    for path, bad, param in [("/tokenize", {"prompt": 5}, "prompt"),
                             ("/tokenize", {"prompt": "x", "frob": 1}, "frob"),
                             ("/tokenize", {"prompt": "x", "model": "gpt-9"}, "model"),
                             ("/tokenize", {"messages": []}, "messages"),
                             ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
                             ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
                             ("/detokenize", {"tokens": "1 2"}, "tokens")]:
        status, reply = post(server, path, bad)
        assert status in (400, 404) and reply["error"]["param"] == param, (path, bad, reply)
        assert f"'{param}'" in reply["error"]["message"], reply


def test_tokenize_needs_the_api_key_and_version_does_not(tiny_chat_model_dir):
    cfg = IngestConfig(node="local", http_port=free_port(), model_name="tiny", api_key="s3cret")
    server = HttpServer(cfg, str(tiny_chat_model_dir), Defaults(max_new_tokens=8))
    server.start()
    assert post(server, "/tokenize", {"prompt": "x"})[0] == 401
    assert post(server, "/detokenize", {"tokens": [5]})[0] == 401
    assert get(server, "/version")[0] == 200


def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(make_server):
    """vLLM's stream_options.continuous_usage_stats (it was refused): every chunk carries
    the usage of its choice so far, one choice or several."""
    server, _ = make_server(["a", "b", "c"], tag=True, gap_s=0.05)
    options = {"include_usage": True, "continuous_usage_stats": True}
    for body, num_choices in (({**GOOD, "prompt": [5, 6], "stream": True}, 1),
                              ({**GOOD, "prompt": [[5, 6], [7]], "n": 2, "stream": True}, 4)):
        conn = http.client.HTTPConnection("127.0.0.1", server.cfg.http_port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream_options": options}))
        chunks = [json.loads(e) for e in events(conn.getresponse())[:-1]]
        conn.close()
        seen = {}
        for c in chunks[:-1]:
            (choice,) = c["choices"]
            i, usage = choice["index"], c["usage"]
            seen[i] = seen.get(i, 0) + 1
            assert usage["prompt_tokens"] == (2 if i < 2 else 1)
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
            if choice["finish_reason"]:
                assert usage["completion_tokens"] == 4   # three words and the tag
            else:
                assert usage["completion_tokens"] == seen[i], (i, c)   # one word a chunk
        assert len(seen) == num_choices and chunks[-1]["choices"] == []
    conn = http.client.HTTPConnection("127.0.0.1", server.cfg.http_port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({**GOOD, "stream": True,
                                                        "stream_options": {"include_usage": True}}))
    plain = [json.loads(e) for e in events(conn.getresponse())[:-1]]
    conn.close()
    assert all(c["usage"] is None for c in plain[:-1])   # without it, only the last chunk has usage
