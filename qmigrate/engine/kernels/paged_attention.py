"""Causal attention over a paged KV cache: a torch reference and Triton kernels.

Cache, one layer: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]; block 0
is an all-zero null block that padding entries of a block table may point at. A batch is
q [T, Hq, D] (rows concatenated; the cache in q's dtype or e4m3), query_start [B+1], seq_lens [B] (keys per row, this step's
included: they are written before attention runs) and block_tables [B, max_blocks].
Row b's i-th query sits at position seq_lens[b] - n_b + i and sees keys 0..that position.

The kernels fold the G = Hq / Hkv query heads that share a KV head into the rows of one
tile, so every K/V tile is read once per (row, KV head), not once per query head.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

try:
    import triton
except ImportError:  # the reference still works without triton
    triton = None

from qmigrate.engine.kernels import shared_prefix
from qmigrate.engine.kernels.tiling import next_pow2
from qmigrate.engine.kv.pool import write_kv  # noqa: F401 -- the write half of a step, re-exported beside attention

LOG2E = 1.4426950408889634
MIN_SPLIT_KEYS = 128   # a decode split shorter than this costs more to merge than it saves
MAX_SPLITS = 16


def paged_attention_reference(q, k_cache, v_cache, query_start, seq_lens, block_tables, scale,
                              window: int = 0, softcap: float = 0.0):
    """Plain torch, one row at a time, softmax in fp32. A row without keys gets zeros.

    window > 0: a query sees only the last `window` positions, its own included.
    softcap > 0: scores become softcap * tanh(scores / softcap) before the mask."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    starts, lens = query_start.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        first, last = starts[b], starts[b + 1]
        num_q = last - first
        if num_q == 0 or seq_len == 0:
            continue
        assert num_q <= seq_len, f"row {b}: {num_q} queries but {seq_len} keys"
        pos = torch.arange(seq_len, device=q.device)
        blocks = block_tables[b].long()[pos // block_size]
        k = _gather(k_cache, blocks, pos % block_size)                     # [L, Hkv, D] fp32
        v = _gather(v_cache, blocks, pos % block_size)
        qb = q[first:last].float().view(num_q, num_kv_heads, group, head_dim)
        scores = torch.einsum("nhgd,lhd->hgnl", qb, k) * scale              # [Hkv, G, n, L]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        qpos = torch.arange(seq_len - num_q, seq_len, device=q.device)
        scores.masked_fill_(pos[None, :] > qpos[:, None], float("-inf"))
        if window:
            scores.masked_fill_(pos[None, :] <= qpos[:, None] - window, float("-inf"))
        o = torch.einsum("hgnl,lhd->nhgd", scores.softmax(-1), v)
        out[first:last] = o.reshape(num_q, num_heads, head_dim).to(q.dtype)
    return out


def _gather(cache, blocks, offsets) -> torch.Tensor:
    """cache[blocks, offsets] in fp32, through its bytes where it is e4m3."""
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8)[blocks, offsets].view(cache.dtype).float()
    return cache[blocks, offsets].float()


def paged_attention(q, k_cache, v_cache, query_start, seq_lens, block_tables, scale,
                    max_query_len: int | None = None, window: int = 0, softcap: float = 0.0):
    """The Triton kernels where they can run (CUDA, or triton's interpreter), else the reference.

    max_query_len == 1 takes the decode kernel; None reads it from query_start (a host sync).
    """
    if not can_use_triton(q):
        return paged_attention_reference(q, k_cache, v_cache, query_start, seq_lens, block_tables, scale,
                                         window, softcap)
    if max_query_len is None:
        max_query_len = int((query_start[1:] - query_start[:-1]).max()) if len(seq_lens) else 0
    if max_query_len == 1 and q.shape[0] == seq_lens.shape[0]:
        return decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale, window=window, softcap=softcap)
    return prefill_attention(q, k_cache, v_cache, query_start, seq_lens, block_tables, scale, max_query_len,
                             window=window, softcap=softcap)


def can_use_triton(q) -> bool:
    if triton is None:
        return False
    return q.is_cuda or is_interpreted()


def supports_head_dim(head_dim: int) -> bool:
    """The kernels' tiles: a power of two from 16 to 256 (other widths take the reference)."""
    return head_dim & (head_dim - 1) == 0 and 16 <= head_dim <= 256


def is_interpreted() -> bool:
    # the interpreter is chosen when triton is first imported, so ask a kernel, not the environment
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(decode_kernel, InterpretedFunction)


