"""`qmigrate bench serve`: its statistics on synthetic timestamps, its datasets and arrivals,
and whole runs against a minimal fake OpenAI server and against a real node on the tiny model."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import threading

import numpy as np
import pytest
from aiohttp import web

from qmigrate.bench import serve_data as D
from qmigrate.bench.core import Workload
from qmigrate.bench.serve import arrival_offsets, parse_rates, run_serve
from qmigrate.bench.serve_stats import CallRecord, meets, parse_slos, summarize


# --- statistics --------------------------------------------------------------------------

def test_summary_of_synthetic_calls():
    # Two calls sent at 0 and 1 s: chunks (one token each) at the times below.
    a = CallRecord(0.0, [0.5, 0.6, 0.8, 1.1], output_tokens=4, expected_tokens=4)
    b = CallRecord(1.0, [1.2, 1.3], output_tokens=2, expected_tokens=3)
    bad = CallRecord(1.0, error="HTTP 500: boom")
    s = summarize([a, b, bad], t0=0.0, end=2.0, slos={"ttft": 0.3})
    assert (s["calls"], s["completed"], s["failed"], s["output_tokens"]) == (3, 2, 1, 6)
    assert s["output_tok_per_s"] == pytest.approx(3.0) and s["requests_per_s"] == pytest.approx(1.0)
    assert s["short_calls"] == 1 and s["errors"] == ["HTTP 500: boom"]
    assert s["ttft_ms"]["p50"] == pytest.approx(np.percentile([500, 200], 50))
    assert s["ttft_ms"]["mean"] == pytest.approx(350)
    # TPOT: (1.1 - 0.5) / 3 and (1.3 - 1.2) / 1
    assert s["tpot_ms"]["p99"] == pytest.approx(np.percentile([200, 100], 99))
    # ITL pools the gaps of every call: 100, 200, 300 and 100 ms.
    itl = [100, 200, 300, 100]
    for q in (50, 90, 99):
        assert s["itl_ms"][f"p{q}"] == pytest.approx(np.percentile(itl, q))
    assert s["e2e_ms"]["p50"] == pytest.approx(np.percentile([1100, 300], 50))
    # Only b's first token came within 300 ms; the failed call never counts.
    assert s["goodput"]["good_calls"] == 1 and s["goodput"]["requests_per_s"] == pytest.approx(0.5)


def test_slos_parse_and_apply():
    assert parse_slos(["ttft:200", "tpot:50,e2e:3000"]) == {"ttft": 0.2, "tpot": 0.05, "e2e": 3.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:x"], ["tpot:0"]):
        with pytest.raises(ValueError):
            parse_slos(bad)
    rec = CallRecord(0.0, [0.1, 0.3, 0.5], output_tokens=3)
    assert meets(rec, {"ttft": 0.1, "tpot": 0.2}) and not meets(rec, {"tpot": 0.19})


def test_arrivals_and_rates():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    poisson = np.diff(arrival_offsets(20000, 50.0, 1.0, seed=3))
    assert statistics.fmean(poisson) == pytest.approx(1 / 50, rel=0.05)
    # The gaps' squared coefficient of variation is 1 / burstiness.
    for shape in (0.25, 4.0):
        gaps = np.diff(arrival_offsets(20000, 50.0, shape, seed=3))
        assert gaps.mean() == pytest.approx(1 / 50, rel=0.05)
        assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / shape, rel=0.15)
    assert arrival_offsets(10, 5.0, seed=1) == arrival_offsets(10, 5.0, seed=1)
    assert parse_rates("2, 4.5,inf") == [2.0, 4.5, math.inf]
    for bad in ("", "0", "-1", "fast"):
        with pytest.raises(ValueError):
            parse_rates(bad)


# --- datasets ----------------------------------------------------------------------------

def test_random_dataset_is_mixed_256():
    reqs = D.random_dataset(Workload())
    assert len(reqs) == 256 and sum(r.output_len for r in reqs) == 70721
    assert [(r.prompt, r.output_len) for r in reqs] == Workload().requests()
    text = D.random_dataset(Workload(4, (8, 16), (4, 8)), fmt="text")
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == r.prompt_len for r in text)


def test_shared_prefix_and_multi_turn_shapes():
    reqs = D.shared_prefix_dataset(groups=3, prompts_per_group=4, system_len=20, question_len=5, output_len=7)
    assert len(reqs) == 12 and all(len(r.prompt) == 25 and r.output_len == 7 for r in reqs)
    for g in range(3):
        group = reqs[4 * g: 4 * g + 4]
        assert all(r.prompt[:20] == group[0].prompt[:20] for r in group)
        assert len({tuple(r.prompt[20:]) for r in group}) == 4
    assert reqs[0].prompt[:20] != reqs[4].prompt[:20]
    assert D.shared_prefix_dataset(2, 2, 8, 4, 3) == D.shared_prefix_dataset(2, 2, 8, 4, 3)
    sessions = D.multi_turn_dataset(sessions=3, turns=4, turn_len=6, output_len=5)
    assert len(sessions) == 3 and all(len(s.turns) == 4 and s.num_calls == 4 for s in sessions)
    assert all(s.think_time_s == 0 for s in sessions)
    thinking = D.multi_turn_dataset(sessions=3, turns=4, turn_len=6, output_len=5, think_time_s=2.5)
    assert [s.turns for s in thinking] == [s.turns for s in sessions] and all(s.think_time_s == 2.5 for s in thinking)


def test_jsonl_dataset(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "hi", "output_len": 3}\n\n{"prompt": [5, 6]}\n{"turns": ["a", "b"], "max_tokens": 2}\n')
    reqs = D.jsonl_dataset(path, default_output_len=9)
    assert [(r.prompt, r.output_len, r.turns) for r in reqs] == [("hi", 3, []), ([5, 6], 9, []), ("", 2, ["a", "b"])]
    for bad in ('{"prompt": 5}', "[1]", '{"prompt": "x", "output_len": 0}', "nope", '{"turns": []}'):
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match="d.jsonl:1"):
            D.jsonl_dataset(path)


# --- against a fake server -----------------------------------------------------------------

class FakeServer:
    """A minimal OpenAI server on a thread: one SSE event per token, usage at the end."""

    def __init__(self, has_chat_template: bool = True, app=None, empty_every: int = 0):
        self.has_chat_template = has_chat_template
        self.empty_every = empty_every   # every such token's event has no text (mid-character)
        self.app = app
        self.bodies, self.in_flight, self.most_in_flight = [], 0, 0
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.started.wait(10)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        app = self.app
        if app is None:
            app = web.Application()
            app.router.add_get("/v1/models", self.models)
            app.router.add_post("/v1/completions", self.generate)
            app.router.add_post("/v1/chat/completions", self.generate)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self.started.set()
        self.loop.run_forever()

    async def models(self, request):
        return web.json_response({"data": [{"id": "fake"}]})

    async def generate(self, request):
        body = await request.json()
        self.bodies.append(body)
        if body.get("model") != "fake":   # as a real server answers a model it does not serve
            return web.json_response({"error": {"message": f"the model '{body.get('model')}' does not exist"}},
                                     status=404)
        chat = "messages" in body
        if chat and not self.has_chat_template:   # as qmigrate's ingest answers
            return web.json_response({"error": {"message": "this model has no chat template; send a plain "
                                                           "prompt instead of messages"}}, status=400)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:   # a client may go away mid-stream (the chat probe reads only the status)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            n = body["max_tokens"] if body.get("ignore_eos") else max(1, body["max_tokens"] // 2)
            for i in range(n):
                await asyncio.sleep(0.001)
                text = "" if self.empty_every and i % self.empty_every == 1 else f"t{i} "
                choice = {"delta": {"content": text}} if chat else {"text": text}
                await resp.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
            usage = {"prompt_tokens": 1, "completion_tokens": n}
            await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode()
                             + b"\n\ndata: [DONE]\n\n")
            return resp
        finally:
            self.in_flight -= 1

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def fake_server():
    server = FakeServer()
    yield server
    server.close()


def test_against_a_fake_server(fake_server, tmp_path):
    reqs = D.random_dataset(Workload(12, (4, 8), (3, 9), vocab=(10, 100)))
    out = tmp_path / "r.json"
    runs = run_serve(base_url=fake_server.url, model=None, requests=reqs, rates=[200.0, math.inf],
                     max_concurrency=3, slos={"e2e": 60.0}, warmup=0, json_path=out,
                     calls_path=tmp_path / "calls.jsonl")
    asked = sum(r.output_len for r in reqs)
    for _, s in runs:
        assert (s["completed"], s["failed"], s["short_calls"], s["output_tokens"]) == (12, 0, 0, asked)
        assert s["goodput"]["good_calls"] == 12
    assert fake_server.most_in_flight <= 3
    body = fake_server.bodies[0]
    assert body["model"] == "fake" and body["stream"] and body["ignore_eos"] and body["prompt"] == reqs[0].prompt
    assert body["min_tokens"] == body["max_tokens"] == reqs[0].output_len
    report = json.loads(out.read_text())
    assert [r["rate"] for r in report["runs"]] == ["200", "inf"] and report["model"] == "fake"
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert [c["rate"] for c in calls] == ["200"] * 12 + ["inf"] * 12
    for c in calls:
        assert c["error"] == "" and 0 <= c["start"] <= c["chunks"][0] and c["chunks"] == sorted(c["chunks"])
    assert sum(c["output_tokens"] for c in calls) == 2 * asked
    # each run its own cache_salt: the second run finds nothing the first cached
    salts = [b["cache_salt"] for b in fake_server.bodies]
    assert len(set(salts[:12])) == len(set(salts[12:])) == 1 and salts[0] != salts[12]


def test_events_of_no_text_are_timed_as_tokens(tmp_path):
    server = FakeServer(empty_every=3)
    try:
        reqs = D.random_dataset(Workload(6, (4, 8), (5, 9), vocab=(10, 100)))
        calls_path = tmp_path / "calls.jsonl"
        run_serve(base_url=server.url, model=None, requests=reqs, rates=[math.inf], warmup=0, calls_path=calls_path)
        calls = [json.loads(line) for line in calls_path.read_text().splitlines()]
        assert sorted(len(c["chunks"]) for c in calls) == sorted(r.output_len for r in reqs)
    finally:
        server.close()


def test_calls_from_several_processes(fake_server, tmp_path):
    """Two client processes, each every second call: every call is made once, at its own
    arrival time, under the shared concurrency limit, and sessions keep their turns."""
    from qmigrate.bench.serve_procs import shares
    assert shares(7, 3) == [3, 2, 2] and shares(None, 2) == [None, None]
    reqs = D.random_dataset(Workload(10, (4, 8), (3, 9), vocab=(10, 100)))
    sessions = D.multi_turn_dataset(sessions=2, turns=2, turn_len=4, output_len=2)
    out = tmp_path / "r.json"
    runs = run_serve(base_url=fake_server.url, model=None, requests=reqs + sessions, rates=[100.0, math.inf],
                     max_concurrency=4, warmup=2, json_path=out, calls_path=tmp_path / "calls.jsonl",
                     processes=2)
    asked = sum(r.output_len for r in reqs) + 2 * 2 * 2
    for _, s in runs:
        assert (s["completed"], s["failed"], s["short_calls"], s["output_tokens"]) == (14, 0, 0, asked)
    assert fake_server.most_in_flight <= 4
    assert json.loads(out.read_text())["client_processes"] == 2
    timed = [b for b in fake_server.bodies if "-run-" in b.get("cache_salt", "")]   # not the warm-up
    assert sorted(str(b["prompt"]) for b in timed if "prompt" in b) == sorted(str(r.prompt) for r in reqs * 2)
    for session in sessions:
        mine = [b["messages"] for b in timed if "messages" in b and b["messages"][0]["content"] == session.turns[0]]
        assert sorted(len(m) for m in mine) == [1, 1, 3, 3]
    offsets = arrival_offsets(len(reqs) + len(sessions), 100.0, 1.0, 0)
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    # the requests' calls (a session's turns have 2 tokens, the requests 3 or more): none sent early
    starts = sorted(c["start"] for c in calls if c["rate"] == "100" and c["output_tokens"] != 2)
    assert len(starts) == len(reqs)
    assert all(got >= want - 1e-3 for got, want in zip(starts, sorted(offsets[:len(reqs)])))
    # a limit below the processes asked for: one process, one call at a time
    fake_server.most_in_flight = 0
    [(_, s)] = run_serve(base_url=fake_server.url, model="fake", requests=reqs[:4], rates=[math.inf],
                         max_concurrency=1, warmup=0, processes=2)
    assert s["completed"] == 4 and fake_server.most_in_flight == 1


def test_the_null_server_answers_every_call_at_once():
    """The server that measures the client's own cost (benchmarks/null_server.py)."""
    from benchmarks.null_server import make_app
    server = FakeServer(app=make_app())
    try:
        reqs = D.random_dataset(Workload(8, (4, 8), (3, 9), vocab=(10, 100)))
        [(_, s)] = run_serve(base_url=server.url, model=None, requests=reqs, rates=[math.inf], warmup=0)
    finally:
        server.close()
    assert (s["completed"], s["failed"], s["output_tokens"]) == (8, 0, 8)


