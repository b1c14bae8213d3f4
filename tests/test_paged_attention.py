"""Paged attention: the torch reference against dense SDPA, the Triton kernels against the reference.

Without CUDA the kernels run in triton's interpreter (fp32 and fp16: the interpreter cannot
multiply bf16 tiles); with CUDA the gpu-marked cases run them compiled, bf16 included.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # must precede the first import of triton (and of our kernels) in this process
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed")

from qmigrate.engine.kernels import paged_attention as pa  # noqa: E402
from benchmarks.paged_attention_kernel import TILE_CHOICES  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
ON_CPU = pytest.param("cpu", marks=pytest.mark.skipif(
    not pa.is_interpreted(),
    reason="no CUDA, and triton was imported before TRITON_INTERPRET could be set"))
ON_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}

NUM_KV_HEADS, HEAD_DIM = 2, 64


def make_cache(rows, group, *, block_size=16, dtype=torch.float32, device="cpu", seed=0,
               spare_blocks=5, padding_rows=()):
    """A random cache with each row's blocks scattered over the pool, and a batch over it.

    rows: (num_queries, seq_len) per row. padding_rows: indices of rows that are padding
    (seq_len as given, 0 or 1, with a block table of null blocks only).
    """
    gen = torch.Generator().manual_seed(seed)
    need = [-(-seq_len // block_size) for _, seq_len in rows]
    num_blocks = 1 + sum(need) + spare_blocks
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    k_cache[0] = v_cache[0] = 0
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)
    max_blocks = max(need) + 2
    tables = torch.zeros(len(rows), max_blocks, dtype=torch.int32)
    for b, n in enumerate(need):
        if b not in padding_rows:
            tables[b, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
    counts = torch.tensor([0] + [n for n, _ in rows])
    query_start = counts.cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in rows], dtype=torch.int32)
    q = torch.randn(int(query_start[-1]), group * NUM_KV_HEADS, HEAD_DIM, generator=gen)
    to = dict(device=device)
    return (q.to(dtype=dtype, **to), k_cache.to(dtype=dtype, **to), v_cache.to(dtype=dtype, **to),
            query_start.to(**to), seq_lens.to(**to), tables.to(**to))


def assert_matches(got, expected, dtype):
    assert not got.isnan().any(), "some outputs were never written"
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)


def dtypes_for(device):
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])


DECODE_LENGTHS = [1, 16, 37, 70, 5, 48]       # one key, a block exactly, several blocks, ...


@pytest.mark.parametrize("device", [ON_CPU, ON_CUDA])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(device, group, num_splits):
    # the last two rows are padding: no keys at all, and one key in the null block
    rows = [(1, n) for n in DECODE_LENGTHS] + [(1, 0), (1, 1)]
    for dtype in dtypes_for(device):
        q, k, v, query_start, seq_lens, tables = make_cache(
            rows, group, dtype=dtype, device=device, seed=group, padding_rows=(6, 7))
        expected = pa.paged_attention_reference(q, k, v, query_start, seq_lens, tables, HEAD_DIM ** -0.5)
        out = torch.full_like(q, float("nan"))
        got = pa.decode_attention(q, k, v, seq_lens, tables, HEAD_DIM ** -0.5, out=out, num_splits=num_splits)
        assert got is out
        assert_matches(out, expected, dtype)
        assert (out[6:] == 0).all()


@pytest.mark.parametrize("device", [ON_CPU, ON_CUDA])
def test_narrower_tiles_than_those_in_use_match_the_reference(device):
    """`benchmarks/paged_attention_kernel.py --tiles` times other tiles against those in use: they must compute the same attention."""
    tiles = (32, 2, 4)
    assert tiles in TILE_CHOICES and tiles != pa.decode_tiles(HEAD_DIM)
    rows = [(1, n) for n in DECODE_LENGTHS] + [(1, 0)]
    q, k, v, query_start, seq_lens, tables = make_cache(rows, 8, device=device, padding_rows=(6,))
    expected = pa.paged_attention_reference(q, k, v, query_start, seq_lens, tables, HEAD_DIM ** -0.5)
    for num_splits in (1, 2):
        out = torch.full_like(q, float("nan"))
        pa.decode_attention(q, k, v, seq_lens, tables, HEAD_DIM ** -0.5, out=out, num_splits=num_splits, tiles=tiles)
        assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("device", [ON_CPU, ON_CUDA])
def test_decode_block_size_32_and_default_splits(device):
    rows = [(1, n) for n in (1, 32, 33, 100)]
    q, k, v, query_start, seq_lens, tables = make_cache(rows, 4, block_size=32, device=device)
    expected = pa.paged_attention_reference(q, k, v, query_start, seq_lens, tables, 0.1)
    assert_matches(pa.decode_attention(q, k, v, seq_lens, tables, 0.1), expected, torch.float32)
    assert_matches(pa.decode_attention(q, k, v, seq_lens, tables, 0.1, num_splits=5), expected, torch.float32)


@pytest.mark.parametrize("device", [ON_CPU, ON_CUDA])
@pytest.mark.parametrize("window,softcap", [(7, 0.0), (0, 1.5), (20, 2.0)])
def test_sliding_window_and_softcap_match_the_reference(device, window, softcap):
    """Decode (split or not) and prefill rows longer and shorter than the window, against the
    reference, which masks keys a window or more behind each query and caps scores with tanh."""
    scale = HEAD_DIM ** -0.5
    decode_rows = [(1, n) for n in DECODE_LENGTHS]
    q, k, v, query_start, seq_lens, tables = make_cache(decode_rows, 3, device=device, seed=21)
    kw = dict(window=window, softcap=softcap)
    expected = pa.paged_attention_reference(q, k, v, query_start, seq_lens, tables, scale, **kw)
    assert not torch.allclose(expected, pa.paged_attention_reference(q, k, v, query_start, seq_lens, tables, scale))
    for num_splits in (1, 3):
        assert_matches(pa.decode_attention(q, k, v, seq_lens, tables, scale, num_splits=num_splits, **kw),
                       expected, torch.float32)
    q, k, v, query_start, seq_lens, tables = make_cache(PREFILL_ROWS, 3, device=device, seed=22)
    expected = pa.paged_attention_reference(q, k, v, query_start, seq_lens, tables, scale, **kw)
    out = torch.full_like(q, float("nan"))
    pa.prefill_attention(q, k, v, query_start, seq_lens, tables, scale, 30, out=out, **kw)
    assert_matches(out, expected, torch.float32)


# (new queries, keys): single tokens, a whole prompt, cached prefixes, a block multiple
PREFILL_ROWS = [(1, 1), (16, 16), (5, 37), (1, 50), (30, 70), (3, 3), (1, 17), (12, 44)]


@pytest.mark.parametrize("device", [ON_CPU, ON_CUDA])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_prefill_matches_reference(device, group):
    for dtype in dtypes_for(device):
        q, k, v, query_start, seq_lens, tables = make_cache(PREFILL_ROWS, group, dtype=dtype,
                                                            device=device, seed=10 + group)
        expected = pa.paged_attention_reference(q, k, v, query_start, seq_lens, tables, HEAD_DIM ** -0.5)
        out = torch.full_like(q, float("nan"))
        pa.prefill_attention(q, k, v, query_start, seq_lens, tables, HEAD_DIM ** -0.5, 30, out=out)
        assert_matches(out, expected, dtype)


@pytest.mark.parametrize("device", [ON_CPU, ON_CUDA])
def test_prefill_rows_of_several_tiles_and_block_size_32(device):
    # 150 queries are two tiles even at G = 1; a row with no queries gets no tile
    rows = [(150, 170), (0, 9), (40, 40), (1, 65)]
    q, k, v, query_start, seq_lens, tables = make_cache(rows, 1, block_size=32, device=device, seed=3)
    expected = pa.paged_attention_reference(q, k, v, query_start, seq_lens, tables, 0.125)
    out = torch.full_like(q, float("nan"))
    pa.prefill_attention(q, k, v, query_start, seq_lens, tables, 0.125, 150, out=out)
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("device", [ON_CPU, ON_CUDA])
def test_prefill_of_one_query_rows_equals_decode(device):
    rows = [(1, n) for n in DECODE_LENGTHS]
    q, k, v, query_start, seq_lens, tables = make_cache(rows, 3, device=device)
    decode = pa.decode_attention(q, k, v, seq_lens, tables, 0.2)
    prefill = pa.prefill_attention(q, k, v, query_start, seq_lens, tables, 0.2, 1)
    assert_matches(prefill, decode, torch.float32)


@pytest.mark.parametrize("device", [ON_CPU, ON_CUDA])
def test_dispatcher_picks_kernels(device):
    for rows in ([(1, n) for n in DECODE_LENGTHS], PREFILL_ROWS):
        q, k, v, query_start, seq_lens, tables = make_cache(rows, 8, device=device)
        expected = pa.paged_attention_reference(q, k, v, query_start, seq_lens, tables, 0.3)
        assert_matches(pa.paged_attention(q, k, v, query_start, seq_lens, tables, 0.3), expected, torch.float32)


def test_prefill_tiles():
    query_start = torch.tensor([0, 1, 1, 41, 57], dtype=torch.int32)      # 1, 0, 40, 16 queries
    rows, first = pa.prefill_tiles(query_start, 57, 16, 40)
    real = rows >= 0
    assert rows[real].tolist() == [0, 2, 2, 2, 3]
    assert first[real].tolist() == [0, 0, 16, 32, 0]
    assert not real[5:].any() and len(rows) == min(-(-57 // 16) + 4, 4 * 3)


@pytest.mark.parametrize("device", [ON_CPU, ON_CUDA])
def test_decode_rows_and_a_prompt_in_a_step_planned_for_a_token_bucket(device):
    """A token-bucket graph's layout: decode rows and a prompt, then padding rows of no queries
    and padding tokens of no row, planned for a row as long as the bucket (so each decode row
    gets a tile of BLOCK_Q query slots); the padding tokens are left alone."""
    rows = [(1, n) for n in DECODE_LENGTHS] + [(40, 40), (1, 90)] + [(0, 1)] * 3
    q, k, v, query_start, seq_lens, tables = make_cache(rows, 8, device=device, seed=5, padding_rows=(8, 9, 10))
    bucket = 64
    q = torch.cat([q, torch.randn(bucket - q.shape[0], *q.shape[1:], device=device)])
    expected = pa.paged_attention_reference(q, k, v, query_start, seq_lens, tables, 0.125)
    plan = pa.prefill_plan(query_start, bucket, bucket, q.shape[1], NUM_KV_HEADS, HEAD_DIM)
    out = torch.full_like(q, float("nan"))
    pa.prefill_attention(q, k, v, query_start, seq_lens, tables, 0.125, bucket, out=out, plan=plan)
    real = int(query_start[-1])
    assert_matches(out[:real], expected[:real], torch.float32)
    assert out[real:].isnan().all()


def test_write_kv_and_reference_match_dense_attention():
    group, block_size, scale = 3, 16, HEAD_DIM ** -0.5
    rows = [(4, 4), (1, 23), (7, 40)]       # (new queries, keys): a prompt, decode, prefix + chunk
    q, k_cache, v_cache, query_start, seq_lens, tables = make_cache(rows, group, seed=7)
    k_cache.zero_()
    v_cache.zero_()
    gen = torch.Generator().manual_seed(8)
    dense = [(torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen),
              torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen)) for _, n in rows]
    # all positions of all rows in one write, plus a padding token that must leave block 0 zero
    slots = [int(tables[b, p // block_size]) * block_size + p % block_size
             for b, (_, n) in enumerate(rows) for p in range(n)] + [-1]
    keys = torch.cat([kd for kd, _ in dense] + [torch.ones(1, NUM_KV_HEADS, HEAD_DIM)])
    values = torch.cat([vd for _, vd in dense] + [torch.ones(1, NUM_KV_HEADS, HEAD_DIM)])
    pa.write_kv(k_cache, v_cache, torch.tensor(slots, dtype=torch.int32), keys, values)
    assert (k_cache[0] == 0).all() and (v_cache[0] == 0).all()

    got = pa.paged_attention_reference(q, k_cache, v_cache, query_start, seq_lens, tables, scale)
    for b, (num_q, seq_len) in enumerate(rows):
        kd, vd = dense[b]
        qb = q[query_start[b]:query_start[b + 1]].transpose(0, 1)                   # [Hq, n, D]
        kd = kd.repeat_interleave(group, dim=1).transpose(0, 1)                      # [Hq, L, D]
        vd = vd.repeat_interleave(group, dim=1).transpose(0, 1)
        mask = torch.ones(num_q, seq_len, dtype=torch.bool).tril(seq_len - num_q)
        expected = F.scaled_dot_product_attention(qb, kd, vd, attn_mask=mask, scale=scale)
        torch.testing.assert_close(got[query_start[b]:query_start[b + 1]], expected.transpose(0, 1),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_splits", [1, 4])
def test_write_kv_and_decode_replay_in_a_cuda_graph(num_splits):
    rows = [(1, n) for n in DECODE_LENGTHS] + [(1, 0)]
    q, k, v, query_start, seq_lens, tables = make_cache(
        rows, 8, dtype=torch.bfloat16, device="cuda", padding_rows=(len(rows) - 1,))
    new_k, new_v = torch.randn(2, len(rows), NUM_KV_HEADS, HEAD_DIM, dtype=q.dtype, device="cuda")
    slots = torch.full((len(rows),), -1, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))

    def step():
        pa.write_kv(k, v, slots, new_k, new_v)
        pa.decode_attention(q, k, v, seq_lens, tables, 0.125, out=out, num_splits=num_splits)

    step()  # compiles the kernels and allocates the split scratch outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    # a later step: each real row drops its last key and writes a fresh one in its place
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len:
            p = seq_len - 1
            slots[b] = int(tables[b, p // 16]) * 16 + p % 16
    new_k.normal_()
    new_v.normal_()
    q.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert (k[0] == 0).all()
    expected = pa.paged_attention_reference(q, k, v, query_start, seq_lens, tables, 0.125)
    assert_matches(out, expected, torch.bfloat16)
    assert (new_k[:-1] == k.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots[:-1].long()]).all()
