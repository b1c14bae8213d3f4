"""The router's policy, as pure bookkeeping: the queue, leases, KV owners and migration.

Every live sequence is either queued here or leased to exactly one worker (invariant 1).
A worker that finishes a step for a sequence becomes its KV owner: it then holds KV for
all of the sequence's tokens but the last. A request for work is answered with the
requester's own sequences first (affinity), then sequences nobody owns, then sequences
that should move: their owner is dead, draining, short of memory or of KV, or holds more
than it can batch (load), or the policy is "any" (migration.py has the order in full).
Times are plain floats supplied by the caller.

How a request for work becomes a lease (chained steps, multi-step leases and their revokes)
is leasing.py's, over the records kept here.

The queue is kept per KV owner (`records.Queue`), and a worker's open leases are listed on
it, so a request for work costs what it returns, not what the whole fleet holds.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque

from qmigrate.config import RouterConfig
from qmigrate.router.gpu_memory import GpuMemory
from qmigrate.router.leasing import Lessor, chain_answered_first
from qmigrate.router.records import (
    Grant,
    LeaseRecord,
    Outcome,
    Queue,
    Row,
    Seq,
    WorkerState,
    choose_mechanism,
)
from qmigrate.router.migration import MovePolicy
from qmigrate.router.prefix_index import PrefixIndex, seq_keys
from qmigrate.wire.protocol import Finish, SeqSpec

__all__ = ["Grant", "Outcome", "Row", "Scheduler", "Seq", "WorkerState",
           "choose_mechanism"]

MAX_CANCELLED = 1 << 14  # cancelled sequences whose late tokens are recognised
MAX_LAPSED = 1 << 14     # sequences whose leases ended without a result, for the same

_FINISHED = frozenset(int(f) for f in Finish if f.is_finished)


class Scheduler:
    def __init__(self, config: RouterConfig | None = None):
        self.config = config or RouterConfig()
        self.seqs: dict[int, Seq] = {}
        self.queue = Queue()
        self.workers: dict[str, WorkerState] = {}
        self.moves = MovePolicy(self.config, self.workers, self.queue)
        self.leases: dict[int, LeaseRecord] = {}
        self.counters: Counter[str] = Counter()
        self.lost: list[tuple[str, str, int]] = []  # (worker, why, sequences it held) to log
        self.vram = GpuMemory(self.workers)   # the monitors' reports
        self.prefix = PrefixIndex()
        self.cache_hits: Counter[str] = Counter()     # per worker: prompt tokens admitted, found cached
        self.cache_queries: Counter[str] = Counter()
        self.tier_stats: dict[str, list[int]] = {}    # per worker with a host tier: protocol.TIER_STATS
        # seq_id -> workers whose leases held it when it was cancelled: their tokens for it
        # in flight are expected, not a misbehaving worker's (at most MAX_CANCELLED kept)
        self.cancelled: OrderedDict[int, frozenset[str]] = OrderedDict()
        # seq_id -> workers whose lease of it ended without its result (expired, revoked,
        # their worker forgotten): tokens still on the way from there are late, which is
        # expected under load, not forged (at most MAX_LAPSED kept)
        self.lapsed: OrderedDict[int, set[str]] = OrderedDict()
        self.lessor = Lessor(self.config, self.seqs, self.queue, self.workers, self.leases, self.moves, self.prefix,
                             self.counters)

    @property
    def revokes(self) -> list[tuple[str, int, list[int]]]:
        return self.lessor.revokes

    @property
    def move_delays(self) -> deque[tuple[str, float]]:
        return self.lessor.move_delays

    def take_revokes(self) -> list[tuple[str, int, list[int]]]:
        return self.lessor.take_revokes()

    def take_shipments(self) -> list:
        """KV shipments of prefix pulls decided for no lease (Grant.shipments' form), to send."""
        return self.lessor.take_shipments()

    def kv_arrived(self, name: str, transfer_ids) -> None:
        """name says these KV shipments reached it (its heartbeat's kv_arrived)."""
        self.lessor.kv_arrived(name, transfer_ids)

    # --- membership --------------------------------------------------------------------
    def register(self, worker: WorkerState, now: float) -> None:
        old = self.workers.get(worker.name)
        if old is not None and old.alive:
            self._forget_worker(old, "dead", now)  # a restarted worker holds nothing
        self.prefix.forget(worker.name)
        worker.last_seen = worker.joined_at = now
        self.workers[worker.name] = worker
        self.counters["workers_joined"] += 1
        self._apply_vram(worker.gpu_uuid, now)

    def touch(self, name: str, now: float) -> None:
        if (w := self.workers.get(name)) is not None:
            w.last_seen = now

    def pulse(self, name: str, loop_age_s: float, now: float) -> None:
        """name's process is alive (its pulse thread says so), and its loop last came between
        two steps loop_age_s ago: a long step is no silence. A loop in one step for
        lease_timeout_s is a hung step: its leases are expiring, and the worker is lost now
        rather than given more work it cannot start."""
        w = self.workers.get(name)
        if w is None or not w.alive:
            return
        if loop_age_s < self.config.lease_timeout_s:
            w.last_seen = max(w.last_seen, now)
        else:
            self.counters["workers_hung"] += 1
            self._lose(w, f"its loop has been in one step for {loop_age_s:.1f} s", now)

    def renew(self, name: str, lease_ids, now: float) -> None:
        """name is alive and still working on these leases (a long prefill, say): push their
        deadlines on. A worker whose loop is stuck sends no heartbeat, so its leases still expire."""
        for lease_id in lease_ids:
            lease = self.leases.get(int(lease_id))
            if lease is not None and lease.worker == name:
                lease.deadline = max(lease.deadline, now + self.config.lease_timeout_s)

    def drain(self, name: str, now: float = 0.0) -> bool:
        w = self.workers.get(name)
        if w is None or not w.alive:
            return False
        if not w.draining:
            w.moving_since = now
        w.draining = True
        self.lessor.revoke_steps(w)
        return True

    def is_drained(self, name: str) -> bool:
        w = self.workers[name]
        return w.draining and w.num_leased == 0 and not w.owned

    def retire(self, name: str) -> None:
        if (w := self.workers.get(name)) is not None:
            self._forget_worker(w, "drain")
            w.alive = False

    def set_vram(self, gpu_uuid: str, total: int, free: int, now: float = 0.0) -> None:
        """A monitor's report of one GPU, in bytes (gpu_memory.py: what the watermarks compare)."""
        self.vram.report(gpu_uuid, total, free)
        self._apply_vram(gpu_uuid, now)

    def set_held(self, name: str, held_bytes: int, now: float = 0.0) -> None:
        """What worker `name` now holds on its device (from its heartbeat)."""
        w = self.workers.get(name)
        if w is not None and held_bytes >= 0 and held_bytes != w.held_bytes:
            w.held_bytes = held_bytes
            self._apply_vram(w.gpu_uuid, now)

    def free_vram_fraction(self, gpu_uuid: str) -> float | None:
        """Free memory over the memory the fleet does not hold, on that GPU; None: no report."""
        return self.vram.free_fraction(gpu_uuid)

    def _apply_vram(self, gpu_uuid: str, now: float) -> None:
        if gpu_uuid and (fraction := self.free_vram_fraction(gpu_uuid)) is not None:
            self.set_free_vram(gpu_uuid, fraction, now)

    def set_free_vram(self, gpu_uuid: str, free_fraction: float, now: float = 0.0) -> None:
        for w in self.workers.values():
            if w.gpu_uuid and w.gpu_uuid == gpu_uuid:
                short = free_fraction < self.config.min_free_vram_fraction
                if short and not w.is_memory_short and self.moves.on_memory:
                    self.lessor.revoke_steps(w)
                    w.moving_since = now
                w.free_vram_fraction = free_fraction
                w.is_memory_short = short
                w.may_prefill = free_fraction >= self.config.admit_free_vram_fraction

    # --- admission ---------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return max(0, self.config.max_queued - len(self.seqs))

    def admit(self, specs: list[SeqSpec]) -> int:
        """Queue as many as fit, in order; returns how many were taken."""
        taken = 0
        num_queued = len(self.queue)
        # A prompt's block keys are made as it comes in, not in the lease that first weighs it
        # (a burst's first lease would otherwise hash every prompt queued behind it).
        sizes = {w.block_size for w in self.workers.values() if w.alive and w.is_caching}
        block_size = sizes.pop() if len(sizes) == 1 else None
        for spec in specs[: self.num_free]:
            taken += 1
            if spec.seq_id in self.seqs:
                continue  # a resend of something already here
            if not spec.is_valid:
                self.counters["rejected_specs"] += 1
                continue
            seq = self.seqs[spec.seq_id] = Seq(spec, spec.ids.tolist())
            if block_size is not None:
                seq_keys(seq, block_size)
            self.queue.push(seq)
            self.counters["admitted"] += 1
        if len(self.queue) > num_queued:
            # New work: a worker with room stops its multi-step leases at the next step to take it.
            for w in self.workers.values():
                if w.alive and not w.draining and len(w.owned) < w.max_seqs:
                    self.lessor.revoke_steps(w)
        return taken

    def readmit(self, spec: SeqSpec) -> None:
        """Queue a sequence again from its full form, past the admission limit: after a router
        restart, or when its output was lost. A sequence still here is left alone."""
        if spec.seq_id not in self.seqs:
            self.queue.push(self.seqs.setdefault(spec.seq_id, Seq(spec, spec.ids.tolist())))
            self.counters["readmitted"] += 1

    def start_ids_at(self, base: int) -> None:
        self.lessor.start_ids_at(base)

    # --- leasing -----------------------------------------------------------------------
    def schedule(self, name: str, max_seqs: int, max_tokens: int, now: float,
                 free_kv_tokens: int | None = None, *, ahead: bool = False) -> Grant | None:
        """A batch for `name`, or None; `ahead`: it already has a batch in flight (Lessor.lease)."""
        return self.lessor.lease(name, max_seqs, max_tokens, now, free_kv_tokens, ahead=ahead)

    def num_chainable(self, name: str) -> int:
        return self.lessor.num_chainable(name)

    def leased_to(self, name: str, seq_ids) -> list[bool]:
        """Per sequence: is its current (or chained next) step leased to `name`? Only such a
        worker's tokens for it count."""
        leases, seqs = self.leases, self.seqs
        out = []
        for sid in seq_ids:
            seq = seqs.get(sid)
            out.append(seq is not None and any(
                lid is not None and (lease := leases.get(lid)) is not None and lease.worker == name
                for lid in (seq.lease_id, seq.next_lease)))
        return out

    def evicted(self, name: str, seq_ids) -> None:
        """name dropped these sequences' KV for room: they are recomputed wherever they run next."""
        for sid in seq_ids:
            seq = self.seqs.get(int(sid))
            if seq is not None and seq.owner == name:
                self._set_owner(seq, None)
                self.counters["evictions"] += 1

    def cancel(self, seq_ids) -> int:
        """Forget these sequences; returns how many were live. A queued one is dropped; a
        leased one too, so its result is ignored when it comes back (as for any unknown
        sequence). Whoever holds or is computing its KV is told to free it with its next lease."""
        num = 0
        for sid in map(int, seq_ids):
            seq = self.seqs.pop(sid, None)
            if seq is None:
                continue
            num += 1
            leased = frozenset(lease.worker for lid in (seq.lease_id, seq.next_lease)
                               if lid is not None and (lease := self.leases.get(lid)))
            if leased:
                self.cancelled[sid] = leased
            holders = {seq.owner} | leased
            self.queue.pop(seq)
            self._set_owner(seq, None)
            for name in holders - {None}:
                if (w := self.workers.get(name)) is not None and w.alive:
                    w.pending_drops.append(sid)
        while len(self.cancelled) > MAX_CANCELLED:
            self.cancelled.popitem(last=False)
        self.counters["cancelled"] += num
        return num

    def was_cancelled_at(self, name: str, seq_id: int) -> bool:
        """seq_id was cancelled while a lease of name's held it: its tokens still on the
        way from there are dropped without counting as a fault."""
        return name in self.cancelled.get(seq_id, ())

    def sort_tokens(self, name: str, seq_ids: list[int]) -> tuple[list[bool], int, int, int]:
        """Which rows of `name`'s Tokens go on (leased_to), and how many of the others are
        (after a cancel, late, never leased to it): a cancelled sequence's or one whose lease
        of name's lapsed (expired, revoked, moved) is expected; only the last is a fault."""
        mine = self.leased_to(name, seq_ids)
        after_cancel = late = never = 0
        for sid, ok in zip(seq_ids, mine):
            if ok:
                continue
            if self.was_cancelled_at(name, sid):
                after_cancel += 1
            elif name in self.lapsed.get(sid, ()):
                late += 1
            else:
                never += 1
        return mine, after_cancel, late, never

    # --- results -----------------------------------------------------------------------
    def complete(self, lease_id: int, name: str, seq_ids: list[int], counts: list[int],
                 tokens: list[int], status: list[int], now: float) -> Outcome:
        lease = self.leases.get(lease_id)
        if lease is None or lease.worker != name:
            self.counters["stale_results"] += 1
            return Outcome(False)
        del self.leases[lease_id]
        w = self.workers[name]
        w.lease_ids.pop(lease_id, None)
        w.last_seen = now
        w.num_leased -= len(lease.seq_ids)
        w.num_arriving -= lease.num_arriving
        outcome = Outcome(True)
        pos = 0
        reported = set()
        back = []  # still running here and not chained: queued again as this worker's
        seqs = self.seqs
        for sid, count, code in zip(seq_ids, counts, status):
            new, pos = tokens[pos:pos + count], pos + count
            seq = seqs.get(sid)
            if seq is None or seq.lease_id != lease_id or sid in reported:
                if seq is not None and seq.next_lease == lease_id:
                    chain_answered_first(seq, lease)
                continue
            reported.add(sid)
            seq.lease_id, chained, seq.next_lease = None, seq.next_lease, None
            if code in _FINISHED:
                self._remove(seq)
                outcome.finished.append((sid, Finish(code)))
                continue
            if code == Finish.NEED_IDS:
                self._set_owner(seq, None)
                self.counters["resends"] += 1
                self._requeue(seq, front=True)  # a chained step fails too; its result is ignored
                continue
            seq.token_ids += new
            if seq.owner != name:
                self._set_owner(seq, name)
            if chained is not None and chained in self.leases:
                seq.lease_id = chained  # the next step is already at this worker
            else:
                seq.revoked_at = lease.revoked_at
                back.append(seq)
        self.queue.extend(back)
        for sid in lease.seq_ids:  # rows the worker failed to report
            seq = self.seqs.get(sid)
            if sid not in reported and seq is not None and seq.lease_id == lease_id:
                seq.lease_id = seq.next_lease = None
                self._set_owner(seq, None)
                self._requeue(seq, front=True)
        return outcome

    def expire(self, now: float) -> list[int]:
        """Take back leases past their deadline and forget workers that stopped talking."""
        expired = []
        for lease_id, lease in list(self.leases.items()):
            if lease.deadline <= now:
                expired.append(lease_id)
                self._revoke(lease_id)
                self.counters["leases_expired"] += 1
        for w in self.workers.values():
            if w.alive and now - w.last_seen > self.config.heartbeat_timeout_s:
                self._lose(w, f"silent for {now - w.last_seen:.1f} s", now)
        return expired

    def _lose(self, w: WorkerState, why: str, now: float) -> None:
        """w is dead to the router: its sequences continue elsewhere, by recompute."""
        w.moving_since = now
        held = len(w.owned | {sid for lease_id in w.lease_ids for sid in self.leases[lease_id].seq_ids})
        self.lost.append((w.name, why, held))
        self._forget_worker(w, "dead", now)
        w.alive = False
        self.counters["workers_lost"] += 1

    # --- internals ---------------------------------------------------------------------
    def _revoke(self, lease_id: int) -> None:
        lease = self.leases.pop(lease_id)
        w = self.workers[lease.worker]
        w.lease_ids.pop(lease_id, None)
        w.num_leased -= len(lease.seq_ids)
        w.num_arriving -= lease.num_arriving
        for sid in lease.seq_ids:
            self.lapsed.setdefault(sid, set()).add(lease.worker)
            self.lapsed.move_to_end(sid)
        while len(self.lapsed) > MAX_LAPSED:
            self.lapsed.popitem(last=False)
        for sid in lease.seq_ids:
            seq = self.seqs.get(sid)
            if seq is not None and seq.next_lease == lease_id:
                seq.next_lease = None  # a chained step that will not happen; the current one stands
            elif seq is not None and seq.lease_id == lease_id:
                seq.lease_id = seq.next_lease = None
                # The worker may or may not have run the step: its KV is not to be trusted.
                self._set_owner(seq, None)
                seq.resync = True
                w.pending_drops.append(sid)
                self._requeue(seq, front=True)

    def cache_report(self, name: str, events, num_prompt: int = 0, num_cached: int = 0) -> None:
        """A worker's prefix cache events (keys cached, ~keys evicted), and prompt tokens it
        admitted and found cached."""
        if name in self.workers:
            self.prefix.apply(name, events)
            self.cache_queries[name] += num_prompt
            self.cache_hits[name] += num_cached
            self.counters["prefix_prompt_tokens"] += num_prompt
            self.counters["prefix_cached_tokens"] += num_cached

    def tier_report(self, name: str, events, stats: list[int] | None) -> None:
        """A worker's host tier events (keys taken, ~keys dropped) and its tiers' totals
        (protocol.TIER_STATS; None: not sent)."""
        if name in self.workers:
            self.prefix.apply_tier(name, events)
            if stats is not None:
                self.tier_stats[name] = stats

    def _forget_worker(self, w: WorkerState, cause: str, now: float = 0.0) -> None:
        if cause == "dead":
            self.prefix.forget(w.name)
        lost = set(w.owned)
        for lease_id in list(w.lease_ids):
            lost.update(self.leases[lease_id].seq_ids)
            self._revoke(lease_id)
        if cause == "dead":
            for sid in lost:
                if (seq := self.seqs.get(sid)) is None:
                    continue
                if seq.owner == w.name:
                    seq.owner = None
                seq.resync = True
                seq.lost_at = now
                self.counters["migrations_dead"] += 1
                self.counters["migrations_by_recompute"] += 1
            w.owned.clear()
            self.queue.rekey(self.seqs[sid] for sid in lost if sid in self.seqs)

    def _set_owner(self, seq: Seq, name: str | None) -> None:
        if seq.owner and seq.owner != name and (old := self.workers.get(seq.owner)):
            old.owned.discard(seq.seq_id)
        seq.owner = name
        if name is not None:
            self.workers[name].owned.add(seq.seq_id)
        self.queue.rekey((seq,))

    def _requeue(self, seq: Seq, front: bool = False) -> None:
        self.queue.push(seq, front)

    def _remove(self, seq: Seq) -> None:
        self._set_owner(seq, None)
        self.queue.pop(seq)
        del self.seqs[seq.seq_id]
        self.counters["finished"] += 1
