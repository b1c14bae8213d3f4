"""The OpenAI-compatible HTTP API of the ingest node: an aiohttp server on a thread of its
own with its own asyncio loop, beside the ingest's ZeroMQ loop.

Neither loop ever waits for the other. A request goes to the ingest loop through a bounded
queue (`submissions`; full means the router is full: 429) and a wake-up message on an
inproc socket; its text comes back from the detokenizer through the ingest loop, which calls
`deliver`, and `deliver` hands it to this loop with call_soon_threadsafe. A request that ends
early (the client went away, or no text for `http_timeout_s`) is put on `cancels`.

A token costs this thread little: its row is appended to its request's `Updates` and the
handler's future is woken, and one watchdog, not a timer per wait, ends the waits that last
past `http_timeout_s`.

A request with several prompts or `n` > 1 fans out into one engine request (sequence id) per
choice, handed over together in one submission; all of them share the request's `Updates`,
whose rows say by sequence id which choice they belong to. The request ends when every
choice has; if it ends sooner, every choice still running is cancelled. A request of one
choice takes a path of its own, with nothing per token for choices it does not have.

The same server runs in each HTTP front process (ingest/front_process.py) when ingest has
several: there it shares the port with the others (`reuse_port`) and, with `admission`, a
request waits for ingest's word that it took the request (`admit`) before it answers, so that
a refusal is still a 429. How a request's rows become its reply or stream is answers.py.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import queue
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import zmq
from aiohttp import web

from qmigrate.ops import logs
from qmigrate.wire import transport
from qmigrate.hub.grammars import Compiler, GrammarError
from qmigrate.hub.tokenizer_info import load_tokenizer_info, token_id_bound
from qmigrate.ingest.logprobs_api import TokenText
from qmigrate.ingest.guard import ClientLimit
from qmigrate.ingest import answers, utility_api
from qmigrate.ingest.handoff import HTTP_BIT, THREAD_ID_BITS
from qmigrate.ingest.json_checks import check_json
from qmigrate.ingest.prompts import Defaults
from qmigrate.ingest.streams import SHUTDOWN, Updates
from qmigrate.ingest.openai_api import ApiError, fan_out, parse_body
from qmigrate.ingest.openai_replies import models_list

log = logging.getLogger("qmigrate.http")

WAKE_ENDPOINT = "inproc://ingest-http-wake"
KEYED_PATHS = ("/v1/", "/tokenize", "/detokenize")  # with an api_key; /health and /version need none
STARTUP_TIMEOUT_S = 30.0
def _at_capacity() -> ApiError:
    return ApiError(429, "the server is at capacity: too many requests are waiting for the router; "
                    "retry later", type="rate_limit_error", code="rate_limit_exceeded")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


class HttpServer:
    def __init__(self, cfg, model_path: str, defaults: Defaults, id_base: int | None = None,
                 trust_remote_code: bool = False, *, reuse_port: bool = False, admission: bool = False,
                 id_bits: int = THREAD_ID_BITS, first_id: int = 1, max_model_len: int = 0):
        self.cfg = cfg
        self.defaults = defaults
        # A tokenizer of its own: this server's thread tokenizes while ingest's does, and a
        # fast tokenizer is not safe to share between threads.
        self.tokenizer, self.max_context, self.eos_ids = load_tokenizer_info(model_path, trust_remote_code)
        self.token_text = TokenText(self.tokenizer)   # logprobs' token texts, decoded once per id
        self.id_bound = token_id_bound(model_path, self.tokenizer)
        self.max_context = min(self.max_context, max_model_len or self.max_context)   # the workers' limit
        # structured outputs' grammars, compiled off both loops (and refused past the time limit)
        self.grammars = Compiler(lambda: load_tokenizer_info(model_path, trust_remote_code)[0],
                                 len(self.tokenizer), defaults.structured_output_compile_timeout_s, xgrammar=False)
        # Bodies are parsed and tokenized on this one thread, the only user of the tokenizer:
        # a long prompt costs its own request time, never the event loop's (/health, streams).
        self.parser = ThreadPoolExecutor(1, thread_name_prefix="http-parse")
        self.client_limit = ClientLimit(cfg.http_max_connections_per_client)
        self.model_names = [cfg.model_name or Path(model_path).name]
        # Each item: one HTTP request's [(seq_id, Prompt), ...], one per choice, taken together.
        self.submissions: queue.Queue = queue.Queue(maxsize=cfg.max_pending)
        self.cancels: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[int, Updates] = {}
        # Sequence ids: ingest's random high part with bit 39 set, so never one of its own, and a
        # counter in the low id_bits (a front's index sits between them: ingest.handoff).
        self.id_base = (id_base or random.SystemRandom().randrange(1, 1 << 22) << 40) | HTTP_BIT
        self.id_mask = (1 << id_bits) - 1
        self.counter = itertools.count(first_id)
        self.reuse_port = reuse_port
        self.admission = admission
        self.loop: asyncio.AbstractEventLoop | None = None
        self.wake_sock = None
        self.ready = threading.Event()
        self.failure: str | None = None
        self.num_serving = 0  # workers the router last said can serve: /health is 503 while 0
        self.api_key = cfg.api_key.encode() if cfg.api_key else None

    @property
    def url(self) -> str:
        return f"http://{self.cfg.http_host}:{self.cfg.http_port}"

    # --- called from the ingest thread -----------------------------------------------------
    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True, name="http").start()
        if not self.ready.wait(STARTUP_TIMEOUT_S) or self.failure:
            raise SystemExit(f"ingest: cannot serve HTTP on {self.url}: {self.failure or 'no start'}")

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """End every open request before the process exits: a stream gets an error event and
        `data: [DONE]`, a plain request a 503. Returns when they are answered or at timeout_s."""
        if self.loop is None or not self.streams:
            return
        done = threading.Event()

        def end_all() -> None:
            for updates in set(self.streams.values()):  # a fanned-out request's choices share one
                updates.push(SHUTDOWN)
                if updates.admitted is not None and not updates.admitted.done():
                    updates.admitted.set_result(True)  # on to the shutdown's answer
            self.loop.create_task(self._answered(done, time.monotonic() + timeout_s))
        try:
            self.loop.call_soon_threadsafe(end_all)
        except RuntimeError:  # the loop has already stopped
            return
        done.wait(timeout_s)

    async def _answered(self, done: threading.Event, deadline: float) -> None:
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the last writes leave the socket
        done.set()

    def deliver(self, rows: list[tuple]) -> None:
        """(seq_id, text, finish code, tokens so far[, prompt tokens found cached]) rows from
        the detokenizer."""
        mine = [row for row in rows if row[0] in self.streams]
        if mine and self.loop is not None:
            self.loop.call_soon_threadsafe(self._dispatch, mine)

    def admit(self, seq_ids: list[int], is_accepted: bool) -> None:
        """Ingest's answer to the requests of these sequences (with `admission`)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._admit, seq_ids, is_accepted)

    # --- this thread -----------------------------------------------------------------------
    def _admit(self, seq_ids: list[int], is_accepted: bool) -> None:
        for seq_id in seq_ids:
            updates = self.streams.get(seq_id)
            if updates is not None and updates.admitted is not None and not updates.admitted.done():
                updates.admitted.set_result(is_accepted)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except Exception as exc:  # noqa: BLE001 -- reported by start() as one line
            self.failure = f"{type(exc).__name__}: {exc}"
            self.ready.set()

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        logs.quiet_bad_requests()
        self.wake_sock = transport.socket(zmq.PUSH, connect=WAKE_ENDPOINT, hwm=1)
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self._errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id}", self.model)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)
        app.router.add_get("/health", self.health)
        # handler_cancellation: a client that goes away cancels its handler, and so its request
        # keepalive_timeout: aiohttp closes a connection still waiting for a request's headers
        # then, whether it sent part of them or nothing (a slow or stalled client);
        # lingering_time: how long the rest of an unread body (after a 408 or 413) is read
        read_s = self.cfg.http_read_timeout_s
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True, keepalive_timeout=read_s,
                               lingering_time=min(10.0, read_s))
        await runner.setup()
        self.client_limit.install(runner.server)
        await web.TCPSite(runner, self.cfg.http_host, self.cfg.http_port, backlog=self.cfg.http_backlog,
                          reuse_port=self.reuse_port or None).start()
        self.ready.set()
        await self._watch()

    async def _watch(self) -> None:
        """Ends every wait for text that has lasted `http_timeout_s`, checked a few times in
        each such span (so a wait ends at most a quarter of it, or a second, late)."""
        limit = self.cfg.http_timeout_s
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            now = self.loop.time()
            for updates in self.streams.values():
                waiter = updates.waiter
                if waiter is not None and not waiter.done() and now - updates.since >= limit:
                    waiter.set_exception(ApiError(
                        503, f"no output within {limit:g} s: the workers are overloaded or down; retry later",
                        type="server_error", code="timeout"))

    def _dispatch(self, rows) -> None:
        streams = self.streams
        for row in rows:
            if (updates := streams.get(row[0])) is not None:
                updates.push(row)

    def _wake(self) -> None:
        try:
            self.wake_sock.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # a wake-up is already waiting

    @web.middleware
    async def _errors(self, request, handler):
        try:
            if self.api_key is not None and request.path.startswith(KEYED_PATHS):
                self._authorize(request)
            return await handler(request)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            kind = "invalid_request_error" if exc.status < 500 else "server_error"
            return web.json_response(ApiError(exc.status, exc.text or exc.reason, type=kind).body(),
                                     status=exc.status)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:  # noqa: BLE001 -- one bad request must not stop the server
            log.exception("error serving %s", request.path)
            return web.json_response(ApiError(500, f"internal error: {type(exc).__name__}",
                                              type="server_error").body(), status=500)

    def _authorize(self, request) -> None:
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key):
            raise ApiError(401, "a valid API key is needed: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    async def health(self, request):
        """200 once a worker can serve (as the router last said), 503 before and while none can."""
        body = {"status": "ok" if self.num_serving else "starting", "workers": self.num_serving,
                "waiting": self.submissions.qsize()}
        return web.json_response(body, status=200 if self.num_serving else 503)

    async def models(self, request):
        return web.json_response(models_list(self.model_names, self.max_context))

    async def model(self, request):
        return web.json_response(utility_api.find_model(request.match_info["model_id"], self.model_names,
                                                        self.max_context))

    async def tokenize(self, request):
        raw = await self._read(request)
        return web.json_response(await self.loop.run_in_executor(self.parser, lambda: utility_api.tokenize(
            self._json(raw), tokenizer=self.tokenizer, model_names=self.model_names,
            max_context=self.max_context, eos_ids=self.eos_ids)))

    async def detokenize(self, request):
        raw = await self._read(request)
        return web.json_response(await self.loop.run_in_executor(self.parser, lambda: utility_api.detokenize(
            self._json(raw), tokenizer=self.tokenizer, model_names=self.model_names,
            vocab_size=len(self.tokenizer))))

    async def version(self, request):
        return web.json_response(utility_api.version())

    async def completions(self, request):
        return await self._generate(request, "completion")

    async def chat_completions(self, request):
        return await self._generate(request, "chat")

    async def _read(self, request) -> bytes:
        try:  # over client_max_size: 413
            return await asyncio.wait_for(request.read(), self.cfg.http_read_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.cfg.http_read_timeout_s:g} s",
                           code="timeout") from None

    @staticmethod
    def _json(raw: bytes):
        """A body's JSON, checked (on the parser thread: a large body costs the loop nothing)."""
        try:
            body = json.loads(raw, parse_constant=_reject_constant)
            check_json(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise ApiError(400, "the request body is not valid JSON: nested too deep") from None
        return body

    def _parse(self, raw: bytes, kind):
        """On the parser thread: the body's JSON, checked and tokenized."""
        return parse_body(self._json(raw), kind, model_names=self.model_names, tokenizer=self.tokenizer,
                          max_context=self.max_context, defaults=self.defaults, eos_ids=self.eos_ids,
                          tool_parser=self.cfg.tool_call_parser, vocab_size=self.id_bound)

    async def _generate(self, request, kind):
        req = await self.loop.run_in_executor(self.parser, self._parse, await self._read(request), kind)
        await self._compile(req)
        seq_id = self._new_id()
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{seq_id:016x}"
        prompts = fan_out(req, rid)
        seq_ids = [seq_id] + [self._new_id() for _ in prompts[1:]]
        updates = Updates()
        if self.admission:
            updates.admitted = self.loop.create_future()
        for sid in seq_ids:
            self.streams[sid] = updates
        try:
            self.submissions.put_nowait(list(zip(seq_ids, prompts)))
        except queue.Full:
            for sid in seq_ids:
                del self.streams[sid]
            raise _at_capacity() from None
        self._wake()
        live = dict(zip(seq_ids, range(len(seq_ids))))  # the choices not yet ended: seq_id -> index
        try:
            if updates.admitted is not None and not await self._admitted(updates):
                live.clear()   # refused: nothing of it runs
                raise _at_capacity()
            if len(seq_ids) > 1:
                if req.stream:
                    return await answers.stream_choices(self.loop, request, req, rid, updates, live, self.token_text)
                return await answers.collect_choices(self.loop, req, rid, updates, live, self.token_text)
            if req.stream:
                response, ended = await answers.stream(self.loop, request, req, rid, updates, self.token_text)
            else:
                response, ended = await answers.collect(self.loop, req, rid, updates, self.token_text), True
            if ended:
                live.clear()
            return response
        finally:
            for sid in seq_ids:
                del self.streams[sid]
            if live:
                for sid in live:
                    self.cancels.put(sid)
                self._wake()

    async def _compile(self, req) -> None:
        """A 400 for a structured output whose grammar does not compile against the tokenizer in
        `structured_output_compile_timeout_s`; the wait holds up this request only."""
        grammar = req.prompt.grammar
        if not grammar:
            return
        param = req.grammar_param
        limit = self.grammars.timeout_s
        try:
            await asyncio.wrap_future(self.grammars.tokenizer(self.eos_ids))
            await asyncio.wait_for(asyncio.wrap_future(self.grammars.start(grammar, self.eos_ids)), limit)
        except asyncio.TimeoutError:
            raise ApiError(400, f"'{param}': the grammar did not compile within {limit:g} s "
                           "(structured_output_compile_timeout_s)", param) from None
        except GrammarError as exc:
            raise ApiError(400, f"'{param}': {exc}", param) from None

    def _new_id(self) -> int:
        return self.id_base | next(self.counter) & self.id_mask

    async def _admitted(self, updates: Updates) -> bool:
        try:
            return await asyncio.wait_for(updates.admitted, self.cfg.http_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(503, "the server did not take the request in time; retry later",
                           type="server_error", code="timeout") from None
