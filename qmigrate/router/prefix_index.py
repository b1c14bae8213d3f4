"""The router's view of every worker's prefix cache, and where new sequences should start.

Workers report the keys of blocks they cache and evict (`StepResult.prefix_events`: a key,
or ~key when evicted), and those their host tier takes and drops (`StepResult.tier_events`);
the index keeps, per key and tier, the workers that hold it, for at most `max_keys` keys of
each tier (least recently seen dropped first). A sequence's keys are those of its full blocks
(`wire/prefix_keys.py`), so the number of its leading keys a worker holds on either tier is
the number of its prompt's blocks that worker would not prefill; those on the host tier are
copied back instead, at a fraction of a prefill (HOST_COPY_COST).

Placement is by score: the prompt tokens a worker would not prefill, less the copies from its
host tier, less a load penalty (its prompt times the share of the worker's batch places taken):
a worker holding a prefix gets no more work than its free places allow. A worker asking for work
takes its hits early, each ahead of the sequences offered before it by no more than the time its
cached tokens would take to prefill (at the rate the worker measured at its start, else
`prefill_tflops`): a hit goes first as the shorter job does, and a miss waits behind a stream of
hits for a bounded time, never for as long as hits keep coming. It leaves a sequence that scores
better on another worker, for up to `prefix_wait_s` after it was first offered, while that
worker has room (batch places and KV blocks): a hit never piles work onto a worker that is full.
A worker whose share of new work is taken (`spread_new_work`) still takes the sequences whose
prefix it holds: the other workers leave those to it, so skipping them would leave them waiting
for nobody. A conversation's next turn is a new sequence whose prefix the last turn's worker
holds, so it goes back there the same way.

A lease is charged the prefill its worker will do (`LeasePrefill`): a prompt less the blocks
the index says that worker holds. A new sequence whose next blocks another sequence at that
worker computes now, or an earlier row of the same lease, waits for a later lease, when they
are cached, instead of computing them again (in-batch prefix caching).
"""

from __future__ import annotations

from collections import OrderedDict

from qmigrate.router.records import Seq, WorkerState, prefill_tflops_of, recompute_seconds
from qmigrate.wire.prefix_keys import block_keys

MAX_KEYS = 1 << 20
# Blocks another sequence computes are worth waiting for from this many tokens (SGLang's
# in-batch prefix caching waits from 32), for at most this many leases of the worker: a
# prompt fills over a few steps at most, so a longer wait means its computation stopped.
MIN_SHARED_TOKENS = 32
MAX_WAIT_LEASES = 8
# What copying a block back from a worker's host tier costs, as a share of prefilling it, an
# estimate: an 8B model's 128 KiB of KV a token crosses PCIe (~25 GB/s) in about 5 us, a
# quarter of the ~20 us its prefill takes per token on an H100.
HOST_COPY_COST = 0.25


class PrefixIndex:
    def __init__(self, max_keys: int = MAX_KEYS):
        self.max_keys = max_keys
        self.holders: OrderedDict[int, set[str]] = OrderedDict()   # key -> workers, GPU tier
        self.host: OrderedDict[int, set[str]] = OrderedDict()      # key -> workers, host tier

    def __len__(self) -> int:
        return len(self.holders) + len(self.host)

    def apply(self, worker: str, events) -> None:
        """A worker's cache events, in the order they happened."""
        self._apply(self.holders, worker, events)

    def apply_tier(self, worker: str, events) -> None:
        """A worker's host tier events (keys taken, ~keys dropped), in order."""
        self._apply(self.host, worker, events)

    def _apply(self, holders: OrderedDict, worker: str, events) -> None:
        for key in events:
            key = int(key)
            if key >= 0:
                holders.setdefault(key, set()).add(worker)
                holders.move_to_end(key)
            elif (held := holders.get(~key)) is not None:
                held.discard(worker)
                if not held:
                    del holders[~key]
        while len(holders) > self.max_keys:
            holders.popitem(last=False)

    def forget(self, worker: str) -> None:
        """A worker that died or restarted holds nothing."""
        for holders in (self.holders, self.host):
            for key in [k for k, held in holders.items() if worker in held]:
                held = holders[key]
                held.discard(worker)
                if not held:
                    del holders[key]

    def match(self, keys: list[int], on_host: dict[str, int] | None = None) -> dict[str, int]:
        """Per worker, how many of the leading keys it holds on either tier (workers holding
        none are absent); `on_host` gets, per worker, how many of those are on its host tier
        only (copied back, not prefilled)."""
        counts: dict[str, int] = {}
        gpu_of, host_of = self.holders, self.host
        for i, key in enumerate(keys):
            gpu, host = gpu_of.get(key), host_of.get(key)
            if not gpu and not host:
                break
            if gpu:
                gpu_of.move_to_end(key)
            if host:
                host_of.move_to_end(key)
            grew = False
            for name in (gpu or set()) | (host or set()):
                if counts.get(name, 0) == i:
                    counts[name] = i + 1
                    grew = True
                    if on_host is not None and not (gpu and name in gpu):
                        on_host[name] = on_host.get(name, 0) + 1
            if not grew:
                break
        return counts


