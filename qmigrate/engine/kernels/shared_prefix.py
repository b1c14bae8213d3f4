"""Decode attention that reads a shared prefix once per group of rows (cascade attention).

With the prefix cache on, rows whose prompts begin alike hold the same cached blocks: a
system prompt of 1,024 tokens under 16 questions is 64 blocks that all 16 block tables
point at. Plain decode attention reads those keys once per row. Here a step's decode rows
are grouped by the blocks their tables share from the start; one program per (group, KV
head, split) attends every row of a group to the shared keys at once, and the decode
kernel starts each row's online softmax from those partials and reads only the row's own
keys after them. Exact up to the order of the floating-point sums.

`groups` is host work on the step's block table (numpy, a few array passes); `Shared` is
what the kernels read, device tensors of fixed shapes so a CUDA graph can replay them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from qmigrate.engine.kernels.tiling import next_pow2

MIN_SHARED_KEYS = 64     # a shorter shared prefix is read per row, as before
PREFIX_SPLITS = 4        # programs per (group, KV head) over the shared keys
PREFIX_TILES = (64, 8, 3)   # keys per tile, warps, pipeline stages of the shared-prefix kernel


@dataclass(frozen=True, slots=True)
class Shared:
    """A decode step's groups on the device. row_start [B] int32: keys of row b attended as
    part of its group (0: the row is in none); group_rows [G, R] int32: each group's rows,
    -1 padded; group_len [G] int32: the keys the group shares (0: an unused group slot)."""
    row_start: torch.Tensor
    group_rows: torch.Tensor
    group_len: torch.Tensor


def rows_per_group(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Rows of one group program: as many as fill a tile of (row, query head) pairs."""
    group = num_heads // num_kv_heads
    return max(1, _tile_m(group, head_dim) // group)


def _tile_m(group: int, head_dim: int) -> int:
    return max(next_pow2(group), 128 if head_dim <= 128 else 64)


def groups(block_table: np.ndarray, seq_lens: np.ndarray, block_size: int, max_rows: int,
           min_keys: int = MIN_SHARED_KEYS):
    """(row_start [B], group_rows [G, max_rows], group_len [G]) int32 for a decode step, or
    None where no two rows share min_keys keys.

    Rows sharing their first block form a group sharing the leading blocks that all of them
    hold alike, short of the block each row's newest key is in (never shared: the step writes
    it). A group of more than max_rows rows is cut into groups of max_rows; a row left alone
    shares nothing.
    """
    b = len(seq_lens)
    if b < 2:
        return None
    table = np.asarray(block_table)
    order = np.argsort(table[:, 0], kind="stable")
    t = table[order]
    first = np.flatnonzero(np.r_[True, t[1:, 0] != t[:-1, 0]])           # where each run begins
    size = np.diff(np.r_[first, b])
    if size.max() < 2:
        return None
    leader = np.repeat(first, size)
    same = t == t[leader]
    # leading blocks equal to the run leader's, then capped below each row's newest key
    lead = np.where(same.all(axis=1), same.shape[1], np.argmin(same, axis=1))
    held = (np.asarray(seq_lens)[order].astype(np.int64) - 1) // block_size
    run_len = np.minimum.reduceat(np.minimum(lead, held), first)
    # cut runs into pieces of at most max_rows; each piece keeps its run's shared length
    at = np.arange(b) - leader
    piece_key = leader * (b + 1) + at // max_rows
    start = np.flatnonzero(np.r_[True, piece_key[1:] != piece_key[:-1]])
    count = np.diff(np.r_[start, b])
    keys = np.repeat(run_len, size)[start] * block_size
    keep = (count >= 2) & (keys >= min_keys) & (t[start, 0] != 0)
    if not keep.any():
        return None
    start, count, keys = start[keep], count[keep], keys[keep]
    num = len(start)
    group_rows = np.full((num, max_rows), -1, dtype=np.int32)
    member = np.repeat(np.arange(num), count)
    slot = np.arange(len(member)) - np.repeat(np.cumsum(count) - count, count)
    rows = order[np.repeat(start, count) + slot]
    group_rows[member, slot] = rows
    row_start = np.zeros(b, dtype=np.int32)
    row_start[rows] = np.repeat(keys, count)
    return row_start, group_rows, keys.astype(np.int32)


class StepGroups:
    """`groups` of a runner's decode steps, reused while a step has the rows of the one before
    and their leading blocks unchanged (a run of decode steps, whose rows only grow)."""

    def __init__(self, block_size: int, max_rows: int):
        self.block_size, self.max_rows = block_size, max_rows
        self.seq_ids: list[int] | None = None
        self.result = None
        self.head = np.zeros((0, 0), dtype=np.int32)   # the leading blocks the result was found on

    def __call__(self, seq_ids: list[int], block_table: np.ndarray, seq_lens: np.ndarray):
        if seq_ids == self.seq_ids and self._still_holds(block_table, seq_lens):
            return self.result
        self.result = groups(block_table, seq_lens, self.block_size, self.max_rows)
        self.seq_ids = list(seq_ids)
        width = 0 if self.result is None else int(self.result[2].max()) // self.block_size
        self.head = np.array(block_table[:, :width])
        return self.result

    def _still_holds(self, block_table: np.ndarray, seq_lens: np.ndarray) -> bool:
        width = self.head.shape[1]
        if block_table.shape[1] < width or not np.array_equal(block_table[:, :width], self.head):
            return False
        return self.result is None or bool((seq_lens > self.result[0]).all())


def max_groups(batch: int) -> int:
    """Group slots a step of `batch` rows may need (every group has two rows or more)."""
    return max(1, batch // 2)


_scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def prefix_partials(q, k_cache, v_cache, block_tables, shared: Shared, qk_scale: float, cap_log2: float,
                    softcap: bool, group: int, dot_precision: str):
    """Launch shared_prefix_kernel; returns its partials (out [B, Hq, P, D], lse [B, Hq, P])."""
    from qmigrate.engine.kernels.paged_attention_kernels import shared_prefix_kernel
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    splits, (block_n, warps, stages) = PREFIX_SPLITS, PREFIX_TILES
    key = (q.device, batch, num_heads, head_dim, splits)
    if key not in _scratch:  # allocated once per shape, before any graph captures it
        _scratch[key] = (torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device),
                         torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device))
    out, lse = _scratch[key]
    rows = shared.group_rows.shape[1]
    shared_prefix_kernel[(shared.group_rows.shape[0], num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, shared.group_rows, shared.group_len, out, lse,
        qk_scale, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        shared.group_rows.stride(0), *out.stride()[:3], *lse.stride()[:2], cap_log2,
        GROUP=group, ROWS=rows, BLOCK_M=next_pow2(rows * group), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n if head_dim <= 128 else min(block_n, 32), NUM_SPLITS=splits,
        DOT_PRECISION=dot_precision, SOFTCAP=softcap,
        num_warps=warps if rows * group >= 64 else 4, num_stages=stages if head_dim <= 128 else 2)
    return out, lse


def to_device(host, device) -> Shared:
    """The groups of `groups` as device tensors (eager steps; graphs load theirs in place)."""
    row_start, group_rows, group_len = host
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)
    return Shared(t(row_start), t(group_rows), t(group_len))