def test_without_ignore_eos_short_outputs_are_reported(fake_server):
    reqs = D.random_dataset(Workload(4, (4, 8), (4, 9), vocab=(10, 100)))
    [(_, s)] = run_serve(base_url=fake_server.url, model="fake", requests=reqs, rates=[math.inf],
                         warmup=0, extensions=False, salt_runs=False)
    assert s["short_calls"] == 4 and "ignore_eos" not in fake_server.bodies[0]
    assert "cache_salt" not in fake_server.bodies[0]


def test_multi_turn_carries_earlier_turns(fake_server):
    sessions = D.multi_turn_dataset(sessions=2, turns=3, turn_len=4, output_len=2)
    [(_, s)] = run_serve(base_url=fake_server.url, model="fake", requests=sessions, rates=[math.inf], warmup=0)
    assert s["completed"] == 6 and s["output_tokens"] == 12
    for session in sessions:
        mine = [b["messages"] for b in fake_server.bodies if b["messages"][0]["content"] == session.turns[0]]
        assert [len(m) for m in mine] == [1, 3, 5]
        last = mine[-1]
        assert [m["content"] for m in last if m["role"] == "user"] == session.turns
        assert [m["content"] for m in last if m["role"] == "assistant"] == ["t0 t1 ", "t0 t1 "]


