"""An HTTP front process: one of the `ingest.http_processes` servers that share the API's port
in front of the one ingest loop, each parsing its own calls and writing its own streams.

It runs the in-thread `HttpServer` unchanged (bound with SO_REUSEPORT, with `admission`), and
on its main thread a bridge to ingest over a DEALER socket: what the server queues goes out
as `Submit`s of wire specs (made here, so ingest does nothing per token id) and `Cancel`s, a
cancel never before its request (`HandoffOrder`); ingest's `FrontAdmit`, `Replies` and
`FrontStatus` come back to the server. Started by ingest (ingest/front_supervisor.py), which
writes its settings as JSON on its stdin; it dies with ingest, and on SIGTERM it ends its open
requests as the in-thread server does when ingest stops.

Run: `python -m qmigrate.ingest.front_process < settings.json` (ingest does it).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import signal
import sys
import time

import zmq

from qmigrate.config import IngestConfig
from qmigrate.ingest.handoff import FRONT_ID_BITS, HandoffOrder, front_base, http_route, reply_rows
from qmigrate.ingest.http import WAKE_ENDPOINT, HttpServer
from qmigrate.ingest.prompts import Defaults, seed_of, to_spec
from qmigrate.ops.process import die_with, freeze_heap
from qmigrate.ops.trace import OFF, tracer
from qmigrate.wire import protocol as P
from qmigrate.wire import transport

log = logging.getLogger("qmigrate.http")

POLL_MS = 1000
ALIVE_S = 1.0   # a hello this often, while the front runs
HWM = 100_000   # messages queued toward ingest before a send fails (the request then gets a 429)


class Bridge:
    """Moves what the server queues to ingest, and ingest's answers to the server."""

    def __init__(self, server: HttpServer, sock: zmq.Socket, trace=OFF):
        self.server, self.sock = server, sock
        self.trace = trace   # replies in from ingest (ops/trace.py)
        self.order = HandoffOrder(FRONT_ID_BITS)
        self.rng = random.SystemRandom()
        self.wake = transport.socket(zmq.PULL, bind=WAKE_ENDPOINT, hwm=1)  # before the server connects

    def run(self, hello: P.FrontHello) -> None:
        poller = zmq.Poller()
        poller.register(self.wake, zmq.POLLIN)
        poller.register(self.sock, zmq.POLLIN)
        said = time.monotonic()
        while True:
            ready = dict(poller.poll(POLL_MS))
            if (now := time.monotonic()) - said >= ALIVE_S:   # ingest kills a front it stops hearing
                transport.send(self.sock, hello)
                said = now
                self.trace.flush()
            while self.wake.poll(0):
                self.wake.recv()
            self.take()
            if self.sock in ready:
                self.on_ingest()

    def take(self) -> None:
        server, cancels = self.server, []
        while not server.cancels.empty():
            cancels.append(server.cancels.get())
        if now := self.order.cancel(cancels):   # their Submit went before: the Cancel follows it
            transport.send(self.sock, P.Cancel(P.pack_i64(now)))
        specs, req_ids, notes, routes = [], [], [], []
        while True:
            try:
                choices = server.submissions.get_nowait()
            except queue.Empty:
                break
            for seq_id, prompt in choices:
                if self.order.take(seq_id):
                    specs.append(to_spec(prompt, seq_id, seed_of(prompt, self.rng), server.eos_ids))
                    req_ids.append(prompt.req_id)
                    notes.append(prompt.note)
                    routes.append(http_route(prompt))
        while specs:
            n = P.submit_count(specs)
            self.submit(specs[:n], req_ids[:n], notes[:n], routes[:n])
            del specs[:n], req_ids[:n], notes[:n], routes[:n]

    def submit(self, specs: list[P.SeqSpec], req_ids: list[str], notes: list[str], routes: list[int]) -> None:
        msg = P.Submit(specs, req_ids, [], -1, P.pack_u8(routes), notes)
        if not transport.send(self.sock, msg):   # ingest is not reading: as good as refused
            self.server.admit([spec.seq_id for spec in specs], False)

    def on_ingest(self) -> None:
        server = self.server
        while (got := transport.recv(self.sock, 0)) is not None:
            msg = got[1]
            if isinstance(msg, P.Replies):
                self.trace("in", len(msg.texts))
                server.deliver(reply_rows(msg))
            elif isinstance(msg, P.FrontAdmit):
                server.admit(P.unpack_i64(msg.seq_ids).tolist(), msg.is_accepted)
            elif isinstance(msg, P.FrontStatus):
                server.num_serving = msg.num_serving


def _stop(signum, frame):
    """SIGTERM (ingest stops, or died): unwind, so that open requests are answered first."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a second must not cut the answers short: ingest kills one that lingers
    raise SystemExit(128 + signum)


def serve(settings: dict) -> int:
    index = settings["index"]
    cfg = IngestConfig(**settings["ingest"])
    sock = transport.socket(zmq.DEALER, connect=settings["endpoint"], identity=f"http-{index}-{os.getpid()}",
                            hwm=HWM)
    server = HttpServer(cfg, settings["model_path"], Defaults(*settings["defaults"]),
                        front_base(settings["id_base"], index), settings["trust_remote_code"], reuse_port=True,
                        admission=True, id_bits=FRONT_ID_BITS, first_id=random.SystemRandom().getrandbits(32),
                        max_model_len=settings["max_model_len"])
    bridge = Bridge(server, sock, tracer(f"http-{index}", settings.get("trace_dir")))
    try:
        server.start()
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        transport.send(sock, P.FrontHello(index, os.getpid(), exc.code[:1024]))
        sock.close(linger=1000)   # the reason reaches ingest, which says it
        return 1
    hello = P.FrontHello(index, os.getpid())
    transport.send(sock, hello)
    freeze_heap()
    try:
        bridge.run(hello)
    finally:
        bridge.trace.flush()
        server.shutdown()   # open requests end with an error, streams with [DONE]
    return 0


def main() -> int:
    settings = json.load(sys.stdin)
    die_with(settings["parent"])
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C stops ingest, and ingest stops this
    from qmigrate.launch import set_title
    from qmigrate.ops.logs import setup
    set_title("http", str(settings["index"]))
    setup("http", str(settings["index"]), "", settings["log_level"])
    try:
        return serve(settings)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1


if __name__ == "__main__":
    sys.exit(main())
