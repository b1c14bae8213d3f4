"""Router: the id queue. A poller loop around the pure Scheduler.

It is also the one way into the detokenizer, through `Output` (output.py): what it forwards
there, held while the detokenizer does not read, and kept in a journal until printed. What it
reads from messages and builds into them (a worker's state, a lease, the rows of tokens a
worker may send) is messages.py."""

from __future__ import annotations

import logging
import os
import time
from collections import Counter, deque

import zmq

from qmigrate.wire import protocol as P
from qmigrate.wire import codec
from qmigrate.wire import transport
from qmigrate.ops.observe import FleetObserver
from qmigrate.router.output import Output
from qmigrate.router.messages import is_vram_entry, kept_rows, kv_bytes_per_token, lease_of, worker_state
from qmigrate.router.scheduler import Scheduler
from qmigrate.router.stats import stats_counters
from qmigrate.router.stranded import StrandedNotice
from qmigrate.wire.security import Guard
from qmigrate.hub.model_facts import migration_costs
from qmigrate.ops import logs
from qmigrate.ops.trace import flush_on_sigterm, tracer
from qmigrate.ops.process import freeze_heap

log = logging.getLogger("qmigrate.router")

POLL_S = 0.02
MAX_BURST = 512
METRICS_INTERVAL_S = 1.0
FORWARDED_AS_SENT = (P.Tokens, P.Cancel)  # their handlers forward the received frame itself


