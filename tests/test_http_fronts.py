"""The HTTP API from two front processes on the one port (`ingest.http_processes: 2`), on a live
node with the tiny model: answers equal to generate() from both, fan-out, cancel on disconnect,
a 429 at capacity, a killed front replaced, and SIGTERM to ingest ending every open stream; and
a taken port, without a node."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import helpers as H
from test_http_e2e import MODEL, PROMPTS, expected  # noqa: F401 -- expected: the generate() fixture

from qmigrate.config import parse_topology
from qmigrate.ingest.front_supervisor import Fronts
from qmigrate.ingest.handoff import front_index
from qmigrate.ingest.prompts import Defaults
from qmigrate.wire import transport

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def node(tiny_chat_model_dir, tmp_path_factory):
    ingest = {"http_processes": 2, "max_pending": 256, "http_process_timeout_s": 4.0}
    tmp = tmp_path_factory.mktemp("http-fronts")
    node = H.HttpNode(tmp, tiny_chat_model_dir, ingest=ingest, trace_dir=tmp / "trace")
    try:
        node.wait_ready()
        yield node
    finally:
        node.stop()


def front_of(response_id: str) -> int:
    """The front that answered: its index is in the request's sequence id (cmpl-<seq id>)."""
    return int(front_index(np.array([int(response_id.rsplit("-", 1)[1], 16)]))[0])


def front_pids(node) -> dict[int, int]:
    return {int(title.rsplit(" ", 1)[1]): pid for title, pid in H.roles_of(node.proc).items()
            if title.startswith("qmigrate http ")}


def open_stream(node, body: dict) -> http.client.HTTPResponse:
    """A call on a connection of its own (streamed unless the body says otherwise)."""
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "stream": True, **body}),
                 {"Content-Type": "application/json"})
    return conn.getresponse()


def first_event(resp: http.client.HTTPResponse) -> dict:
    line = b""
    while not line.startswith(b"data: "):
        line = resp.readline()
    return json.loads(line[6:])


def is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def counters(node) -> dict:
    """The router's counters, or {} while it does not answer (a loaded machine)."""
    try:
        return node.stats(timeout_s=1)
    except transport.Unreachable:
        return {}


@contextlib.contextmanager
def worker_stopped(node, pid: int | None = None):
    """The worker held (SIGSTOP): no sequence makes a token, so none reaches its end, however
    fast the worker is; it goes on at the end. `pid`: the worker's, when looked up before."""
    pid = pid or H.pid_of(node.proc, "qmigrate worker")
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def held_streams(node, count: int):
    """`count` streams sent, and taken by the router, while the worker is stopped: each is
    open when ingest goes. Yields their connections."""
    wait_for(lambda: counters(node).get("live") == 0, what="no sequence live")
    with worker_stopped(node):
        conns = []
        for _ in range(count):
            conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=60)
            conn.request("POST", "/v1/completions", json.dumps(
                {"model": MODEL, "stream": True, "prompt": "Hello", "max_tokens": 400, "ignore_eos": True}),
                {"Content-Type": "application/json"})
            conns.append(conn)
        wait_for(lambda: counters(node).get("live", 0) == count, what=f"{count} streams at the router")
        yield conns


def assert_each_ends_with_shutdown(conns) -> None:
    for conn in conns:
        resp = conn.getresponse()
        try:
            tail = resp.read()
        except http.client.IncompleteRead as exc:   # the process ended before the chunked body's end
            tail = exc.partial
        assert tail.endswith(b"data: [DONE]\n\n") and b'"code": "shutdown"' in tail, tail[-300:]