@pytest.mark.parametrize("has_chat_template,sessions_as", [(False, "auto"), (True, "text")])
def test_sessions_go_as_plain_text_completions_without_a_chat_template(has_chat_template, sessions_as, tmp_path):
    server = FakeServer(has_chat_template)
    try:
        sessions = D.multi_turn_dataset(sessions=2, turns=3, turn_len=4, output_len=2)
        out = tmp_path / "r.json"
        [(_, s)] = run_serve(base_url=server.url, model=None, requests=sessions, rates=[math.inf], warmup=1,
                             sessions_as=sessions_as, json_path=out)
    finally:
        server.close()
    assert s["completed"] == 6 and s["failed"] == 0
    assert json.loads(out.read_text())["sessions_as"] == "text"
    prompts = [b["prompt"] for b in server.bodies if "prompt" in b]
    answer = "t0 t1 "   # what the fake server says to every call of 2 tokens
    for session in sessions:
        t = session.turns
        assert {p for p in prompts if p.startswith(f"User: {t[0]}\n")} == {
            f"User: {t[0]}\nAssistant:",
            f"User: {t[0]}\nAssistant:{answer}\nUser: {t[1]}\nAssistant:",
            f"User: {t[0]}\nAssistant:{answer}\nUser: {t[1]}\nAssistant:{answer}\nUser: {t[2]}\nAssistant:"}
    with pytest.raises(ValueError):
        run_serve(base_url="http://127.0.0.1:9", model="fake", requests=sessions, rates=[1.0], sessions_as="xml")


