"""Time the shared-prefix decode kernel against the plain one, for each tile choice.

Run on a CUDA GPU: python benchmarks/shared_prefix_kernel.py"""

import random

import numpy as np
import torch
from triton.testing import do_bench

from qmigrate.engine.kernels import paged_attention as pa
from qmigrate.engine.kernels import shared_prefix as sp


# (splits, (keys per tile, warps, stages)) to try beside the one in use
PREFIX_CHOICES = ((4, (64, 8, 3)), (8, (64, 8, 3)), (16, (64, 8, 3)), (8, (64, 4, 3)), (8, (32, 4, 3)),
                  (16, (32, 4, 2)), (8, (128, 8, 3)), (2, (64, 8, 3)))


def main() -> None:
    """Decode attention over rows in groups that share a prefix, read once per group against
    once per row, for each choice of PREFIX_CHOICES (the one in use first): TinyLlama's
    attention shape (Hq 32, Hkv 4, D 64), bf16, 16-token blocks. The plain kernel's reads of a
    shared prefix mostly hit the L2 cache, so the saving is less than the bytes suggest."""
    assert torch.cuda.is_available(), "timing needs a CUDA GPU"
    heads, kv_heads, head_dim, bs, scale = 32, 4, 64, 16, 0.125
    in_use = (sp.PREFIX_SPLITS, sp.PREFIX_TILES)
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
        host = sp.groups(table, lens, bs, sp.rows_per_group(heads, kv_heads, head_dim))
        shared = sp.to_device(host, "cuda")
        expected = pa.paged_attention_reference(q, k, v, torch.arange(rows + 1, dtype=torch.int32, device="cuda"),
                                                dl, dt, scale)
        out = torch.empty_like(q)
        host_us = do_bench(lambda: sp.groups(table, lens, bs, sp.rows_per_group(heads, kv_heads, head_dim)),
                           return_mode="median") * 1e3
        plain = do_bench(lambda: pa.decode_attention(q, k, v, dl, dt, scale, out=out), return_mode="median")
        times = []
        for splits, tiles in choices:
            sp.PREFIX_SPLITS, sp.PREFIX_TILES = splits, tiles
            pa.decode_attention(q, k, v, dl, dt, scale, out=out, shared=shared)
            torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
            times.append(do_bench(lambda: pa.decode_attention(q, k, v, dl, dt, scale, out=out, shared=shared),
                                  return_mode="median"))
        sp.PREFIX_SPLITS, sp.PREFIX_TILES = in_use
        print(f"{rows:>5} {num_groups:>6} {shared_len:>6} {int(np.mean(own)):>4} {host_us:7.1f} {plain * 1e3:10.1f} "
              + " ".join(f"{t * 1e3:10.1f}" for t in times))


if __name__ == "__main__":
    main()