def wait_for(condition, timeout_s: float = 30.0, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := condition():
            return got
        time.sleep(0.05)
    pytest.fail(f"not within {timeout_s} s: {what() if callable(what) else what}")


def two_fronts(model_dir, tmp_path, port: int, port_wait_s: float = 0.0) -> Fronts:
    """An ingest's two HTTP processes on `port`, not yet started, without a node."""
    topo = parse_topology({"transport": "ipc", "ipc_dir": str(tmp_path), "model": {"path": str(model_dir)},
                           "nodes": [{"name": "local"}], "router": {"node": "local"},
                           "detokenizer": {"node": "local"}, "workers": [{"name": "w1", "node": "local"}],
                           "ingest": {"node": "local", "http_port": port, "http_processes": 2}})
    return Fronts(topo, str(model_dir), Defaults(), 5 << 40, port_wait_s=port_wait_s)


@pytest.mark.parametrize("shared", [False, True], ids=["plain", "reuse_port"])
def test_a_taken_port_is_one_line_and_no_front_is_left(tiny_chat_model_dir, tmp_path, shared, monkeypatch):
    """Taken by another server's fronts (SO_REUSEPORT), the fronts could bind and would share
    its port: ingest finds it taken before it starts any. Taken by a plain socket, the fronts
    themselves fail (ingest's own look is left out here) and say why."""
    if not shared:
        monkeypatch.setattr("qmigrate.serve.bind_problem", lambda host, port: None)
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, int(shared))
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        fronts = two_fronts(tiny_chat_model_dir, tmp_path, port)
        try:
            with pytest.raises(SystemExit, match=f"^ingest: cannot serve HTTP on http://127.0.0.1:{port}: "
                                                 f"{'' if shared else 'OSError: '}.*(?i:address already in use)"):
                fronts.start()
        finally:
            pids = fronts.pids
            fronts.stop()
    assert len(pids) == (0 if shared else 2) and not any(is_alive(pid) for pid in pids)
    assert list(tmp_path.iterdir()) == []   # the socket's directory is gone with them


