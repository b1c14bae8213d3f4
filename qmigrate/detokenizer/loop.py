"""Detokenizer: turns token streams into text on stdout or, for requests that came in over
HTTP, sends the text back to the ingest node that took them.

Everything arrives from the router on one PULL socket. With a journal, every message is
written to it before what it prints is written out (and each idle flush of buffered text
likewise), so a restarted detokenizer replays the journal without printing, knows what it
printed, asks the router for everything again (`Resync`) and prints only what is new.
A message's text is made in memory first and written out in one write right after its
journal record, so a kill can fall between what is journaled and what is printed only
across those two system calls, not across the work of decoding.
It tells the router which requests it printed to their end (`Printed`), so the router can
forget them."""

from __future__ import annotations

import logging
import os
import struct
import sys
import time

import numpy as np
import zmq

from qmigrate.wire import protocol as P
from qmigrate.wire import codec
from qmigrate.wire import transport
from qmigrate.detokenizer import EXIT_REQUESTS_FAILED
from qmigrate.detokenizer.formats import make_sink
from qmigrate.hub.loading import resolve_model
from qmigrate.hub.tokenizer_info import load_tokenizer_info
from qmigrate.router.journal import Journal
from qmigrate.wire.security import Guard
from qmigrate.ops import logs
from qmigrate.ops.process import freeze_heap
from qmigrate.ops.progress import TerminalWriter
from qmigrate.ops.trace import flush_on_sigterm, tracer

log = logging.getLogger("qmigrate.detokenizer")

PRINTED_EVERY_S = 0.2
MAX_TIMED = 1 << 16  # requests whose latency is being timed
_TIME = struct.Struct("<d")


