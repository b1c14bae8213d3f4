"""The prefix cache of a worker's KV pool: which full blocks hold which prefix.

A full block whose token ids are known is keyed by `prefix_keys.block_key` (its parent's
key and its ids; the first block's parent is the sequence's salt seed). Blocks carry
reference counts, one per sequence that holds them. A cached block that no sequence
references is `idle`: it keeps its KV and its key until the pool needs the block, least
recently used first. A new sequence starts on the longest chain of cached blocks that
matches its prompt.

Every block a key is given to or taken from is recorded in `events` (the key, or ~key when
evicted), in order, for the router's prefix index.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from qmigrate.wire.prefix_keys import block_keys, iter_block_keys, seed_key

MAX_EVENTS = 1 << 16   # events kept while no one takes them (the oldest are dropped)


class PrefixCache:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.refs = np.zeros(num_blocks, dtype=np.int32)
        self.key_of: dict[int, int] = {}                   # block -> key
        self.by_key: dict[int, int] = {}                   # key -> block
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self.ids: dict[int, list[int] | None] = {}         # seq_id -> ids at its positions (None: unknown)
        self.keys: dict[int, list[int]] = {}               # seq_id -> keys of its first blocks
        self.seeds: dict[int, int] = {}                    # seq_id -> parent key of its first block
        self.events: list[int] = []
        self.num_prompt_tokens = 0                         # prompts admitted, and the part found cached
        self.num_cached_tokens = 0

    # --- references --------------------------------------------------------------------------
    def ref(self, blocks) -> None:
        for b in blocks:
            if self.refs[b] == 0 and b in self.idle:
                del self.idle[b]
            self.refs[b] += 1

    def unref(self, block: int) -> bool:
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
        out = []
        for _ in range(n):
            b, _ = self.idle.popitem(last=False)
            key = self.key_of.pop(b)
            del self.by_key[key]
            self._event(~key)
            out.append(b)
        return out

    # --- sequences ---------------------------------------------------------------------------
    def match(self, seq_id: int, ids, salt: str, max_blocks: int) -> list[int]:
        """The cached blocks of the longest prefix of `ids` (at most max_blocks), referenced
        for seq_id, which starts on them."""
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
        return blocks

    def count_admission(self, num_prompt: int, num_cached: int) -> None:
        self.num_prompt_tokens += num_prompt
        self.num_cached_tokens += num_cached

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

    def cut(self, seq_id: int, length: int) -> None:
        ids = self.ids.get(seq_id)
        if ids is not None:
            del ids[length:]
        keys = self.keys.get(seq_id)
        if keys is not None:
            del keys[length // self.block_size:]

    def forget(self, seq_id: int) -> None:
        self.ids.pop(seq_id, None)
        self.keys.pop(seq_id, None)
        self.seeds.pop(seq_id, None)

    # --- reports -----------------------------------------------------------------------------
    def _event(self, key: int) -> None:
        self.events.append(key)
        if len(self.events) > 2 * MAX_EVENTS:
            del self.events[:-MAX_EVENTS]

    def take_events(self) -> list[int]:
        """Keys cached (as is) and evicted (as ~key, negative) since the last call, in order."""
        out, self.events = self.events, []
        return out

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
