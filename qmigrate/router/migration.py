"""When a sequence should leave the worker that holds its KV, why, and how it travels.

Pure rules over the router's worker records (shared with the Scheduler, which owns them):
the causes of a move (dead, drain, memory, policy "any", kv, load; policy "pinned" keeps
only the first two), how many sequences an overloaded or KV-short worker may lose to
another, how many sequences nobody holds a worker may take while others could take them
too, which queued sequences a worker asking for work is offered and in what order, and
recompute against KV transfer.

New work is placed before placed work moves: a sequence nobody holds costs the same prefill
anywhere, while a load move costs a KV shipment or a second prefill. So while such
sequences wait, nothing moves for load, and each worker asking for them gets its share of
them (by max_seqs), not whatever fits its step: a burst split by who asked first would
leave one worker alternating two batches while the other ran one.

KV pressure is the exception: it moves sequences whatever waits, since the alternative is an
eviction. As in Llumnix (OSDI'24), a worker's freeness is the KV it has free over the
sequences it holds: how many more tokens each can grow before it must evict one. Below
`kv_pressure_steps` its cheapest sequences to move (the shortest) go to a worker that keeps
twice that after taking them, until it has twice that again; a moved sequence stays where it
went for `move_cooldown_s`. The gap between the two marks and the cooldown keep sequences
from going back and forth.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter

from qmigrate.config import RouterConfig
from qmigrate.router.records import Queue, Seq, WorkerState, choose_mechanism, prefill_tflops_of


class MovePolicy:
    def __init__(self, config: RouterConfig, workers: dict[str, WorkerState], queue: Queue):
        self.config = config
        self.workers = workers
        self.queue = queue

    @property
    def on_load(self) -> bool:
        return self.config.migrate_on_load and self.config.policy != "pinned"

    @property
    def on_memory(self) -> bool:
        return self.config.migrate_on_memory and self.config.policy != "pinned"

    @property
    def on_kv(self) -> bool:
        return self.config.migrate_on_kv and self.config.policy != "pinned"

    def may_start(self, seq: Seq, w: WorkerState) -> bool:
        """Policy "pinned": a sequence nobody holds that has run elsewhere (evicted there for
        room) waits for that worker while it lives and takes work; else anyone may run it."""
        if self.config.policy != "pinned" or seq.home is None or seq.home == w.name:
            return True
        home = self.workers.get(seq.home)
        return home is None or not home.alive or home.draining

    def may_keep(self, w: WorkerState) -> bool:
        """False when some of w's sequences ought to move: they must come back to the queue."""
        if w.draining or (self.on_memory and w.is_memory_short):
            return False
        if not self.on_load and not self.on_kv:
            return True
        if self.on_load and len(w.owned) > w.capacity:
            return False
        return not any(self.num_to_balance(w, o) or self.num_to_relieve(w, o) for o in self.workers.values()
                       if o is not w and o.alive and not o.draining)

    def steal_quota(self, w: WorkerState) -> Counter[str]:
        """How many sequences each other worker may lose to `w` for load reasons."""
        quota: Counter[str] = Counter()
        if not self.on_load and not self.on_kv:
            return quota
        for other in self.workers.values():
            if other is w or not other.alive:
                continue
            n = self.num_to_relieve(other, w)
            if self.on_load:
                n = max(n, len(other.owned) - other.capacity, self.num_to_balance(other, w))
            quota[other.name] = max(n, 0)
        return quota

    def num_to_balance(self, owner: WorkerState, taker: WorkerState) -> int:
        """How many of owner's sequences should move to taker to even out their load (0: none).

        A decode step of fewer rows costs a GPU nearly as much as a full one, so moving a
        sequence (a KV shipment or a second prefill) pays only when its owner holds more
        than one step's batch: past max_seqs its sequences take turns, a token every other
        step. Then up to that excess moves, half the difference at most, into room the taker
        has in its own batch; and only past `rebalance_threshold` sequences of difference,
        and only once new work is placed (see admission_room)."""
        gap = len(owner.owned) - len(taker.owned)
        if not self.on_load or gap < self.config.rebalance_threshold or (
                self.config.spread_new_work and self.queue.of(None)):
            return 0
        return max(0, min(gap // 2, len(owner.owned) - owner.max_seqs, taker.max_seqs - len(taker.owned)))

    @staticmethod
    def kv_freeness(w: WorkerState) -> float | None:
        """KV tokens w has free (as it last reported, plus what moves away have released since)
        per sequence it holds or is taking on: how far each can grow before w evicts. None:
        w has not reported its pool."""
        if w.free_kv_tokens is None or not w.kv_tokens:
            return None
        return (w.free_kv_tokens + w.kv_released) / max(1, w.load)

    def is_kv_short(self, w: WorkerState) -> bool:
        free = self.kv_freeness(w) if self.on_kv and w.owned else None
        return free is not None and free < self.config.kv_pressure_steps

    def num_to_relieve(self, owner: WorkerState, taker: WorkerState) -> int:
        """How many of a KV-short owner's sequences taker should take (0: none): enough to
        give owner twice kv_pressure_steps of freeness again, as many as leave taker that
        much too, and no more than its batch has room for. A sequence is counted at owner's
        mean KV per sequence."""
        if not self.is_kv_short(owner) or taker is owner or not taker.alive or taker.draining \
                or not taker.may_prefill or taker.free_kv_tokens is None or not taker.kv_tokens:
            return 0
        mark = 2 * self.config.kv_pressure_steps
        used = max(0, owner.kv_tokens - owner.free_kv_tokens - owner.kv_released)
        per_seq = max(owner.block_size, used / max(1, len(owner.owned)))
        free = owner.free_kv_tokens + owner.kv_released
        need = -(-(mark * owner.load - free) // (per_seq + mark))
        fits = (taker.free_kv_tokens - mark * taker.load) // (per_seq + mark)
        return int(max(0, min(need, fits, taker.max_seqs - taker.load, len(owner.owned))))

    def num_to_shed(self, w: WorkerState) -> int:
        """How many of its queued sequences a KV-short worker leaves for a worker that would
        take them (num_to_relieve), rather than run them into an eviction."""
        if not self.is_kv_short(w):
            return 0
        return max((self.num_to_relieve(w, o) for o in self.workers.values() if o is not w), default=0)

    def admission_room(self, w: WorkerState) -> int | None:
        """How many queued sequences that nobody holds w may take now (None: no limit). When
        other workers have room for them too (batch places, and KV blocks as they last
        reported), w gets its share of all the work placed on these workers or waiting, in
        proportion to max_seqs, less what it holds already; none while it is short of KV."""
        waiting = len(self.queue.of(None))
        if not waiting or not self.config.spread_new_work:
            return None
        peers = [o for o in self.workers.values() if o is not w and o.alive and not o.draining
                 and o.may_prefill and o.load < o.capacity and self._has_kv_room(o)]
        if not peers:
            return None
        if w.load >= w.capacity or self.is_kv_short(w):
            return 0
        peers.append(w)
        total = sum(o.load for o in peers) + waiting
        share = -(-total * w.max_seqs // sum(o.max_seqs for o in peers))
        return max(0, share - w.load)

    def cause(self, owner: WorkerState, quota: Counter[str]) -> str | None:
        if not owner.alive:
            return "dead"
        if owner.draining:
            return "drain"
        if self.on_memory and owner.is_memory_short:
            return "memory"
        if self.config.policy == "any":
            return "any"
        if quota[owner.name] > 0:
            return "kv" if self.is_kv_short(owner) else "load"
        return None

    def mechanism(self, seq: Seq, dest: WorkerState, now: float) -> str:
        """How seq travels from its owner to dest: by recompute where either end has no KV
        link; else as the migration setting says, and under "auto" whichever ends sooner,
        counting what the owner's link is already shipping and what dest already recomputes
        (the moves given to each and not yet done, as the router estimates them)."""
        owner = self.workers[seq.owner]
        if not owner.alive or not owner.kv_endpoint or not dest.kv_endpoint:
            return "recompute"
        if self.config.migration != "auto":
            return self.config.migration
        return choose_mechanism(len(seq.token_ids) - 1, owner.kv_bytes_per_token, owner.num_params,
                                self.config.link_gbps, prefill_tflops_of(dest, self.config.prefill_tflops),
                                link_wait_s=max(0.0, owner.link_free_at - now),
                                prefill_wait_s=max(0.0, dest.recompute_free_at - now))

    @staticmethod
    def kv_room(w: WorkerState, held: list[Seq]) -> float:
        """KV tokens w can take for sequences new to it without evicting any it owns, from
        what it last reported free. Its pool holds what it owns plus what it is prefilling
        now (`held`: the sequences of its open leases), and each owned sequence grows a token
        a step, so a block per owned sequence is kept for that growth."""
        if w.free_kv_tokens is None or not w.kv_tokens:
            return float("inf")
        arriving = sum(len(seq.token_ids) + w.block_size for seq in held if seq.owner != w.name)
        return w.free_kv_tokens - arriving - w.block_size * len(w.owned)

    @staticmethod
    def _has_kv_room(w: WorkerState) -> bool:
        """kv_room's rule for a peer, without walking its leases: a block for each sequence
        it owns or is taking on, and one for a new sequence."""
        if w.free_kv_tokens is None or not w.kv_tokens:
            return True
        return w.free_kv_tokens - w.block_size * (len(w.owned) + w.num_arriving + 1) > 0

    def candidates(self, w: WorkerState, queue: Queue, quota: Counter[str], limit: int,
                   now: float = 0.0) -> list[tuple[Seq, str | None]]:
        """Up to `limit` queued sequences this worker may run, best first, with the migration
        cause: those that must leave a draining or memory-short owner (their owner will not
        run them again, so they would wait the longest), its own (short of KV, less the
        shortest, which it leaves for a taker), those a KV-short owner gives up (the shortest
        first: the cheapest to move), those held nowhere, then those that load balancing would
        move to it. A sequence moved for KV or load within move_cooldown_s stays."""
        # Short of memory: it leaves its own sequences to whoever may take them (cause "memory").
        shedding = self.on_memory and w.is_memory_short and any(
            o.alive and not o.draining and o.may_prefill for o in self.workers.values() if o is not w)
        urgent, relieving, movable = [], [], []
        for owner, queued in queue.by_owner.items():
            other = self.workers.get(owner) if owner is not None else None
            if other is not None and other is not w and (cause := self.cause(other, quota)) is not None:
                if cause == "kv":
                    relieving.append(sorted(queued.values(), key=lambda seq: len(seq.token_ids)))
                else:
                    (urgent if cause in ("drain", "memory") and w.may_prefill else movable).append(queued.values())
        out = self._merged(urgent, quota, limit, [], now)
        if not shedding:
            own = queue.of(w.name).values()
            if leave := self.num_to_shed(w):   # short of KV: its cheapest wait for a taker
                movable_now = (seq for seq in own if not self.cooling(seq, now))
                left = {seq.seq_id for seq in heapq.nsmallest(leave, movable_now, key=lambda seq: len(seq.token_ids))}
                own = (seq for seq in own if seq.seq_id not in left)
            out += [(seq, None) for seq in itertools.islice(own, limit - len(out))]
        for queued in relieving:
            self._merged([queued], quota, limit, out, now)
        unheld = queue.of(None).values()
        if self.config.policy == "pinned":
            unheld = (seq for seq in unheld if self.may_start(seq, w))
        out += [(seq, None) for seq in itertools.islice(unheld, max(0, limit - len(out)))]
        return self._merged(movable, quota, limit, out, now)

    def cooling(self, seq: Seq, now: float) -> bool:
        """seq moved for KV or load less than move_cooldown_s ago: it stays where it is."""
        return seq.moved_at is not None and now - seq.moved_at < self.config.move_cooldown_s

    def _merged(self, queues: list, quota: Counter[str], limit: int, out: list,
                now: float) -> list[tuple[Seq, str | None]]:
        """out, then the sequences of these owners' queues in the router's order (one queue:
        its own order), with their cause."""
        merged = queues[0] if len(queues) == 1 else heapq.merge(*queues, key=lambda seq: seq.queue_pos)
        for seq in merged:
            if len(out) >= limit:
                break
            owner = self.workers[seq.owner]
            if (cause := self.cause(owner, quota)) is not None:
                if cause in ("kv", "load"):
                    if self.cooling(seq, now):
                        continue
                    quota[owner.name] -= 1
                out.append((seq, cause))
        return out
