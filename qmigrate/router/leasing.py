"""How a worker's request for work becomes a lease: which queued sequences it takes within
one step's token and KV budget, the chained next step of its batch in flight, how many steps
the lease covers, and the revokes that end multi-step leases early.

Chained leases hide the round trip without splitting the batch: a worker that asks for
work while a batch is in flight may be given the *next* step of that batch's sequences
(rows of length CONTINUE: "go on from the step you are running"). Such a sequence is
still in one place, that worker; it is never chained when it ought to move instead.

Multi-step leases take the router off the per-step path: while nothing waits for a worker,
its lease covers up to `max_lease_steps` steps. When something must move sooner (a drain,
memory pressure, an idle worker to feed, new requests to admit) the router revokes such a
lease: it ends at the worker's next step boundary and its rows come back like any result
(a chained lease not yet begun is revoked too, and then runs one step).
Revokes to send collect in `revokes`; the router sends them once per loop turn.

A prefix pull does not hold up a lease. The worker that will take a new sequence is told to
wait for nothing: the holder is sent a ShipKV at once, and the sequence stays queued, leased
to nobody, until the taker says the KV arrived (its heartbeat's `kv_arrived`); then it is
leased there and imports the KV as its lease starts. Rows leased meanwhile run as usual. A
shipment that has not arrived within PULL_WAIT_S is given up and the sequence prefilled.
Shipments decided while building a lease that ends up empty wait in `shipments` for the
router, which takes them once per loop turn.

Pure bookkeeping over the Scheduler's records, which it shares (the Scheduler owns them).
"""

from __future__ import annotations

import itertools
import secrets
from collections import Counter, deque

from qmigrate.config import RouterConfig
from qmigrate.router.migration import MovePolicy
from qmigrate.router.prefix_index import LeasePrefill, PrefixIndex, place_new, seq_keys
from qmigrate.router.records import (Grant, LeaseRecord, Pull, Queue, Row, Seq, WorkerState, choose_mechanism,
                                     prefill_tflops_of, recompute_seconds, transfer_seconds)
from qmigrate.wire.protocol import CONTINUE

PULL_WAIT_S = 2.0   # a pulled prefix not there by then is prefilled (the worker's transfer_wait_s)


