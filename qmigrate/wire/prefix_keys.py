"""Keys of full KV blocks, the same on every worker and at the router.

A block's key is a hash of its parent block's key and its own token ids, so one key names a
whole prefix: two sequences share a block's KV exactly when they share every token up to
its end (and the salt). A per-request `cache_salt` starts the chain from a different seed,
so tenants that must not share KV never do. Keys are 63-bit non-negative integers (they
travel in msgpack and in int64 arrays).
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

MASK = (1 << 63) - 1
# Keys already computed, by (parent key, block bytes): the blocks of a shared system prompt are
# hashed once, not once per prompt. Emptied when full (at 32,768 blocks, a few MB).
_known: dict[tuple[int, bytes], int] = {}
MAX_KNOWN = 1 << 15


def seed_key(salt: str = "") -> int:
    """The parent key of a sequence's first block."""
    if not salt:
        return 0
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8, person=b"qm-salt").digest(), "little") & MASK


def block_key(parent: int, block_ids) -> int:
    """The key of one full block whose token ids are `block_ids`, after the block `parent`."""
    return next(iter_block_keys(block_ids, len(block_ids), parent=parent))


def iter_block_keys(ids, block_size: int, salt: str = "", max_blocks: int | None = None,
                    parent: int | None = None, first: int = 0):
    """Keys of the full blocks of `ids` (at most max_blocks), from block `first` on, whose
    parent is `parent` (the seed of `salt` when None), one at a time: a lookup that stops at
    its first miss hashes no further.

    The ids are turned into bytes once and each block hashed from a slice of them: a 1,152-token
    prompt is 72 blocks, and the router and every worker key each prompt it sees. `ids` may
    be those bytes already (little-endian int32, as a SeqSpec carries them)."""
    if isinstance(ids, bytes):
        data = ids
    elif isinstance(ids, list):
        data = struct.pack(f"<{len(ids)}i", *ids)   # a list: twice as fast as through numpy
    else:
        data = np.asarray(ids, dtype="<i4").tobytes()
    step = 4 * block_size
    n = len(data) // step
    if max_blocks is not None:
        n = min(n, max_blocks)
    key = seed_key(salt) if parent is None else parent
    blake2b, known = hashlib.blake2b, _known
    for off in range(first * step, n * step, step):
        block = data[off:off + step]
        child = known.get((key, block))
        if child is None:
            child = int.from_bytes(blake2b(key.to_bytes(8, "little") + block, digest_size=8).digest(), "little") & MASK
            if len(known) >= MAX_KNOWN:
                known.clear()
            known[(key, block)] = child
        key = child
        yield key


def block_keys(ids, block_size: int, salt: str = "", max_blocks: int | None = None,
               parent: int | None = None, first: int = 0) -> list[int]:
    """Keys of the full blocks of `ids` (at most max_blocks), from block `first` on, whose
    parent is `parent` (the seed of `salt` when None)."""
    return list(iter_block_keys(ids, block_size, salt, max_blocks, parent, first))
