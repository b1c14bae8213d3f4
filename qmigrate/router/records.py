"""The router's records: sequences, workers and leases, and the cost rule
that picks how a sequence moves. Plain data; `scheduler.py` holds the policy."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from qmigrate.wire.protocol import Finish, SeqSpec, pack_i32

@dataclass(slots=True)
class Seq:
    spec: SeqSpec
    token_ids: list[int]
    owner: str | None = None
    lease_id: int | None = None
    next_lease: int | None = None  # a chained lease that takes over when lease_id completes
    queue_key: object = None       # the owner it is queued under; _OUT when not queued
    queue_pos: int = 0             # its place in the router's order: lower runs first
    lost_at: float | None = None   # when the worker holding it was found dead
    revoked_at: float | None = None  # from a lease that load balancing revoked: since when
    # Set when a worker vanished holding this sequence: tokens it reported here may never
    # have reached the detokenizer, so the next worker sends them again.
    resync: bool = False
    prefix_keys: tuple | None = None   # (block size, length, keys of its full blocks): prefix_index.seq_keys
    offered_at: float | None = None    # when a worker was first offered it (cache-aware placement)
    num_waits: int = 0                 # leases it sat out for prefix blocks others computed (prefix_index)
    home: str | None = None            # the worker it last came to (policy "pinned" keeps it there)
    moved_at: float | None = None      # when it last moved for KV or load (move_cooldown_s)
    pull: "Pull | None" = None         # its prefix is on the way to a worker (Lessor: leased once there)
    pull_given_up: bool = False        # a pull of it did not arrive in time: it is prefilled instead
    # the lease whose step its worker could not chain on (leasing.chain_answered_first)
    unchainable: int | None = None

    @property
    def seq_id(self) -> int:
        return self.spec.seq_id

    def __post_init__(self):
        self.queue_key = _OUT

    @property
    def packed_ids(self) -> bytes:
        """Every token so far, packed as a SeqSpec carries them: a prompt that has not run yet
        keeps the bytes it came with (nothing is packed again)."""
        s = self.spec
        return s.token_ids if len(self.token_ids) == s.prompt_len else pack_i32(self.token_ids)

    def respec(self, kv_from: str = "", transfer_id: int = 0) -> SeqSpec:
        """The full form as it stands now, for a worker that has not seen this sequence."""
        s = self.spec
        # every field as it came (sampling controls included), but the ids and the handover's
        return dataclasses.replace(s, token_ids=self.packed_ids, kv_from=kv_from, transfer_id=transfer_id,
                                   resend_from=0 if self.resync else -1)


@dataclass(slots=True)
class WorkerState:
    name: str
    max_seqs: int
    max_tokens: int
    inflight: int = 2
    kv_endpoint: str = ""
    gpu_uuid: str = ""
    kv_bytes_per_token: int = 0
    num_params: int = 0
    prefill_tokens_per_s: int = 0   # one prefill step's prompt tokens a second, timed at its start; 0: not timed
    kv_tokens: int = 0        # KV pool capacity in tokens; 0: unknown
    block_size: int = 16      # KV block size: a new sequence takes whole blocks
    is_caching: bool = False  # its pool keeps a prefix cache (a prompt prefills only what it misses)
    held_bytes: int = 0       # device memory it holds (weights, KV pool, graphs): not pressure
    last_seen: float = 0.0
    joined_at: float = 0.0
    alive: bool = True
    draining: bool = False
    free_vram_fraction: float | None = None  # as the monitor last reported; None: no report
    may_prefill: bool = True        # free memory above the admission watermark
    is_memory_short: bool = False   # free memory below the migration watermark
    owned: set[int] = field(default_factory=set)
    num_leased: int = 0
    num_arriving: int = 0   # sequences leased to it whose KV it does not hold yet (new to it)
    free_kv_tokens: int | None = None  # as it reported with its last request for work
    kv_released: int = 0    # KV tokens of sequences moved away that its last report did not free yet
    kv_delivered: int = 0   # of those, what its last lease told it to free (its next report has freed)
    pending_drops: list[int] = field(default_factory=list)
    lease_ids: dict[int, None] = field(default_factory=dict)  # its open leases, oldest first
    moving_since: float | None = None  # when its sequences were told to leave (drain, memory, death)
    link_free_at: float = 0.0     # when the KV shipments it was told to start should have left its link
    recompute_free_at: float = 0.0  # when the moved sequences it was given to recompute should be prefilled

    @property
    def capacity(self) -> int:
        return self.max_seqs * self.inflight

    @property
    def load(self) -> int:
        """Sequences it holds or is taking on."""
        return len(self.owned) + self.num_arriving


@dataclass(slots=True)
class Row:
    seq_id: int
    length: int               # tokens in the sequence once this step's input is in
    last_token: int
    spec: SeqSpec | None      # set when the worker needs the full form


@dataclass(slots=True)
class Grant:
    """A lease handed to `worker`, plus KV shipments the owners must start."""

    lease_id: int
    worker: str
    rows: list[Row]
    drop_ids: list[int]
    # (owner, seq_id, dest, transfer_id, num_tokens, start): the KV of positions [start, num_tokens)
    # (owner, seq_id, dest endpoint, transfer_id, num_tokens, start, block keys: a prefix pull)
    shipments: list[tuple[str, int, str, int, int, int, list[int]]]
    num_steps: int = 1


@dataclass(slots=True)
class Pull:
    """A new sequence's prefix, shipped from `kv_from` to `worker` under `transfer_id`: the
    sequence waits in the queue, leased to nobody, until that worker says the KV arrived (then
    it is leased there, the KV imported as its lease starts) or until `deadline` (then it is
    prefilled wherever it goes)."""
    worker: str
    kv_from: str
    transfer_id: int
    deadline: float
    arrived: bool = False


@dataclass(slots=True)
class LeaseRecord:
    worker: str
    seq_ids: list[int]
    deadline: float
    num_steps: int = 1
    is_revoked: bool = False  # a Revoke went out: it ends at the worker's next step boundary
    revoked_at: float | None = None  # when, if load balancing revoked it (for the move delay)
    num_arriving: int = 0  # rows new to the worker (counted in its num_arriving while open)


@dataclass(slots=True)
class Outcome:
    accepted: bool
    finished: list[tuple[int, Finish]] = field(default_factory=list)


def transfer_seconds(num_tokens: int, kv_bytes_per_token: int, link_gbps: float) -> float:
    """How long shipping num_tokens of KV takes a link alone: a fixed 1 ms to set it up, then
    the bytes at link_gbps."""
    return 1e-3 + num_tokens * kv_bytes_per_token * 8 / (link_gbps * 1e9)


def recompute_seconds(num_tokens: int, num_params: int, prefill_tflops: float) -> float:
    """How long prefilling num_tokens again takes a GPU alone: 2 FLOPs a parameter a token."""
    return num_tokens * 2 * num_params / (prefill_tflops * 1e12)


def prefill_tflops_of(w: WorkerState, setting: float) -> float:
    """The prefill rate w's recomputes are costed at: what its own prefill measured at its start
    (as FLOP/s of its model), else the `prefill_tflops` setting (a worker that did not time one,
    as a CPU worker does not). Costed at the setting, an 8B model on an H200 pulled prefixes that
    took longer to ship than to prefill (docs/benchmarks.md)."""
    if w.prefill_tokens_per_s > 0 and w.num_params > 0:
        return w.prefill_tokens_per_s * 2 * w.num_params / 1e12
    return setting


def choose_mechanism(num_tokens: int, kv_bytes_per_token: int, num_params: int,
                     link_gbps: float, prefill_tflops: float, *, link_wait_s: float = 0.0,
                     prefill_wait_s: float = 0.0) -> str:
    """KV transfer when shipping the cache ends sooner than recomputing it.

    transfer ≈ link_wait_s + num_tokens · kv_bytes_per_token / link bandwidth
    recompute ≈ prefill_wait_s + num_tokens · 2 · num_params / prefill FLOP rate
    Alone, both grow linearly in length, so the choice is between bytes per token over the
    link and FLOPs per token on the GPU; a fixed 1 ms setup cost for a transfer tips short
    sequences towards recompute. The waits are the work already given to the link (the
    shipments it has started) and to the taker's prefill (the moves it recomputes), so a
    drain that moves many sequences at once splits them between the two instead of queuing
    them all on one link.
    """
    if num_tokens <= 0 or kv_bytes_per_token <= 0 or num_params <= 0:
        return "recompute"
    transfer_s = link_wait_s + transfer_seconds(num_tokens, kv_bytes_per_token, link_gbps)
    recompute_s = prefill_wait_s + recompute_seconds(num_tokens, num_params, prefill_tflops)
    return "transfer" if transfer_s < recompute_s else "recompute"


class Queue:
    """Queued sequences, one ordered map per KV owner (None: held nowhere), so a worker
    finds its own work without walking everyone's. Each map is in the router's order
    (`Seq.queue_pos`, lower first); iterating the whole queue merges them."""

    def __init__(self):
        self.by_owner: dict[str | None, OrderedDict[int, Seq]] = {}
        self._back = itertools.count(1)
        self._front = itertools.count(-1, -1)
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def __contains__(self, seq_id: int) -> bool:
        return any(seq_id in d for d in self.by_owner.values())

    def __iter__(self):
        """Sequence ids in the router's order (not on a hot path)."""
        merged = heapq.merge(*(d.values() for d in self.by_owner.values()), key=_pos)
        return (seq.seq_id for seq in merged)

    def of(self, owner: str | None) -> OrderedDict[int, Seq]:
        return self.by_owner.get(owner) or _EMPTY

    def push(self, seq: Seq, front: bool = False) -> None:
        assert seq.queue_key is _OUT, f"sequence {seq.seq_id} is queued twice"
        d = self.by_owner.get(seq.owner)
        if d is None:
            d = self.by_owner[seq.owner] = OrderedDict()
        d[seq.seq_id] = seq
        if front:
            seq.queue_pos = next(self._front)
            d.move_to_end(seq.seq_id, last=False)
        else:
            seq.queue_pos = next(self._back)
        seq.queue_key = seq.owner
        self.size += 1

    def extend(self, seqs: list[Seq]) -> None:
        """push(seq) for each, at the back: the common case of a step's results, kept cheap."""
        for seq in seqs:
            assert seq.queue_key is _OUT, f"sequence {seq.seq_id} is queued twice"
            d = self.by_owner.get(seq.owner)
            if d is None:
                d = self.by_owner[seq.owner] = OrderedDict()
            d[seq.seq_id] = seq
            seq.queue_pos = next(self._back)
            seq.queue_key = seq.owner
        self.size += len(seqs)

    def pop(self, seq: Seq) -> None:
        if seq.queue_key is _OUT:
            return
        d = self.by_owner[seq.queue_key]
        del d[seq.seq_id]
        if not d:
            del self.by_owner[seq.queue_key]
        seq.queue_key = _OUT
        self.size -= 1

    def rekey(self, seqs) -> None:
        """These queued sequences changed owner: file them under the new one, in order."""
        moved = {}
        for seq in seqs:
            if seq.queue_key is not _OUT and seq.queue_key != seq.owner:
                self.pop(seq)
                moved.setdefault(seq.owner, []).append(seq)
        for owner, group in moved.items():
            d = self.by_owner.setdefault(owner, OrderedDict())
            items = sorted([*d.values(), *group], key=_pos)
            d.clear()
            for seq in items:
                d[seq.seq_id] = seq
            for seq in group:
                seq.queue_key = owner
            self.size += len(group)


_OUT = object()  # Seq.queue_key of a sequence that is not queued
_EMPTY: OrderedDict = OrderedDict()


def _pos(seq: Seq) -> int:
    return seq.queue_pos