class Router:
    def __init__(self, topo):
        rc = topo.router
        self.trace = tracer("router", topo.trace_dir)
        flush_on_sigterm(self.trace)
        self.incarnation = int.from_bytes(os.urandom(6), "big") | 1   # told with Stats and SubmitAck
        self.config = rc
        self.heartbeat_interval_s = rc.heartbeat_interval_s
        self.sched = Scheduler(self.config)
        self.sched.start_ids_at(int(time.time() * 1000) << 20)
        self.work = transport.socket(zmq.ROUTER, bind=topo.endpoint("router").bind)
        self.telemetry = transport.socket(zmq.SUB, bind=topo.endpoint("telemetry").bind)
        self.telemetry.setsockopt(zmq.SUBSCRIBE, b"")
        self.out = Output(topo.endpoint("detokenizer").connect, rc.journal)
        self.dropped_log = logs.dropped  # what peers send that is dropped: they can send it at will
        self.identity: dict[str, bytes] = {}
        self.ingest: bytes | None = None  # the ingest process that said hello last
        self.guard = Guard.for_topology(topo, "router")
        self.parked: dict[str, deque] = {}
        self.worker_times: dict[str, tuple[int, int]] = {}
        self.kv_imported: dict[str, int] = {}   # per worker, as its heartbeats report
        self.nodes = {w.name: w.node for w in topo.workers}
        # What a move costs comes from the model the topology names, never from a worker's
        # hello: a worker (or a stolen worker key) would choose numbers that force transfers.
        costs = migration_costs(topo.model.path)
        if costs is None and self.config.migration == "auto":
            log.warning("the model's config.json is not readable on this node: every migration recomputes")
        self.kv_bytes_per_token = kv_bytes_per_token(topo, costs)
        self.num_params = costs.num_params if costs else 0
        self.observer = FleetObserver()
        self.errors: Counter[str] = Counter()
        self.metrics = None
        self.stranded = StrandedNotice()
        self.turn = 0   # which waiting worker serve_parked asks first
        if rc.metrics_port:
            from qmigrate.ops.metrics import RouterMetrics, serve
            self.metrics = RouterMetrics()
            serve(self.metrics.registry, rc.metrics_port, topo.node(rc.node).bind_host)
        self.handlers = {
            P.Hello: self.on_hello, P.Heartbeat: self.on_heartbeat, P.Pulse: self.on_pulse,
            P.WorkRequest: self.on_work_request, P.StepResult: self.on_step_result,
            P.Submit: self.on_submit, P.Drain: self.on_drain, P.StatsRequest: self.on_stats,
            P.Cancel: self.on_cancel,
            P.Resync: self.on_resync, P.Printed: self.on_printed, P.Tokens: self.on_tokens,
        }
        if self.out.journal is not None:
            self.out.recover(self.sched)

    def serve_forever(self) -> None:
        freeze_heap()
        poller = zmq.Poller()
        poller.register(self.work, zmq.POLLIN)
        poller.register(self.telemetry, zmq.POLLIN)
        last_expiry = last_metrics = 0.0
        while True:
            ready = dict(poller.poll(int(POLL_S * 1000)))
            if self.work in ready:
                self.drain_socket()
            if self.telemetry in ready:
                self.drain_telemetry()
            now = time.monotonic()
            ticked = now - last_expiry > 0.1
            if ticked:
                self.sched.expire(now)
                last_expiry = now
                self.log_lost()
            if self.out.backlog:
                self.out.flush_backlog()
            if (ready or ticked) and not self.out.backlog:  # no new work while output waits
                self.serve_parked(now)
                self.release_drained()
            if self.sched.revokes:
                self.send_revokes()
            if shipments := self.sched.take_shipments():   # prefix pulls decided for no lease
                self.send_shipments(shipments)
            if now - last_metrics > METRICS_INTERVAL_S:
                self.trace.flush()
                self.notice_stranded(now)
                self.observer.tick(now)
                if self.metrics is not None:
                    self.metrics.update(self.sched, self.observer, self.errors)
                last_metrics = now

    def log_lost(self) -> None:
        for name, why, held in self.sched.lost:
            log.warning("worker %s lost: %s; its %d sequences continue elsewhere", name, why, held)
        self.sched.lost.clear()

    def drain_socket(self) -> None:
        for _ in range(MAX_BURST):
            try:
                frames, peer = transport.recv_frames(self.work, zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.dropped_log.warning("dropped a message of %d frames", len(frames))
                self.errors["malformed"] += 1
                continue
            sender, frame = frames
            try:
                msg = codec.decode(frame)
            except P.ProtocolError as exc:
                msg = None
                self.dropped_log.warning("dropped malformed message from %r: %s", sender[:64], exc)
                if exc.msg_type == P.MsgType.SUBMIT:  # answered, or ingest would send it again
                    self.refuse_submit(sender, str(exc))
            if msg is not None and (refusal := self.guard.check(peer, msg, sender)) is not None:
                if isinstance(msg, P.Hello):
                    self.reply(sender, P.Reject(f"refused: {refusal}"))
                continue
            handler = self.handlers.get(type(msg)) if msg is not None else None
            if msg is None:
                self.errors["malformed"] += 1
            elif handler is None:
                self.errors["unexpected_message"] += 1
                self.dropped_log.warning("no handler for %s from %r", type(msg).__name__, sender[:64])
            if handler is not None:
                try:
                    if isinstance(msg, FORWARDED_AS_SENT):
                        handler(sender, msg, frame)
                    else:
                        handler(sender, msg)
                except P.ProtocolError as exc:
                    self.errors["malformed"] += 1
                    self.dropped_log.warning("dropped %s from %r: %s", type(msg).__name__, sender[:64], exc)
                    if isinstance(msg, P.Submit):
                        self.refuse_submit(sender, str(exc))
                except Exception as exc:  # noqa: BLE001 -- one bad message must not stop the router
                    self.errors["handler"] += 1
                    self.dropped_log.warning("dropped %s from %r: %s: %s", type(msg).__name__, sender[:64],
                                        type(exc).__name__, exc)
                    if isinstance(msg, P.Submit):
                        self.refuse_submit(sender, f"{type(exc).__name__}: {exc}")

    def refuse_submit(self, sender: bytes, reason: str) -> None:
        """A Submit this router cannot take: say so, and ingest splits it (never sends it as is)."""
        self.errors["submit_refused"] += 1
        self.reply(sender, P.Reject(reason[:P.MAX_NOTE]))

    def drain_telemetry(self) -> None:
        for _ in range(MAX_BURST):
            try:
                frame = self.telemetry.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = transport.parse(frame, "vram monitor")
            if isinstance(msg, P.VramReport):
                self.on_vram(msg)

    def on_vram(self, msg: P.VramReport) -> None:
        for gpu in msg.gpus:
            if is_vram_entry(gpu):
                self.sched.set_vram(gpu[0], gpu[2], gpu[4], time.monotonic())
                index, util = (gpu[1], gpu[5]) if len(gpu) >= 6 else (gpu[1], -1)
                self.observer.vram(msg.node[:64], gpu[0][:128], index, gpu[2], gpu[3], gpu[4],
                                   util if type(util) is int else -1)
            else:
                self.errors["malformed"] += 1
                self.dropped_log.warning("dropped a malformed VRAM report entry from %s", msg.node[:64])

    def reply(self, to: bytes, msg) -> None:
        transport.send(self.work, msg, to=to)  # dropped if that peer does not read

    # --- handlers ------------------------------------------------------------------------
    def on_hello(self, sender: bytes, msg: P.Hello) -> None:
        if msg.version != P.PROTOCOL_VERSION:
            self.reply(sender, P.Reject(f"protocol version {msg.version}; router speaks {P.PROTOCOL_VERSION}"))
            return
        if msg.role == "worker":
            current = self.identity.get(msg.name)
            if current not in (None, sender) and self.sched.workers[msg.name].alive:
                log.warning("refused a hello as live worker %s from another peer %r", msg.name, sender)
                self.reply(sender, P.Reject(f"worker {msg.name} is already connected"))
                return
            state, inflight, device = worker_state(msg, self.kv_bytes_per_token.get(msg.name, 0), self.num_params)
            self.identity[msg.name] = sender
            self.parked[msg.name] = deque(maxlen=inflight)
            self.sched.register(state, time.monotonic())
            self.observer.joined(msg.name, self.nodes.get(msg.name, ""), device, time.monotonic())
            log.info("worker %s joined (%s)", msg.name, msg.info.get("device", "?"))
        elif msg.role == "ingest":
            self.on_ingest_hello(sender)
        self.reply(sender, P.Welcome(P.PROTOCOL_VERSION, self.heartbeat_interval_s, self.config.lease_timeout_s))

    def on_ingest_hello(self, sender: bytes) -> None:
        """A new ingest process (it restarted): the HTTP clients of the one before went with
        it, so the requests they made are cancelled rather than run for nobody."""
        if self.ingest not in (None, sender):
            orphans = self.out.answered_over_http()
            if num := self.sched.cancel(orphans):
                log.warning("a new ingest: cancelled %d requests of HTTP clients the one before had", num)
            if orphans:
                self.out.forward(codec.encode(P.Cancel(P.pack_i64(orphans))))  # the detokenizer ends them
        self.ingest = sender

    def _worker(self, sender: bytes) -> str | None:
        name = sender.decode(errors="replace")
        if self.identity.get(name) != sender or not self.sched.workers[name].alive:
            self.reply(sender, P.Reject("unknown worker: say hello first", is_unknown_peer=True))
            self.errors["unknown_worker"] += 1
            return None
        return name

    def on_heartbeat(self, sender: bytes, msg: P.Heartbeat) -> None:
        if (name := self._worker(sender)) is not None:
            now = time.monotonic()
            self.sched.touch(name, now)
            self.sched.renew(name, P.unpack_i64(msg.lease_ids, "lease_ids").tolist(), now)
            self.sched.set_held(name, msg.held_bytes, now)
            self.worker_times[name] = (msg.busy_ms, msg.idle_ms)
            self.kv_imported[name] = msg.num_kv_imported
            if msg.kv_arrived:
                self.sched.kv_arrived(name, P.unpack_i64(msg.kv_arrived, "Heartbeat.kv_arrived").tolist())

    def on_pulse(self, sender: bytes, msg: P.Pulse) -> None:
        """From a worker's pulse thread, on a socket of its own: no reply (it does not read).
        A pulse for a worker the router does not know as live is ignored; the worker's loop
        hears the Reject and says hello again."""
        self.sched.pulse(msg.name, msg.loop_age_ms / 1000, time.monotonic())
        self.log_lost()

    def on_work_request(self, sender: bytes, msg: P.WorkRequest) -> None:
        if (name := self._worker(sender)) is None:
            return
        self.sched.touch(name, time.monotonic())
        self.trace("request", name, msg.request_no)
        self.observer.asked(name, msg.free_kv_tokens)
        self.parked[name].append(msg)

    def on_step_result(self, sender: bytes, msg: P.StepResult) -> None:
        if (name := self._worker(sender)) is None:
            return
        # The arrays' lengths, signs and codes were checked at decode (StepResult.validate).
        tokens = P.unpack_i32(msg.tokens).tolist()
        self.trace("result", name, msg.lease_id)
        evicted = P.unpack_i64(msg.evicted_ids)
        now = time.monotonic()
        self._cache_report(name, msg)
        self.sched.complete(msg.lease_id, name, P.unpack_i64(msg.seq_ids).tolist(),
                            P.unpack_i32(msg.counts).tolist(), tokens, P.unpack_u8(msg.status).tolist(), now)
        self.observer.reported(name, len(tokens), msg.free_kv_tokens, now)
        if len(evicted):
            self.sched.evicted(name, evicted.tolist())

    def _cache_report(self, name: str, msg: P.StepResult) -> None:
        """The prefix cache's events, and the cached part of the prompts that started there."""
        num_prompt = num_cached = 0
        if msg.cached_tokens:
            for sid, n in zip(P.unpack_i64(msg.seq_ids).tolist(), P.unpack_i32(msg.cached_tokens).tolist()):
                if n >= 0 and (seq := self.sched.seqs.get(sid)) is not None and seq.lease_id == msg.lease_id:
                    num_prompt += len(seq.token_ids)
                    num_cached += min(n, len(seq.token_ids))
        if msg.prefix_events or num_prompt:
            self.sched.cache_report(name, P.unpack_i64(msg.prefix_events).tolist(), num_prompt, num_cached)
        if msg.tier_events or msg.tier_stats:
            self.sched.tier_report(name, P.unpack_i64(msg.tier_events).tolist(),
                                   P.unpack_i64(msg.tier_stats).tolist() if msg.tier_stats else None)

    def on_tokens(self, sender: bytes, msg: P.Tokens, frame: bytes) -> None:
        """A worker's new tokens, sent on the socket of its results and before them: the
        detokenizer gets them in that order, so no result arrives here without its tokens.
        Only rows of sequences leased to the sender go on: a worker (or a stolen worker key)
        cannot write into another worker's sequences, nor into one whose lease it lost."""
        if (name := self._worker(sender)) is None:
            return
        seq_ids = P.unpack_i64(msg.seq_ids)
        self.trace("tokens", name, len(seq_ids))
        mine, after_cancel, late, never = self.sched.sort_tokens(name, seq_ids.tolist())
        if all(mine):
            self.out.forward(frame)
            return
        # A cancelled sequence's tokens from the worker it was leased to are expected (the
        # lease runs on to its next step boundary), and so are those of a lease that lapsed
        # (expired, revoked, moved: the worker ran on meanwhile); only rows of sequences never
        # leased to the sender are a fault.
        self.sched.counters["tokens_after_cancel"] += after_cancel
        if late:
            self.sched.counters["tokens_late"] += late
            log.debug("dropped late tokens of %d sequences whose lease of worker %s lapsed", late, name)
        if never:
            self.errors["tokens_never_leased"] += never
            self.dropped_log.warning("dropped tokens of %d sequences never leased to worker %s", never, name)
        if any(mine):
            self.out.forward(codec.encode(kept_rows(msg, seq_ids, mine)))

    def on_submit(self, sender: bytes, msg: P.Submit) -> None:
        if self.ingest is None:   # this router restarted: ingest said its hello to the one before
            self.ingest = sender
        if self.out.is_backlog_full:
            # The detokenizer is not reading: admit nothing (its names, errors and end would
            # only add to what waits for it); ingest keeps the Submit and sends it later.
            self.sched.counters["submits_deferred"] += 1
            self.reply(sender, P.SubmitAck(0, 0, is_deferred=True, incarnation=self.incarnation))
            return
        offered = msg.seqs[:self.sched.num_free]
        for spec in offered:
            spec.ids  # validates the packed ids
        taken = self.sched.admit(offered)
        self.trace("submit", len(msg.seqs), taken)
        new = self.out.accept(msg, taken, 2 * self.config.max_queued, self.sched.seqs)
        if new is not None:
            if taken and not self.out.backlog:
                # Workers waiting for work get the new prompts before their metadata goes to
                # the detokenizer (a burst's metadata takes milliseconds to send); no token of
                # theirs can reach it before this handler is done.
                self.serve_parked(time.monotonic())
            self.out.announce(new)
        self.reply(sender, P.SubmitAck(taken, self.sched.num_free, incarnation=self.incarnation))

    def on_cancel(self, sender: bytes, msg: P.Cancel, frame: bytes) -> None:
        self.sched.cancel(P.unpack_i64(msg.seq_ids, "seq_ids").tolist())
        self.out.forward(frame)  # the detokenizer ends their output

    def on_resync(self, sender: bytes, msg: P.Resync) -> None:
        log.info("the detokenizer (pid %d) asks for everything not yet printed", msg.pid)
        self.out.resync(self.sched)

    def on_printed(self, sender: bytes, msg: P.Printed) -> None:
        self.out.printed(msg)

    def on_drain(self, sender: bytes, msg: P.Drain) -> None:
        w = self.sched.workers.get(msg.worker)
        if w is not None and w.alive and not w.draining and not any(
                o.alive and not o.draining for o in self.sched.workers.values() if o is not w):
            self.reply(sender, P.DrainAck(False, f"not draining {msg.worker}: it is the last live worker, "
                                          f"so its sequences would have nowhere to go (start another first)"))
            return
        ok = self.sched.drain(msg.worker, time.monotonic())
        if ok:   # what it holds now moves, but for a sequence whose last token is in flight
            n = len(w.owned)
            text = f"draining {msg.worker}: {n} sequence{'s' if n != 1 else ''} to move"
        else:
            text = f"no live worker named {msg.worker!r}"
        self.reply(sender, P.DrainAck(ok, text))

    def on_stats(self, sender: bytes, msg: P.StatsRequest) -> None:
        self.trace.flush()
        counters = stats_counters(self.sched, unprinted=len(self.out.outputs), output_backlog=len(self.out.backlog),
                                  dropped_sends=transport.num_dropped, parked=self.parked,
                                  kv_imported=self.kv_imported, worker_times=self.worker_times, errors=self.errors)
        workers, gpus = self.observer.snapshot(self.sched)
        self.reply(sender, P.Stats(counters, workers, gpus, self.incarnation))

    # --- periodic ------------------------------------------------------------------------
    def notice_stranded(self, now: float) -> None:
        """Say once, not in silence, when requests wait and no worker can take them."""
        workers = self.sched.workers.values()
        up = any(w.alive and not w.draining for w in workers)
        if (line := self.stranded.check(len(self.sched.seqs), up, bool(workers), now)) is not None:
            log.warning("%s", line)

    def serve_parked(self, now: float) -> None:
        """Answer waiting requests, one lease per worker per round, rotating who goes first."""
        names = [n for n, waiting in self.parked.items() if waiting]
        if not names or not (self.sched.queue or self.sched.leases):
            return
        self.turn = (self.turn + 1) % len(names)
        names = names[self.turn:] + names[:self.turn]
        progress = True
        while progress:
            progress = False
            for name in names:
                waiting = self.parked[name]
                if not waiting:
                    continue
                req = waiting[0]
                free = req.free_kv_tokens if req.free_kv_tokens >= 0 else None
                grant = self.sched.schedule(name, req.max_seqs, req.max_tokens, now, free, ahead=True)
                log.debug("request %d of %s (queue %d): %s", req.request_no, name,
                          len(self.sched.queue), grant and len(grant.rows))
                if grant is not None:
                    waiting.popleft()
                    self.send_grant(grant, req.request_no)
                    progress = True

    def send_shipments(self, shipments) -> None:
        for owner, seq_id, dest, transfer_id, num_tokens, start, keys in shipments:
            if owner in self.identity:
                self.reply(self.identity[owner], P.ShipKV(seq_id, dest, transfer_id, num_tokens, start,
                                                          P.pack_i64(keys) if keys else b""))
                self.observer.shipped(num_tokens - start, self.sched.workers[owner].kv_bytes_per_token)

    def send_grant(self, grant, request_no: int) -> None:
        self.send_shipments(grant.shipments)
        self.trace("grant", grant.worker, grant.lease_id, len(grant.rows), grant.num_steps, request_no)
        self.observer.leased(grant.worker, len(grant.rows))
        self.reply(self.identity[grant.worker], lease_of(grant, request_no, self.config.lease_timeout_s))

    def send_revokes(self) -> None:
        for worker, lease_id, seq_ids in self.sched.take_revokes():
            if worker in self.identity:
                self.reply(self.identity[worker], P.Revoke(lease_id, P.pack_i64(seq_ids)))

    def release_drained(self) -> None:
        for name, w in self.sched.workers.items():
            if w.alive and w.draining and self.sched.is_drained(name):
                self.reply(self.identity[name], P.Exit("drained"))
                self.sched.retire(name)
                self.parked[name].clear()
                log.info("worker %s drained and released", name)


def run(topo, name: str) -> int:
    router = Router(topo)
    log.info("router listening on %s", topo.endpoint("router").bind)
    try:
        router.serve_forever()
    finally:
        router.trace.flush()
    return 0
