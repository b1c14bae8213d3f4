"""A matmul of few rows against e4m3 weights; imported only where triton is.

Decode steps of few rows are bound by reading the weights: `torch._scaled_mm` with rowwise
scales measured no faster than bf16 there (docs/benchmarks.md), so for up to SMALL_M rows
each program streams a BLOCK_N-column slice of the e4m3 weight, upcasts it to the
activations' dtype and multiplies on the tensor cores; the per-channel scale is applied to
the fp32 accumulator. The activations stay in their dtype (no per-token quantization).
"""

import triton
import triton.language as tl


@triton.jit
def w8_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, m, n, k, stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[:m, cols] = x[:m] @ (w[cols] * s[cols]).T (+ b[cols]); x [m, k], w [n, k] e4m3, s [n] fp32."""
    col = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = col * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < m
    n_ok = offs_n < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & (kk[None, :] < k),
                    other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & (kk[None, :] < k), other=0.0)   # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    acc = acc * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])
