"""Time the paged attention kernels on a CUDA GPU: decode and prefill for TinyLlama's
attention shape, or (`--tiles`) each decode tile choice against the one in use.

Run: python benchmarks/paged_attention_kernel.py [--tiles]"""

import functools
import random
import sys

import torch

from qmigrate.engine.kernels import paged_attention as pa


def random_batch(rows, num_heads, num_kv_heads, head_dim, block_size, dtype, device):
    """rows: (new queries, keys) each; blocks handed out in a shuffled order."""
    need = [-(-seq_len // block_size) for _, seq_len in rows]
    shape = (1 + sum(need), block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    k_cache[0] = v_cache[0] = 0
    order = (torch.randperm(sum(need)) + 1).tolist()
    tables = torch.zeros(len(rows), max(need), dtype=torch.int32)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    query_start = torch.tensor([0] + [n for n, _ in rows]).cumsum(0).to(torch.int32)
    q = torch.randn(int(query_start[-1]), num_heads, head_dim, dtype=dtype, device=device)
    seq_lens = torch.tensor([s for _, s in rows], dtype=torch.int32)
    return q, k_cache, v_cache, query_start.to(device), seq_lens.to(device), tables.to(device)


def bench() -> None:
    """Decode and prefill times for TinyLlama's attention shape (Hq 32, Hkv 4, D 64), bf16."""
    from triton.testing import do_bench
    assert torch.cuda.is_available(), "timing needs a CUDA GPU"
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size, context = 32, 4, 64, 16, 512
    scale, dtype = head_dim ** -0.5, torch.bfloat16
    elem = torch.finfo(dtype).bits // 8
    print(f"{torch.cuda.get_device_name()}, Hq {heads}, Hkv {kv_heads}, D {head_dim}, bf16, block {block_size}")
    print(f"{'decode batch':>12} {'context':>7} {'splits':>6} {'us':>8} {'GB/s':>7} {'us 1 split':>10} {'GB/s':>7}")
    for batch in (1, 16, 64, 128, 256):
        q, k, v, query_start, seq_lens, tables = random_batch(
            [(1, context)] * batch, heads, kv_heads, head_dim, block_size, dtype, "cuda")
        expected = pa.paged_attention_reference(q, k, v, query_start, seq_lens, tables, scale)
        out = torch.empty_like(q)
        splits = pa.decode_splits(batch, kv_heads, tables.shape[1] * block_size, q.device)
        kv_bytes = 2 * batch * context * kv_heads * head_dim * elem
        cols = []
        for n in (splits, 1):
            pa.decode_attention(q, k, v, seq_lens, tables, scale, out=out, num_splits=n)
            torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
            ms = do_bench(lambda n=n: pa.decode_attention(q, k, v, seq_lens, tables, scale, out=out, num_splits=n),
                          return_mode="median")
            cols += [f"{ms * 1e3:8.1f}", f"{kv_bytes / ms / 1e6:7.0f}"]
        print(f"{batch:>12} {context:>7} {splits:>6} {cols[0]} {cols[1]} {cols[2]:>10} {cols[3]}")
    print(f"{'prefill rows':>12} {'new':>5} {'cached':>6} {'us':>8} {'TFLOP/s':>8}")
    for num_rows, new, cached in ((8, 256, 0), (8, 256, 768)):
        rows = [(new, cached + new)] * num_rows
        q, k, v, query_start, seq_lens, tables = random_batch(
            rows, heads, kv_heads, head_dim, block_size, dtype, "cuda")
        expected = pa.paged_attention_reference(q, k, v, query_start, seq_lens, tables, scale)
        out = torch.empty_like(q)
        pa.prefill_attention(q, k, v, query_start, seq_lens, tables, scale, new, out=out)
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
        ms = do_bench(lambda: pa.prefill_attention(q, k, v, query_start, seq_lens, tables, scale, new, out=out),
                      return_mode="median")
        # QK^T and PV over the keys each query sees: 4 * D flops per (query head, key)
        flops = 4 * head_dim * heads * num_rows * sum(cached + i + 1 for i in range(new))
        print(f"{num_rows:>12} {new:>5} {cached:>6} {ms * 1e3:8.1f} {flops / ms / 1e9:8.1f}")


TILE_CHOICES = ((64, 4, 3), (64, 4, 4), (64, 2, 3), (64, 8, 3), (32, 4, 3), (32, 4, 4), (32, 2, 3),
                (32, 2, 4), (32, 1, 4), (16, 2, 4), (16, 1, 4))


def bench_tiles() -> None:
    """Decode microseconds per layer for each choice of tiles in TILE_CHOICES, the one in use
    first, over batches and contexts whose rows vary in length (0.5-1.5x the context)."""
    from triton.testing import do_bench
    assert torch.cuda.is_available(), "timing needs a CUDA GPU"
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size = 32, 4, 64, 16
    scale, dtype = head_dim ** -0.5, torch.bfloat16
    in_use = pa.decode_tiles(head_dim)
    choices = [in_use] + [c for c in TILE_CHOICES if c != in_use]
    print(f"{torch.cuda.get_device_name()}, Hq {heads}, Hkv {kv_heads}, D {head_dim}, bf16, block {block_size}; "
          f"us per layer for (keys per tile, warps, stages), the one in use first")
    print(f"{'batch':>5} {'context':>7} {'splits':>6} " + " ".join(f"{'%d/%d/%d' % c:>8}" for c in choices)
          + f" {'in use/best':>11}")
    for batch in (16, 32, 64, 96, 128, 192, 256):
        for context in (300, 800, 1600):
            lengths = [max(16, int(context * random.Random(batch * 7919 + context + i).uniform(0.5, 1.5)))
                       for i in range(batch)]
            q, k, v, query_start, seq_lens, tables = random_batch(
                [(1, n) for n in lengths], heads, kv_heads, head_dim, block_size, dtype, "cuda")
            expected = pa.paged_attention_reference(q, k, v, query_start, seq_lens, tables, scale)
            out = torch.empty_like(q)
            splits = pa.decode_splits(batch, kv_heads, tables.shape[1] * block_size, q.device)
            times = []
            for tiles in choices:
                run = functools.partial(pa.decode_attention, q, k, v, seq_lens, tables, scale, out=out,
                                        num_splits=splits, tiles=tiles)
                run()
                torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
                times.append(do_bench(run, return_mode="median") * 1e3)
            print(f"{batch:>5} {context:>7} {splits:>6} " + " ".join(f"{t:8.1f}" for t in times)
                  + f" {times[0] / min(times):11.2f}")


if __name__ == "__main__":
    bench_tiles() if "--tiles" in sys.argv[1:] else bench()
