"""Ingest's side of its HTTP front processes (`ingest.http_processes` >= 2): it starts them,
talks to them over a ROUTER socket on an ipc:// path in a private directory, routes each
detokenizer row to the front that holds its request, and replaces a front that dies.

A front's live sequences are counted here (taken in a Submit, ended by a finish row), so that
when a front dies they are cancelled at the router instead of running for nobody; the other
fronts' requests go on. The loop owns the queue to the router: `receive` hands it the fronts'
Submits and Cancels, and it answers each Submit with `admit`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque

import numpy as np
import zmq

from qmigrate.config_endpoints import MAX_IPC_PATH, SHORT_TMP
from qmigrate.ingest.handoff import front_index, split_by_front
from qmigrate.wire import protocol as P
from qmigrate.wire import codec
from qmigrate.wire import transport

log = logging.getLogger("qmigrate.ingest")

START_TIMEOUT_S = 60.0   # every front loads a tokenizer, all at once
STOP_GRACE_S = 3.0       # a front's shutdown answers its open requests within 2 s
RESTART_DELAY_S = 1.0    # a front that dies is started again at most this often
CHECK_S = 0.1            # how often the fronts' processes are looked at
HWM = 100_000


@dataclasses.dataclass(slots=True)
class Front:
    index: int
    proc: subprocess.Popen
    started_at: float
    identity: bytes | None = None   # its socket's, from its hello: None until it serves
    live: set[int] = dataclasses.field(default_factory=set)
    heard_at: float = 0.0           # its last message (it says hello every second)


def _private_dir(parent: str | None) -> str:
    """A 0700 directory for the socket in `parent` (None: the temp directory), or in /tmp when
    that is too long a path for an ipc:// socket."""
    os.makedirs(parent or tempfile.gettempdir(), exist_ok=True)
    path = tempfile.mkdtemp(prefix="qm-http-", dir=parent)
    if len(path) + len("/fronts.sock") > MAX_IPC_PATH:
        os.rmdir(path)
        path = tempfile.mkdtemp(prefix="qm-http-", dir=SHORT_TMP)
    return path


