"""What the router sends the detokenizer, and keeps until it is printed.

The router is the one way into the detokenizer: request names and errors from ingest, and the
tokens workers send before their step results, are forwarded on one PUSH socket, in order.
While the detokenizer does not read they are held here, never dropped: past either bound the
router admits no new request (a Submit is deferred) until it reads again. With a journal, what
the router accepted survives a kill: on start it runs again every request whose output the
detokenizer has not confirmed (the same tokens: sampling depends only on the request), and the
detokenizer prints each token once."""

from __future__ import annotations

import logging
from collections import deque

import zmq

from qmigrate.router.journal import Journal, OutputLog
from qmigrate.wire import protocol as P
from qmigrate.wire import codec
from qmigrate.wire import transport

log = logging.getLogger("qmigrate.router")

MAX_BACKLOG = 100_000
MAX_BACKLOG_BYTES = 256 << 20


class Output:
    def __init__(self, endpoint: str, journal_path: str):
        self.detok = transport.socket(zmq.PUSH, connect=endpoint, hwm=100_000)
        self.backlog: deque[bytes] = deque()
        self.backlog_bytes = 0
        self.outputs = OutputLog()
        self.journal = Journal(journal_path) if journal_path else None

    def forward(self, frame: bytes) -> None:
        """To the detokenizer, in order; held here while it does not read (never dropped: a
        full backlog stops admission instead, see Router.on_submit)."""
        if self.backlog or not transport.send_frame(self.detok, frame, what="detokenizer message"):
            self.backlog.append(frame)
            self.backlog_bytes += len(frame)

    @property
    def is_backlog_full(self) -> bool:
        return len(self.backlog) >= MAX_BACKLOG or self.backlog_bytes >= MAX_BACKLOG_BYTES

    def flush_backlog(self) -> None:
        while self.backlog:
            try:
                self.detok.send(self.backlog[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.backlog_bytes -= len(self.backlog.popleft())

    def recover(self, sched) -> None:
        """Rebuild from the journal: every request not confirmed printed runs again."""
        self.outputs.replay(self.journal.read())
        self.journal.rewrite([codec.encode(self.outputs.snapshot())])
        for spec in self.outputs.specs.values():
            sched.readmit(spec)
        if len(self.outputs) or self.outputs.errors:
            log.warning("recovered %d unfinished requests from %s", len(self.outputs), self.journal.path)
        self.resend(sched)

    def resend(self, sched) -> None:
        """Everything the detokenizer may lack (it restarted, or this router did); what it
        printed already it skips. Requests that finished here but were not confirmed run again."""
        for sid in self.outputs.specs:
            self.forward(codec.encode(self.outputs.meta(sid)))
            seq = sched.seqs.get(sid)
            if seq is None:
                sched.readmit(self.outputs.specs[sid])
            elif len(seq.token_ids) > seq.spec.prompt_len:
                made = seq.token_ids[seq.spec.prompt_len:]
                self.forward(codec.encode(P.Tokens(P.pack_i64([sid]), P.pack_i32([0]), P.pack_i32([len(made)]),
                                               P.pack_i32(made), P.pack_u8([0]))))
        for error in self.outputs.error_messages():
            self.forward(codec.encode(error))
        if self.outputs.num_requests >= 0:
            self.forward(codec.encode(P.InputClosed(self.outputs.num_requests)))

    def resync(self, sched) -> None:
        """The detokenizer asks for everything not yet printed: what waits here is sent again too."""
        self.backlog.clear()
        self.backlog_bytes = 0
        self.resend(sched)

    def accept(self, msg: P.Submit, num_taken: int, max_kept: int, live) -> P.Submit | None:
        """Record what the scheduler took of a Submit (in the journal before the ack: accepted
        means kept); returns what is new, for `announce`."""
        new = self.outputs.add(msg, num_taken)
        # Finished requests wait here for the detokenizer's Printed, at most max_kept of them:
        # past that the oldest are forgotten (only a detokenizer restart needs them).
        self.outputs.trim(max_kept, live)
        if new is not None and self.journal is not None:
            self.journal.append(codec.encode(new))
        return new

    def announce(self, new: P.Submit) -> None:
        """The new requests' names, ingest's errors and the input's end, to the detokenizer."""
        for spec in new.seqs:
            self.forward(codec.encode(self.outputs.meta(spec.seq_id)))
        numbers = P.unpack_i64(new.error_ids).tolist()
        for (req_id, message), number in zip(new.errors, numbers):
            self.forward(codec.encode(P.RequestError(req_id, message, number)))
        if new.num_requests >= 0:
            self.forward(codec.encode(P.InputClosed(new.num_requests)))

    def answered_over_http(self) -> list[int]:
        """The requests not yet printed whose answers go back to ingest (its HTTP clients)."""
        return [sid for sid, (route, _) in self.outputs.extras.items() if route in P.INGEST_ROUTES]

    def printed(self, msg: P.Printed) -> None:
        seq_ids = P.unpack_i64(msg.seq_ids, "seq_ids").tolist()
        if self.outputs.printed(seq_ids) and self.journal is not None:
            self.journal.append(codec.encode(msg))
