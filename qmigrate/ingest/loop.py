"""Ingest: reads prompts (stdin, `qmigrate feed` clients and, with `http_port`, the HTTP
API), tokenizes, validates, and hands them to the router. Stdin is read only while fewer
than `max_pending` prompts wait for the router, so a full router stops the reading instead
of growing memory; the HTTP API answers 429 then.

Everything for the detokenizer (request names and routes, refused requests, the end of the
input) travels in the same acknowledged `Submit` as the prompts, and the router forwards it:
a Submit is sent again until acknowledged, so a router restart loses none of it.

A request id given in JSONL is refused while a request with the same id is still running
(the detokenizer reports every request's end back here, so ids are reusable after it).

Bad input is a per-request error, never the end of the node: a stdin line that is not UTF-8
is an error record of its own; each request is checked as the router will decode it before
it is queued; a Submit the router refuses anyway (answered with a Reject) is split in halves
until the request it cannot take is alone, and that one becomes an error record."""

from __future__ import annotations

import logging
import os
import queue
import random
import signal
import sys
import threading
import time
from collections import deque

import zmq

from qmigrate.wire import protocol as P
from qmigrate.wire import transport
from qmigrate.hub.loading import resolve_model
from qmigrate.hub.tokenizer_info import load_tokenizer_info, token_id_bound
from qmigrate.ingest.handoff import THREAD_ID_BITS, HandoffOrder, http_route, reply_rows
from qmigrate.hub.grammars import Compiler, GrammarError
from qmigrate.ingest.prompts import CancelRequest, Defaults, PromptError, parse_line, seed_of, to_spec
from qmigrate.wire.security import Guard
from qmigrate.ops.process import freeze_heap, run_until_fatal
from qmigrate.ops.trace import tracer

log = logging.getLogger("qmigrate.ingest")

ACK_TIMEOUT_S = 5.0
STARTUP_TIMEOUT_S = 30.0
WORKERS_POLL_S = 0.2
DEFERRED_RETRY_S = 0.2  # a Submit the router deferred (its output backlog is full) goes again after this
HEALTH_POLL_S = 0.5  # how often the router is asked whether a worker can serve


class BadLine(str):
    """A stdin line that could not be read as text: admitted as an error record."""


def error_record(req_id: str, message: str, number: int) -> tuple[str, str, int]:
    """(req_id, message, the error's unique number) within the wire's bounds, whatever the
    user sent. The number is the sequence id the request would have had."""
    def clean(text: str, limit: int) -> str:
        return text[:limit].encode("utf-8", "replace").decode("utf-8")
    return clean(req_id, P.MAX_REQ_ID), clean(message, P.MAX_NOTE), number