# --- ignore_eos and min_tokens, from the request to the worker's stopping rule ---------------

def test_request_extensions_parse():
    import copy
    from conftest import CHAT_TEMPLATE
    from qmigrate.ingest.openai_api import ApiError, parse_body
    from tokenizer_util import build_tokenizer
    tok = copy.deepcopy(build_tokenizer())
    tok.chat_template = CHAT_TEMPLATE
    parse = lambda body, kind="completion": parse_body({"model": "m", **body}, kind, model_names=["m"],
                                                       tokenizer=tok, max_context=64, eos_ids=[1])
    p = parse({"prompt": [5, 6], "max_tokens": 9, "ignore_eos": True, "min_tokens": 4}).prompt
    assert (p.ignore_eos, p.min_tokens, p.max_new_tokens) == (True, 4, 9)
    p = parse({"messages": [{"role": "user", "content": "hi"}], "ignore_eos": False}, "chat").prompt
    assert (p.ignore_eos, p.min_tokens) == (False, 0)
    # A clamp to the context takes min_tokens down with it.
    assert parse({"prompt": [5] * 60, "max_tokens": 20, "min_tokens": 20}).prompt.min_tokens == 4
    for body, param in (({"ignore_eos": 1}, "ignore_eos"), ({"min_tokens": -1}, "min_tokens"),
                        ({"min_tokens": 10, "max_tokens": 9}, "min_tokens"), ({"min_tokens": 1.5}, "min_tokens")):
        with pytest.raises(ApiError) as info:
            parse({"prompt": [5, 6], **body})
        assert info.value.status == 400 and info.value.param == param, info.value.message