def seq_keys(seq: Seq, block_size: int) -> list[int]:
    """Keys of the blocks a worker could reuse for seq (all full blocks but the one holding
    its last token), computed once per block size."""
    cached = seq.prefix_keys
    if cached is None or cached[0] != block_size or cached[1] != len(seq.token_ids):
        n = len(seq.token_ids)
        keys = block_keys(seq.packed_ids, block_size, seq.spec.cache_salt, max_blocks=(n - 1) // block_size)
        seq.prefix_keys = cached = (block_size, n, keys)
    return cached[2]


def has_room(w: WorkerState) -> bool:
    """A worker a new sequence may wait for: alive, taking prefills, with batch places and KV
    blocks free as it last reported."""
    if not w.alive or w.draining or not w.may_prefill or w.load >= w.capacity:
        return False
    if w.free_kv_tokens is None or not w.kv_tokens:
        return True
    return w.free_kv_tokens - w.block_size * (len(w.owned) + w.num_arriving + 1) > 0


def score(seq: Seq, w: WorkerState, hits: dict[str, int], on_host: dict[str, int] | None = None) -> float:
    """Prompt tokens w would not prefill, less the cost of copying those on its host tier
    back, less its load penalty."""
    return saved_tokens(w, hits, on_host) - len(seq.token_ids) * min(1.0, w.load / max(1, w.capacity))


def saved_tokens(w: WorkerState, hits: dict[str, int], on_host: dict[str, int] | None = None) -> float:
    """Prompt tokens w would not prefill, its host tier's copies counted at HOST_COPY_COST."""
    return (hits.get(w.name, 0) - HOST_COPY_COST * (on_host or {}).get(w.name, 0)) * w.block_size


def place_new(index: PrefixIndex, w: WorkerState, workers: dict[str, WorkerState], candidates: list,
              now: float, wait_s: float, prefill_tflops: float, counters,
              matched: dict[int, dict[str, int]] | None = None) -> list:
    """The candidates for w with sequences nobody holds reordered by when they were first
    offered, each hit moved earlier by the time its saved prefill would take (in their queue
    positions otherwise kept), and those better started elsewhere left out.
    `matched` collects each new sequence's hits (seq_id -> the index's match), for the
    lease's costs to reuse: the index does not change while a lease is built."""
    new = [i for i, (seq, cause) in enumerate(candidates) if seq.owner is None and cause is None]
    if not new or not len(index):
        return candidates
    others = [o for o in workers.values() if o is not w and has_room(o)]
    token_s = recompute_seconds(1, w.num_params, prefill_tflops_of(w, prefill_tflops))   # a token's prefill on w
    kept, priority = [], {}   # priority: when a kept one was offered, less its saved prefill
    for i in new:
        seq = candidates[i][0]
        on_host: dict[str, int] = {}
        hits = index.match(seq_keys(seq, w.block_size), on_host)
        if matched is not None:
            matched[seq.seq_id] = hits
        if seq.offered_at is None:
            seq.offered_at = now
        mine = score(seq, w, hits, on_host)
        if hits and now - seq.offered_at < wait_s and any(score(seq, o, hits, on_host) > mine for o in others):
            counters["prefix_held_back"] += 1
            continue   # another worker with room holds more of it: leave it for that one
        kept.append(i)
        saved = int(saved_tokens(w, hits, on_host)) if w.name in hits else 0
        priority[i] = seq.offered_at - saved * token_s
    order = sorted(kept, key=priority.__getitem__)
    out, it, skipped = [], iter(order), set(new) - set(kept)
    for i, entry in enumerate(candidates):
        if i in skipped:
            continue
        out.append(candidates[next(it)] if i in priority else entry)   # a kept new one's place
    return out


class LeasePrefill:
    """What one lease to a worker with a prefix cache costs, row by row, and which new
    sequences should wait for blocks that others compute first.

    A prompt is charged its tokens less the blocks the index says w holds: a worker reports
    the blocks it cached with each step's result, so the index misses only what steps in
    flight compute. Those blocks, and those that earlier rows of this lease compute, are not
    cached when this lease's prompts start (a worker caches a block once the step writing it
    is launched, and may spread a prompt over several steps): a new sequence whose next
    uncached blocks are among them waits for a later lease, for at most MAX_WAIT_LEASES of
    w's leases. Its KV is charged in full: an idle cached block counts as free in w's report
    and leaves it when a sequence takes it."""

    def __init__(self, index: PrefixIndex, w: WorkerState, held: list[Seq],
                 matched: dict[int, dict[str, int]] | None = None):
        self.index, self.w, self.held = index, w, held
        self.matched = matched or {}               # hits place_new found for this lease
        self.computing: set[int] | None = None   # keys of prompts under way at w, once asked
        self.taken: list[Seq] = []
        self.waiting: list[Seq] = []

    def cost(self, seq: Seq) -> tuple[int, int]:
        """(prompt tokens w will compute for seq, tokens of its blocks right after those
        that others compute first)."""
        bs, keys = self.w.block_size, seq_keys(seq, self.w.block_size)
        hits = self.matched.get(seq.seq_id)
        if hits is None:
            hits = self.index.match(keys) if len(self.index) else {}
        held = hits.get(self.w.name, 0)
        if self.computing is None:   # most leases carry no prompt: built only when one comes
            self.computing = set()
            for other in (*self.held, *self.taken):
                self.take(other)
        shared = held
        while shared < len(keys) and keys[shared] in self.computing:
            shared += 1
        return len(seq.token_ids) - held * bs, (shared - held) * bs

    def take(self, seq: Seq) -> None:
        """seq is at w (a row of this lease, or in flight): while no token of it is back,
        its prompt's blocks are being computed."""
        if len(seq.token_ids) > seq.spec.prompt_len:
            return
        if self.computing is None:
            self.taken.append(seq)
        else:
            self.computing.update(seq_keys(seq, self.w.block_size))

    def should_wait(self, seq: Seq, shared_tokens: int) -> bool:
        if shared_tokens >= MIN_SHARED_TOKENS and seq.num_waits < MAX_WAIT_LEASES:
            self.waiting.append(seq)
            return True
        return False

    def granted(self) -> None:
        """The lease goes out: those that waited for it have waited one lease more."""
        for seq in self.waiting:
            seq.num_waits += 1
