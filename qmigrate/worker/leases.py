"""A worker's bookkeeping between the router and its device, without sockets or a model.

The worker keeps `inflight` batches in flight: asked for, received, or on the device.
Leases queue here in arrival order; the head starts when the device can take it and its KV
shipments have landed (or their wait is over: missing KV is recomputed). A lease past its
deadline is dropped unstarted, since the router has already taken its sequences back. At
most two leases are on the device at once, the newer launched before the older is collected,
so the device never waits for the host. A multi-step lease runs alone: the steps after its
first are launched while it is being finished, so nothing may queue behind it.

The socket loop (`worker/loop.py`) asks `next_action` what to do, does it, and reports
back with `started` / `finished`. Times are plain floats supplied by the caller.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from qmigrate.config import WorkerConfig
from qmigrate.wire import protocol as P

START, FINISH, WAIT = "start", "finish", "wait"
MAX_ON_DEVICE = 2
FORGET_AFTER_HEARTBEATS = 10  # no lease for this long: the router forgot our requests


@dataclass(slots=True)
class Queued:
    lease: P.Lease
    deadline: float
    wait_until: float | None = None   # set when it reaches the head and waits for KV


@dataclass(slots=True)
class OnDevice:
    lease_id: int
    num_steps: int
    handle: object                    # what the engine side needs to finish it


@dataclass(slots=True)
class Leases:
    config: WorkerConfig
    heartbeat_s: float = 0.5          # the router's heartbeat interval, from its Welcome
    outstanding: int = 0              # requests sent and not answered
    request_no: int = 0
    last_lease: float = 0.0
    last_heartbeat: float = float("-inf")
    last_started: float = 0.0
    starting: int | None = None       # the lease being started now (a long prefill)
    queued: deque[Queued] = field(default_factory=deque)
    on_device: deque[OnDevice] = field(default_factory=deque)
    revoked: dict[int, frozenset[int] | None] = field(default_factory=dict)  # None: every row
    withdrawn: list[P.Lease] = field(default_factory=list)   # revoked before they started
    num_expired: int = 0
    num_revokes_ignored: int = 0

    # --- the router side -----------------------------------------------------------------
    def requests(self, now: float, free_tokens: int) -> list[P.WorkRequest]:
        """Work requests to send now, so that `inflight` batches are asked for, here or running."""
        cfg = self.config
        if self.outstanding and now - self.last_lease > FORGET_AFTER_HEARTBEATS * self.heartbeat_s:
            self.outstanding = 0  # the router may have restarted and forgotten our requests
            self.last_lease = now
        out = []
        while self.outstanding + len(self.queued) + len(self.on_device) < cfg.inflight:
            self.request_no += 1
            self.outstanding += 1
            out.append(P.WorkRequest(self.request_no, cfg.max_num_seqs, cfg.max_num_batched_tokens, free_tokens))
        return out

    def on_lease(self, lease: P.Lease, now: float) -> None:
        self.outstanding = max(0, self.outstanding - 1)
        self.last_lease = now
        self.queued.append(Queued(lease, now + lease.timeout_s))

    def on_revoke(self, msg: P.Revoke) -> bool:
        """A Revoke for a lease held here ends that lease at its next step boundary: every
        row stops there. (Its seq_ids name the rows the router wants back, but a lease is
        answered once, so only ending all of it returns them sooner.) A chain not started yet
        (every row goes on from the lease before it, nothing else in it) is withdrawn: it
        never runs, is answered at once without a token (`take_withdrawn`), and its place is
        asked for again, so the router can send the next step of those rows together with
        what it revoked them for. A Revoke for any other lease is ignored (False)."""
        if msg.lease_id not in self.held_lease_ids():
            self.num_revokes_ignored += 1
            return False
        P.unpack_i64(msg.seq_ids, "seq_ids")
        for i, q in enumerate(self.queued):
            if q.lease.lease_id == msg.lease_id and is_chain(q.lease):
                del self.queued[i]
                self.withdrawn.append(q.lease)
                return True
        self.revoked[msg.lease_id] = None
        return True

    def take_withdrawn(self) -> list[P.Lease]:
        """Leases withdrawn unstarted since the last call: each is answered with no token."""
        withdrawn, self.withdrawn = self.withdrawn, []
        return withdrawn

    def revoked_rows(self, lease_id: int) -> frozenset[int] | None:
        """Rows of a held lease revoked so far (None: every row)."""
        return self.revoked.get(lease_id, frozenset())

    def on_reset(self) -> None:
        """After a new hello: the router holds none of our requests."""
        self.outstanding = 0

    def held_lease_ids(self) -> list[int]:
        """Leases received and not yet answered: a heartbeat names them, the router renews them."""
        held = [q.lease.lease_id for q in self.queued] + [d.lease_id for d in self.on_device]
        if self.starting is not None:
            held.append(self.starting)
        return held

    def renewed(self, now: float) -> None:
        """A heartbeat naming the held leases went out at `now`: the router pushes their
        deadlines on as it reads it, and the queued ones' deadlines here move on with them
        (from the send, a little before the router's). A lease waiting for KV that never
        comes then starts when its wait is over, recomputing, instead of expiring here unstarted
        while the router still counts it as running."""
        for q in self.queued:
            q.deadline = max(q.deadline, now + q.lease.timeout_s)

    def heartbeat_due(self, now: float) -> bool:
        if now - self.last_heartbeat > self.heartbeat_s:
            self.last_heartbeat = now
            return True
        return False

    # --- the device side -----------------------------------------------------------------
    def next_action(self, now: float, awaited: Callable[[P.Lease], set[int]]):
        """(START, lease), (FINISH, handle of the oldest lease on the device) or (WAIT, seconds).
        `awaited(lease)` names the KV shipments the lease still waits for."""
        self.drop_expired(now)
        if self.queued and self.can_start_more:
            head = self.queued[0]
            if head.wait_until is None:
                head.wait_until = min(head.deadline, now + self.config.transfer_wait_s)
            if now >= head.wait_until or not awaited(head.lease):
                self.queued.popleft()
                self.starting = head.lease.lease_id
                return START, self._dispatched(head.lease)
            if not self.on_device:  # waiting for KV; run what is already here meanwhile
                return WAIT, min(head.wait_until - now, 0.02)
        # Finish the oldest when nothing more can join it on the device, when the next lease
        # waits for KV, or when none came within the chain wait (it usually chains on this one).
        if self.on_device and (self.queued or not self.can_start_more
                               or now >= self.last_started + self.config.chain_wait_s):
            return FINISH, self.on_device[0].handle
        return WAIT, self.wait_s(now)

    def wait_s(self, now: float) -> float:
        """How long the loop may block on its sockets now."""
        if self.queued and self.can_start_more:
            return 0.0
        if self.on_device:
            return max(0.0, self.last_started + self.config.chain_wait_s - now)
        return self.heartbeat_s

    def next_behind(self, now: float, awaited: Callable[[P.Lease], set[int]]) -> P.Lease | None:
        """The lease to launch now behind the last step of the lease being finished: the head
        of the queue, if its KV shipments are here (else the loop starts it later)."""
        self.drop_expired(now)
        if not self.queued or not self.has_room_behind or awaited(self.queued[0].lease):
            return None
        head = self.queued.popleft()
        self.starting = head.lease.lease_id
        return self._dispatched(head.lease)

    @property
    def has_room_behind(self) -> bool:
        """A lease may still start behind the last step of the one being finished."""
        return len(self.on_device) < MAX_ON_DEVICE

    @property
    def can_start_more(self) -> bool:
        return len(self.on_device) < MAX_ON_DEVICE and all(d.num_steps == 1 for d in self.on_device)

    def started(self, lease: P.Lease, handle, now: float) -> None:
        """The lease's first step is on the device (handle None: it could not start)."""
        self.starting = None
        self.last_started = now
        if handle is None:
            self.revoked.pop(lease.lease_id, None)
        else:
            self.on_device.append(OnDevice(lease.lease_id, lease.num_steps, handle))

    def finished(self) -> int:
        """The oldest lease on the device is done and answered; its id."""
        done = self.on_device.popleft()
        self.revoked.pop(done.lease_id, None)
        return done.lease_id

    def drop_expired(self, now: float) -> list[int]:
        dropped = [q.lease.lease_id for q in self.queued if q.deadline < now]
        if dropped:
            self.queued = deque(q for q in self.queued if q.deadline >= now)
            for lease_id in dropped:
                self.revoked.pop(lease_id, None)
            self.num_expired += len(dropped)
        return dropped

    def _dispatched(self, lease: P.Lease) -> P.Lease:
        """The lease as it runs here: `steps_per_dispatch` forces a number of steps locally."""
        steps = self.config.steps_per_dispatch
        return dataclasses.replace(lease, num_steps=steps) if lease.num_steps < steps else lease


def is_chain(lease: P.Lease) -> bool:
    """Every row of the lease goes on from the step before it (CONTINUE), and it carries
    nothing else: no full forms, no KV to drop. Withdrawn unstarted, it changes nothing here."""
    return not lease.full and not lease.drop_ids and bool(lease.lengths) \
        and bool((P.unpack_i32(lease.lengths, "lengths") == P.CONTINUE).all())


class KVOutbox:
    """KV shipments whose copy to host memory is still queued on the device. Each is sent
    once its copy has landed (its event has passed), in the order they were made, so a
    worker never waits for the device to ship one. `copied` is a CUDA event, or None for a
    shipment ready now; `send` puts it on the wire."""

    def __init__(self):
        self.waiting: deque[tuple[object, Callable[[], None]]] = deque()

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, copied, send: Callable[[], None]) -> None:
        self.waiting.append((copied, send))
        self.flush()

    def flush(self, wait: bool = False) -> int:
        """Send the shipments that are ready (with `wait`, all of them, waiting for each)."""
        sent = 0
        while self.waiting:
            copied, send = self.waiting[0]
            if copied is not None and not copied.query():
                if not wait:
                    break
                copied.synchronize()
            self.waiting.popleft()
            send()
            sent += 1
        return sent