def test_min_new_tokens_holds_off_eos_and_stop_sequences():
    from qmigrate.wire import protocol as P
    from qmigrate.wire import codec
    from qmigrate.worker.state import SeqState
    spec = P.SeqSpec(1, P.pack_i32([5, 6]), 2, 10, stop_ids=[[7, 8]], eos_ids=[2], min_new_tokens=3)
    state = SeqState.from_spec(spec, spec.ids)
    assert state.finish_after(2, 0, 3, 100) == P.Finish.NONE       # EOS as token 1 of 3
    assert state.finish_after(7, 1, 4, 100) == P.Finish.NONE
    assert state.finish_after(8, 2, 5, 100) == P.Finish.STOP        # the stop ends token 3
    state = SeqState.from_spec(spec, spec.ids)
    assert [state.finish_after(2, i, 3 + i, 100) for i in range(4)] == [P.Finish.NONE] * 2 + [P.Finish.EOS] * 2
    plain = P.SeqSpec(1, P.pack_i32([5, 6]), 2, 10, eos_ids=[2])
    assert SeqState.from_spec(plain, plain.ids).finish_after(2, 0, 3, 100) == P.Finish.EOS
    # It travels in Submit, and a value above max_new_tokens is refused at decode.
    got = codec.decode(codec.encode(P.Submit([spec])))
    assert got.seqs[0].min_new_tokens == 3
    with pytest.raises(P.ProtocolError):
        codec.decode(codec.encode(P.Submit([P.SeqSpec(1, P.pack_i32([5]), 1, 4, min_new_tokens=5)])))


# --- against a real node -----------------------------------------------------------------------