class Detokenizer:
    def __init__(self, topo, output: str | None = None):
        tokenizer, _, _ = load_tokenizer_info(resolve_model(topo.model.path), topo.model.trust_remote_code)
        self.vocab_size = len(tokenizer)
        self.replaying = False
        self.now = 0.0
        self.out = TerminalWriter(sys.stdout)
        self.pending: list[str] = []  # text made by the message in hand, printed after its journal record
        self.sink = make_sink(output or topo.detokenizer.output, tokenizer, self.write, self.clock,
                              reply=self.reply, whole_lines=not sys.stdout.isatty())
        self.pull = transport.socket(zmq.PULL, bind=topo.endpoint("detokenizer").bind, hwm=100_000)
        self.router = transport.socket(zmq.DEALER, connect=topo.endpoint("router").connect,
                                       identity=f"detokenizer-{os.getpid()}")
        self.replies = transport.socket(zmq.PUSH, connect=topo.endpoint("ingest_reply").connect, hwm=100_000)
        self.outbox: list[tuple] = []   # Replies rows: the arguments of reply()
        self.outbox_has_ids = False     # a row of the outbox carries token ids
        self.journal = Journal(topo.detokenizer.journal) if topo.detokenizer.journal else None
        self.expected: int | None = None
        self.last_printed = 0.0
        self.guard = Guard.for_topology(topo, "detokenizer")
        self.latency = None
        self.times: dict[int, list] = {}  # seq_id -> [admitted, first token or None]
        if topo.detokenizer.metrics_port:
            from qmigrate.ops.metrics import LatencyMetrics, serve
            self.latency = LatencyMetrics()
            serve(self.latency.registry, topo.detokenizer.metrics_port, topo.node(topo.detokenizer.node).bind_host)
        self.handlers = {P.RequestMeta: self.on_meta, P.Tokens: self.on_tokens,
                         P.RequestError: self.on_error, P.InputClosed: self.on_closed,
                         P.Cancel: self.on_cancel}
        self.trace = tracer("detokenizer", topo.trace_dir)   # tokens in, replies out (trace.py)
        flush_on_sigterm(self.trace)

    def clock(self) -> float:
        return self.now if self.replaying else time.monotonic()

    def write(self, text: str) -> None:
        if not self.replaying:
            self.pending.append(text)

    def print_pending(self) -> None:
        if self.pending:
            text, self.pending = "".join(self.pending), []
            self.out(text)

    def reply(self, seq_id: int, text: str, finish: int, num_tokens: int, cached_tokens: int = -1,
              logprobs=None, prompt=None, ids=None) -> None:
        if not self.replaying:
            self.outbox.append((seq_id, text, finish, num_tokens, cached_tokens, logprobs, prompt, ids))
            self.outbox_has_ids |= ids is not None

    def send_replies(self) -> None:
        if not self.outbox:
            return
        seq_ids, texts, finish, counts, cached, lps, prompts, ids = zip(*self.outbox)
        has_ids, self.outbox, self.outbox_has_ids = self.outbox_has_ids, [], False
        self.trace("out", len(seq_ids))
        msg = P.Replies(P.pack_i64(seq_ids), P.pack_u8(finish), P.pack_i32(counts), list(texts), P.pack_i32(cached))
        if any(x is not None for x in lps) or any(x is not None for x in prompts):
            msg = P.replies_with_logprobs(msg, lps, prompts)
        if has_ids:
            msg = P.replies_with_ids(msg, ids)
        if not transport.send(self.replies, msg, flags=zmq.NOBLOCK):
            # Ingest gone or far behind: its HTTP clients time out rather than this loop stall.
            log.warning("ingest is not taking replies; dropped %d", len(seq_ids))

    def recover(self) -> None:
        """Replay the journal without printing, then ask the router for everything again."""
        if self.journal is not None:
            records = self.journal.read()
            self.replaying = True
            try:
                for record in records:
                    (self.now,) = _TIME.unpack_from(record)
                    if len(record) == _TIME.size:
                        self.sink.flush_idle(self.now)
                    else:
                        self.handle(codec.decode(record[_TIME.size:]))
            finally:
                self.replaying = False
            if records:
                log.warning("replayed %d journal records: %d requests done, %d under way",
                            len(records), self.sink.num_done, self.sink.num_started)
        transport.send(self.router, P.Resync(os.getpid()))

    def serve_forever(self, exit_when_done: bool) -> None:
        self.recover()
        freeze_heap()
        while True:
            if self.pull.poll(100):
                frames, peer = transport.recv_frames(self.pull)
                self.receive(frames[-1], peer)
            self.send_replies()
            now = time.monotonic()
            due = self.journal is not None and self.sink.is_idle_due(now)
            self.sink.flush_idle(now)
            if due:
                self.journal.append(_TIME.pack(now))
            self.print_pending()
            if now - self.last_printed > PRINTED_EVERY_S:
                self.report_printed(now)
            if (exit_when_done and self.expected is not None and self.sink.num_done >= self.expected
                    and self.sink.num_started == 0):
                self.report_printed(now)
                return

    def receive(self, frame: bytes, peer: str = "") -> None:
        msg = transport.parse(frame, "router")
        if msg is None or self.guard.check(peer, msg, b"") is not None:
            return
        now = time.monotonic()
        self.handle(msg)
        if self.journal is not None and type(msg) in self.handlers:
            self.journal.append(_TIME.pack(now) + frame)  # before what it made is printed
        self.print_pending()

    def handle(self, msg) -> None:
        handler = self.handlers.get(type(msg))
        try:
            if handler is None:
                raise P.ProtocolError(f"unexpected {type(msg).__name__}")
            handler(msg)
        except P.ProtocolError as exc:
            logs.dropped.warning("dropped a message: %s", exc)
        except Exception as exc:  # noqa: BLE001 -- one bad message must not stop the output
            logs.dropped.warning("dropped a message: %s: %s", type(exc).__name__, exc)

    def report_printed(self, now: float) -> None:
        self.last_printed = now
        self.trace.flush()
        if self.sink.newly_done:
            done, self.sink.newly_done = sorted(set(self.sink.newly_done)), []
            transport.send(self.router, P.Printed(P.pack_i64(done)))

    def on_meta(self, msg: P.RequestMeta) -> None:
        self.sink.start(msg.seq_id, msg.req_id, P.unpack_ids(msg.prompt_ids).tolist(), msg.route,
                        msg.note[:1000])
        if self.latency is not None and not self.replaying:
            self.times[msg.seq_id] = [time.monotonic(), None]
            while len(self.times) > MAX_TIMED:  # requests that never ended here (lost with a router)
                del self.times[next(iter(self.times))]

    def on_cancel(self, msg: P.Cancel) -> None:
        for seq_id in P.unpack_i64(msg.seq_ids).tolist():
            self.sink.cancel(seq_id)
            self.times.pop(seq_id, None)

    def on_error(self, msg: P.RequestError) -> None:
        self.sink.error(msg.req_id, msg.message, msg.seq_id)
        if self.latency is not None and not self.replaying:
            self.latency.failed()

    def on_closed(self, msg: P.InputClosed) -> None:
        self.expected = msg.num_requests

    def on_tokens(self, msg: P.Tokens) -> None:
        seq_ids = P.unpack_i64(msg.seq_ids).tolist()
        if not self.replaying:
            self.trace("in", len(seq_ids))
        starts = P.unpack_i32(msg.start).tolist()
        counts = P.unpack_i32(msg.counts).tolist()
        tokens = P.unpack_i32(msg.tokens).tolist()
        finish = P.unpack_u8(msg.finish).tolist()
        if msg.cached_tokens:
            for sid, n in zip(seq_ids, P.unpack_i32(msg.cached_tokens).tolist()):
                if n >= 0:
                    self.sink.cached(sid, n)
        entries = self.logprobs_of(msg, seq_ids, counts) if msg.lp_width >= 0 or msg.prompt_width >= 0 else None
        # Lengths and signs were checked at decode (Tokens.validate). An id past the tokenizer
        # is valid output of a model whose vocabulary is larger: it decodes as no text.
        pos = 0
        now = time.monotonic()
        timed = self.latency is not None and not self.replaying
        for sid, start, count, code in zip(seq_ids, starts, counts, finish):
            self.sink.tokens(sid, start, tokens[pos:pos + count], entries and entries[pos:pos + count])
            pos += count
            if timed and count and (t := self.times.get(sid)) is not None and t[1] is None:
                t[1] = now
            if code and (end := P.Finish(code)).is_finished:
                self.sink.finish(sid, end.reason, start + count)
                if timed and (t := self.times.pop(sid, None)) is not None:
                    self.latency.finished(t[0], t[1], now, start + count, end.reason)

    def logprobs_of(self, msg: P.Tokens, seq_ids: list[int], counts: list[int]) -> list | None:
        """Each token's logprobs (a reference into the message's arrays: wire/packed.py) or
        None; a prompt's go to the sink here."""
        if msg.prompt_width >= 0:
            prompt_counts = P.unpack_i32(msg.prompt_counts).tolist()
            values, ids = P.unpack_logprob_block(msg.prompt_values, msg.prompt_top_ids, sum(prompt_counts),
                                                 msg.prompt_width, 2)
            pos = 0
            for sid, n in zip(seq_ids, prompt_counts):
                if n:
                    self.sink.prompt_logprobs(sid, (values[pos:pos + n], ids[pos:pos + n]))
                pos += n
        if msg.lp_width < 0:
            return None
        n = sum(counts)
        values, ids = P.unpack_logprob_block(msg.lp_values, msg.lp_top_ids, n, msg.lp_width, 1)
        known = (~np.isnan(values[:, 0])).tolist()
        return [(values, ids, k) if known[k] else None for k in range(n)]


def run(topo, name: str, exit_when_done: bool = False) -> int:
    detokenizer = Detokenizer(topo)
    try:
        detokenizer.serve_forever(exit_when_done)
    finally:
        detokenizer.trace.flush()
    if exit_when_done and (failed := detokenizer.sink.num_failed):
        log.warning("%d of %d requests failed", failed, detokenizer.sink.num_done)
        return EXIT_REQUESTS_FAILED
    return 0
