"""Worker: asks the router for batches, runs them, sends results on.

A socket loop around two pure cores: `Leases` (worker/leases.py) decides what to ask for and
which lease to start or finish next; `WorkerCore` runs a lease on the engine. Results go back to the
router; new tokens go to the router too, on the same socket and before the result that
counts them, and the router forwards them to the detokenizer: a kill can cut the stream
after some tokens, never deliver a result without its tokens. KV shipments to and from other
workers travel on
a separate PULL socket, as a header and a raw frame.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque

import numpy as np
import torch
import zmq

from qmigrate.wire import protocol as P
from qmigrate.wire import codec
from qmigrate.wire import transport
from qmigrate.hub.loading import load_model, resolve_model
from qmigrate.engine.engine import Engine
from qmigrate.wire.security import SecurityError
from qmigrate.ops import logs
from qmigrate.ops.trace import flush_on_sigterm, tracer
from qmigrate.worker.core import WorkerCore
from qmigrate.worker.leases import FINISH, START, WAIT, KVOutbox, Leases
from qmigrate.worker.pulse import Pulse
from qmigrate.worker.threads import share_cpu_threads
from qmigrate.ops.process import freeze_heap, run_until_fatal

log = logging.getLogger("qmigrate.worker")

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
             "float8_e4m3fn": torch.float8_e4m3fn}   # kv_cache_dtype fp8
STARTUP_TIMEOUT_S = 60.0
HELLO_RESEND_S = 2.0
NVML_EVERY_S = 5.0  # how often NVML is asked what this process holds on its GPU
# A GPU worker's host tier is page-locked a chunk at a time (engine/kv/host_tier.py) once the
# worker has had no lease for this long: never between a busy run's leases.
GROW_TIER_IDLE_S = 0.5


class Worker:
    def __init__(self, topo, name: str):
        self.cfg = topo.worker(name)
        self.name = name
        self.router_addr = topo.endpoint("router").connect
        self.kv_endpoint = topo.endpoint("kv", name)
        device = self.cfg.device if self.cfg.device != "cuda" else "cuda:0"
        share_cpu_threads(topo, self.cfg)
        self.ranks = None
        if self.cfg.tensor_parallel_size > 1:   # N processes, this one rank 0 (worker/ranks.py)
            from qmigrate.worker import ranks
            path = resolve_model(topo.model.path)
            ranks.check_model(name, path, self.cfg.tensor_parallel_size, topo.model.trust_remote_code)
            self.ranks = ranks.Ranks(topo, name, path)
            device = ranks.rank_device(device, 0)
            model = None
            engine = ranks.build_engine(topo, name, path, self.ranks.tp)
        else:
            model, _ = load_model(resolve_model(topo.model.path), device, topo.model.dtype,
                                  trust_remote_code=topo.model.trust_remote_code,
                                  load_format=topo.model.load_format)
            engine = Engine(model, self.cfg.engine_config(), own_model=True)
        self.core = WorkerCore(engine)
        on_gpu = device.startswith("cuda")
        engine.grammars.compiler = grammar_compiler(topo, engine.shape.vocab_size, prepare=on_gpu)
        if self.cfg.grammar_masks == "process" or (self.cfg.grammar_masks == "auto" and on_gpu):
            engine.grammars.use_process(resolve_model(topo.model.path), topo.model.trust_remote_code,
                                        topo.defaults.structured_output_compile_timeout_s,
                                        self.cfg.grammar_mask_processes, rows=self.cfg.max_num_seqs)
        self.trace = self.core.trace = engine.trace = tracer(f"worker-{name}", topo.trace_dir)
        flush_on_sigterm(self.trace)
        engine.warm_up()
        if engine.prefill_tokens_per_s:
            log.info("worker %s: a step of prompts alone runs %s tokens/s", name, f"{engine.prefill_tokens_per_s:,}")
        del model
        self.device = device
        self.router = transport.socket(zmq.DEALER, connect=self.router_addr, identity=name)
        self.kv_in = transport.socket(zmq.PULL, bind=self.kv_endpoint.bind,
                                      max_bytes=transport.KV_MAX_MESSAGE_BYTES, hwm=64)
        self.peers: dict[str, zmq.Socket] = {}
        self.leases = Leases(self.cfg)
        self.pulse = Pulse(self.router_addr, name, self.leases.heartbeat_s)
        self.deferred: deque = deque()  # router messages that came during a multi-step lease
        self.outbox = KVOutbox()
        self.busy_s = self.idle_s = 0.0
        self.last_busy = time.monotonic()
        self.num_kv_imported_sent = 0
        self.gpu_memory = None  # this process's memory on its GPU as NVML reports it
        self.nvml_at, self.nvml_bytes = -NVML_EVERY_S, 0
        if device.startswith("cuda"):
            from qmigrate.monitor.vram import ProcessMemory, torch_device_uuid
            uuid = torch_device_uuid(torch.device(device).index or 0)
            self.gpu_memory = ProcessMemory(uuid, os.getpid()) if uuid else None

    @property
    def heartbeat_s(self) -> float:
        return self.leases.heartbeat_s

    # --- startup -----------------------------------------------------------------------
    def hello(self, rejoin: bool = False) -> None:
        """Say hello until welcomed. At startup give up after STARTUP_TIMEOUT_S; when rejoining
        (the router restarted, or forgot this worker) keep trying: the router may take a while."""
        engine = self.core.engine
        from qmigrate.monitor.vram import torch_device_uuid
        uuid = torch_device_uuid(torch.device(self.device).index or 0) if self.device.startswith("cuda") else None
        uuid = uuid or f"CPU-{self.name}"  # no NVML report names it; a test's simulated monitor may
        info = {"device": self.device, "kv_endpoint": self.kv_endpoint.connect,
                "max_seqs": self.cfg.max_num_seqs, "max_tokens": self.cfg.max_num_batched_tokens,
                "inflight": self.cfg.inflight, "kv_bytes_per_token": engine.kv_bytes_per_token,
                "num_params": engine.shape.num_params, "gpu_uuid": uuid or "",
                "prefill_tokens_per_s": engine.prefill_tokens_per_s,
                "kv_tokens": engine.pool.capacity_tokens, "block_size": engine.pool.block_size,
                "prefix_cache": int(engine.pool.is_caching),
                "held_bytes": self.held_bytes()}
        hello = P.Hello("worker", self.name, info=info)
        transport.send(self.router, hello)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        sent = time.monotonic()
        while rejoin or time.monotonic() < deadline:
            self.pulse.turned()   # waiting for the router is no step
            got = transport.recv(self.router, 0.5)
            if got is None:
                if time.monotonic() - sent > HELLO_RESEND_S:  # it may have died with the router
                    transport.send(self.router, hello)
                    sent = time.monotonic()
                continue
            msg = got[1]
            if isinstance(msg, P.Welcome):
                self.leases.heartbeat_s = self.pulse.interval_s = msg.heartbeat_interval_s
                return
            if isinstance(msg, P.Reject) and not msg.is_unknown_peer:
                raise SystemExit(f"worker {self.name}: router refused: {msg.reason}")
            # a Reject of a message sent before this hello (say, before a router restart): skip it
        raise SystemExit(f"worker {self.name}: router unreachable at {self.router_addr} "
                         f"(no answer in {STARTUP_TIMEOUT_S:g} s)")

    # --- loop --------------------------------------------------------------------------
    def serve_forever(self) -> None:
        self.hello()
        self.pulse.start()
        log.info("worker %s ready on %s: %s", self.name, self.device, self.core.engine.describe())
        freeze_heap()
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.poller.register(self.kv_in, zmq.POLLIN)
        while True:
            now = time.monotonic()
            self.note_busy(now)
            self.ask(now)
            action, arg = self.leases.next_action(now, self.core.awaited_transfers)
            if action == START:
                self.start_lease(arg)
            elif action == FINISH:
                self.finish_lease(arg)
            elif self.grow_while_idle(now):
                arg = 0.0      # the host tier took a piece: look at the sockets and go on
            if self.receive(arg if action == WAIT else 0.0):
                while self.leases.on_device:
                    self.finish_lease(self.leases.on_device[0].handle)
                self.close()
                return
            self.keep_alive()

    def note_busy(self, now: float) -> None:
        """Mark `now` as busy if a lease is queued or on the device."""
        if self.leases.queued or self.leases.on_device:
            self.last_busy = now

    def grow_while_idle(self, now: float) -> bool:
        """Page-lock one more piece of the host tier once this worker has had no lease for
        GROW_TIER_IDLE_S (engine/kv/host_tier.py); True when it did."""
        return now - self.last_busy >= GROW_TIER_IDLE_S and self.core.engine.grow_tier()

    def ask(self, now: float) -> None:
        """Ask for the batches missing from those in flight (Leases.requests)."""
        for req in self.leases.requests(now, self.core.free_tokens):
            self.trace("ask", req.request_no)
            self.send_router(req)

    def answer_withdrawn(self) -> None:
        """A chain revoked before it started is answered now, and its place asked for again,
        even mid-lease: the router's next lease for these rows can then start behind the
        step being run, not one step later."""
        withdrawn = self.leases.take_withdrawn()
        for lease in withdrawn:
            self.trace("withdrawn", lease.lease_id)
            self.send_router(self.core.unrun(lease))
        if withdrawn:
            self.ask(time.monotonic())

    def receive(self, timeout_s: float) -> bool:
        """Take what the sockets hold, waiting up to timeout_s; True when told to exit."""
        self.outbox.flush()
        if self.deferred:
            timeout_s = 0.0
        elif self.outbox:
            timeout_s = min(timeout_s, 0.001)  # a shipment's copy lands within a step
        t0 = time.monotonic()
        ready = dict(self.poller.poll(math.ceil(timeout_s * 1000)))
        if not self.leases.queued and not self.leases.on_device:
            self.idle_s += time.monotonic() - t0
        if self.kv_in in ready:
            self.receive_kv()
        while self.deferred:
            if self.handle(self.deferred.popleft()):
                return True
        return self.router in ready and self.receive_router()

    def receive_router(self, mid_lease: bool = False) -> bool:
        while (got := transport.recv(self.router, 0)) is not None:
            msg = got[1]
            # KV to ship goes at once, between two steps: the lease that takes it elsewhere
            # waits for it, and with it everything queued behind on that worker. (The router
            # ships only sequences leased nowhere, so none of them is in this lease.)
            if mid_lease and not isinstance(msg, (P.Lease, P.Revoke, P.ShipKV)):
                self.deferred.append(msg)   # exit, re-hello: once the lease is done
            elif self.handle(msg):
                return True
        return False

    def handle(self, msg) -> bool:
        if isinstance(msg, P.Lease):
            self.trace("lease", msg.lease_id, msg.num_steps, len(msg.seq_ids) // 8, len(msg.full))
            self.leases.on_lease(msg, time.monotonic())
        elif isinstance(msg, P.Revoke):
            self.leases.on_revoke(msg)
            self.answer_withdrawn()
        elif isinstance(msg, P.ShipKV):
            self.ship(msg)
        elif isinstance(msg, P.Exit):
            log.info("worker %s exiting: %s", self.name, msg.reason)
            return True
        elif isinstance(msg, P.Reject):
            log.warning("router: %s; saying hello again", msg.reason)
            self.hello(rejoin=True)
            self.leases.on_reset()
        return False

    def start_lease(self, lease: P.Lease, *, count_busy: bool = True) -> None:
        """Launch the lease's first step. `count_busy` is off inside a finish, which counts it."""
        t0 = time.monotonic()
        self.trace("start_begin", lease.lease_id)
        after = self.leases.on_device[-1].handle if self.leases.on_device else None
        handle = None
        try:
            handle = self.core.start(lease, after=after, between=self.keep_alive)
        except (P.ProtocolError, ValueError) as exc:
            log.warning("lease %d rejected: %s", lease.lease_id, exc)
        finally:
            self.trace("start_end", lease.lease_id)
            if count_busy:
                self.busy_s += time.monotonic() - t0
            self.leases.started(lease, handle, time.monotonic())
        self.keep_alive()

    def finish_lease(self, started) -> None:
        t0 = time.monotonic()
        lease_id = started.lease.lease_id
        self.trace("finish_begin", lease_id)
        try:
            result, tokens = self.core.finish(started, lambda step: self.between_steps(lease_id, step),
                                              self.leases.revoked_rows(lease_id), self.start_behind)
        except (P.ProtocolError, ValueError) as exc:
            log.warning("lease %d failed: %s", lease_id, exc)
            return
        finally:
            self.busy_s += time.monotonic() - t0
            self.leases.finished()
        # Tokens first, on the same socket: the router never has a result without its tokens.
        self.send_router(tokens)
        self.send_router(result)
        self.trace("finish_end", lease_id)

    def start_behind(self) -> bool:
        """The lease being finished has launched its last step: queue the next one behind it.
        True while none could start and there is room for one (ask again while the step runs)."""
        self.receive_router(mid_lease=True)
        lease = self.leases.next_behind(time.monotonic(), self.core.awaited_transfers)
        if lease is not None:
            self.start_lease(lease, count_busy=False)
            return False
        return self.leases.has_room_behind

    def between_steps(self, lease_id: int, tokens: P.Tokens):
        """Between two steps of a multi-step lease: stream this step's tokens, take Revokes."""
        self.send_router(tokens)
        self.outbox.flush()
        self.receive_router(mid_lease=True)
        self.keep_alive()
        return self.leases.revoked_rows(lease_id)

    def ship(self, msg: P.ShipKV) -> None:
        """Export the KV (queued on the device behind the steps in flight) and send it once
        it has reached host memory: the worker goes on stepping meanwhile."""
        if msg.keys:   # a prefix this worker holds cached, for another's sequence
            kv, copied = self.core.export_prefix_started(P.unpack_i64(msg.keys, "ShipKV.keys").tolist())
        else:
            kv, copied = self.core.export_started(msg.seq_id, msg.num_tokens, msg.start)
        self.outbox.add(copied, lambda: self.send_kv(msg, kv))

    def send_kv(self, msg: P.ShipKV, kv: torch.Tensor | None) -> None:
        sock = self.peers.get(msg.dest)
        if sock is None:
            try:
                sock = transport.socket(zmq.PUSH, connect=msg.dest, max_bytes=transport.KV_MAX_MESSAGE_BYTES, hwm=128)
            except (SecurityError, zmq.ZMQError) as exc:
                log.warning("KV for sequence %d not shipped: %s", msg.seq_id, exc)
                return
            self.peers[msg.dest] = sock
            # Wait a little for a slow peer rather than drop the shipment at once.
            sock.setsockopt(zmq.SNDTIMEO, 500)
        if kv is None:
            header = P.KVHeader(msg.transfer_id, msg.seq_id, 0, "float32", [0])
            payload = b""
        else:
            header = P.KVHeader(msg.transfer_id, msg.seq_id, kv.shape[2],
                                str(kv.dtype).removeprefix("torch."), list(kv.shape),  # [L, 2, n, H, D]
                                msg.start)
            payload = kv.view(torch.uint8).numpy() if kv.dtype != torch.uint8 else kv.numpy()
        try:
            sock.send_multipart([codec.encode(header), payload], copy=False)
        except zmq.Again:
            log.warning("KV for sequence %d not shipped: %s is not taking data", msg.seq_id, msg.dest)

    def receive_kv(self) -> None:
        while True:
            try:
                frames = self.kv_in.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            header = transport.parse(frames[0], "kv peer") if frames else None
            if not isinstance(header, P.KVHeader) or len(frames) != 2:
                transport.dropped_log.warning("dropped a malformed KV shipment")
                continue
            self.core.receive_transfer(header.transfer_id, header.seq_id, _kv_tensor(header, frames[1]),
                                       header.start)

    def close(self) -> None:
        """Leaving on purpose: let queued tokens, results and KV reach their peers first (a
        drained worker's last shipments go out just before it leaves)."""
        self.outbox.flush(wait=True)
        self.pulse.stop()
        self.router.close(linger=5000)
        for sock in self.peers.values():
            sock.close(linger=2000)
        if self.ranks is not None:
            self.ranks.stop(self.core.engine.runner)
        self.core.engine.grammars.close()
        transport.end()

    def send_router(self, msg) -> None:
        transport.send(self.router, msg)

    def keep_alive(self) -> None:
        self.pulse.turned()
        # Sent on schedule even while results flow: it also carries the busy/idle counters.
        # After a KV import it goes at once, so the router counts the import before it sees
        # any token that used it; after a shipment arrives too, so that a sequence waiting
        # for its pulled prefix is leased here without delay.
        imported = self.core.num_kv_imported
        if self.leases.heartbeat_due(time.monotonic()) or imported != self.num_kv_imported_sent \
                or self.core.arrived:
            self.trace.flush()
            self.num_kv_imported_sent = imported
            arrived, self.core.arrived = self.core.arrived, []
            self.send_router(P.Heartbeat(self.name, len(self.core.seqs), self.core.free_tokens,
                                         int(self.busy_s * 1000), int(self.idle_s * 1000),
                                         P.pack_i64(self.leases.held_lease_ids()), self.held_bytes(), imported,
                                         P.pack_i64(arrived)))
            self.leases.renewed(time.monotonic())

    def held_bytes(self) -> int:
        """Device memory this process holds: weights, KV pool, graphs and activations, and its
        CUDA context where NVML reports it per process (the router does not count any of it as
        memory pressure). A CPU worker holds no device memory."""
        if not self.device.startswith("cuda"):
            return 0
        reserved = int(torch.cuda.memory_reserved(torch.device(self.device)))
        now = time.monotonic()
        if self.gpu_memory is not None and now - self.nvml_at >= NVML_EVERY_S:
            self.nvml_at, self.nvml_bytes = now, self.gpu_memory.held_bytes() or 0
        return max(reserved, self.nvml_bytes)