def _qk_scale(scale: float, softcap: float) -> float:
    """What the kernels multiply q.k by: the scale in log2 units, or scale / softcap before
    the tanh of soft-capping (whose result the kernels take to log2 units)."""
    return scale / softcap if softcap else scale * LOG2E


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check(q, k_cache, v_cache, block_tables):
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads over {num_kv_heads} KV heads"
    assert head_dim & (head_dim - 1) == 0 and 16 <= head_dim <= 256, f"head_dim {head_dim}"
    assert block_size & (block_size - 1) == 0, f"block_size {block_size}"
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, torch.float8_e4m3fn), \
        "the cache holds q's dtype or e4m3"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert block_tables.stride(1) == 1
    return num_heads // num_kv_heads, num_kv_heads, head_dim, block_size


def _dot_precision(dtype) -> str:
    # fp32 caches would otherwise get tf32 products on the GPU
    return "ieee" if dtype == torch.float32 else "tf32"


# ---------------------------------------------------------------------------------- decode

@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_splits(batch: int, num_kv_heads: int, max_context: int, device) -> int:
    """Context splits per (row, KV head): a function of shapes only, so graphs can capture it.

    Split only while the (row, KV head) programs are too few to fill the GPU once.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    programs = batch * num_kv_heads
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    return max(1, min(_cdiv(sms, programs), max_context // MIN_SPLIT_KEYS, MAX_SPLITS))


def decode_tiles(head_dim: int) -> tuple[int, int, int]:
    """(keys per tile, warps, pipeline stages) of the decode kernel.

    One choice for every batch: with rows of varied lengths and contexts of 300-1600 keys it
    measured best or near best of 11 choices at most batch sizes (`python
    benchmarks/paged_attention_kernel.py --tiles`; figures in docs/benchmarks-history.md).
    Narrower tiles won clearly only with rows of one length."""
    return (64 if head_dim <= 128 else 32), 4, 3


_scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def decode_scratch(batch: int, num_heads: int, head_dim: int, num_splits: int, device):
    """Per-split partial outputs [B, Hq, S, D] and log2-sum-exps [B, Hq, S], fp32."""
    return (torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=device))


def decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale, out=None,
                     num_splits: int | None = None, scratch=None, tiles: tuple[int, int, int] | None = None,
                     window: int = 0, softcap: float = 0.0, shared: shared_prefix.Shared | None = None):
    """One query per row: q [B, Hq, D] -> [B, Hq, D]. No host sync; the grid follows shapes.

    With split-K the partials need scratch; without one it is allocated once per shape and
    reused, so only a call of a new shape allocates (warm up before capturing a graph).
    `tiles` (keys per tile, warps, pipeline stages) replaces decode_tiles' choice (timing only).
    `shared`: groups of rows whose leading keys are the same blocks, attended once per group
    (engine/kernels/shared_prefix.py); the rows then read their own keys in one split each.
    """
    group, num_kv_heads, head_dim, block_size = _check(q, k_cache, v_cache, block_tables)
    batch, num_heads = q.shape[0], q.shape[1]
    assert seq_lens.shape[0] == batch and block_tables.shape[0] == batch
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    assert shared is None or not window, "a shared prefix is not read through a window"
    if shared is not None:
        num_splits = 1
    if num_splits is None:
        context = block_tables.shape[1] * block_size
        num_splits = decode_splits(batch, num_kv_heads, min(context, window) if window else context, q.device)
    block_n, num_warps, num_stages = tiles or decode_tiles(head_dim)
    if num_splits > 1:
        if scratch is None:
            key = (q.device, batch, num_heads, head_dim, num_splits)
            if key not in _scratch:
                _scratch[key] = decode_scratch(batch, num_heads, head_dim, num_splits, q.device)
            scratch = _scratch[key]
        part_out, part_lse = scratch
        dst, dst_strides = part_out, (*part_out.stride()[:3], *part_lse.stride()[:2])
    else:
        part_lse = out  # unused when there is one split
        dst, dst_strides = out, (out.stride(0), out.stride(1), 0, 0, 0)
    if shared is not None:
        prefix_out, prefix_lse = shared_prefix.prefix_partials(
            q, k_cache, v_cache, block_tables, shared, _qk_scale(scale, softcap), float(softcap) * LOG2E,
            bool(softcap), group, _dot_precision(q.dtype))
        prefix = (shared.row_start, prefix_out, prefix_lse, *prefix_out.stride()[:3], *prefix_lse.stride()[:2])
    else:
        prefix = (seq_lens, out, out, 0, 0, 0, 0, 0)   # unread
    decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, seq_lens, block_tables, dst, part_lse,
        _qk_scale(scale, softcap), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), *dst_strides, int(window), float(softcap) * LOG2E, *prefix,
        WINDOWED=bool(window), SOFTCAP=bool(softcap),
        SHARED=shared is not None, PREFIX_SPLITS=shared_prefix.PREFIX_SPLITS,
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages)
    if num_splits > 1:
        merge_splits_kernel[(batch, num_heads)](
            part_out, part_lse, out, *part_out.stride()[:3], *part_lse.stride()[:2],
            out.stride(0), out.stride(1), NUM_SPLITS=num_splits,
            SPLITS_PAD=next_pow2(num_splits), HEAD_DIM=head_dim, num_warps=4)
    return out


# --------------------------------------------------------------------------------- prefill

def prefill_tiles(query_start, num_tokens: int, block_q: int, max_query_len: int):
    """(row, first query) of every BLOCK_Q-query tile, int32 [num_tiles]; no host sync.

    num_tiles is a bound from the arguments alone; the tiles past the real ones get row -1.
    """
    batch = query_start.shape[0] - 1
    num_tiles = min(_cdiv(num_tokens, block_q) + batch, batch * _cdiv(max_query_len, block_q))
    counts = (query_start[1:] - query_start[:-1] + block_q - 1) // block_q   # tiles per row
    ends = counts.cumsum(0)
    tile = torch.arange(num_tiles, device=query_start.device)
    rows = torch.searchsorted(ends, tile, right=True)
    inside = rows < batch
    rows = rows.clamp(max=batch - 1)
    first = ((tile - (ends[rows] - counts[rows])) * block_q).to(torch.int32)
    return torch.where(inside, rows, -1).to(torch.int32), first


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """How prefill_attention tiles a step's queries. It depends on the step's rows only, not
    on the layer, so a forward computes it once for all of its layers."""
    block_m: int
    block_q: int
    tile_rows: torch.Tensor
    tile_first: torch.Tensor


def prefill_plan(query_start, num_tokens: int, max_query_len: int, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> PrefillPlan:
    """max_query_len may be any bound on the longest row (a CUDA graph plans for its bucket)."""
    group = num_heads // num_kv_heads
    # a tile is BLOCK_M (query, head) pairs, query-major; small queries get a small tile
    max_m = 128 if head_dim <= 128 else 64
    block_m = max(next_pow2(group), min(max_m, max(16, next_pow2(max_query_len * group))))
    block_q = block_m // group
    tile_rows, tile_first = prefill_tiles(query_start, num_tokens, block_q, max_query_len)
    return PrefillPlan(block_m, block_q, tile_rows, tile_first)


def prefill_attention(q, k_cache, v_cache, query_start, seq_lens, block_tables, scale,
                      max_query_len: int, out=None, plan: PrefillPlan | None = None,
                      window: int = 0, softcap: float = 0.0):
    """Any number of queries per row, after any cached prefix: q [T, Hq, D] -> [T, Hq, D]."""
    group, num_kv_heads, head_dim, block_size = _check(q, k_cache, v_cache, block_tables)
    if out is None:
        out = torch.empty_like(q)
    batch = seq_lens.shape[0]
    if batch == 0 or q.shape[0] == 0 or max_query_len == 0:
        return out
    if plan is None:
        plan = prefill_plan(query_start, q.shape[0], max_query_len, q.shape[1], num_kv_heads, head_dim)
    block_m = plan.block_m
    prefill_kernel[(plan.tile_rows.shape[0], num_kv_heads)](
        q, k_cache, v_cache, query_start, seq_lens, block_tables, plan.tile_rows, plan.tile_first, out,
        _qk_scale(scale, softcap), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), int(window), float(softcap) * LOG2E,
        WINDOWED=bool(window), SOFTCAP=bool(softcap), GROUP=group, BLOCK_M=block_m, BLOCK_Q=plan.block_q, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=64 if head_dim <= 128 else 32,
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=8 if block_m >= 128 else 4, num_stages=3 if head_dim <= 128 else 2)
    return out


# --------------------------------------------------------------------------------- kernels

if triton is not None:
    from qmigrate.engine.kernels.paged_attention_kernels import decode_kernel, merge_splits_kernel, prefill_kernel
