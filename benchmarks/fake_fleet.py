"""Fake workers for the router benchmark: the real worker protocol, no model.

A `FakeDevice` is one GPU that runs the leases it is given back to back, each step taking
`step_s`: a lease of k steps that arrives at t on an idle device ends at t + k·step_s, and
one that arrives while another runs starts when that one ends (the pipelining a real worker
gets from keeping two batches in flight). Every row yields one token per step; a Revoke
ends the lease at the next step boundary, as a real worker does. Sequences never finish
here: the benchmark feeds long ones, so what it measures is the router's steady state.

`serve` drives several fake devices from one process, a poller over one DEALER socket per
fake worker, so a fleet of fakes costs little CPU. Run as
`python -m benchmarks.fake_fleet ENDPOINT NAME...`: on SIGTERM it prints one JSON line with
what each fake worker did, and exits.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import zmq

from qmigrate.wire import protocol as P
from qmigrate.wire import transport

FAKE_TOKEN = 7
MAX_TOKENS = 1 << 20       # the prefill budget a fake asks for: prompts never limit a batch
HELLO_TIMEOUT_S = 30.0


@dataclass(slots=True)
class FakeLease:
    lease_id: int
    seq_ids: bytes            # int64, echoed back
    num_steps: int
    arrived: float
    stops: np.ndarray         # int32 [rows]: steps each row runs (num_steps unless revoked)
    start: float = 0.0
    end: float = 0.0


@dataclass(slots=True)
class Completion:
    end: float
    start: float
    num_rows: int
    num_tokens: int


class FakeDevice:
    """One fake GPU's timeline. Times are plain floats supplied by the caller."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.leases: deque[FakeLease] = deque()   # oldest first; the head is running or next
        self.free_at = 0.0                         # when the last lease ended

    @property
    def lease_ids(self) -> list[int]:
        return [lease.lease_id for lease in self.leases]

    @property
    def num_held(self) -> int:
        return len(self.leases)

    def add(self, lease: P.Lease, now: float) -> None:
        rows = len(P.unpack_i64(lease.seq_ids, "seq_ids"))
        steps = max(1, lease.num_steps)
        self.leases.append(FakeLease(lease.lease_id, lease.seq_ids, steps, now,
                                     np.full(rows, steps, dtype=np.int32)))
        self._plan()

    def revoke(self, msg: P.Revoke, now: float) -> bool:
        """End the lease at its next step boundary (a lease not started yet runs one step).
        False when the lease is not held here (finished, unknown): then nothing changes."""
        lease = next((x for x in self.leases if x.lease_id == msg.lease_id), None)
        if lease is None:
            return False
        P.unpack_i64(msg.seq_ids, "seq_ids")
        boundary = 1 if now < lease.start else min(lease.num_steps, int((now - lease.start) / self.step_s) + 1)
        np.minimum(lease.stops, boundary, out=lease.stops)
        self._plan()
        return True

    def next_end(self) -> float | None:
        return self.leases[0].end if self.leases else None

    def due(self, now: float) -> list[tuple[P.StepResult, Completion]]:
        """Results of the leases whose last step has ended by now, oldest first."""
        done = []
        while self.leases and self.leases[0].end <= now:
            lease = self.leases.popleft()
            self.free_at = lease.end
            counts = lease.stops
            result = P.StepResult(lease.lease_id, lease.seq_ids, P.pack_i32(counts),
                                  P.pack_i32(np.full(int(counts.sum()), FAKE_TOKEN)),
                                  bytes(len(counts)))
            done.append((result, Completion(lease.end, lease.start, len(counts), int(counts.sum()))))
        return done

    def _plan(self) -> None:
        """Start and end of every lease held: each starts when it came or the one before ended."""
        free = self.free_at
        for lease in self.leases:
            lease.start = max(lease.arrived, free)
            lease.end = lease.start + int(lease.stops.max(initial=1)) * self.step_s
            free = lease.end


