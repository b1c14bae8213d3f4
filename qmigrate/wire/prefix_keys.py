"""Keys of full KV blocks, the same on every worker and at the router.

A block's key is a hash of its parent block's key and its own token ids, so one key names a
whole prefix: two sequences share a block's KV exactly when they share every token up to
its end (and the salt). A per-request `cache_salt` starts the chain from a different seed,
so tenants that must not share KV never do. Keys are 63-bit non-negative integers (they
travel in msgpack and in int64 arrays).
"""

from __future__ import annotations

import hashlib

import numpy as np

MASK = (1 << 63) - 1


def seed_key(salt: str = "") -> int:
    """The parent key of a sequence's first block."""
    if not salt:
        return 0
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8, person=b"qm-salt").digest(), "little") & MASK


def block_key(parent: int, block_ids) -> int:
    """The key of one full block whose token ids are `block_ids`, after the block `parent`."""
    data = parent.to_bytes(8, "little") + np.asarray(block_ids, dtype="<i4").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & MASK


def block_keys(ids, block_size: int, salt: str = "", max_blocks: int | None = None,
               parent: int | None = None, first: int = 0) -> list[int]:
    """Keys of the full blocks of `ids` (at most max_blocks), from block `first` on, whose
    parent is `parent` (the seed of `salt` when None)."""
    ids = np.asarray(ids, dtype="<i4")
    n = len(ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    key = seed_key(salt) if parent is None else parent
    keys = []
    for b in range(first, n):
        key = block_key(key, ids[b * block_size:(b + 1) * block_size])
        keys.append(key)
    return keys