class Ingest:
    def __init__(self, topo, read_stdin: bool, wait_for_workers: int = 0, restarted: bool = False):
        cfg = topo.ingest
        self.mode = cfg.input
        self.chat = cfg.chat
        self.max_pending = cfg.max_pending
        d = topo.defaults
        self.defaults = Defaults(d.max_new_tokens, d.temperature, d.top_p, d.top_k,
                                 d.structured_output_compile_timeout_s)
        model_path = resolve_model(topo.model.path)
        self.tokenizer, self.max_context, self.eos_ids = load_tokenizer_info(model_path, topo.model.trust_remote_code)
        self.max_context = min(self.max_context, topo.max_model_len or self.max_context)
        self.id_bound = token_id_bound(model_path, self.tokenizer)
        trust = topo.model.trust_remote_code
        self.grammars = Compiler(lambda: load_tokenizer_info(model_path, trust)[0], len(self.tokenizer),
                                 d.structured_output_compile_timeout_s, xgrammar=False)
        self.router_addr = topo.endpoint("router").connect
        self.router = transport.socket(zmq.DEALER, connect=self.router_addr,
                                       identity=f"ingest-{os.getpid()}")
        self.feed = transport.socket(zmq.ROUTER, bind=topo.endpoint("ingest").bind)
        self.replies = transport.socket(zmq.PULL, bind=topo.endpoint("ingest_reply").bind, hwm=100_000)
        self.live: dict[str, int] = {}        # JSONL/text request id -> sequence id, until it ends
        self.live_ids: dict[int, str] = {}
        # Sequence ids are unique across ingest processes: a random high part, a counter below.
        self.id_base = random.SystemRandom().randrange(1, 1 << 22) << 40
        self.http = None     # the API on a thread of this process
        self.fronts = None   # or in http_processes processes of its own
        if cfg.http_port is not None and cfg.http_processes > 1:
            from qmigrate.ingest.front_supervisor import START_TIMEOUT_S, Fronts
            # Started again after a death, the HTTP processes of the ingest before may still be
            # answering their last requests on the port: it is waited for
            self.fronts = Fronts(topo, model_path, self.defaults, self.id_base,
                                 port_wait_s=START_TIMEOUT_S if restarted else 0.0)
        elif cfg.http_port is not None:
            from qmigrate.ingest.http import WAKE_ENDPOINT, HttpServer
            self.wake = transport.socket(zmq.PULL, bind=WAKE_ENDPOINT, hwm=1)
            self.http = HttpServer(cfg, model_path, self.defaults, self.id_base, topo.model.trust_remote_code,
                                   max_model_len=topo.max_model_len)
        self.guard = Guard.for_topology(topo, "ingest")
        self.trace = tracer("ingest", topo.trace_dir)   # replies in from the detokenizer (trace.py)
        self.lines: queue.Queue = queue.Queue(maxsize=self.max_pending)
        self.read_stdin = read_stdin
        self.stdin_done = not read_stdin
        self.pending: deque[tuple[P.SeqSpec, str, int, str]] = deque()  # spec, req_id, route, note
        self.errors: list[tuple[str, str, int]] = []  # error records not yet acknowledged
        self.cancel_after_ack: set[int] = set()  # cancelled before their Submit was sent
        # HTTP requests cancelled while still in the hand-off queue: dropped when taken
        self.order = HandoffOrder(THREAD_ID_BITS)
        self.in_flight = 0            # specs sent in the Submit awaiting its ack
        self.max_batch = P.SUBMIT_MAX_SEQS  # halved when a Submit is refused or unanswered
        self.errors_in_flight = 0
        self.closing_in_flight = False
        self.awaiting_ack = False
        self.sent_at = 0.0
        self.router_incarnation = 0   # of the router that answered last (P.Stats.incarnation; 0: none yet)
        self.sent_to = 0              # ... when the Submit awaiting its ack went out
        self.retry_at = 0.0
        self.line_no = 0
        self.num_requests = 0
        self.closed_sent = False
        self.rng = random.SystemRandom()
        # Submit no prompt until this many workers have joined, so a short run is spread over
        # the whole fleet; prompts are read and tokenized meanwhile. 0: submit at once.
        self.wait_for_workers = wait_for_workers
        self.asked_at = 0.0

    def hello(self) -> None:
        transport.send(self.router, P.Hello("ingest", "ingest"))
        got = transport.recv(self.router, STARTUP_TIMEOUT_S)
        if got is None:
            raise SystemExit(f"ingest: router unreachable at {self.router_addr} "
                             f"(no answer in {STARTUP_TIMEOUT_S:g} s)")
        if isinstance(got[1], P.Reject) and not got[1].is_unknown_peer:
            raise SystemExit(f"ingest: router refused: {got[1].reason}")

    def serve_forever(self, exit_on_eof: bool) -> None:
        signal.signal(signal.SIGTERM, _stop)
        try:
            self._serve(exit_on_eof)
        finally:
            self.trace.flush()
            if self.http is not None:
                self.http.shutdown()  # open HTTP requests end with an error, streams with [DONE]
            if self.fronts is not None:
                self.fronts.stop()    # as they do in each front process

    def _serve(self, exit_on_eof: bool) -> None:
        self.hello()
        freeze_heap()
        api = self.http or self.fronts
        if api is not None:
            api.start()
            print(f"qmigrate: OpenAI-compatible API on {api.url}/v1", file=sys.stderr, flush=True)
        if self.read_stdin:
            threading.Thread(target=self._read_stdin, daemon=True, name="stdin").start()
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.feed, zmq.POLLIN)
        poller.register(self.replies, zmq.POLLIN)
        if self.http is not None:
            poller.register(self.wake, zmq.POLLIN)
        if self.fronts is not None:
            poller.register(self.fronts.sock, zmq.POLLIN)
        while True:
            self.take_lines()
            self.take_http()
            if self.fronts is not None and (lost := self.fronts.check()):
                self.cancel(lost)
            if self.wait_for_workers and self.pending:  # errors and the end of input need no worker
                self.ask_for_workers()
            else:
                self.submit()
            if api is not None:
                self.ask_for_workers(HEALTH_POLL_S)  # for /health
            ready = dict(poller.poll(20))
            if self.router in ready:
                self.on_router()
            if self.feed in ready:
                self.on_feed()
            if self.replies in ready:
                self.on_replies()
            if self.http is not None and self.wake in ready:
                while self.wake.poll(0):
                    self.wake.recv()
            if self.fronts is not None and self.fronts.sock in ready:
                self.on_fronts()
            if self.closed_sent and exit_on_eof:
                return

    def _read_stdin(self) -> None:
        for raw in sys.stdin.buffer:  # bytes: a line that is not UTF-8 is that line's error
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                line = BadLine(f"the line is not valid UTF-8 ({exc.reason} at byte {exc.start})")
            self.lines.put(line)  # blocks while max_pending lines wait: backpressure
        self.lines.put(None)

    def take_lines(self) -> None:
        while len(self.pending) + len(self.errors) < self.max_pending:  # errors wait for the router too
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return
            if line is None:
                self.stdin_done = True
                return
            self.admit(line)

    def admit(self, line: str) -> None:
        self.line_no += 1
        self.num_requests += 1
        try:
            if isinstance(line, BadLine):
                raise PromptError(str(self.line_no), str(line))
            prompt = parse_line(line, mode=self.mode, line_no=self.line_no, tokenizer=self.tokenizer,
                                max_context=self.max_context, defaults=self.defaults,
                                eos_ids=self.eos_ids, vocab_size=self.id_bound, chat=self.chat)
            if isinstance(prompt, CancelRequest):
                seq_id = self.live.get(prompt.req_id)
                if seq_id is None:
                    raise PromptError(prompt.req_id, "cancel: no running request has this id")
                self.num_requests -= 1  # the cancelled request's end is its record
                self.cancel([seq_id])
                return
            if prompt.req_id in self.live:
                raise PromptError(prompt.req_id, f"duplicate id {prompt.req_id!r}: a request with this "
                                  "id is still running; this one is refused")
            if prompt.grammar:   # stdin's requests wait in line anyway: compiled here, within the limit
                try:
                    self.grammars.matcher(prompt.grammar, self.eos_ids)
                except GrammarError as exc:
                    raise PromptError(prompt.req_id, f"structured output: {exc}", "structured_outputs") from None
        except PromptError as exc:
            self.errors.append(error_record(exc.req_id, exc.message, self.id_base | self.num_requests))
            return
        seq_id = self.id_base | self.num_requests
        self.live[prompt.req_id], self.live_ids[seq_id] = seq_id, prompt.req_id
        self.enqueue(seq_id, prompt, P.ROUTE_STDOUT)

    def enqueue(self, seq_id: int, prompt, route: int) -> None:
        spec = to_spec(prompt, seq_id, seed_of(prompt, self.rng), self.eos_ids)
        self.pending.append((spec, prompt.req_id, route, prompt.note))

    def take_http(self) -> None:
        if self.http is None:
            return
        cancels = []
        while not self.http.cancels.empty():
            cancels.append(self.http.cancels.get())
        if cancelled := self.order.cancel(cancels):
            self.cancel(cancelled)
        while len(self.pending) < self.max_pending:
            try:
                # One HTTP request's choices, all together: pending may pass max_pending by
                # fewer than MAX_CHOICES.
                choices = self.http.submissions.get_nowait()
            except queue.Empty:
                return
            for seq_id, prompt in choices:
                if self.order.take(seq_id):
                    self.enqueue(seq_id, prompt, http_route(prompt))

    def on_fronts(self) -> None:
        """The HTTP front processes' requests, taken while fewer than max_pending wait for the
        router (a request's choices all or none), and their cancels."""
        for front, msg in self.fronts.receive():
            if isinstance(msg, P.Cancel):
                self.cancel(P.unpack_i64(msg.seq_ids).tolist())
                continue
            is_accepted = len(self.pending) < self.max_pending
            if is_accepted:
                self.pending.extend(zip(msg.seqs, msg.req_ids, P.unpack_u8(msg.routes).tolist(), msg.notes))
            self.fronts.admit(front, msg, is_accepted)

    def cancel(self, seq_ids: list[int]) -> None:
        """Forget requests: those not yet sent to the router here, the rest at the router,
        which has the detokenizer end their output."""
        wanted = set(seq_ids)
        # Not yet sent: a Cancel now would reach the router before them. They go with their
        # Submit, and their Cancel right after its ack, so each still gets its final record.
        later = {item[0].seq_id for i, item in enumerate(self.pending)
                 if i >= self.in_flight and item[0].seq_id in wanted}
        self.cancel_after_ack |= later
        for seq_id in seq_ids:
            self.live.pop(self.live_ids.pop(seq_id, None), None)
        now = [sid for sid in seq_ids if sid not in later]
        if now:
            transport.send(self.router, P.Cancel(P.pack_i64(now)))  # it tells the detokenizer

    def on_replies(self) -> None:
        while self.replies.poll(0):
            frame = self.replies.recv()
            msg = transport.parse(frame, "the detokenizer")
            if not isinstance(msg, P.Replies):
                continue
            self.trace("in", len(msg.texts))
            if self.fronts is not None:
                self.fronts.forward(frame, msg)
            if self.live_ids or self.http is not None:
                self.take_replies(msg)

    def take_replies(self, msg: P.Replies) -> None:
        """The ends of stdin's requests, and the in-thread server's rows."""
        rows = reply_rows(msg)
        for seq_id, _, code, *_ in rows:
            if code and seq_id in self.live_ids:
                self.live.pop(self.live_ids.pop(seq_id), None)
        if self.http is not None:
            self.http.deliver(rows)

    def submit(self) -> None:
        now = time.monotonic()
        if self.awaiting_ack and now - self.sent_at > ACK_TIMEOUT_S:
            # Lost ack (a router restart, say): send again, the router ignores what it has
            # already; in a smaller Submit, so a message it cannot read is not sent as is.
            self.awaiting_ack = False
            if self.in_flight > 1:
                self.max_batch = self.in_flight // 2
        elif self.awaiting_ack and now - self.sent_at > WORKERS_POLL_S:
            self.ask_for_workers()   # a restarted router is found by its Stats (`on_router`)
        closing = (self.read_stdin and self.stdin_done and not self.closed_sent and not self.pending
                   and self.lines.empty() and len(self.errors) <= P.SUBMIT_MAX_SEQS)
        if self.awaiting_ack or now < self.retry_at or not (self.pending or self.errors or closing):
            return
        batch = [self.pending[i] for i in range(min(self.max_batch, P.submit_count(b[0] for b in self.pending)))]
        self.errors_in_flight = min(len(self.errors), P.SUBMIT_MAX_SEQS)
        self.closing_in_flight = closing
        errors = self.errors[:self.errors_in_flight]
        transport.send(self.router, P.Submit([b[0] for b in batch], [b[1] for b in batch],
                                             [[r, m] for r, m, _ in errors],
                                             self.num_requests if closing else -1,
                                             P.pack_u8([b[2] for b in batch]), [b[3] for b in batch],
                                             P.pack_i64([n for _, _, n in errors])))
        self.in_flight, self.sent_at, self.awaiting_ack = len(batch), now, True
        self.sent_to = self.router_incarnation

    def ask_for_workers(self, every_s: float = WORKERS_POLL_S) -> None:
        if (now := time.monotonic()) - self.asked_at >= every_s:
            transport.send(self.router, P.StatsRequest())
            self.asked_at = now
            self.trace.flush()

    def on_router(self) -> None:
        while (got := transport.recv(self.router, 0)) is not None:
            msg = got[1]
            if isinstance(msg, (P.Stats, P.SubmitAck)) and msg.incarnation:
                self.router_incarnation = msg.incarnation
            if isinstance(msg, P.Stats):
                if self.awaiting_ack and self.sent_to and msg.incarnation and msg.incarnation != self.sent_to:
                    # the Submit went to a router that has since restarted: its ack will not come,
                    # so it goes again now rather than after ACK_TIMEOUT_S (stats come every
                    # WORKERS_POLL_S); the router ignores what it already has
                    self.awaiting_ack = False
                if msg.counters.get("workers", 0) >= self.wait_for_workers:
                    self.wait_for_workers = 0
                serving = msg.counters.get("serving", msg.counters.get("workers", 0))
                serving = serving if type(serving) is int and serving >= 0 else 0
                if self.wait_for_workers:
                    serving = 0   # ready (/health 200) only once every worker of the fleet has joined
                if self.http is not None:
                    self.http.num_serving = serving
                if self.fronts is not None:
                    self.fronts.set_serving(serving)
            if isinstance(msg, P.Reject) and self.awaiting_ack and not msg.is_unknown_peer:
                self.on_refused(msg.reason)
            if isinstance(msg, P.SubmitAck) and self.awaiting_ack and msg.is_deferred:
                self.awaiting_ack, self.in_flight, self.errors_in_flight = False, 0, 0
                self.closing_in_flight = False
                self.retry_at = time.monotonic() + DEFERRED_RETRY_S  # the output is behind: all of it later
                continue
            if isinstance(msg, P.SubmitAck) and self.awaiting_ack:
                taken = max(0, min(msg.num_accepted, self.in_flight))
                cancel = []
                for _ in range(taken):
                    seq_id = self.pending.popleft()[0].seq_id
                    if seq_id in self.cancel_after_ack:
                        self.cancel_after_ack.discard(seq_id)
                        cancel.append(seq_id)
                if cancel:
                    transport.send(self.router, P.Cancel(P.pack_i64(cancel)))
                if taken < self.in_flight:
                    self.retry_at = time.monotonic() + 0.05  # router full: wait, keep order
                del self.errors[:self.errors_in_flight]
                self.closed_sent |= self.closing_in_flight
                self.in_flight = self.errors_in_flight = 0
                self.awaiting_ack = self.closing_in_flight = False
                self.max_batch = min(P.SUBMIT_MAX_SEQS, 2 * self.max_batch)

    def on_refused(self, reason: str) -> None:
        """The router could not take the Submit in flight: send its first half alone next, so
        the requests around a bad one go on; a request refused alone gets an error record."""
        log.warning("the router refused a Submit of %d requests: %s", self.in_flight, reason[:200])
        if self.in_flight == 1:
            spec, req_id, route, _ = self.pending.popleft()
            self.live.pop(self.live_ids.pop(spec.seq_id, None), None)
            self.cancel_after_ack.discard(spec.seq_id)
            if route in P.INGEST_ROUTES and self.http is not None:
                self.http.deliver([(spec.seq_id, "", int(P.Finish.ERROR), 0)])
            elif route in P.INGEST_ROUTES and self.fronts is not None:
                self.fronts.fail(spec.seq_id)
            else:
                self.errors.insert(0, error_record(req_id, f"refused by the router: {reason}", spec.seq_id))
        elif self.in_flight == 0:  # errors alone (each within bounds already): keep them in bounds again
            for i in range(self.errors_in_flight):
                self.errors[i] = error_record(self.errors[i][0][:64], "invalid request", self.errors[i][2])
        self.max_batch = max(1, self.in_flight // 2)
        self.in_flight = self.errors_in_flight = 0
        self.awaiting_ack = self.closing_in_flight = False

    def on_feed(self) -> None:
        while (got := transport.recv(self.feed, 0, guard=self.guard)) is not None:
            sender, msg = got
            if not isinstance(msg, P.FeedLines):
                continue
            accepted = 0
            for line in msg.lines:
                try:
                    self.lines.put_nowait(line)
                except queue.Full:
                    break
                accepted += 1
            transport.send(self.feed, P.FeedAck(accepted), to=sender)


def _stop(signum, frame):
    """SIGTERM: unwind the loop, so that open HTTP requests are answered before the exit."""
    # ignored from here: a stop sends more than one (to the node's group, then to each role)
    # and they must not cut the answers short; one that hangs is killed after the node's grace
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def run(topo, name: str, read_stdin: bool = False, exit_when_done: bool = False, wait_for_workers: int = 0,
        restarted: bool = False) -> int:
    return run_until_fatal(lambda: Ingest(topo, read_stdin, wait_for_workers, restarted)
                           .serve_forever(exit_on_eof=exit_when_done))
