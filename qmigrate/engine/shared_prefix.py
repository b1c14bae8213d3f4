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

from .tiling import next_pow2

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
    """Launch _shared_prefix_kernel; returns its partials (out [B, Hq, P, D], lse [B, Hq, P])."""
    from .paged_attention_kernels import _shared_prefix_kernel
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    splits, (block_n, warps, stages) = PREFIX_SPLITS, PREFIX_TILES
    key = (q.device, batch, num_heads, head_dim, splits)
    if key not in _scratch:  # allocated once per shape, before any graph captures it
        _scratch[key] = (torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device),
                         torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device))
    out, lse = _scratch[key]
    rows = shared.group_rows.shape[1]
    _shared_prefix_kernel[(shared.group_rows.shape[0], num_kv_heads, splits)](
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


def _bench() -> None:
    """Decode attention over rows in groups that share a prefix, read once per group against
    once per row, for each choice of PREFIX_CHOICES (the one in use first): TinyLlama's
    attention shape (Hq 32, Hkv 4, D 64), bf16, 16-token blocks. The plain kernel's reads of a
    shared prefix mostly hit the L2 cache, so the saving is less than the bytes suggest."""
    import random
    from triton.testing import do_bench
    from . import paged_attention as pa
    global PREFIX_SPLITS, PREFIX_TILES
    assert torch.cuda.is_available(), "timing needs a CUDA GPU"
    heads, kv_heads, head_dim, bs, scale = 32, 4, 64, 16, 0.125
    in_use = (PREFIX_SPLITS, PREFIX_TILES)
    choices = [in_use] + [c for c in PREFIX_CHOICES if c != in_use]
    print(f"{torch.cuda.get_device_name()}, Hq {heads}, Hkv {kv_heads}, D {head_dim}, bf16, block {bs}; us per layer "
          f"once a row, then once a group for (splits, keys per tile, warps, stages), the one in use first")
    print(f"{'rows':>5} {'groups':>6} {'shared':>6} {'own':>4} {'host us':>7} {'once a row':>10} "
          + " ".join(f"{'%d/%d/%d/%d' % (c[0], *c[1]):>10}" for c in choices))
    cases = ((64, 4, 1024), (128, 8, 1024), (256, 16, 1024), (256, 64, 1024), (256, 16, 256), (512, 32, 1024),
             (512, 128, 1024))
    for rows, num_groups, shared_len in cases:
        rng = random.Random(rows + num_groups)
        own = [rng.randrange(1, 384) for _ in range(rows)]
        shared_blocks = shared_len // bs
        blocks = num_groups * shared_blocks + sum(-(-n // bs) for n in own)
        ids = list(range(1, blocks + 1))
        rng.shuffle(ids)
        prefixes = [[ids.pop() for _ in range(shared_blocks)] for _ in range(num_groups)]
        tables = [prefixes[r % num_groups] + [ids.pop() for _ in range(-(-own[r] // bs))] for r in range(rows)]
        table = np.zeros((rows, max(map(len, tables))), dtype=np.int32)
        for r, t in enumerate(tables):
            table[r, :len(t)] = t
        lens = np.array([shared_len + n for n in own], dtype=np.int32)
        k = torch.randn(blocks + 1, bs, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        q = torch.randn(rows, heads, head_dim, dtype=torch.bfloat16, device="cuda")
        dt, dl = torch.from_numpy(table).cuda(), torch.from_numpy(lens).cuda()
        host = groups(table, lens, bs, rows_per_group(heads, kv_heads, head_dim))
        shared = to_device(host, "cuda")
        expected = pa.paged_attention_reference(q, k, v, torch.arange(rows + 1, dtype=torch.int32, device="cuda"),
                                                dl, dt, scale)
        out = torch.empty_like(q)
        host_us = do_bench(lambda: groups(table, lens, bs, rows_per_group(heads, kv_heads, head_dim)),
                           return_mode="median") * 1e3
        plain = do_bench(lambda: pa.decode_attention(q, k, v, dl, dt, scale, out=out), return_mode="median")
        times = []
        for splits, tiles in choices:
            PREFIX_SPLITS, PREFIX_TILES = splits, tiles
            pa.decode_attention(q, k, v, dl, dt, scale, out=out, shared=shared)
            torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
            times.append(do_bench(lambda: pa.decode_attention(q, k, v, dl, dt, scale, out=out, shared=shared),
                                  return_mode="median"))
        PREFIX_SPLITS, PREFIX_TILES = in_use
        print(f"{rows:>5} {num_groups:>6} {shared_len:>6} {int(np.mean(own)):>4} {host_us:7.1f} {plain * 1e3:10.1f} "
              + " ".join(f"{t * 1e3:10.1f}" for t in times))


PREFIX_CHOICES = ((4, (64, 8, 3)), (8, (64, 8, 3)), (16, (64, 8, 3)), (8, (64, 4, 3)), (8, (32, 4, 3)),
                  (16, (32, 4, 2)), (8, (128, 8, 3)), (2, (64, 8, 3)))


if __name__ == "__main__":
    _bench()