def _kv_tensor(header: P.KVHeader, data: bytes) -> torch.Tensor | None:
    if header.num_tokens == 0:
        return None
    dtype = KV_DTYPES.get(header.dtype)
    shape = header.shape
    if dtype is None or len(shape) != 5 or shape[2] != header.num_tokens or min(shape) <= 0:
        logs.dropped.warning("KV shipment with bad dtype or shape: %s %s", header.dtype, shape)
        return None
    nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    if len(data) != nbytes:
        logs.dropped.warning("KV shipment of %d bytes, expected %d", len(data), nbytes)
        return None
    raw = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
    return raw.view(dtype).reshape(shape)


def run(topo, name: str) -> int:
    return run_until_fatal(lambda: _serve(topo, name))


def _serve(topo, name: str) -> None:
    worker = Worker(topo, name)
    try:
        worker.serve_forever()
    except RuntimeError as exc:   # a collective of a tensor-parallel worker whose other rank died
        if worker.ranks is None:
            raise
        raise worker.ranks.failed(exc) from None
    finally:
        worker.trace.flush()   # the stretch since the last heartbeat


def grammar_compiler(topo, vocab_size: int, prepare: bool = False):
    """Structured output's compiler for this worker: the model's tokenizer, loaded on first use
    or, with `prepare` (a GPU worker: a step must not wait for it), on a pool thread now."""
    from qmigrate.hub.grammars import Compiler
    return Compiler.for_model(resolve_model(topo.model.path), topo.model.trust_remote_code, vocab_size,
                              topo.defaults.structured_output_compile_timeout_s, prepare)
