"""Ingest: reads prompts (stdin and/or `qmigrate feed` clients), tokenizes, validates, and
hands them to the router. Stdin is read only while fewer than `max_pending` prompts wait
for the router, so a full router stops the reading instead of growing memory.

Everything for the detokenizer (request names, refused requests, the end of the input)
travels in the same acknowledged `Submit` as the prompts, and the router forwards it: a
Submit is sent again until acknowledged, so a router restart loses none of it."""

from __future__ import annotations

import logging
import os
import queue
import random
import sys
import threading
import time
from collections import deque

import zmq

from .. import protocol as P
from .. import transport
from ..engine.models import load_tokenizer_info, resolve_model
from ..intake import Defaults, PromptError, parse_line
from . import run_until_fatal

log = logging.getLogger("qmigrate.ingest")

SUBMIT_BATCH = 64
ACK_TIMEOUT_S = 5.0
STARTUP_TIMEOUT_S = 30.0


class Ingest:
    def __init__(self, topo, read_stdin: bool):
        cfg = topo.ingest
        self.mode = cfg.input
        self.max_pending = cfg.max_pending
        d = topo.defaults
        self.defaults = Defaults(d.max_new_tokens, d.temperature, d.top_p, d.top_k)
        self.tokenizer, self.max_context, self.eos_ids = load_tokenizer_info(resolve_model(topo.model.path))
        self.router_addr = topo.endpoint("router").connect
        self.router = transport.socket(zmq.DEALER, connect=self.router_addr,
                                       identity=f"ingest-{os.getpid()}")
        self.feed = transport.socket(zmq.ROUTER, bind=topo.endpoint("ingest").bind)
        self.lines: queue.Queue = queue.Queue(maxsize=self.max_pending)
        self.read_stdin = read_stdin
        self.stdin_done = not read_stdin
        self.pending: deque[tuple[P.SeqSpec, str]] = deque()
        self.errors: list[list[str]] = []   # [req_id, message] not yet acknowledged
        self.in_flight = 0            # specs sent in the Submit awaiting its ack
        self.errors_in_flight = 0
        self.closing_in_flight = False
        self.awaiting_ack = False
        self.sent_at = 0.0
        self.retry_at = 0.0
        self.line_no = 0
        self.num_requests = 0
        self.closed_sent = False
        # Sequence ids are unique across ingest processes: a random high part, a counter below.
        self.id_base = random.SystemRandom().randrange(1, 1 << 22) << 40
        self.rng = random.SystemRandom()

    def hello(self) -> None:
        transport.send(self.router, P.Hello("ingest", "ingest"))
        got = transport.recv(self.router, STARTUP_TIMEOUT_S)
        if got is None:
            raise SystemExit(f"ingest: router unreachable at {self.router_addr} "
                             f"(no answer in {STARTUP_TIMEOUT_S:g} s)")

    def serve_forever(self, exit_on_eof: bool) -> None:
        self.hello()
        if self.read_stdin:
            threading.Thread(target=self._read_stdin, daemon=True, name="stdin").start()
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.feed, zmq.POLLIN)
        while True:
            self.take_lines()
            self.submit()
            ready = dict(poller.poll(20))
            if self.router in ready:
                self.on_router()
            if self.feed in ready:
                self.on_feed()
            if self.closed_sent and exit_on_eof:
                return

    def _read_stdin(self) -> None:
        for line in sys.stdin:
            self.lines.put(line)  # blocks while max_pending lines wait: backpressure
        self.lines.put(None)

    def take_lines(self) -> None:
        while len(self.pending) < self.max_pending:
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
            prompt = parse_line(line, mode=self.mode, line_no=self.line_no, tokenizer=self.tokenizer,
                                max_context=self.max_context, defaults=self.defaults,
                                eos_ids=self.eos_ids)
        except PromptError as exc:
            self.errors.append([exc.req_id, exc.message])
            return
        seq_id = self.id_base | self.num_requests
        ids = P.pack_i32(prompt.prompt_ids)
        seed = prompt.seed if prompt.seed is not None else self.rng.randrange(1 << 62)
        spec = P.SeqSpec(seq_id, ids, len(prompt.prompt_ids), prompt.max_new_tokens,
                         prompt.temperature, prompt.top_p, prompt.top_k, seed, prompt.stop_ids,
                         sorted(self.eos_ids))
        self.pending.append((spec, prompt.req_id))

    def submit(self) -> None:
        now = time.monotonic()
        if self.awaiting_ack and now - self.sent_at > ACK_TIMEOUT_S:
            self.awaiting_ack = False  # lost ack: resend; the router ignores what it already has
        closing = (self.read_stdin and self.stdin_done and not self.closed_sent and not self.pending
                   and self.lines.empty() and len(self.errors) <= SUBMIT_BATCH)
        if self.awaiting_ack or now < self.retry_at or not (self.pending or self.errors or closing):
            return
        batch = [self.pending[i] for i in range(min(SUBMIT_BATCH, len(self.pending)))]
        self.errors_in_flight = min(len(self.errors), SUBMIT_BATCH)
        self.closing_in_flight = closing
        transport.send(self.router, P.Submit([spec for spec, _ in batch], [r for _, r in batch],
                                             self.errors[:self.errors_in_flight],
                                             self.num_requests if closing else -1))
        self.in_flight, self.sent_at, self.awaiting_ack = len(batch), now, True

    def on_router(self) -> None:
        while (got := transport.recv(self.router, 0)) is not None:
            msg = got[1]
            if isinstance(msg, P.SubmitAck) and self.awaiting_ack:
                taken = max(0, min(msg.num_accepted, self.in_flight))
                for _ in range(taken):
                    self.pending.popleft()
                if taken < self.in_flight:
                    self.retry_at = time.monotonic() + 0.05  # router full: wait, keep order
                del self.errors[:self.errors_in_flight]
                self.closed_sent |= self.closing_in_flight
                self.in_flight = self.errors_in_flight = 0
                self.awaiting_ack = self.closing_in_flight = False

    def on_feed(self) -> None:
        while (got := transport.recv(self.feed, 0)) is not None:
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


def run(topo, name: str, read_stdin: bool = False, exit_when_done: bool = False) -> int:
    return run_until_fatal(lambda: Ingest(topo, read_stdin).serve_forever(exit_on_eof=exit_when_done))