class Fronts:
    def __init__(self, topo, model_path: str, defaults, id_base: int, port_wait_s: float = 0.0):
        cfg = topo.ingest
        self.port_wait_s = port_wait_s   # how long start() waits for a taken port to be let go
        self.host, self.port = cfg.http_host, cfg.http_port
        self.url = f"http://{cfg.http_host}:{cfg.http_port}"
        # Its directory goes in the node's own, if it has one: the launcher removes that, so a
        # directory left by an ingest killed outright goes with it.
        self.ipc_dir = topo.ipc_dir if topo.transport == "ipc" else None
        self.dir: str | None = None   # made by start(), removed by stop()
        self.sock: zmq.Socket | None = None
        # what every front is started with (front_process.serve), less its index
        self.settings = {"ingest": dataclasses.asdict(cfg), "model_path": model_path,
                         "defaults": list(dataclasses.astuple(defaults)), "id_base": id_base,
                         "trust_remote_code": topo.model.trust_remote_code, "trace_dir": topo.trace_dir,
                         "max_model_len": topo.max_model_len,
                         "log_level": logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()}
        self.fronts: list[Front | None] = [None] * cfg.http_processes
        self.silent_s = cfg.http_process_timeout_s
        self.restart_at = [0.0] * cfg.http_processes
        self.by_identity: dict[bytes, Front] = {}
        self.num_serving = 0
        self.early: deque = deque()   # Submits and Cancels that came while others started
        self.checked_at = 0.0
        self.is_started = False

    @property
    def pids(self) -> list[int]:
        return [f.proc.pid for f in self.fronts if f is not None]

    def start(self) -> None:
        """Start every front and wait until each serves; a front that cannot is one line and
        the end of ingest, as for the in-thread server."""
        from qmigrate.serve import bind_problem
        deadline = time.monotonic() + self.port_wait_s
        while (why := bind_problem(self.host, self.port)) is not None:
            if time.monotonic() >= deadline:
                self._cannot(why)
            time.sleep(0.1)
        self.dir = _private_dir(self.ipc_dir)
        endpoint = f"ipc://{self.dir}/fronts.sock"
        self.sock = transport.socket(zmq.ROUTER, bind=endpoint, hwm=HWM, curve=False)
        self.settings = {**self.settings, "endpoint": endpoint, "parent": os.getpid()}
        self.fronts = [self._spawn(i) for i in range(len(self.fronts))]
        deadline = time.monotonic() + START_TIMEOUT_S
        while any(f.identity is None for f in self.fronts):
            if self.sock.poll(100):
                self.early.extend(self._read_all())   # a hello that says why it cannot: the end
            for f in self.fronts:
                if f.identity is None and (rc := f.proc.poll()) is not None:
                    if self.sock.poll(500):   # its last words may still be on their way
                        self.early.extend(self._read_all())
                    self._cannot(f"HTTP process {f.index} exited with status {rc}")
            if time.monotonic() > deadline:
                self._cannot(f"no start within {START_TIMEOUT_S:g} s")
        self.is_started = True

    def _cannot(self, why: str):
        raise SystemExit(f"ingest: cannot serve HTTP on {self.url}: {why}")

    def _spawn(self, index: int) -> Front:
        proc = subprocess.Popen([sys.executable, "-m", "qmigrate.ingest.front_process"], stdin=subprocess.PIPE)
        try:
            proc.stdin.write(json.dumps({**self.settings, "index": index}).encode())
            proc.stdin.close()
        except BrokenPipeError:  # it died at once: check() sees it
            pass
        return Front(index, proc, time.monotonic())

    # --- messages ----------------------------------------------------------------------------
    def receive(self):
        """(front, Submit or Cancel) for each one waiting; hellos are taken here."""
        while self.early:
            yield self.early.popleft()
        yield from self._read_all()

    def _read_all(self):
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) == 2 and (got := self._read(*frames)) is not None:
                yield got

    def _read(self, identity: bytes, frame: bytes):
        msg = transport.parse(frame, "an HTTP process")
        if isinstance(msg, P.FrontHello):
            self._hello(identity, msg)
            return None
        front = self.by_identity.get(identity)
        if front is not None:
            front.heard_at = time.monotonic()
        if front is None or not isinstance(msg, (P.Submit, P.Cancel)):
            return None   # a dead front's last words, or nothing a front sends
        if isinstance(msg, P.Submit) and not _is_from(front, msg):
            transport.dropped_log.warning("dropped a Submit from HTTP process %d: not its requests", front.index)
            return None
        return front, msg

    def _hello(self, identity: bytes, msg: P.FrontHello) -> None:
        front = self.fronts[msg.index] if msg.index < len(self.fronts) else None
        if front is None or front.proc.pid != msg.pid:
            return   # a front that has since been replaced
        front.heard_at = time.monotonic()
        if front.identity == identity:
            return   # the hello it says every second: it is alive
        if msg.error:
            if not self.is_started:   # as the in-thread server's failure: one line, and the end
                raise SystemExit(msg.error)
            log.warning("HTTP process %d cannot serve: %s", msg.index, msg.error)
            return
        front.identity = identity
        self.by_identity[identity] = front
        transport.send(self.sock, P.FrontStatus(self.num_serving), to=identity)

    def admit(self, front: Front, msg: P.Submit, is_accepted: bool) -> None:
        seq_ids = [spec.seq_id for spec in msg.seqs]
        if is_accepted:
            front.live.update(seq_ids)
        if front.identity is not None:
            transport.send(self.sock, P.FrontAdmit(P.pack_i64(seq_ids), is_accepted), to=front.identity)

    def set_serving(self, num_serving: int) -> None:
        if num_serving != self.num_serving:
            self.num_serving = num_serving
            for identity in self.by_identity:
                transport.send(self.sock, P.FrontStatus(num_serving), to=identity)

    def forward(self, frame: bytes, msg: P.Replies) -> None:
        """The detokenizer's rows, each to its front: the frame as it came when every row is one
        front's. A finish row ends its sequence's place among its front's live ones."""
        for index, part in split_by_front(msg).items():
            front = self.fronts[index] if index < len(self.fronts) else None
            if front is not None and front.identity is not None and not transport.send_frame(
                    self.sock, frame if part is None else codec.encode(part), to=front.identity, what="Replies") \
                    and front.proc.poll() is not None:
                self.by_identity.pop(front.identity)   # dead: nothing more to it; check() replaces it
                front.identity = None
        finish = P.unpack_u8(msg.finish)
        if finish.any():
            ended = P.unpack_i64(msg.seq_ids)[finish != 0]
            for seq_id, index in zip(ended.tolist(), front_index(ended).tolist()):
                if 0 <= index < len(self.fronts) and self.fronts[index] is not None:
                    self.fronts[index].live.discard(seq_id)

    def fail(self, seq_id: int) -> None:
        """A sequence the router refused: its request ends with an error."""
        msg = P.Replies(P.pack_i64([seq_id]), P.pack_u8([P.Finish.ERROR]), P.pack_i32([0]), [""])
        self.forward(codec.encode(msg), msg)

    # --- processes ---------------------------------------------------------------------------
    def check(self) -> list[int]:
        """Replace the fronts that died; the live sequences of each, for the router to cancel."""
        now = time.monotonic()
        if now - self.checked_at < CHECK_S:
            return []
        # after a stall of this loop its fronts' hellos wait unread: judge no silence this time
        judge = now - self.checked_at < self.silent_s / 2
        self.checked_at, lost = now, []
        for i, front in enumerate(self.fronts):
            if front is None:
                if now >= self.restart_at[i]:
                    self.fronts[i] = self._spawn(i)
            elif judge and self._is_silent(front, now):
                log.warning("HTTP process %d said nothing for %.0f s (stopped or stuck): it is killed and "
                            "starts again", i, now - front.heard_at)
                front.proc.kill()   # the next look replaces it, and cancels its sequences
            elif (rc := front.proc.poll()) is not None:
                log.warning("HTTP process %d exited with status %d; its %d running sequences are cancelled "
                            "and it starts again", i, rc, len(front.live))
                lost += front.live
                self.by_identity.pop(front.identity, None)
                self.fronts[i] = None
                self.restart_at[i] = front.started_at + RESTART_DELAY_S
        return lost

    def _is_silent(self, front: Front, now: float) -> bool:
        """Serving, running, and not heard from for `http_process_timeout_s`: stopped or stuck."""
        return front.identity is not None and now - front.heard_at > self.silent_s and front.proc.poll() is None

    def stop(self) -> None:
        """Every front ends its open requests (SIGTERM) and exits; one that lingers is killed."""
        running = [f.proc for f in self.fronts if f is not None and f.proc.poll() is None]
        for proc in running:
            proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.sock is not None:
            self.sock.close(linger=0)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


def _is_from(front: Front, msg: P.Submit) -> bool:
    """A front's Submit carries its own requests, routed back to it, and nothing else."""
    n = len(msg.seqs)
    ids = np.fromiter((spec.seq_id for spec in msg.seqs), np.int64, n)
    return (len(msg.req_ids) == len(msg.notes) == n and not msg.errors and msg.num_requests == -1
            and len(msg.routes) == n and bool(np.isin(P.unpack_u8(msg.routes), P.INGEST_ROUTES).all())
            and bool((front_index(ids) == front.index).all()))