@dataclass(slots=True)
class FakeWorker:
    name: str
    sock: zmq.Socket
    device: FakeDevice
    max_seqs: int
    inflight: int
    outstanding: int = 0
    request_no: int = 0
    heartbeat_s: float = 0.5
    last_heartbeat: float = 0.0
    alive: bool = True
    completions: list[Completion] = field(default_factory=list)

    def request_work(self) -> None:
        while self.outstanding + self.device.num_held < self.inflight:
            self.request_no += 1
            transport.send(self.sock, P.WorkRequest(self.request_no, self.max_seqs, MAX_TOKENS))
            self.outstanding += 1

    def hello(self) -> None:
        info = {"device": "fake", "max_seqs": self.max_seqs, "max_tokens": MAX_TOKENS,
                "inflight": self.inflight}
        transport.send(self.sock, P.Hello("worker", self.name, info=info))

    def on_message(self, msg, now: float) -> None:
        if isinstance(msg, P.Lease):
            self.outstanding = max(0, self.outstanding - 1)
            self.device.add(msg, now)
        elif isinstance(msg, P.Revoke):
            self.device.revoke(msg, now)
        elif isinstance(msg, P.Welcome):
            self.heartbeat_s = msg.heartbeat_interval_s
        elif isinstance(msg, P.Exit):
            self.alive = False
        elif isinstance(msg, P.Reject):
            self.hello()
            self.outstanding = 0

    def tick(self, now: float) -> None:
        for result, done in self.device.due(now):
            transport.send(self.sock, result)
            self.completions.append(done)
        if now - self.last_heartbeat > self.heartbeat_s:
            self.last_heartbeat = now
            transport.send(self.sock, P.Heartbeat(self.name, 0, -1, lease_ids=P.pack_i64(self.device.lease_ids)))
        self.request_work()


def serve(endpoint: str, names: list[str], step_s: float, max_seqs: int, inflight: int,
          should_stop) -> list[FakeWorker]:
    workers = [FakeWorker(n, transport.socket(zmq.DEALER, connect=endpoint, identity=n),
                          FakeDevice(step_s), max_seqs, inflight) for n in names]
    _welcome(workers)
    by_sock = {w.sock: w for w in workers}
    poller = zmq.Poller()
    for w in workers:
        poller.register(w.sock, zmq.POLLIN)
    last_check = 0.0
    while True:
        now = time.monotonic()
        if now - last_check > 0.02:
            last_check = now
            if should_stop():
                return workers
        ends = [e for w in workers if w.alive and (e := w.device.next_end()) is not None]
        wait = min(ends, default=now + 0.02) - now
        # zmq polls in whole milliseconds: wake early, then sleep the rest of the way.
        ready = poller.poll(math.floor(wait * 1000) if wait >= 0.001 else 0)
        if not ready and 0 < wait < 0.001:
            time.sleep(wait)
        for sock, _ in ready:
            w = by_sock[sock]
            while (got := _recv_now(sock)) is not None:
                try:
                    w.on_message(got, time.monotonic())
                except P.ProtocolError as exc:
                    print(f"fake worker {w.name}: dropped a {type(got).__name__}: {exc}", file=sys.stderr)
        now = time.monotonic()
        for w in workers:
            if w.alive:
                w.tick(now)


def _recv_now(sock: zmq.Socket):
    try:
        frame = sock.recv(zmq.NOBLOCK)
    except zmq.Again:
        return None
    return transport.parse(frame, "router")


def _welcome(workers: list[FakeWorker]) -> None:
    waiting = {w.name: w for w in workers}
    for w in workers:
        w.hello()
    deadline = time.monotonic() + HELLO_TIMEOUT_S
    while waiting:
        if time.monotonic() > deadline:
            raise SystemExit(f"fake workers: no Welcome for {', '.join(waiting)} in {HELLO_TIMEOUT_S:g} s")
        for name, w in list(waiting.items()):
            got = transport.recv(w.sock, 0.01)
            if got is not None and isinstance(got[1], P.Welcome):
                w.on_message(got[1], time.monotonic())
                del waiting[name]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Fake workers for the router benchmark.")
    ap.add_argument("endpoint")
    ap.add_argument("names", nargs="+")
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--max-seqs", type=int, default=256)
    ap.add_argument("--inflight", type=int, default=2)
    args = ap.parse_args(argv)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    parent = os.getppid()
    workers = serve(args.endpoint, args.names, args.step_ms / 1000, args.max_seqs, args.inflight,
                    lambda: bool(stopping) or os.getppid() != parent)
    report = {w.name: [[c.start, c.end, c.num_rows, c.num_tokens] for c in w.completions] for w in workers}
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
