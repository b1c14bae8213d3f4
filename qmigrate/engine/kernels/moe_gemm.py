"""A grouped GEMM for mixture-of-experts layers; imported only where triton is.

Assignments (token, slot) are sorted by expert and each expert's run padded to BLOCK_M rows,
so every tile of rows belongs to one expert: program (tile, column block) multiplies its
rows by that expert's weight. The grid is a bound from shapes alone (no host sync), so it
can be captured in a CUDA graph; tiles past the real ones have expert -1 and return.
"""

import triton
import triton.language as tl


@triton.jit
def grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, sorted_ptr, expert_ptr, weight_ptr,
                         num_assign, n, k, stride_am, stride_be, stride_bn, stride_cm,
                         ROWS_PER_A: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """c[i] = a[i // ROWS_PER_A] @ b[expert(i)].T (times weight[i]) for the assignments i of
    one tile; a [*, K], b [E, N, K], c [num_assign, N]."""
    tile = tl.program_id(0)
    col = tl.program_id(1)
    expert = tl.load(expert_ptr + tile)
    if expert < 0:
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ptr + offs_m)
    valid = ids < num_assign
    rows = tl.where(valid, ids // ROWS_PER_A, 0).to(tl.int64)
    offs_n = col * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    b_base = b_ptr + expert.to(tl.int64) * stride_be
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(a_ptr + rows[:, None] * stride_am + kk[None, :], mask=valid[:, None] & (kk[None, :] < k),
                    other=0.0)
        b = tl.load(b_base + offs_n[None, :] * stride_bn + kk[:, None], mask=(offs_n[None, :] < n) & (kk[:, None] < k),
                    other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if MUL_WEIGHT:
        w = tl.load(weight_ptr + ids, mask=valid, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    out = c_ptr + ids.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < n))