class Lessor:
    def __init__(self, config: RouterConfig, seqs: dict[int, Seq], queue: Queue, workers: dict[str, WorkerState],
                 leases: dict[int, LeaseRecord], moves: MovePolicy, prefix: PrefixIndex, counters: Counter[str]):
        self.config, self.seqs, self.queue, self.workers = config, seqs, queue, workers
        self.leases, self.moves, self.prefix, self.counters = leases, moves, prefix, counters
        self._lease_ids = itertools.count(1)
        self.revokes: list[tuple[str, int, list[int]]] = []  # (worker, lease_id, seq_ids; [] = all)
        self.shipments: list = []   # pulls decided for no lease (Grant.shipments' form), to send
        self.pulls: dict[int, int] = {}   # transfer id -> seq_id of the pulls on the way
        # (cause, seconds from the decision to move to the lease on the new worker)
        self.move_delays: deque[tuple[str, float]] = deque(maxlen=4096)

    def start_ids_at(self, base: int) -> None:
        """Number leases from base, so a restarted router never reuses the ids of results
        still travelling from before the restart."""
        self._lease_ids = itertools.count(base)

    @staticmethod
    def new_transfer_id() -> int:
        """A KV shipment's id: random, 62 bits. Only the sender (in its ShipKV) and the receiver
        (in its lease) are told it, over their encrypted links, so a worker key that another
        node's worker stole cannot send KV that a receiver takes for a migrating sequence."""
        return secrets.randbits(62) or 1

    def take_revokes(self) -> list[tuple[str, int, list[int]]]:
        revokes, self.revokes = self.revokes, []
        return revokes

    def take_shipments(self) -> list:
        shipments = self.shipments
        if shipments:   # asked every loop turn: no new list while there are none
            self.shipments = []
        return shipments

    def kv_arrived(self, name: str, transfer_ids) -> None:
        """name has these shipments: a sequence whose pull it was may now be leased there."""
        for transfer_id in transfer_ids:
            seq = self.seqs.get(self.pulls.get(transfer_id, -1))
            if seq is not None and seq.pull is not None and seq.pull.transfer_id == transfer_id \
                    and seq.pull.worker == name:
                seq.pull.arrived = True
                del self.pulls[transfer_id]

    def revoke_steps(self, w: WorkerState, seq_ids: list[int] | None = None, *, for_load_at: float | None = None) -> None:
        """End w's multi-step leases at its next step boundary; with seq_ids, end every lease
        of w that holds one of them. for_load_at: when load balancing decided it."""
        for lease_id in w.lease_ids:
            lease = self.leases[lease_id]
            if lease.is_revoked:
                continue
            rows = [] if seq_ids is None else sorted(set(seq_ids).intersection(lease.seq_ids))
            if (seq_ids is None and lease.num_steps <= 1) or (seq_ids is not None and not rows):
                continue
            lease.is_revoked, lease.revoked_at = True, for_load_at
            self.revokes.append((w.name, lease_id, rows))
            self.counters["revokes"] += 1

    def lease(self, name: str, max_seqs: int, max_tokens: int, now: float,
              free_kv_tokens: int | None = None, *, ahead: bool = False) -> Grant | None:
        """A batch for `name`, or None (Scheduler.schedule).

        `ahead` marks a request sent while the worker already has a batch in flight. It is
        answered with the next step of that batch (a chain), or with a full batch; never
        with part of the sequences, since a step of half of them costs a GPU nearly as much
        as a step of all, and splitting would double the steps. Otherwise it waits for the
        batch in flight to come back."""
        w = self.workers.get(name)
        if w is None or not w.alive or w.draining:
            return None
        max_seqs = min(max_seqs, w.max_seqs)
        w.free_kv_tokens = free_kv_tokens
        # KV of moves away told to it with its last lease is freed in this report
        w.kv_released, w.kv_delivered = w.kv_released - w.kv_delivered, 0
        held = self.held(w)
        chainable = [seq for seq in held if is_chainable(seq)] if self.may_chain(w) else []
        quota = self.moves.steal_quota(w)
        # Look at a bounded stretch of the queue: a request costs what it can return.
        candidates = self.moves.candidates(w, self.queue, quota, max_seqs + 64, now)
        matched: dict[int, dict[str, int]] = {}
        if self.config.prefix_aware:
            candidates = place_new(self.prefix, w, self.workers, candidates, now, self.config.prefix_wait_s,
                                   self.config.prefill_tflops, self.counters, matched)
        if ahead and w.num_leased and not chainable and len(candidates) < max_seqs:
            return None
        # The batch in flight goes on at a token a row: those tokens are kept from the budget
        # that new prompts may fill, so a prefill never makes a running row skip a step.
        budget = min(max_tokens, w.max_tokens)
        reserved = min(len(chainable), max_seqs, max(0, budget - 1))
        budget -= reserved
        room = self.moves.kv_room(w, held)
        new_room = self.moves.admission_room(w)
        prefill = LeasePrefill(self.prefix, w, held, matched) if w.is_caching else None
        rows: list[Row] = []
        shipments = []
        num_passed = num_arriving = num_moved = 0
        for seq, cause in candidates:
            if len(rows) >= max_seqs:
                break
            num_passed += 1
            is_diff = seq.owner == name
            if not is_diff and not w.may_prefill:
                break  # short of memory: only sequences whose KV it holds
            is_new = seq.owner is None
            mechanism = None if cause is None else self.moves.mechanism(seq, w, now)
            kv_cost = 0 if is_diff else len(seq.token_ids) + w.block_size
            is_prompt = not is_diff and mechanism != "transfer"   # w computes its KV from its ids
            cost, shared = (len(seq.token_ids) if is_prompt else 1), 0
            if is_prompt and prefill is not None:
                cost, shared = prefill.cost(seq)
            if is_new and new_room is not None and new_room <= 0 and (
                    cost >= len(seq.token_ids) or self.moves.is_kv_short(w)):
                # its share of new work is taken: the rest is for the others, but not the
                # sequences whose prefix it holds (place_new has left them to it) unless it
                # is short of KV, when they would only grow into an eviction or a move
                continue
            if is_new and is_prompt and prefill is not None and prefill.should_wait(seq, shared):
                self.counters["prefix_waits"] += 1
                continue   # it starts on those blocks once they are cached
            if is_new and self._waits_for_pull(seq, w, now, shipments, matched.get(seq.seq_id)):
                continue   # its prefix is on the way to a worker: leased there once it is in
            if kv_cost and kv_cost > room:
                continue
            if rows and cost > budget:
                continue
            if prefill is not None:
                prefill.take(seq)
            budget -= cost
            room -= kv_cost
            num_passed -= 1
            num_arriving += not is_diff
            num_moved += not is_diff and cause is not None
            if is_new and new_room is not None:
                new_room -= 1
            rows.append(self._lease_row(seq, w, cause, mechanism, shipments, now))
        queued = len(rows)
        # Queued work takes rows first, so chaining never starves it; the batch in flight fills
        # the rest, with the tokens kept for it.
        chained = chainable[: max(0, min(max_seqs - queued, budget + reserved))]
        rows += [Row(seq.seq_id, CONTINUE, CONTINUE, None) for seq in chained]
        if len(rows) < max_seqs:
            self._feed_from_leases(w, quota, max_seqs - len(rows), now)
        if not rows:
            self.shipments += shipments   # pulls started for sequences that wait for them
            return None
        if prefill is not None:
            prefill.granted()
        lease_id = next(self._lease_ids)
        seq_ids = [r.seq_id for r in rows]
        for row in rows[:queued]:
            seq = self.seqs[row.seq_id]
            seq.lease_id = lease_id
            self.queue.pop(seq)
        for seq in chained:
            seq.next_lease = lease_id
        num_steps = self._num_steps(w, rows, queued, skipped=num_passed > 0, moved=num_moved > 0 or bool(shipments),
                                    full=len(candidates) > queued and len(rows) >= max_seqs)
        self.counters["chained_rows"] += len(chained)
        self.leases[lease_id] = LeaseRecord(name, seq_ids, now + self.config.lease_timeout_s, num_steps,
                                            num_arriving=num_arriving)
        w.lease_ids[lease_id] = None
        w.num_leased += len(rows)
        w.num_arriving += num_arriving
        drops, w.pending_drops = w.pending_drops, []
        w.kv_delivered = w.kv_released
        self.counters["leases"] += 1
        self.counters["leased_rows"] += len(rows)
        return Grant(lease_id, name, rows, drops, shipments, num_steps)

    def _num_steps(self, w: WorkerState, rows: list[Row], queued: int, *, skipped: bool, moved: bool,
                   full: bool) -> int:
        """Steps the lease may cover: several for a batch that nothing waits to join.

        New prompts among its rows do not end it: their first tokens stream after the first
        step like any other, and a lease of one step would put a round trip to the router
        and the next lease's start between that step and the next, while every row waits.
        Work that did not fit this lease's budget keeps it to one step, and so does a
        sequence moved here (the router follows a move step by step). Behind a full batch,
        the lease ends when its first row reaches max_new_tokens, when a place frees."""
        limit = self.config.max_lease_steps
        if limit <= 1 or skipped or moved or self.config.policy == "any" or not self.moves.may_keep(w):
            return 1
        if full:
            for r in rows[:queued]:
                seq = self.seqs[r.seq_id]
                limit = min(limit, seq.spec.prompt_len + seq.spec.max_new_tokens - len(seq.token_ids))
        return max(1, limit)

    def _feed_from_leases(self, w: WorkerState, quota: Counter[str], room: int, now: float) -> None:
        """w has room that the queue cannot fill: revoke rows of other workers' multi-step
        leases that load balancing would move to it, so they come back at the next step."""
        for name, n in quota.items():
            other = self.workers[name]
            if n <= 0 or room <= 0 or not other.alive or not any(
                    self.leases[i].num_steps > 1 and not self.leases[i].is_revoked for i in other.lease_ids):
                continue
            held = self.held(other)
            if self.moves.is_kv_short(other):   # the cheapest to move: the shortest
                held.sort(key=lambda seq: len(seq.token_ids), reverse=True)
            take = [seq.seq_id for seq in held][-min(n, room):]
            self.revoke_steps(other, take, for_load_at=now)
            room -= len(take)

    def num_chainable(self, name: str) -> int:
        w = self.workers.get(name)
        if w is None or not w.alive or not self.may_chain(w):
            return 0
        return sum(1 for seq in self.held(w) if is_chainable(seq))

    def held(self, w: WorkerState) -> list[Seq]:
        """Sequences whose current step is at w (a lease record may list stale ones)."""
        return [seq for lease_id in w.lease_ids for sid in self.leases[lease_id].seq_ids
                if (seq := self.seqs.get(sid)) is not None and seq.lease_id == lease_id]

    def may_chain(self, w: WorkerState) -> bool:
        return self.config.chain_leases and self.config.policy != "any" and self.moves.may_keep(w)

    def _lease_row(self, seq: Seq, w: WorkerState, cause, mechanism, shipments, now: float) -> Row:
        revoked_at, seq.revoked_at = seq.revoked_at, None
        if seq.owner == w.name:
            return Row(seq.seq_id, len(seq.token_ids), seq.token_ids[-1], None)
        seq.home = w.name
        if seq.lost_at is not None:
            self.move_delays.append(("dead", now - seq.lost_at))
            seq.lost_at = None
        if cause == "load":  # from the revoke that sent it back; a queued one moves as decided
            self.move_delays.append(("load", 0.0 if revoked_at is None else now - revoked_at))
        kv_from, transfer_id = "", 0
        if cause is not None:
            owner = self.workers[seq.owner]
            if owner.moving_since is not None and cause in ("drain", "memory", "dead"):
                self.move_delays.append((cause, now - owner.moving_since))
            self.counters[f"migrations_{cause}"] += 1
            self.counters[f"migrations_by_{mechanism}"] += 1
            owner.owned.discard(seq.seq_id)
            if cause in ("kv", "load"):
                seq.moved_at = now
            owner.kv_released += len(seq.token_ids)
            if mechanism == "transfer":
                transfer_id = self.new_transfer_id()
                kv_from = owner.kv_endpoint
                start = self._cached_start(seq, w)
                shipments.append((owner.name, seq.seq_id, w.kv_endpoint, transfer_id,
                                  len(seq.token_ids) - 1, start, []))
                self._ship(owner, len(seq.token_ids) - 1 - start, now)
            else:
                self._recompute(w, len(seq.token_ids), owner.num_params, now)
                if owner.alive:
                    owner.pending_drops.append(seq.seq_id)
        elif seq.owner is None and seq.pull is not None:   # its pulled prefix is here (_waits_for_pull)
            kv_from, transfer_id = seq.pull.kv_from, seq.pull.transfer_id
            seq.pull = None
        seq.owner = None
        spec = seq.respec(kv_from, transfer_id)
        seq.resync = False
        return Row(seq.seq_id, len(seq.token_ids), seq.token_ids[-1], spec)

    def _ship(self, sender: WorkerState, num_tokens: int, now: float) -> None:
        """sender was told to ship num_tokens of KV: its link is busy that much longer."""
        sender.link_free_at = max(now, sender.link_free_at) + transfer_seconds(
            num_tokens, sender.kv_bytes_per_token, self.config.link_gbps)

    def _recompute(self, taker: WorkerState, num_tokens: int, num_params: int, now: float) -> None:
        """taker was given num_tokens of a moved sequence to prefill again: its prefill is busy
        that much longer."""
        taker.recompute_free_at = max(now, taker.recompute_free_at) + recompute_seconds(
            num_tokens, num_params, prefill_tflops_of(taker, self.config.prefill_tflops))

    def _waits_for_pull(self, seq: Seq, w: WorkerState, now: float, shipments: list,
                        hits: dict[str, int] | None = None) -> bool:
        """Whether new sequence seq sits this lease out for a prefix pull: one on the way to w
        (or to another worker) that has not arrived, or one started now (its ShipKV among
        `shipments`). One that did not arrive in time, or whose taker died, is given up.
        `hits`: the index's match for seq that placement found for this lease, if it did."""
        p = seq.pull
        if p is not None:
            taker = self.workers.get(p.worker)
            if p.arrived and p.worker == w.name:
                return False
            if now < p.deadline and taker is not None and taker.alive and not taker.draining:
                return True
            self.pulls.pop(p.transfer_id, None)
            seq.pull, seq.pull_given_up = None, True
            self.counters["prefix_pulls_given_up"] += 1
            return False
        if seq.pull_given_up or (pull := self._pull(seq, w, now, hits)) is None:
            return False
        holder, num_tokens, start, keys = pull
        transfer_id = self.new_transfer_id()
        shipments.append((holder.name, seq.seq_id, w.kv_endpoint, transfer_id, num_tokens, start, keys))
        self._ship(holder, num_tokens - start, now)
        seq.pull = Pull(w.name, holder.kv_endpoint, transfer_id, now + PULL_WAIT_S)
        if len(self.pulls) > 4 * len(self.seqs) + 64:   # ids of pulls whose sequences ended
            self.pulls = {t: sid for t, sid in self.pulls.items() if sid in self.seqs}
        self.pulls[transfer_id] = seq.seq_id
        self.counters["prefix_pulls"] += 1
        return True

    def _pull(self, seq: Seq, w: WorkerState, now: float, hits: dict[str, int] | None = None):
        """(holder, num_tokens, start, keys) when w should pull seq's prefix from the worker
        that holds the most of it beyond what w holds: the blocks [start, num_tokens) of keys
        `keys`, when shipping them costs less than prefilling them (prefix_pull); else None.
        `hits`: the index's match for seq's keys, when placement already made it."""
        cfg = self.config
        if cfg.prefix_pull == "never" or not cfg.prefix_aware or not w.kv_endpoint or not len(self.prefix):
            return None
        keys = seq_keys(seq, w.block_size)
        if hits is None:
            hits = self.prefix.match(keys)
        mine = hits.get(w.name, 0)
        holder, most = None, mine
        for name, n in hits.items():
            o = self.workers.get(name)
            if n > most and o is not None and o is not w and o.alive and o.kv_endpoint \
                    and o.block_size == w.block_size:
                holder, most = o, n
        if holder is None:
            return None
        gain = (most - mine) * w.block_size
        if cfg.prefix_pull == "auto" and choose_mechanism(
                gain, holder.kv_bytes_per_token, holder.num_params, cfg.link_gbps,
                prefill_tflops_of(w, cfg.prefill_tflops),
                link_wait_s=max(0.0, holder.link_free_at - now)) != "transfer":
            return None
        return holder, most * w.block_size, mine * w.block_size, keys[mine:most]

    def _cached_start(self, seq: Seq, w: WorkerState) -> int:
        """Leading positions of seq's KV that w holds cached (as it reported): a shipment to
        it starts there. Whole blocks, and never all of the KV."""
        if not self.config.prefix_aware or not len(self.prefix):
            return 0
        num_kv = len(seq.token_ids) - 1
        blocks = self.prefix.match(seq_keys(seq, w.block_size)).get(w.name, 0)
        return min(blocks, (num_kv - 1) // w.block_size) * w.block_size if num_kv > 0 else 0


def chain_answered_first(seq: Seq, chain: LeaseRecord) -> None:
    """seq's chain was answered before the step it followed: withdrawn after a revoke, or
    answered unrun by a worker that no longer holds that step (it dropped that lease), which
    cannot continue it and so gets no chain on that step again (is_chainable)."""
    seq.next_lease = None
    if not chain.is_revoked:
        seq.unchainable = seq.lease_id


def is_chainable(seq: Seq) -> bool:
    """seq's next step may be leased as a chain of the step it is running: none is yet, and
    its worker did not answer one on this step without running it (a worker that lost the
    step would answer each new chain so, as fast as the two can talk)."""
    return seq.next_lease is None and seq.unchainable != seq.lease_id
