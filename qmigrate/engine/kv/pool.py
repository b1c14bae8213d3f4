"""A worker's KV pool: fixed-size blocks, one block table per cached sequence.

Layout: `kv[layer, 0 or 1]` holds keys or values as [num_blocks, block_size, kv_heads,
head_dim], in the model's dtype or in e4m3 (kv_cache_dtype fp8, a scale of 1.0: engine/fp8.py); position p of a sequence lives in block `blocks[p // block_size]` at offset
`p % block_size`. The pool is allocated once; sequences of any length share it, and
capacity is counted in tokens. Block 0 is never handed out: it stays zero, and padding
entries of block tables point at it, so a gather past a row's end reads zeros, not stale
data that might be NaN.

When a step needs more blocks than are free, whole sequences that are not in the step are
evicted, least recently used first. Their ids are kept in `evicted` until the worker
reports them to the router, which then recomputes them wherever they run next.

With the prefix cache on (`prefix_cache.py`) blocks are shared: a full block whose ids are
known is cached under a key of its prefix, and outlives its sequences until a new block is
needed and it is the least recently used one nobody holds. A sequence never writes a block
that others share or that is cached (`truncate` copies it first). With it off the pool has a
`NoPrefixCache`, which shares nothing: the same code runs either way.

The pool's maps (`blocks`, `length`, `free`, `evicted`) are changed by its own methods only;
others may read them.
"""

from __future__ import annotations

import itertools

from collections import OrderedDict

import numpy as np
import torch

from qmigrate.engine import fp8
from qmigrate.engine.kv.prefix_cache import BasePrefixCache, NoPrefixCache, PrefixCache


def write_kv(k_cache, v_cache, slot_mapping, k, v) -> None:
    """Write k, v [T, Hkv, D] at flat slots block * block_size + offset; no host sync.

    A negative slot marks a padding token: it writes zeros into the null block, which keeps
    it zero (every duplicate write there carries the same zeros, so order does not matter).
    """
    keep = (slot_mapping >= 0)[:, None, None]
    slots = slot_mapping.clamp(min=0).long()
    for cache, new in ((k_cache, k), (v_cache, v)):
        flat = bits(cache).view(-1, cache.shape[2], cache.shape[3])
        flat.index_copy_(0, slots, bits(fp8.saturate(torch.where(keep, new, 0), cache.dtype)))


def bits(t: torch.Tensor) -> torch.Tensor:
    """An e4m3 tensor as its bytes (uint8, the same shape), for the copies and gathers that
    torch does not offer for float8; any other tensor as it is."""
    return t.view(torch.uint8) if fp8.is_fp8(t.dtype) else t


def landed(kv, copied):
    """kv once the copy that fills it (a CUDA event, or None: done) has passed."""
    if copied is not None:
        copied.synchronize()
    return kv


class OutOfBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device, prefix_cache: bool = True,
                 can_copy: bool = True):
        """`can_copy` False: the blocks are mirrored elsewhere (the other tensor-parallel ranks
        follow this pool's block tables) and a block is never copied here."""
        if num_blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks, got {num_blocks}")
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        # Unused slots of a block must never hold NaN bits (a masked score times a NaN value
        # is still NaN). A GPU pool is zeroed at once; on the CPU a block is zeroed when it is
        # first handed out, so untouched pages of a large pool cost no memory.
        self.is_lazy = torch.device(device).type == "cpu"
        make = torch.empty if self.is_lazy else torch.zeros
        self.kv = make(shape, dtype=dtype, device=device)
        self.is_clean = np.zeros(num_blocks, dtype=bool)
        self._zero([0])
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.free = list(range(num_blocks - 1, 0, -1))             # unreferenced, not cached
        self.blocks: OrderedDict[int, list[int]] = OrderedDict()   # seq_id -> blocks, LRU order
        self.length: dict[int, int] = {}                            # seq_id -> cached positions
        self.evicted: list[int] = []
        self.prefix: BasePrefixCache = PrefixCache(num_blocks, block_size) if prefix_cache else NoPrefixCache()
        self.can_copy = can_copy
        self.tier = None   # a HostTier: cached blocks this pool evicts, found again by key

    def attach_tier(self, tier) -> None:
        """Blocks the prefix cache evicts are copied to `tier` (host_tier.HostTier) and come
        back from it when a prompt's cached chain continues there."""
        if not self.is_caching or not self.can_copy:
            raise ValueError("a KV tier needs the prefix cache and a pool whose blocks may be copied")
        self.tier = tier
        self.prefix.on_evict = lambda blocks, keys: tier.save(self.kv, blocks, keys)

    @property
    def is_caching(self) -> bool:
        """Blocks are shared by prefix (what the router is told; KV may be shipped onto a prefix)."""
        return self.prefix.is_enabled

    # --- capacity --------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can have now: free ones and cached ones no sequence references."""
        return len(self.free) + self.prefix.num_idle

    @property
    def free_tokens(self) -> int:
        return self.num_free_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- sequences ---------------------------------------------------------------------------
    def cached_len(self, seq_id: int) -> int:
        return self.length.get(seq_id, -1)

    def touch(self, seq_id: int) -> None:
        self.blocks.move_to_end(seq_id)

    def release(self, seq_id: int) -> None:
        blocks = self.blocks.pop(seq_id, None)
        if blocks is not None:
            del self.length[seq_id]
            self._unref(blocks)
            self.prefix.forget(seq_id)

    def _unref(self, blocks: list[int]) -> None:
        """Drop one reference to each block; cached ones stay cached."""
        self.free.extend(self.prefix.unref(blocks))

    def truncate(self, seq_id: int, length: int) -> bool:
        """Keep positions [0, length): the tail past it will be written again. A block the
        tail is cut out of is the sequence's own from here on (copied when others share it);
        False when no block could be had for that copy (the sequence is then released)."""
        length = min(self.length[seq_id], length)
        self.length[seq_id] = length
        blocks = self.blocks[seq_id]
        keep = self.prefix.cut(seq_id, length, len(blocks))
        self._unref(blocks[keep:])
        del blocks[keep:]
        if length % self.block_size and blocks and self.prefix.is_shared(blocks[-1]):
            if not self.num_free_blocks or not self.can_copy:
                self.release(seq_id)
                return False
            old, new = blocks[-1], self._take(1)[0]
            raw = bits(self.kv)
            raw[:, :, new] = raw[:, :, old]
            self._unref([old])
            blocks[-1] = new
        return True

    def make_room(self, num_blocks: int, protect) -> bool:
        """Free blocks until `num_blocks` are free, evicting LRU sequences outside `protect`."""
        if self.num_free_blocks >= num_blocks:
            return True
        for victim in [s for s in self.blocks if s not in protect]:
            self.release(victim)
            self.evicted.append(victim)
            if self.num_free_blocks >= num_blocks:
                return True
        return False

    def grow(self, seq_id: int, num_tokens: int) -> None:
        """Give seq_id blocks for `num_tokens` positions; the caller made room first."""
        blocks = self.blocks.setdefault(seq_id, [])
        self.length.setdefault(seq_id, 0)
        need = self.blocks_for(num_tokens) - len(blocks)
        if need > self.num_free_blocks:
            raise OutOfBlocks(f"sequence {seq_id} needs {need} more KV blocks, {self.num_free_blocks} are free")
        if need > 0:
            blocks += self._take(need)

    def _take(self, n: int) -> list[int]:
        """n unreferenced blocks, free ones first, then cached ones least recently used first."""
        new = [self.free.pop() for _ in range(min(n, len(self.free)))]
        if len(new) < n:
            new += self.prefix.evict(n - len(new))
        self.prefix.ref(new)
        if self.is_lazy:
            self._zero([b for b in new if not self.is_clean[b]])
        return new

    def _zero(self, blocks: list[int]) -> None:
        if blocks:
            bits(self.kv)[:, :, torch.as_tensor(blocks)] = 0
            self.is_clean[blocks] = True

    def clean(self, blocks) -> None:
        """A lazy pool: zero those of these blocks (any ids, repeats too) never zeroed yet. For
        a pool that mirrors another's block tables (a tensor-parallel follower), where blocks
        are handed out by the other pool."""
        if self.is_lazy:
            blocks = np.unique(np.asarray(blocks, dtype=np.int64))
            self._zero(blocks[~self.is_clean[blocks]].tolist())

    def mark_written(self, seq_ids, seq_lens, rows=None) -> None:
        """A step just queued writes the KV of seq_ids up to seq_lens (the sequences hold
        their blocks already). `rows` (seq_id, start, new_ids) say which ids the step writes;
        without them, every row of the step decodes a token not known here yet."""
        self.length.update(zip(seq_ids, seq_lens.tolist() if isinstance(seq_lens, np.ndarray) else seq_lens))
        if rows is None:
            self.prefix.note_decoded(seq_ids, seq_lens, self.blocks, self.length)
        else:
            self.prefix.note_rows(rows, self.blocks, self.length)

    def take_evicted(self) -> list[int]:
        out, self.evicted = self.evicted, []
        return out

    # --- the prefix cache ----------------------------------------------------------------------
    def admit(self, seq_id: int, ids, salt: str = "") -> int:
        """Start seq_id (a prompt of `ids`) on the longest cached prefix of it, leaving at
        least its last token to compute; the number of positions it starts with."""
        self.release(seq_id)
        most = (len(ids) - 1) // self.block_size
        blocks = self.prefix.match(seq_id, ids, salt, max_blocks=most)
        self.blocks[seq_id] = blocks
        if self.tier is not None and len(blocks) < most:
            blocks += self._from_tier(seq_id, ids, most)
        self.length[seq_id] = n = len(blocks) * self.block_size
        return n

    def _from_tier(self, seq_id: int, ids, most: int) -> list[int]:
        """The blocks of seq_id's next keys that the tier holds, copied into blocks of this
        pool that are free or idle (no sequence is evicted for them) and cached here again."""
        tier, keys = self.tier, []
        room = self.num_free_blocks
        for key in self.prefix.next_keys(seq_id, ids, most):
            if key not in tier or len(keys) == room:
                break
            keys.append(key)
        if not keys:
            return []
        tier.touch(keys)   # taking blocks may evict idle ones into the tier: these stay
        new = self._take(len(keys))
        kept = next((i for i, k in enumerate(keys) if k not in tier), len(keys))
        if kept < len(keys):
            self._unref(new[kept:])
            new, keys = new[:kept], keys[:kept]
        if new:
            tier.restore(self.kv, new, keys)
            self.prefix.adopt(seq_id, ids, new, keys)
        return new

    def note_sampled(self, seq_ids, seq_lens, tokens, skip=frozenset()) -> None:
        """Tokens sampled for rows of sequences at lengths seq_lens (those of `skip` sampled
        none): each is the id at that position once the next step writes it."""
        self.prefix.note_sampled(seq_ids, seq_lens, tokens, skip, self.blocks, self.length)

    def check(self) -> None:
        """Assert the allocator's invariants (for tests): every block is free, cached and
        idle, or referenced as often as sequences hold it; a referenced cached block's key is
        the key of its sequence's ids."""
        held = np.zeros(self.num_blocks, dtype=np.int64)
        for blocks in self.blocks.values():
            np.add.at(held, np.asarray(blocks, dtype=np.int64), 1)
        assert held[0] == 0 and 0 not in self.free
        assert len(set(self.free)) == len(self.free)
        self.prefix.check(held, self.free, self.blocks, self.length)
        if self.tier is not None:
            self.tier.check()

    # --- addressing ----------------------------------------------------------------------------
    def slot(self, seq_id: int, pos: int) -> int:
        """Flat slot (block * block_size + offset) of one position."""
        return self.blocks[seq_id][pos // self.block_size] * self.block_size + pos % self.block_size

    def slots(self, seq_id: int, start: int, stop: int) -> np.ndarray:
        """Flat slot (block * block_size + offset) of positions [start, stop)."""
        blocks = np.asarray(self.blocks[seq_id], dtype=np.int64)
        pos = np.arange(start, stop)
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def block_table(self, seq_ids, width: int) -> np.ndarray:
        """[len(seq_ids), width] int32; entries past a sequence's blocks point at block 0."""
        table = np.zeros((len(seq_ids), width), dtype=np.int32)
        # a sequence may hold blocks past its length (it was cut back): only `width` count
        lists = [self.blocks[sid][:width] for sid in seq_ids]
        counts = np.fromiter((len(b) for b in lists), dtype=np.int64, count=len(lists))
        flat = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int32, count=int(counts.sum()))
        table[np.arange(width) < counts[:, None]] = flat   # row-major, as `flat` runs
        return table

    # --- shipping ----------------------------------------------------------------------------
    def export(self, seq_id: int, num_tokens: int | None = None, start: int = 0) -> torch.Tensor:
        """[num_layers, 2, n, kv_heads, head_dim] of positions [start, num_tokens) on the CPU,
        contiguous, for shipping."""
        return landed(*self.export_started(seq_id, num_tokens, start))

    def export_started(self, seq_id: int, num_tokens: int | None = None, start: int = 0) -> tuple[torch.Tensor, object]:
        """The same, without waiting: on a GPU the copy to (pinned) host memory is queued
        behind the steps already launched, and the tensor holds the KV once the returned CUDA
        event has passed (None: it holds it now). The blocks may be freed at once: any step
        that writes them again is queued after the copy."""
        n = self.length[seq_id] if num_tokens is None else num_tokens
        if not 0 <= start < n <= self.length[seq_id]:
            raise ValueError(f"sequence {seq_id}: cannot export [{start}, {n}) of {self.length[seq_id]} positions")
        slots = torch.from_numpy(self.slots(seq_id, start, n))
        flat = bits(self.kv).view(self.num_layers, 2, -1, self.num_kv_heads, self.head_dim)
        if not self.kv.is_cuda:
            return flat.index_select(2, slots).contiguous().view(self.dtype), None
        gathered = flat.index_select(2, slots.pin_memory().to(self.device, non_blocking=True))
        host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
        host.copy_(gathered, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return host.view(self.dtype), copied

    def load(self, seq_id: int, kv: torch.Tensor, protect, start: int = 0) -> bool:
        """Place shipped KV of positions [start, start + n) in free blocks; False when there
        is no room for it. With start > 0 the sequence holds [0, start) here already (from
        the cache). Shipped KV is the sender's word alone: its blocks, and every block the
        sequence computes on top of them, stay the sequence's own and never join the cache
        under a content key, where another request's prompt could hit them."""
        n = kv.shape[2]
        if start:
            if self.cached_len(seq_id) < start:
                raise ValueError(f"sequence {seq_id}: KV shipped from {start} but {self.cached_len(seq_id)} held")
            self.truncate(seq_id, start)
        else:
            self.release(seq_id)
        if not self.make_room(self.blocks_for(start + n) - len(self.blocks.get(seq_id, ())), protect | {seq_id}):
            self.release(seq_id)
            return False
        self.grow(seq_id, start + n)
        # Through pinned memory and without waiting: a copy from pageable memory waits for the
        # step in flight, and the worker could not queue the next one meanwhile.
        # KV of another dtype (a sender with another kv_cache_dtype) is converted here
        slots, kv = torch.from_numpy(self.slots(seq_id, start, start + n)), bits(fp8.saturate(kv, self.dtype))
        if self.kv.is_cuda:
            slots, kv = slots.pin_memory(), kv.pin_memory()
        flat = bits(self.kv).view(self.num_layers, 2, -1, self.num_kv_heads, self.head_dim)
        flat.index_copy_(2, slots.to(self.device, non_blocking=True), kv.to(self.device, non_blocking=True))
        self.length[seq_id] = start + n
        self.prefix.note_loaded(seq_id)   # never cached (its first `start` positions stay so)
        return True