def test_an_ingest_started_again_waits_for_the_port_its_predecessors_fronts_hold(tiny_chat_model_dir, tmp_path):
    """The fronts of an ingest killed outright end their open streams before they let the port
    go, while the node has already started a new ingest: that one waits for the port."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    fronts = two_fronts(tiny_chat_model_dir, tmp_path, port, port_wait_s=30.0)
    try:
        with ThreadPoolExecutor(1) as pool:
            started = pool.submit(fronts.start)
            time.sleep(1.0)
            assert not started.done() and fronts.pids == []   # waiting, no front started yet
            taken.close()
            started.result(timeout=60)
        assert len(fronts.pids) == 2 and all(is_alive(pid) for pid in fronts.pids)
    finally:
        taken.close()
        pids = fronts.pids
        fronts.stop()
    assert not any(is_alive(pid) for pid in pids)


def test_concurrent_streamed_and_whole_requests_from_both_fronts_equal_generate(node, expected):
    wanted = {p: expected(expected.tok.encode(p), 5)[0] for p in PROMPTS}

    def one(i: int) -> tuple[str, str, str]:
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            whole = node.client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
            return prompt, whole.choices[0].text, whole.id
        chunks = list(node.client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                                     stream=True))
        return prompt, "".join(c.choices[0].text for c in chunks), chunks[0].id

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(64)))
    assert [text for _, text, _ in results] == [wanted[prompt] for prompt, _, _ in results]
    assert {front_of(rid) for _, _, rid in results} == {0, 1}   # the kernel spread them over both


def test_a_traced_node_times_the_replies_at_ingest_and_at_each_front(node):
    from qmigrate.ops import trace
    trace_dir = node.config.parent / "trace"

    def one(i: int) -> str:
        chunks = node.client.completions.create(model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=4,
                                                temperature=0, stream=True)
        return list(chunks)[0].id
    with ThreadPoolExecutor(16) as pool:
        assert {front_of(rid) for rid in pool.map(one, range(32))} == {0, 1}

    def hops() -> set[str]:
        return {line.split("-")[0] for line in trace.summarize(trace_dir) if ": messages in: " in line}
    def fronts() -> set[str]:   # each flushes its timeline once a second
        return {p.name.split("-")[1] for p in trace_dir.glob("http-*.jsonl") if '"in"' in p.read_text()}
    wait_for(lambda: {"detokenizer", "ingest", "http"} <= hops() and fronts() == {"0", "1"}, 15,
             "replies traced at every hop and at both HTTP processes")


def test_choices_and_several_prompts_fan_out_through_a_front(node, expected):
    batch_ids = [expected.tok.encode(p) for p in PROMPTS[1:]]
    single = [expected(p, 6)[0] for p in batch_ids]
    batch = node.client.completions.create(model=MODEL, prompt=batch_ids, max_tokens=6, temperature=0, n=2)
    assert [(c.index, c.text) for c in batch.choices] == [(i, single[i // 2]) for i in range(4)]
    stream = node.client.completions.create(model=MODEL, prompt=batch_ids, max_tokens=6, temperature=0, n=2,
                                            stream=True, stream_options={"include_usage": True})
    texts, chunks = {}, list(stream)
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {i: single[i // 2] for i in range(4)}
    assert chunks[-1].usage.completion_tokens == batch.usage.completion_tokens


def test_token_ids_come_back_through_each_front_beside_requests_without(node, expected, tiny_model_dir):
    """Requests that ask for their ids and requests that do not, at once through both fronts:
    a Replies message then holds rows of both kinds for both fronts, and each is split with
    its ids (ingest.handoff.split_by_front)."""
    from conftest import greedy_tokens
    prompts = [expected.tok.encode(p) for p in PROMPTS]
    wanted = {tuple(p): greedy_tokens(tiny_model_dir, p, 6) for p in prompts}

    def one(i: int):
        prompt, asks = prompts[i % len(prompts)], i % 4 < 2
        extra = {"extra_body": {"return_token_ids": True}} if asks else {}
        if i % 2:
            choice = node.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                                    **extra).choices[0]
            return prompt, asks, (choice.model_extra or {}).get("token_ids"), choice.text
        ids, text, chunks = [], "", node.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                                                   temperature=0, stream=True, **extra)
        for chunk in chunks:
            ids += (chunk.choices[0].model_extra or {}).get("token_ids") or []
            text += chunk.choices[0].text
        return prompt, asks, ids if asks else None, text

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(32)))
    for prompt, asks, ids, text in results:
        assert ids == (wanted[tuple(prompt)] if asks else None)
        assert text == expected(prompt, 6)[0]


def test_a_client_that_closes_mid_stream_frees_its_sequence(node):
    """Each stream closed after its first event, with the worker held so that it cannot end
    first; the router counts a cancel as it hears of it. The tiny model can write its 500
    tokens before the hold on a loaded machine (its first event read late), and the sequence
    then finishes instead: that race is tried again, up to three times a stream."""
    worker = H.pid_of(node.proc, "qmigrate worker")
    for i in range(4):   # on whichever front the kernel picks, most likely both
        tries = []
        for _ in range(3):
            before = wait_for(lambda: counters(node), what="the router's counters")
            resp = open_stream(node, {"prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True})
            first_event(resp)
            with worker_stopped(node, worker):
                resp.close()
                now = wait_for(lambda: (c := counters(node)) and any(c.get(k, 0) > before.get(k, 0) for k in
                                                                     ("cancelled", "finished")) and c,
                               what=f"cancel {i + 1} at the router")
            cancelled, finished = (now.get(k, 0) - before.get(k, 0) for k in ("cancelled", "finished"))
            tries.append((cancelled, finished))
            if cancelled or not finished:
                break
        assert tries[-1] == (1, 0), f"stream {i + 1}: (cancelled, finished) per try: {tries}"
    wait_for(lambda: counters(node).get("live") == 0, what="no sequence live")


def test_a_full_ingest_answers_429_and_the_requests_it_took_still_run(node):
    """With the router stopped, one request of 2 prompts x 128 choices fills ingest's
    max_pending (256); the next request is refused by ingest and its front answers 429."""
    router = H.pid_of(node.proc, "qmigrate router")
    big = {"model": MODEL, "prompt": [[5, 6, 7], [8, 9]], "n": 128, "max_tokens": 1, "extra_body": {"ignore_eos": True}}
    os.kill(router, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            taken = pool.submit(node.client.completions.create, **big)

            def refused():
                resp = open_stream(node, {"prompt": [5, 6], "max_tokens": 2})
                body = resp.read() if resp.status == 429 else None
                resp.close()   # one it took: cancelled again
                return body
            body = json.loads(wait_for(refused, what="a 429"))
            os.kill(router, signal.SIGCONT)
            assert body["error"]["code"] == "rate_limit_exceeded" and "at capacity" in body["error"]["message"]
            answer = taken.result(timeout=120)
    finally:
        os.kill(router, signal.SIGCONT)
    assert len(answer.choices) == 256 and answer.usage.completion_tokens == 256


def test_a_killed_front_is_replaced_and_the_other_fronts_streams_go_on(node):
    before = front_pids(node)
    assert sorted(before) == [0, 1]
    cancelled = node.stats().get("cancelled", 0)
    streams = [open_stream(node, {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True}) for _ in range(8)]
    on = {i: front_of(first_event(resp)["id"]) for i, resp in enumerate(streams)}
    os.kill(before[0], signal.SIGKILL)
    killed = [i for i, k in on.items() if k == 0]
    for i, resp in enumerate(streams):
        if i not in killed:   # the other front's streams go on
            for _ in range(5):
                assert first_event(resp)["choices"][0]["finish_reason"] is None
        else:   # no process holds its connection any more: it ends cut, without [DONE]
            with pytest.raises(http.client.IncompleteRead) as cut:
                resp.read()
            assert b"[DONE]" not in cut.value.partial and b'"error"' not in cut.value.partial
        resp.close()
    # The dead front's sequences are cancelled by ingest; the others by their clients, unless a
    # loaded machine let one finish before this thread closed it
    wait_for(lambda: (s := node.stats()).get("cancelled", 0) >= cancelled + len(killed) and s["live"] == 0,
             what="every sequence ended: the dead front's cancelled by ingest, none left running")
    wait_for(lambda: front_pids(node).get(0) not in (None, before[0]), what="a new front 0")
    assert "HTTP process 0 exited with status -9" in node.stderr.read_text()

    def served_by_the_new_front():   # a connection of its own each: the kernel picks a front for it
        resp = open_stream(node, {"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True, "stream": False})
        answer = json.loads(resp.read())
        assert answer["usage"]["completion_tokens"] == 2
        return front_of(answer["id"]) == 0
    wait_for(served_by_the_new_front, what="an answer from the new front 0")


def test_a_stopped_front_is_killed_and_replaced(node):
    """SIGSTOP: the kernel still hands the front its share of new connections, which nobody
    answers. Ingest hears no hello from it for http_process_timeout_s and replaces it."""
    before = front_pids(node)
    os.kill(before[1], signal.SIGSTOP)
    try:
        wait_for(lambda: front_pids(node).get(1) not in (None, before[1]), what="a new front 1")
    finally:
        if front_pids(node).get(1) == before[1]:   # not replaced (the test failed): let it go on
            os.kill(before[1], signal.SIGCONT)
    assert "HTTP process 1 said nothing for" in node.stderr.read_text()
    assert front_pids(node)[0] == before[0]   # the other front was left alone
    for prompt in ([5, 6, 7], [8, 9]):   # every front answers again
        resp = open_stream(node, {"prompt": prompt, "max_tokens": 2, "ignore_eos": True, "stream": False})
        assert json.loads(resp.read())["usage"]["completion_tokens"] == 2


def test_sigterm_to_ingest_ends_every_open_stream_and_every_front(node):
    """Last in this module: it stops ingest (the node starts it again)."""
    pids = front_pids(node)
    assert sorted(pids) == [0, 1]
    with held_streams(node, 6) as conns:
        os.kill(H.pid_of(node.proc, "qmigrate ingest"), signal.SIGTERM)
        assert_each_ends_with_shutdown(conns)
    wait_for(lambda: not any(is_alive(pid) for pid in pids.values()), what="every front process gone")


def test_sigkill_to_ingest_ends_every_open_stream_with_an_error_event(node):
    """After the SIGTERM test: ingest (started again) is killed outright. Its fronts outlive it
    (the kernel sends each SIGTERM as its parent dies), so every stream still ends with an
    error event and [DONE]; then ingest and its fronts are started again."""
    wait_for(lambda: sorted(front_pids(node)) == [0, 1] and node.stats(timeout_s=1).get("workers", 0) >= 1,
             timeout_s=60, what="ingest and both fronts back")
    pids = front_pids(node)
    answered = set()

    def both_fronts_answer():   # a connection of its own each: the kernel picks a front for it
        try:
            resp = open_stream(node, {"prompt": [5, 6], "max_tokens": 1, "stream": False})
            answered.add(front_of(json.loads(resp.read())["id"]))
        except (ConnectionError, http.client.HTTPException, KeyError):   # a front still starting
            pass
        return answered == {0, 1}
    wait_for(both_fronts_answer, what="an answer from each new front")

    with held_streams(node, 6) as conns:
        os.kill(H.pid_of(node.proc, "qmigrate ingest"), signal.SIGKILL)
        assert_each_ends_with_shutdown(conns)
    wait_for(lambda: not any(is_alive(pid) for pid in pids.values()), what="every old front gone")
    wait_for(lambda: sorted(front_pids(node)) == [0, 1], timeout_s=60,
             what=lambda: f"ingest's fronts started again; the node said:\n{node.stderr.read_text()[-3000:]}")
