"""A matmul of few rows against e4m3 weights; imported only where triton is.

Decode steps of few rows are bound by reading the weights, so the weight is read once, in
e4m3, and upcast in registers: the activations stay in their dtype (no per-token
quantization) and the per-channel scale is applied to the fp32 accumulator. To keep every
multiprocessor streaming, the grid is (column slices of BLOCK_N, SPLIT_K slices of k): a
4096-wide projection in slices of 32 columns is 128 programs, fewer than an H100's 132
multiprocessors, so k is cut as well. With SPLIT_K > 1 each program writes its fp32 partial
sums and `reduce_kernel` adds them up, scales, adds the bias and casts (one launch more).

One row (BLOCK_M 1) multiplies on the FP32 units, summing a [BLOCK_N, BLOCK_K] tile of
products and reducing it at the end; more rows multiply on the tensor cores (`tl.dot`,
BLOCK_M at least 16), either as x @ w.T or swapped, as (w @ x.T).T. The tensor cores take the
weight upcast to x's dtype, or, with F16, both operands in fp16 (one row too, padded to 16):
Hopper converts e4m3 to fp16 two values an instruction but to bf16 in several steps. In fp16,
x keeps 11 bits instead of bf16's 8, and an activation past ±65504 saturates there.
"""

import torch
import triton
import triton.language as tl

F16_MAX = tl.constexpr(65504.0)      # fp16's largest finite value


@triton.jit
def w8_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, part_ptr, m, n, k, k_split, stride_xm, stride_wn, stride_om,
              HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, SWAP: tl.constexpr, F16: tl.constexpr):
    """out[:m, cols] = x[:m] @ (w[cols] * s[cols]).T (+ b[cols]) over k slice `program_id(1)` of
    `k_split` columns; x [m, k], w [n, k] e4m3, s [n] fp32. With SPLIT_K > 1 the unscaled fp32
    sums go to part [SPLIT_K, m, n] instead. EVEN_K: k_split is a multiple of BLOCK_K and the
    slices cover k exactly (no mask along k). SWAP: the product taken as (w @ x.T).T, so that the
    weight's BLOCK_N columns, not the few rows, are the tensor cores' long side (Hopper's
    warpgroup MMA takes 64 rows at a time). F16: the tensor cores multiply in fp16 (the weight
    converted two values an instruction, x saturated at fp16's range) instead of x's dtype."""
    col = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = col * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < m
    n_ok = offs_n < n
    k_lo = split * k_split
    k_hi = tl.minimum(k_lo + k_split, k)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    if BLOCK_M == 1:
        prods = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + offs_k
            if EVEN_K:
                w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
                x = tl.load(x_ptr + kk)
            else:
                w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & (kk[None, :] < k_hi), other=0.0)
                x = tl.load(x_ptr + kk, mask=kk < k_hi, other=0.0)
            prods += w.to(tl.float32) * x.to(tl.float32)[None, :]
        acc = tl.sum(prods, axis=1)[None, :]                                    # [1, BLOCK_N]
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + offs_k
            if EVEN_K:
                w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0)          # [BLOCK_N, BLOCK_K]
                x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
            else:
                w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & (kk[None, :] < k_hi), other=0.0)
                x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & (kk[None, :] < k_hi), other=0.0)
            if F16:
                wc = w.to(tl.float16)
                x = tl.clamp(x.to(tl.float32), -F16_MAX, F16_MAX).to(tl.float16)
            else:
                wc = w.to(x.dtype)
            if SWAP:
                acc_t = tl.dot(wc, tl.trans(x), acc_t)
            else:
                acc = tl.dot(x, tl.trans(wc), acc)
        if SWAP:
            acc = tl.trans(acc_t)
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + (split * m + offs_m[:, None]) * n + offs_n[None, :], acc, mask=mask)


@triton.jit
def reduce_kernel(part_ptr, s_ptr, b_ptr, out_ptr, m, n, stride_om, HAS_BIAS: tl.constexpr,
                  SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[row, cols] = sum over the SPLIT_K partials * s[cols] (+ b[cols]), for program (row, slice)."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (split * m + row) * n + offs, mask=ok, other=0.0)
    acc = acc * tl.load(s_ptr + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def w8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
              block_n: int, block_k: int, split_k: int, num_warps: int, num_stages: int,
              swap: bool = False, f16: bool = False) -> torch.Tensor:
    """x [m, k] (rows contiguous) @ (weight [n, k] e4m3 * scale [n, 1]).T + bias, in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = 1 if m == 1 and not f16 else max(16, triton.next_power_of_2(m))
    # each slice of k a whole number of tiles; the last slice may be short (or empty)
    k_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_split)
    even_k = k % k_split == 0
    part = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    b = bias if bias is not None else scale
    w8_kernel[(triton.cdiv(n, block_n), split_k)](
        x, weight, scale, b, out, part, m, n, k, k_split, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=even_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split_k, SWAP=swap and block_m > 1, F16=f16, num_warps=num_warps, num_stages=num_stages)
    if split_k > 1:
        block = 1024
        reduce_kernel[(m, triton.cdiv(n, block))](part, scale, b, out, m, n, out.stride(0), HAS_BIAS=bias is not None,
                                                  SPLIT_K=split_k, BLOCK=block, num_warps=4)
    return out