@pytest.fixture
def node(http_node):
    """The session's live node on the tiny chat model (conftest.http_node), by its URL."""
    import time
    import urllib.request
    deadline = time.monotonic() + 90
    while True:
        assert http_node.proc.poll() is None, http_node.stderr.read_text()[-3000:]
        assert time.monotonic() < deadline, "the node did not serve HTTP in 90 s"
        try:
            # A completion, not /v1/models alone: the worker is up once one comes back.
            req = urllib.request.Request(http_node.url + "/v1/completions", method="POST",
                                         data=json.dumps({"model": "tiny", "prompt": [5, 6], "max_tokens": 1}).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                if resp.status == 200:
                    return http_node.url
        except OSError:
            time.sleep(0.3)


@pytest.mark.slow
def test_a_real_node_gives_exact_lengths(node, tmp_path, qmigrate):
    out = tmp_path / "serve.json"
    run = qmigrate("bench", "serve", "--base-url", node, "--requests", "6", "--prompt-len", "4:16",
                   "--output-len", "4:12", "--vocab", "10:1000", "--request-rate", "50,inf", "--max-concurrency", "4",
                   "--goodput", "e2e:600000", "--json", str(out))
    assert run.returncode == 0, run.stderr
    asked = sum(n for _, n in Workload(6, (4, 16), (4, 12), (10, 1000)).requests())
    report = json.loads(out.read_text())
    assert report["output_tokens_asked"] == asked and report["model"] == "tiny"
    for r in report["runs"]:
        assert (r["completed"], r["failed"], r["short_calls"], r["output_tokens"]) == (6, 0, 0, asked), r
        assert r["prompt_tokens"] == sum(len(p) for p, _ in Workload(6, (4, 16), (4, 12), (10, 1000)).requests())
        assert r["goodput"]["good_calls"] == 6 and r["ttft_ms"]["p50"] > 0
    assert "inf" in run.stdout and "TTFT" in run.stdout
    sessions = D.multi_turn_dataset(sessions=2, turns=2, turn_len=5, output_len=3)
    [(_, s)] = run_serve(base_url=node, model="tiny", requests=sessions, rates=[math.inf], warmup=0)
    assert (s["completed"], s["failed"], s["short_calls"], s["output_tokens"]) == (4, 0, 0, 12), s


# --- the HTTP thread's cheaper per-token path -----------------------------------------------

@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_frame_is_the_chunk_it_stands_for(kind):
    from types import SimpleNamespace
    from qmigrate.ingest.streams import MARK as _MARK, Frame as _Frame, sse as _sse
    from qmigrate.ingest.openai_replies import chunk
    for usage in (False, True):
        req = SimpleNamespace(kind=kind, model="m\u00e9", include_usage=usage, continuous_usage=False)
        frame = _Frame(chunk(req, "cmpl-1", 7, _MARK))
        for text in ("a", ' "quoted"\n\\', "\u00e9t\u00e9 \U0001f600", "\ue000text\ue000"):
            assert frame(text) == _sse(chunk(req, "cmpl-1", 7, text))


def test_what_arrived_together_leaves_together():
    from types import SimpleNamespace
    from qmigrate.ingest.answers import next_all
    from qmigrate.ingest.http import HttpServer
    from qmigrate.ingest.streams import SHUTDOWN as _SHUTDOWN, Updates as _Updates

    async def main():
        server = HttpServer.__new__(HttpServer)
        server.cfg = SimpleNamespace(http_timeout_s=5.0)
        server.loop, server.streams = asyncio.get_running_loop(), {}
        updates = server.streams[1] = _Updates()
        for row in [(1, "a", 0, 1), (1, "b", 0, 2, -1), (1, "c", 2, 3, 16), (1, "late", 0, 4, -1)]:
            updates.push(row)
        got = [await next_all(server.loop, updates), await next_all(server.loop, updates)]
        asyncio.get_running_loop().call_later(0.01, updates.push, (1, "woken", 0, 5, -1))
        got.append(await next_all(server.loop, updates))  # a row wakes the wait
        for row in [(1, "x", 0, 6, -1), _SHUTDOWN, (1, "after", 0, 7, -1)]:
            updates.push(row)
        got.append(await next_all(server.loop, updates))  # the text before a shutdown still leaves
        with pytest.raises(Exception, match="shutting down"):
            await next_all(server.loop, updates)
        server.cfg.http_timeout_s = 0.05  # one watchdog ends waits that last past the limit
        watchdog = asyncio.create_task(server._watch())
        updates.rows.clear()
        with pytest.raises(Exception, match="no output within"):
            await asyncio.wait_for(next_all(server.loop, updates), 5)
        watchdog.cancel()
        return got

    assert asyncio.run(main()) == [("abc", 2, 3, 16), ("late", 0, 4, -1), ("woken", 0, 5, -1), ("x", 0, 6, -1)]


def test_the_pipeline_figure_is_read_for_the_same_workload_only(tmp_path):
    from qmigrate.bench.serve import _pipeline_figure
    path = tmp_path / "bench.json"
    runs = [{"path": "pipeline", "tok_per_s": v} for v in (30.0, 10.0, 20.0)] + [{"path": "in-process", "tok_per_s": 99.0}]
    path.write_text(json.dumps({"workload": {"output_tokens": 500}, "runs": runs}))
    assert _pipeline_figure(path, 500) == 20.0
    assert _pipeline_figure(path, 501) is None


def test_the_prefix_hit_rate_is_read_from_usage():
    from qmigrate.bench.serve_stats import CallRecord, format_rows, summarize
    recs = [CallRecord(0.0, [0.1, 0.2], 2, 2, prompt_tokens=100, cached_tokens=c) for c in (0, 96, -1)]
    s = summarize(recs, 0.0, 1.0)
    assert s["prefix_hit_rate"] == 96 / 200
    assert format_rows([("inf", s)]).splitlines()[1].endswith("48%")
    assert summarize(recs[2:], 0.0, 1.0)["prefix_hit_rate"] is None


def test_middle_events_are_read_as_json_would_read_them():
    from qmigrate.bench.serve_client import EventTexts

    def event(text, finish=None, **style):
        return b"data: " + json.dumps({"id": "cmpl-1", "choices": [{"index": 0, "text": text, "finish_reason": finish}],
                                       "usage": None}, **style).encode()

    for style in ({"ensure_ascii": False}, {"separators": (",", ":")}):  # ours; compact and ASCII, as others send
        texts, got, sliced = EventTexts(), [], 0
        words = ["a", "b", ' "q" ', "\\", "\u00e9\U0001f600", "", "x\ny", "cmpl-1", "c"]
        words += ["\ud800", "d"] if "separators" in style else []  # a lone surrogate, where it can be sent
        for text in words:
            raw = event(text, **style)
            if (seen := texts.text_of(raw)) is not None:
                sliced += 1
            else:
                seen = json.loads(raw[6:])["choices"][0]["text"]
                if seen:
                    texts.learn(raw, seen)
            got.append(seen)
        assert got == words and sliced >= len(words) - 3, (style, sliced)
        for other in (event("", "length", **style), event("a", **style)[:-1] + b', "more": 1}',
                      event("a", **style).replace(b'"a"', b'"a", "text": "b"'), b"data: [DONE]"):
            assert texts.text_of(other) is None, other


def test_the_table_fits_80_columns_and_a_rate_not_kept_up_with_is_named():
    """bench serve printed one 120-column line per rate, which wraps at 80 columns, and said
    nothing when the server completed 0.17 requests/s of 4 offered."""
    from qmigrate.bench.serve_stats import CallRecord, format_rows, keep_up_warnings, summarize
    recs = [CallRecord(0.0, [0.1 + i, 0.2 + i, 0.3 + i], 3, 3, prompt_tokens=100, cached_tokens=0) for i in range(4)]
    slow, fast = summarize(recs, 0.0, 24.0), summarize(recs, 0.0, 1.05)
    slow["goodput"] = {"requests_per_s": 123456.78}
    table = format_rows([("4", slow), ("3.5", fast), ("inf", slow)])
    assert max(len(line) for line in table.splitlines()) <= 80, table
    for figure in ("0.17", "3.81", "TTFT", "TPOT", "ITL", "E2E", "123456.78"):
        assert figure in table
    warned = keep_up_warnings([("4", slow), ("3.5", fast), ("inf", slow)])
    assert len(warned) == 1 and warned[0].startswith("rate 4: the server completed 0.17 requests/s of the 4 "
                                                     "offered (4%)"), warned
    # a session of 4 calls is one request of the rate
    assert keep_up_warnings([("1", fast)], calls_per_request=4.0) == []
    assert len(keep_up_warnings([("1", fast)], calls_per_request=5.0)) == 1


def test_a_growing_queue_is_told_from_a_long_tail_by_ttft_over_the_run():
    """Completions short of the offered rate mean a growing queue only when TTFT grows over
    the run: 40 calls sent over 10 s (4/s) whose TTFT holds at 20 ms while one output lasts
    until 40 s complete 1/s, which is the run's tail; the same calls with TTFT rising from
    20 ms to 2 s did not keep up, even where the completions kept the rate."""
    from qmigrate.bench.serve_stats import CallRecord, keep_up_warnings, summarize
    starts = [i * 0.25 for i in range(40)]

    def run(ttft, end_of_last):
        recs = [CallRecord(t, [t + ttft(i), t + ttft(i) + 0.5], 2, 2) for i, t in enumerate(starts)]
        recs[-1].chunks[-1] = end_of_last
        return summarize(recs, 0.0, end_of_last)

    tail = run(lambda i: 0.02, 40.0)
    assert tail["ttft_p50_ms_by_quarter"] == pytest.approx([20.0] * 4)
    (said,) = keep_up_warnings([("4", tail)])
    assert "completed 1.00 requests/s of the 4 offered" in said and "the shortfall is the run's tail" in said
    queue = run(lambda i: 0.02 + 0.05 * i, 40.0)
    q = queue["ttft_p50_ms_by_quarter"]
    assert q[0] < q[1] < q[2] < q[3] and q[3] > 5 * q[0]
    (said,) = keep_up_warnings([("4", queue)])
    assert "did not keep up" in said and "include its queue" in said
    kept = run(lambda i: 0.02 + 0.05 * i, 12.0)   # the completions keep the rate; TTFT still grew
    assert kept["requests_per_s"] > 0.9 * 4 * 0.8 and "did not keep up" in keep_up_warnings([("3", kept)])[0]
    assert keep_up_warnings([("3", run(lambda i: 0.02, 12.0))]) == []


def test_logprobs_option_asks_every_call_for_them(fake_server):
    """--logprobs N: completions send logprobs=N, chat turns logprobs and top_logprobs=N (from
    the client processes too); without it no call asks."""
    reqs = D.random_dataset(Workload(3, (4, 8), (3, 5), vocab=(10, 100)))
    sessions = D.multi_turn_dataset(sessions=1, turns=1, turn_len=4, output_len=2)
    for processes in (1, 2):
        fake_server.bodies.clear()
        run_serve(base_url=fake_server.url, model="fake", requests=reqs + sessions, rates=[math.inf], warmup=0,
                  processes=processes, logprobs=5)
        assert [b["logprobs"] for b in fake_server.bodies if "prompt" in b] == [5] * 3
        turns = [b for b in fake_server.bodies if "messages" in b and b["messages"][0]["content"] != "hello"]
        assert [(b["logprobs"], b["top_logprobs"]) for b in turns] == [(True, 5)]   # not the chat probe
    fake_server.bodies.clear()
    run_serve(base_url=fake_server.url, model="fake", requests=reqs, rates=[math.inf], warmup=0)
    assert fake_server.bodies and not any("logprobs" in b for b in fake_server.bodies)
