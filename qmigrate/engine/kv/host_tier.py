"""A worker's host-memory KV tier: cached blocks the GPU pool evicts, kept under their keys.

When the pool's prefix cache gives up an idle cached block for a new one (`PrefixCache.evict`),
the block's KV is copied here under the same key; a prompt whose cached chain breaks on the
GPU continues in this tier (`BlockPool.admit`), and the blocks found are copied back into new
GPU blocks instead of being prefilled. The tier has its own LRU and a fixed capacity in
blocks; when full, its least recently used block is dropped.

Blocks are raw bytes: the pool is viewed as uint8, so the tier holds blocks of any KV dtype
unchanged. Host memory is allocated in chunks. On the CPU they are added as the tier fills. On
a GPU they are page-locked, which must not fall inside steps (it did, and made a capped
multi-turn run slower with the tier than without) nor hold up a start (on an H200, 30 GiB took
16.8 s to page-lock, doubling the benchmark model's `serve` start): the first chunk is pinned
when the tier is made, and the rest one chunk at a time once the worker has had no lease for
a while (`grow`; worker/loop.py's GROW_TIER_IDLE_S; about 50 ms a chunk there). Until then
the tier holds what its pinned chunks hold.

On a GPU no copy stalls a step: evicted blocks are gathered on the current stream (a device
copy, ordered before any step that writes them again) and copied to host on a stream of the
tier's own, whose event marks the slot as landed; a block copied back waits on that event on
the device, not on the host, and the copy back is queued on the current stream, before the
step that reads it. A slot is reused only behind everything queued on the current stream.

Every key the tier takes or drops is recorded in `events` (key, or ~key when dropped), for the
router's index of which worker holds which block on which tier.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import numpy as np
import torch

from qmigrate.engine.kv.prefix_cache import EventLog

log = logging.getLogger(__name__)

CHUNK_BYTES = 256 << 20     # host memory is allocated in pieces of this size as the tier fills
PINNED_CHUNK_BYTES = 64 << 20   # on a GPU: a piece page-locked between steps while idle


class HostTier:
    def __init__(self, pool_kv: torch.Tensor, capacity_bytes: int, pin: bool | None = None,
                 grows_idle: bool | None = None):
        """`pool_kv`: the pool's [layers, 2, blocks, block_size, heads, head_dim] tensor;
        `pin`: page-locked host memory (default: when the pool is on a GPU); `grows_idle`: chunks
        after the first are added only by `grow` (default: when pinned)."""
        raw = _bytes_view(pool_kv)
        self.block_shape = (raw.shape[0], raw.shape[1], *raw.shape[3:])
        self.block_bytes = int(np.prod(self.block_shape))
        self.capacity = int(capacity_bytes // self.block_bytes)
        if self.capacity < 1:
            raise ValueError(f"kv_offloading_size: {capacity_bytes} bytes hold no KV block of {self.block_bytes}")
        self.on_device = pool_kv.is_cuda
        self.pin = self.on_device if pin is None else pin
        self.grows_idle = self.pin if grows_idle is None else grows_idle
        chunk = PINNED_CHUNK_BYTES if self.grows_idle else CHUNK_BYTES
        self.chunk_blocks = max(1, min(self.capacity, chunk // self.block_bytes))
        self.chunks: list[torch.Tensor] = []
        self.allocated_blocks = 0
        self.slots: OrderedDict[int, int] = OrderedDict()   # key -> slot, least recently used first
        self.free: list[int] = []
        self.landing: dict[int, object] = {}                # slot -> CUDA event of its copy in flight
        self.stream = torch.cuda.Stream(pool_kv.device) if self.on_device else None
        self.events = EventLog()
        self.num_hits = 0          # blocks copied back for a prompt
        self.bytes_in = 0          # copied into this tier
        self.bytes_out = 0         # copied back to the pool
        self.pin_s = 0.0           # seconds spent in `grow` so far
        if self.grows_idle:
            self.grow()

    # --- looking up -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.slots)

    def __contains__(self, key: int) -> bool:
        return key in self.slots

    def touch(self, keys) -> None:
        """These keys are the most recently used (they are about to be copied back)."""
        for key in keys:
            self.slots.move_to_end(key)

    # --- into the tier -------------------------------------------------------------------------
    def save(self, pool_kv: torch.Tensor, blocks: list[int], keys: list[int]) -> None:
        """Copy the pool's `blocks` here under `keys` (blocks the pool is about to reuse); a
        key held already is only touched."""
        new = [(b, k) for b, k in zip(blocks, keys) if k not in self.slots]
        self.touch([k for k in keys if k in self.slots])
        # more than fit: the last ones (the eviction order puts parents later)
        room = self.allocated() if self.grows_idle else self.capacity
        new = new[max(0, len(new) - room):]
        if not new:
            return
        slots = [self._slot() for _ in new]
        raw = _bytes_view(pool_kv)
        index = torch.as_tensor([b for b, _ in new], dtype=torch.long)
        if self.on_device:
            self._poll()
            gathered = raw.index_select(2, _to_device(index, raw.device)).movedim(2, 0).contiguous()
            current = torch.cuda.current_stream(raw.device)
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                for dst, lo, hi in self._runs(slots):
                    dst.copy_(gathered[lo:hi], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            gathered.record_stream(self.stream)
            for s in slots:
                self.landing[s] = event
        else:
            gathered = raw.index_select(2, index).movedim(2, 0)
            for dst, lo, hi in self._runs(slots):
                dst.copy_(gathered[lo:hi])
        for (_, key), s in zip(new, slots):
            self.slots[key] = s
            self._event(key)
        self.bytes_in += len(new) * self.block_bytes

    def _slot(self) -> int:
        """A free slot: on the CPU a new chunk's while the tier is below capacity, else the LRU
        key's (a tier that grows while idle grows only in `grow`)."""
        if not self.free:
            if not self.grows_idle and self.allocated() < self.capacity:
                self._add_chunk()
            else:
                key, slot = self.slots.popitem(last=False)
                self._event(~key)
                return slot
        return self.free.pop()

    def allocated(self) -> int:
        """Blocks of host memory allocated so far."""
        return self.allocated_blocks

    def grow(self) -> bool:
        """Page-lock one more chunk of a tier that grows while idle, below its capacity (called
        while the worker has nothing to run); False when there is nothing to do."""
        if not self.grows_idle or self.allocated() >= self.capacity:
            return False
        started = time.perf_counter()
        self._add_chunk()
        self.pin_s += time.perf_counter() - started
        if self.allocated() >= self.capacity and len(self.chunks) > 1:
            log.info("host KV tier: %d blocks (%.1f GiB) allocated while idle, %.1f s in all", self.capacity,
                     self.capacity * self.block_bytes / 2**30, self.pin_s)
        return True

    def _add_chunk(self) -> None:
        allocated = self.allocated()
        n = min(self.chunk_blocks, self.capacity - allocated)
        # a tensor of its own, not an inference tensor (a step's evictions come under inference
        # mode, a shipment's outside it: both write into the chunk)
        with torch.inference_mode(False):
            chunk = torch.empty((n, *self.block_shape), dtype=torch.uint8, pin_memory=self.pin)
        self.chunks.append(chunk)
        self.allocated_blocks += n
        self.free[:0] = range(allocated + n - 1, allocated - 1, -1)   # lower slots are taken first

    # --- back to the pool ------------------------------------------------------------------------
    def restore(self, pool_kv: torch.Tensor, blocks: list[int], keys: list[int]) -> None:
        """Copy the blocks held under `keys` into the pool's `blocks` (queued before any step
        launched after this call)."""
        slots = [self.slots[k] for k in keys]
        self.touch(keys)
        raw = _bytes_view(pool_kv)
        index = torch.as_tensor(blocks, dtype=torch.long)
        if self.on_device:
            current = torch.cuda.current_stream(raw.device)
            for s in slots:
                if (event := self.landing.get(s)) is not None:
                    current.wait_event(event)
            staged = torch.empty((len(slots), *self.block_shape), dtype=torch.uint8, device=raw.device)
            for src, lo, hi in self._runs(slots):
                staged[lo:hi].copy_(src, non_blocking=True)
            raw.index_copy_(2, _to_device(index, raw.device), staged.movedim(0, 2))
        else:
            staged = torch.cat([src for src, _, _ in self._runs(slots)])
            raw.index_copy_(2, index, staged.movedim(0, 2))
        self.num_hits += len(slots)
        self.bytes_out += len(slots) * self.block_bytes

    def _runs(self, slots: list[int]):
        """(chunk's view, lo, hi): slots[lo:hi] are consecutive slots of one chunk, seen as one
        tensor (one copy each)."""
        lo = 0
        while lo < len(slots):
            chunk, first = divmod(slots[lo], self.chunk_blocks)
            hi = lo + 1
            while (hi < len(slots) and slots[hi] == slots[hi - 1] + 1
                   and slots[hi] // self.chunk_blocks == chunk):
                hi += 1
            yield self.chunks[chunk][first:first + hi - lo], lo, hi
            lo = hi

    def _poll(self) -> None:
        """Forget the events of copies that have landed."""
        done = [s for s, e in self.landing.items() if e.query()]
        for s in done:
            del self.landing[s]

    # --- reports -----------------------------------------------------------------------------
    def _event(self, key: int) -> None:
        self.events.add(key)

    def take_events(self) -> list[int]:
        return self.events.take()

    def stats(self) -> dict[str, int]:
        return {"blocks": len(self.slots), "capacity_blocks": self.capacity, "hits": self.num_hits,
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out}

    def check(self) -> None:
        """Assert the tier's invariants (for tests)."""
        allocated = sum(len(c) for c in self.chunks)
        assert allocated == self.allocated_blocks
        used = list(self.slots.values())
        assert len(set(used)) == len(used), "two keys share a host slot"
        assert not set(used) & set(self.free) and len(set(self.free)) == len(self.free)
        assert len(used) <= self.capacity and all(0 <= s < allocated for s in used + self.free)
        assert len(used) + len(self.free) == min(allocated, self.capacity)

    def read_started(self, key: int) -> torch.Tensor:
        """A block's bytes as held, for a copy queued on the current stream: that stream
        waits (on the device) for the copy that fills the slot."""
        slot = self.slots[key]
        self.slots.move_to_end(key)
        if self.on_device and (event := self.landing.get(slot)) is not None:
            torch.cuda.current_stream().wait_event(event)
        chunk, at = divmod(slot, self.chunk_blocks)
        return self.chunks[chunk][at]

    def read(self, key: int) -> torch.Tensor:
        """A block's bytes as held (for tests): [layers, 2, block_size, heads, head_dim * itemsize]."""
        chunk, at = divmod(self.slots[key], self.chunk_blocks)
        if (event := self.landing.get(self.slots[key])) is not None:
            event.synchronize()
        return self.chunks[chunk][at]


def export_by_keys(pool, keys: list[int]) -> tuple[torch.Tensor | None, object]:
    """The KV of the leading blocks of `keys` that the pool holds cached, on its GPU or in its
    host tier, as [layers, 2, n, heads, head_dim] in host memory (None: not even the first),
    and the CUDA event after which the tensor holds it (None: it does now). For a worker that
    ships a prefix it holds to another (a prefix pull); nothing here changes the pool."""
    by_key = getattr(pool.prefix, "by_key", {})
    tier = pool.tier
    found = []   # (block on the GPU, or None) and key, in order
    for key in keys:
        block = by_key.get(key)
        if block is None and (tier is None or key not in tier):
            break
        found.append((block, key))
    if not found:
        return None, None
    raw = _bytes_view(pool.kv)
    staged = torch.empty((raw.shape[0], raw.shape[1], len(found), *raw.shape[3:]), dtype=torch.uint8,
                         device=raw.device)
    on_gpu = [i for i, (b, _) in enumerate(found) if b is not None]
    if on_gpu:
        index = torch.as_tensor([found[i][0] for i in on_gpu], dtype=torch.long)
        at = torch.as_tensor(on_gpu, dtype=torch.long)
        if raw.is_cuda:
            index, at = _to_device(index, raw.device), _to_device(at, raw.device)
        staged.index_copy_(2, at, raw.index_select(2, index))
    for i, (block, key) in enumerate(found):
        if block is None:
            staged[:, :, i].copy_(tier.read_started(key), non_blocking=True)
    num_tokens = len(found) * pool.block_size
    shape = (raw.shape[0], 2, num_tokens, pool.num_kv_heads, pool.head_dim)
    if not raw.is_cuda:
        return staged.view(pool.kv.dtype).reshape(shape), None
    host = torch.empty(staged.shape, dtype=torch.uint8, pin_memory=True)
    host.copy_(staged, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host.view(pool.kv.dtype).reshape(shape), copied


def tier_stats(pool) -> dict[str, int]:
    """Of a pool: per tier, blocks held and hits, and bytes moved through the host tier (protocol's
    TIER_STATS names); empty without a host tier."""
    tier = pool.tier
    if tier is None:
        return {}
    t, p = tier.stats(), pool.prefix.stats()
    return {"gpu_blocks": p["cached_blocks"], "gpu_hits": p["cached_tokens"] // pool.block_size - t["hits"],
            "host_blocks": t["blocks"], "host_hits": t["hits"], "host_bytes_in": t["bytes_in"],
            "host_bytes_out": t["bytes_out"]}


def _to_device(index: torch.Tensor, device) -> torch.Tensor:
    """Block ids to the device without waiting (a copy from pageable memory would wait for the
    step in flight)."""
    return index.pin_memory().to(device, non_blocking=True)


def _bytes_view(kv: torch.Tensor) -> torch.Tensor:
    """The pool's KV as raw bytes (whatever its dtype): the last dimension in bytes."""
    return kv if kv.dtype == torch.uint8 else kv.view(torch.uint8)


def tier_bytes(setting_gib: float, on_gpu: bool, devices_here: int = 1) -> int:
    """Bytes of host memory for a worker's tier from `kv_offloading_size` (GiB): a positive
    value as is; 0 off; negative (the default) sized from host memory on a GPU, min(available
    RAM / 4 / the GPUs of this host, 64 GiB), and off on the CPU, where the pool itself is host
    memory."""
    if setting_gib > 0:
        return int(setting_gib * 2**30)
    if setting_gib == 0 or not on_gpu:
        return 0
    return int(min(available_ram() / 4 / max(1, devices_here), 64 * 2**30))


def available_ram() -> int:
    """Host memory available to new allocations, in bytes (0 when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
