"""The prefix cache of a worker's KV pool: which full blocks hold which prefix.

A full block whose token ids are known is keyed by `prefix_keys.block_key` (its parent's
key and its ids; the first block's parent is the sequence's salt seed). Blocks carry
reference counts, one per sequence that holds them. A cached block that no sequence
references is `idle`: it keeps its KV and its key until the pool needs the block, least
recently used first. A new sequence starts on the longest chain of cached blocks that
matches its prompt.

Every block a key is given to or taken from is recorded in `events` (the key, or ~key when
evicted), in order, for the router's prefix index.

The pool talks to its cache through `BasePrefixCache` only. `NoPrefixCache` is the form for a
pool that shares nothing (`enable_prefix_caching: false`): it matches nothing, keys nothing and frees
every block as soon as its sequence lets go of it, so the pool has one code path either way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable, Mapping

import numpy as np

from qmigrate.wire.prefix_keys import block_keys, iter_block_keys, seed_key

MAX_EVENTS = 1 << 16   # events kept while no one takes them (the oldest are dropped)


class EventLog:
    """Keys a cache reports to the router (a key added, ~key dropped), bounded while no one
    takes them: past twice MAX_EVENTS only the newest MAX_EVENTS are kept."""

    def __init__(self) -> None:
        self.keys: list[int] = []

    def add(self, key: int) -> None:
        self.keys.append(key)
        if len(self.keys) > 2 * MAX_EVENTS:
            del self.keys[:-MAX_EVENTS]

    def take(self) -> list[int]:
        out, self.keys = self.keys, []
        return out


class BasePrefixCache(ABC):
    """What the pool asks of a prefix cache. `blocks` and `length` are the pool's own maps
    (seq_id -> its blocks, seq_id -> positions written), read here, never changed."""

    is_enabled: bool   # blocks are shared by prefix (the router is told; KV may be shipped onto a prefix)

    # --- blocks ------------------------------------------------------------------------------
    @property
    @abstractmethod
    def num_idle(self) -> int:
        """Blocks that keep cached KV but that no sequence holds (a new block may take one)."""

    @abstractmethod
    def ref(self, blocks: list[int]) -> None:
        """A sequence takes these blocks."""

    @abstractmethod
    def unref(self, blocks: list[int]) -> list[int]:
        """A sequence lets go of these blocks (in order); those now free to reuse, last block
        first (a block is of no use without its parents)."""

    @abstractmethod
    def is_shared(self, block: int) -> bool:
        """Others hold the block, or its KV is cached: it must not be written."""

    @abstractmethod
    def evict(self, n: int) -> list[int]:
        """n idle blocks, least recently used first, their keys dropped."""

    # --- sequences -----------------------------------------------------------------------------
    @abstractmethod
    def match(self, seq_id: int, ids, salt: str, max_blocks: int) -> list[int]:
        """The cached blocks of the longest prefix of `ids` (at most max_blocks), referenced
        for seq_id, which starts on them; the prompt's tokens and those found are counted."""

    @abstractmethod
    def note_rows(self, rows: Iterable, blocks: Mapping, length: Mapping) -> None:
        """Rows (seq_id, start, new_ids) of a step just queued: their positions hold these ids
        (no new_ids: a token fed on the device, not known here yet); cache every full block
        of theirs whose ids are known."""

    @abstractmethod
    def note_decoded(self, seq_ids, seq_lens, blocks: Mapping, length: Mapping) -> None:
        """A step of decode rows only, every input token not known here yet: cache the blocks
        those tokens fill whose ids are known."""

    @abstractmethod
    def note_sampled(self, seq_ids, seq_lens, tokens, skip, blocks: Mapping, length: Mapping) -> None:
        """Tokens sampled for rows of sequences at lengths seq_lens (sequences in `skip`
        sampled none): each is the id at that position once the next step writes it."""

    @abstractmethod
    def note_loaded(self, seq_id: int) -> None:
        """Shipped KV was placed for seq_id: the sender's word alone, so neither it nor any
        block the sequence computes on top of it is ever cached under a content key."""

    @abstractmethod
    def cut(self, seq_id: int, length: int, num_blocks: int) -> int:
        """seq_id, holding num_blocks blocks, keeps positions [0, length): how many of its
        blocks it keeps (the rest the pool lets go of)."""

    @abstractmethod
    def forget(self, seq_id: int) -> None:
        """seq_id was released."""

    # --- reports -------------------------------------------------------------------------------
    @abstractmethod
    def take_events(self) -> list[int]:
        """Keys cached (as is) and evicted (as ~key, negative) since the last call, in order."""

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Prompt tokens admitted and the part of them found cached, and blocks cached now."""

    @abstractmethod
    def check(self, held: np.ndarray, free: list[int], blocks: Mapping, length: Mapping) -> None:
        """Assert the invariants of the blocks (`held`: each block's number of holders)."""


class NoPrefixCache(BasePrefixCache):
    """The null form: no block is shared, cached or matched."""

    is_enabled = False

    @property
    def num_idle(self) -> int:
        return 0

    def ref(self, blocks):
        pass

    def unref(self, blocks):
        return blocks[::-1]

    def is_shared(self, block):
        return False

    def evict(self, n):
        if n > 0:
            raise RuntimeError(f"{n} blocks asked of a pool that caches none")
        return []

    def match(self, seq_id, ids, salt, max_blocks):
        return []

    def note_rows(self, rows, blocks, length):
        pass

    def note_decoded(self, seq_ids, seq_lens, blocks, length):
        pass

    def note_sampled(self, seq_ids, seq_lens, tokens, skip, blocks, length):
        pass

    def note_loaded(self, seq_id):
        pass

    def cut(self, seq_id, length, num_blocks):
        return num_blocks   # its blocks are its own: the tail is written over, not given back

    def forget(self, seq_id):
        pass

    def take_events(self):
        return []

    def stats(self):
        return {"prompt_tokens": 0, "cached_tokens": 0, "cached_blocks": 0}

    def check(self, held, free, blocks, length):
        assert len(free) + int((held > 0).sum()) == len(held) - 1
        assert not (held[free] > 0).any()


class PrefixCache(BasePrefixCache):
    is_enabled = True

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.refs = np.zeros(num_blocks, dtype=np.int32)
        self.key_of: dict[int, int] = {}                   # block -> key
        self.by_key: dict[int, int] = {}                   # key -> block
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self.ids: dict[int, list[int] | None] = {}         # seq_id -> ids at its positions (None: unknown)
        self.keys: dict[int, list[int]] = {}               # seq_id -> keys of its first blocks
        self.seeds: dict[int, int] = {}                    # seq_id -> parent key of its first block
        self.events = EventLog()
        self.num_prompt_tokens = 0                         # prompts admitted, and the part found cached
        self.num_cached_tokens = 0
        self.on_evict = None                               # called with (blocks, keys) evicted, before reuse

    # --- references --------------------------------------------------------------------------
    def ref(self, blocks) -> None:
        for b in blocks:
            if self.refs[b] == 0 and b in self.idle:
                del self.idle[b]
            self.refs[b] += 1

    def unref(self, blocks: list[int]) -> list[int]:
        """Cached blocks no one holds any more stay cached, idle: the last block first in the
        eviction order, since a block is of no use without its parents."""
        return [b for b in reversed(blocks) if self._unref(b)]

    def _unref(self, block: int) -> bool:
        """Drop one reference; True when the block is free to reuse (no one holds it, no key)."""
        self.refs[block] -= 1
        assert self.refs[block] >= 0, f"block {block} released more often than it was taken"
        if self.refs[block]:
            return False
        if block in self.key_of:
            self.idle[block] = None
            return False
        return True

    def is_shared(self, block: int) -> bool:
        """Other sequences hold it, or its KV is cached under a key: it must not be written."""
        return self.refs[block] > 1 or block in self.key_of

    def evict(self, n: int) -> list[int]:
        """n idle blocks, least recently used first, their keys dropped."""
        if n > len(self.idle):
            raise RuntimeError(f"{n} blocks asked of {len(self.idle)} idle cached blocks")
        out, keys = [], []
        for _ in range(n):
            b, _ = self.idle.popitem(last=False)
            key = self.key_of.pop(b)
            del self.by_key[key]
            self._event(~key)
            out.append(b)
            keys.append(key)
        if self.on_evict is not None and out:
            self.on_evict(out, keys)
        return out

    # --- sequences ---------------------------------------------------------------------------
    @property
    def num_idle(self) -> int:
        return len(self.idle)

    def match(self, seq_id: int, ids, salt: str, max_blocks: int) -> list[int]:
        by_key = self.by_key
        seed = self.seeds[seq_id] = seed_key(salt)
        blocks, keys = [], []
        for key in iter_block_keys(ids, self.block_size, max_blocks=max_blocks, parent=seed):
            block = by_key.get(key)
            if block is None:
                break
            blocks.append(block)
            keys.append(key)
        self.ref(blocks)
        self.keys[seq_id] = keys
        self.ids[seq_id] = _ints(ids[:len(blocks) * self.block_size])
        self.num_prompt_tokens += len(ids)
        self.num_cached_tokens += len(blocks) * self.block_size
        return blocks

    def next_keys(self, seq_id: int, ids, max_blocks: int):
        """The keys of seq_id's blocks past those it matched, up to max_blocks in all."""
        keys = self.keys[seq_id]
        bs, done = self.block_size, len(keys)
        parent = keys[-1] if keys else self.seeds[seq_id]
        return iter_block_keys(ids[done * bs:], bs, max_blocks=max_blocks - done, parent=parent)

    def adopt(self, seq_id: int, ids, blocks: list[int], keys: list[int]) -> None:
        """seq_id, just matched, goes on onto `blocks` (referenced already), whose KV of the
        next `keys` was copied in from another tier: they are cached under those keys."""
        mine = self.keys[seq_id]
        for block, key in zip(blocks, keys):
            if key not in self.by_key:
                self.key_of[block] = key
                self.by_key[key] = block
                self._event(key)
            mine.append(key)
        self.ids[seq_id] = _ints(ids[:len(mine) * self.block_size])
        self.num_cached_tokens += len(blocks) * self.block_size

    def note_rows(self, rows: Iterable, blocks: Mapping, length: Mapping) -> None:
        for r in rows:
            if r.new_ids:
                self.note_ids(r.seq_id, r.start, r.new_ids)
            self._commit(r.seq_id, blocks, length)

    def note_decoded(self, seq_ids, seq_lens, blocks: Mapping, length: Mapping) -> None:
        for k in np.flatnonzero(np.asarray(seq_lens) % self.block_size == 0).tolist():
            self._commit(seq_ids[k], blocks, length)

    def note_sampled(self, seq_ids, seq_lens, tokens, skip, blocks: Mapping, length: Mapping) -> None:
        seq_lens = seq_lens.tolist() if isinstance(seq_lens, np.ndarray) else seq_lens
        if skip:
            keep = [k for k, s in enumerate(seq_ids) if s not in skip]
            seq_ids, seq_lens, tokens = ([a[k] for k in keep] for a in (seq_ids, seq_lens, tokens))
        bs, known = self.block_size, self.ids
        for sid, n, token in zip(seq_ids, seq_lens, tokens):
            ids = known.get(sid)
            if ids is not None and len(ids) == n:
                ids.append(token)
                if (n + 1) % bs == 0 and length.get(sid, 0) > n:
                    self._commit(sid, blocks, length)

    def note_loaded(self, seq_id: int) -> None:
        self.ids[seq_id] = None

    def _commit(self, seq_id: int, blocks: Mapping, length: Mapping) -> None:
        if seq_id in blocks:
            self.commit(seq_id, blocks[seq_id], length[seq_id])

    def note_ids(self, seq_id: int, start: int, new_ids) -> None:
        ids = self.ids.get(seq_id)
        if start == 0 and seq_id in self.seeds:
            self.ids[seq_id] = _ints(new_ids)
        elif ids is not None and len(ids) >= start:
            del ids[start:]
            ids.extend(_ints(new_ids))
        else:
            self.ids[seq_id] = None   # KV of unknown ids (shipped here): never cached

    def commit(self, seq_id: int, blocks: list[int], length: int) -> None:
        """Cache every full block of seq_id whose ids are known and whose KV is written."""
        ids = self.ids.get(seq_id)
        if ids is None:
            return
        bs = self.block_size
        keys = self.keys.setdefault(seq_id, [])
        num_full = min(length, len(ids)) // bs
        if num_full <= len(keys):
            return
        parent = keys[-1] if keys else self.seeds[seq_id]
        done = len(keys)   # hash only the blocks not keyed yet: a decode step fills one block of a row
        for b, key in enumerate(block_keys(ids[done * bs:num_full * bs], bs, parent=parent), start=done):
            block = blocks[b]
            if block not in self.key_of and key not in self.by_key:
                self.key_of[block] = key
                self.by_key[key] = block
                self._event(key)
            keys.append(key)

    def cut(self, seq_id: int, length: int, num_blocks: int) -> int:
        """Blocks past `length` may be shared or cached: the sequence gives them all back."""
        ids = self.ids.get(seq_id)
        if ids is not None:
            del ids[length:]
        keys = self.keys.get(seq_id)
        if keys is not None:
            del keys[length // self.block_size:]
        return min(num_blocks, -(-length // self.block_size))

    def forget(self, seq_id: int) -> None:
        self.ids.pop(seq_id, None)
        self.keys.pop(seq_id, None)
        self.seeds.pop(seq_id, None)

    # --- reports -----------------------------------------------------------------------------
    def _event(self, key: int) -> None:
        self.events.add(key)

    def take_events(self) -> list[int]:
        return self.events.take()

    def stats(self) -> dict[str, int]:
        return {"prompt_tokens": self.num_prompt_tokens, "cached_tokens": self.num_cached_tokens,
                "cached_blocks": self.num_cached_blocks}

    @property
    def num_cached_blocks(self) -> int:
        return len(self.key_of)

    # --- invariants (tests) ------------------------------------------------------------------
    def check(self, held: np.ndarray, free: list[int], blocks: dict, length: dict) -> None:
        assert (self.refs == held).all(), "a block's reference count is not the number of its holders"
        idle = set(self.idle)
        assert all(held[b] == 0 and b in self.key_of for b in idle)
        assert not (set(free) & set(self.key_of)) and not (held[free] > 0).any()
        assert len(free) + len(idle) + int((held > 0).sum()) == len(held) - 1
        assert len(self.by_key) == len(self.key_of)
        assert all(self.by_key[k] == b for b, k in self.key_of.items())
        bs = self.block_size
        for sid, keys in self.keys.items():
            ids = self.ids.get(sid)
            assert len(keys) * bs <= length[sid]
            if ids is None:
                continue
            assert keys == block_keys(ids, bs, max_blocks=len(keys), parent=self.seeds[sid])
            for b, key in zip(blocks[sid], keys):
                assert self.key_of.get(b, key) == key, "a cached block's key is not its ids' key"


def _ints(ids) -> list[int]:
    """A list of its own of token ids, which are Python ints: an array is converted, a step
    row's ids (which the engine keeps as ints) copied."""
    return ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
