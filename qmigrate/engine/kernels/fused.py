"""Fused kernels for a Llama-family decoder step, each with a torch fallback.

Every function runs a Triton kernel on CUDA tensors and the plain torch ops that
transformers' Llama modules use everywhere else, so the fallback reproduces the
reference model bit for bit on the CPU. The kernels copy that arithmetic too: each
intermediate that torch rounds to the model dtype is rounded to it in the kernel,
fp32 contraction into FMA is off, and silu uses CUDA's expf and an IEEE division as
torch does. Only rms_norm may differ in the last bits, as its sum runs in another order.

The Triton paths launch fixed grids that depend only on shapes, never sync with the
host and allocate only their outputs, so they can be captured in a CUDA graph.

On the CPU the kernels run only under the Triton interpreter (TRITON_INTERPRET=1 set
before this module is imported), and only when asked: `use_triton=True`, or
`TRITON_ON_CPU = True` for every call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qmigrate.engine import fp8
from qmigrate.engine.kv.pool import bits

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:
    triton = None

TRITON_ON_CPU = False  # run the kernels on CPU tensors (interpreter only) when use_triton is None


def _use_triton(x: torch.Tensor, use_triton: bool | None) -> bool:
    if use_triton is None:
        return triton is not None and (x.is_cuda or (TRITON_ON_CPU and INTERPRETED))
    if use_triton:
        if triton is None:
            raise RuntimeError("triton is not installed")
        if not x.is_cuda and not INTERPRETED:
            raise RuntimeError("Triton on CPU tensors needs TRITON_INTERPRET=1 set before this module is imported")
    return use_triton


# fp32 a*b + c*d must not become fma(a, b, c*d): torch rounds each product
_LAUNCH = {"enable_fp_fusion": False}


if triton is not None:

    @triton.jit
    def _round(x, dtype: tl.constexpr):
        # fp32 -> the nearest dtype value (ties to even), kept in fp32. bf16 is rounded on the
        # bits because the Triton interpreter's cast truncates, so the GPU and the tests run
        # the same arithmetic.
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            return bits.to(tl.float32, bitcast=True)
        else:
            return x.to(dtype).to(tl.float32)

    @triton.jit
    def _rms_norm_kernel(x_ptr, x_stride, res_ptr, res_stride, w_ptr, y_ptr, y_stride, res_out_ptr,
                         res_out_stride, eps, H: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        dtype = x_ptr.dtype.element_ty
        h = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
            h = _round(r + h, dtype)
            tl.store(res_out_ptr + row * res_out_stride + cols, h.to(dtype), mask=mask)
        var = tl.sum(h * h, axis=0) / H
        h = _round(h * tl.rsqrt(var + eps), dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y_dtype = y_ptr.dtype.element_ty
        tl.store(y_ptr + row * y_stride + cols, _round(w * h, y_dtype).to(y_dtype), mask=mask)

    @triton.jit
    def _silu_and_mul_kernel(gu_ptr, gu_stride, out_ptr, INTER: tl.constexpr, BLOCK: tl.constexpr,
                             CUDA_EXP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < INTER
        g = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * gu_stride + INTER + cols, mask=mask, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        # torch's CUDA silu: expf and an IEEE division (tl.exp is a faster approximation, and
        # the interpreter has no libdevice)
        e = libdevice.exp(-g) if CUDA_EXP else tl.exp(-g)
        s = _round(tl.math.div_rn(g, 1.0 + e), dtype)  # F.silu rounds to the model dtype
        tl.store(out_ptr + row * INTER + cols, _round(s * u, dtype).to(dtype), mask=mask)

    @triton.jit
    def _rotate(x_ptr, d, mask, c_lo, c_hi, s_lo, s_hi, HALF: tl.constexpr, dtype: tl.constexpr):
        # x*cos + cat(-x2, x1)*sin, every product and sum rounded to the model dtype as torch does
        x1 = tl.load(x_ptr + d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + HALF + d, mask=mask, other=0.0).to(tl.float32)
        lo = _round(_round(x1 * c_lo, dtype) + _round(-x2 * s_lo, dtype), dtype)
        hi = _round(_round(x2 * c_hi, dtype) + _round(x1 * s_hi, dtype), dtype)
        return lo.to(dtype), hi.to(dtype)

    @triton.jit
    def _rope_kv_kernel(qkv_ptr, qkv_stride, pos_ptr, cos_ptr, sin_ptr, table_stride, q_ptr,
                        k_cache_ptr, v_cache_ptr, slot_ptr, block_size,
                        kc_stride_block, kc_stride_slot, kc_stride_head,
                        vc_stride_block, vc_stride_slot, vc_stride_head,
                        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                        HALF: tl.constexpr, BLOCK: tl.constexpr, PASS: tl.constexpr, PASS_BLOCK: tl.constexpr):
        # program (t, h): h < NUM_HEADS rotates query head h; otherwise kv head h - NUM_HEADS.
        # HALF is half the rotary dims; the PASS dims after them (partial rotary) are copied.
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.arange(0, BLOCK)
        mask = d < HALF
        dtype = q_ptr.dtype.element_ty
        pos = tl.load(pos_ptr + t).to(tl.int64)
        # transformers casts cos/sin to the model dtype before rotating
        c_lo = _round(tl.load(cos_ptr + pos * table_stride + d, mask=mask, other=0.0), dtype)
        c_hi = _round(tl.load(cos_ptr + pos * table_stride + HALF + d, mask=mask, other=0.0), dtype)
        s_lo = _round(tl.load(sin_ptr + pos * table_stride + d, mask=mask, other=0.0), dtype)
        s_hi = _round(tl.load(sin_ptr + pos * table_stride + HALF + d, mask=mask, other=0.0), dtype)
        row = qkv_ptr + t * qkv_stride
        if h < NUM_HEADS:
            lo, hi = _rotate(row + h * HEAD_DIM, d, mask, c_lo, c_hi, s_lo, s_hi, HALF, dtype)
            out = q_ptr + (t * NUM_HEADS + h) * HEAD_DIM
            tl.store(out + d, lo, mask=mask)
            tl.store(out + HALF + d, hi, mask=mask)
            if PASS > 0:
                p = tl.arange(0, PASS_BLOCK)
                keep = tl.load(row + h * HEAD_DIM + 2 * HALF + p, mask=p < PASS, other=0.0)
                tl.store(out + 2 * HALF + p, keep, mask=p < PASS)
        else:
            kv_head = h - NUM_HEADS
            slot = tl.load(slot_ptr + t).to(tl.int64)
            if slot >= 0:
                block = slot // block_size
                offset = slot % block_size
                lo, hi = _rotate(row + (NUM_HEADS + kv_head) * HEAD_DIM, d, mask, c_lo, c_hi, s_lo, s_hi,
                                 HALF, dtype)
                k_out = k_cache_ptr + block * kc_stride_block + offset * kc_stride_slot + kv_head * kc_stride_head
                tl.store(k_out + d, lo.to(k_cache_ptr.dtype.element_ty), mask=mask)
                tl.store(k_out + HALF + d, hi.to(k_cache_ptr.dtype.element_ty), mask=mask)
                if PASS > 0:
                    p = tl.arange(0, PASS_BLOCK)
                    keep = tl.load(row + (NUM_HEADS + kv_head) * HEAD_DIM + 2 * HALF + p, mask=p < PASS, other=0.0)
                    tl.store(k_out + 2 * HALF + p, keep.to(k_cache_ptr.dtype.element_ty), mask=p < PASS)
                v_in = row + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM
                v_out = v_cache_ptr + block * vc_stride_block + offset * vc_stride_slot + kv_head * vc_stride_head
                for i in tl.static_range(2):
                    v = tl.load(v_in + i * HALF + d, mask=mask, other=0.0)
                    tl.store(v_out + i * HALF + d, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
                if PASS > 0:
                    p = tl.arange(0, PASS_BLOCK)
                    v = tl.load(v_in + 2 * HALF + p, mask=p < PASS, other=0.0)
                    tl.store(v_out + 2 * HALF + p, v.to(v_cache_ptr.dtype.element_ty), mask=p < PASS)

    INTERPRETED = type(_rms_norm_kernel).__name__ == "InterpretedFunction"
else:
    INTERPRETED = False


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(x.dtype)


def _launch_rms_norm(x, residual, weight, eps, res_out):
    num_tokens, hidden = x.shape
    assert x.stride(1) == 1 and weight.is_contiguous() and weight.shape == (hidden,)
    y = torch.empty((num_tokens, hidden), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if num_tokens == 0:
        return y
    has_residual = residual is not None
    if has_residual:
        assert residual.stride(1) == 1 and res_out.stride(1) == 1
    else:
        residual = res_out = x
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_tokens,)](x, x.stride(0), residual, residual.stride(0), weight, y, y.stride(0),
                                    res_out, res_out.stride(0), eps, H=hidden, BLOCK=block,
                                    HAS_RESIDUAL=has_residual, num_warps=_warps(block), **_LAUNCH)
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, use_triton: bool | None = None) -> torch.Tensor:
    """x [T, H], weight [H] -> [T, H], as LlamaRMSNorm."""
    if not _use_triton(x, use_triton):
        return _rms_norm_torch(x, weight, eps)
    return _launch_rms_norm(x, None, weight, eps, None)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 inplace: bool = False, use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, H] -> (rms_norm(residual + x), residual + x), the residual add of a decoder layer.

    With inplace the new residual is written into `residual`, which is returned."""
    assert x.shape == residual.shape and x.dtype == residual.dtype
    if not _use_triton(x, use_triton):
        new_residual = residual.add_(x) if inplace else residual + x
        return _rms_norm_torch(new_residual, weight, eps), new_residual
    new_residual = residual if inplace else torch.empty_like(x, memory_format=torch.contiguous_format)
    return _launch_rms_norm(x, residual, weight, eps, new_residual), new_residual


def silu_and_mul(gate_up: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
    """gate_up [T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
    num_tokens, width = gate_up.shape
    inter = width // 2
    if not _use_triton(gate_up, use_triton):
        return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    assert gate_up.stride(1) == 1 and width % 2 == 0
    out = torch.empty((num_tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        gate_up, gate_up.stride(0), out, INTER=inter, BLOCK=block, CUDA_EXP=not INTERPRETED,
        num_warps=_warps(block), **_LAUNCH)
    return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_and_write_kv_torch(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
                             head_dim):
    num_tokens = qkv.shape[0]
    q, k, v = qkv.view(num_tokens, -1, head_dim).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    cos_t = cos[positions].to(qkv.dtype).unsqueeze(1)                    # [T, 1, R]
    sin_t = sin[positions].to(qkv.dtype).unsqueeze(1)
    rot = cos.shape[1]
    if rot == head_dim:
        q = (q * cos_t) + (_rotate_half(q) * sin_t)
        k = (k * cos_t) + (_rotate_half(k) * sin_t)
    else:  # partial rotary: the dims past R pass through
        q = torch.cat([(q[..., :rot] * cos_t) + (_rotate_half(q[..., :rot]) * sin_t), q[..., rot:]], dim=-1)
        k = torch.cat([(k[..., :rot] * cos_t) + (_rotate_half(k[..., :rot]) * sin_t), k[..., rot:]], dim=-1)
    valid = slot_mapping >= 0                                              # boolean index: a host sync
    slots = slot_mapping[valid].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    for cache, new in ((k_cache, k), (v_cache, v)):
        bits(cache)[blocks, offsets] = bits(fp8.saturate(new[valid], cache.dtype))
    return q.contiguous()


def rope_and_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      num_heads: int, num_kv_heads: int, head_dim: int,
                      use_triton: bool | None = None) -> torch.Tensor:
    """Rotate q and k as transformers' apply_rotary_pos_emb, store k and v in the paged cache.

    qkv [T, (num_heads + 2 * num_kv_heads) * head_dim]: q heads, then k heads, then v heads.
    positions [T] int; cos, sin [max_positions, R] fp32 (see rope_tables); every
    position, padding rows' too, must index the tables. R < head_dim rotates the first R
    dims of each head and passes the rest through (partial rotary).
    k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim], in qkv's dtype or e4m3
    (saturating casts: engine/fp8.py); token t goes to flat
    slot slot_mapping[t] = block * block_size + offset; a slot of -1 writes nothing.
    Returns q rotated, [T, num_heads, head_dim] contiguous.
    """
    num_tokens = qkv.shape[0]
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and head_dim % 2 == 0
    rot = cos.shape[1]
    assert rot % 2 == 0 and rot <= head_dim, f"rotary dims {rot} of a head of {head_dim}"
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
    if not _use_triton(qkv, use_triton):
        return _rope_and_write_kv_torch(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads,
                                        num_kv_heads, head_dim)
    assert qkv.stride(1) == 1 and cos.stride() == sin.stride() and cos.stride(1) == 1
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert cos.dtype == torch.float32 and sin.dtype == torch.float32
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    block = triton.next_power_of_2(rot // 2)
    num_pass = head_dim - rot
    _rope_kv_kernel[(num_tokens, num_heads + num_kv_heads)](
        qkv, qkv.stride(0), positions, cos, sin, cos.stride(0), q, k_cache, v_cache, slot_mapping,
        k_cache.shape[1], k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=rot // 2, BLOCK=block,
        PASS=num_pass, PASS_BLOCK=triton.next_power_of_2(max(num_pass, 1)), num_warps=1, **_LAUNCH)
    return q


@torch.no_grad()
def rope_tables(rotary_emb: torch.nn.Module, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, head_dim] fp32 from a transformers rotary embedding module.

    Static rope types only (default, linear, llama3, yarn...): dynamic NTK scaling
    changes the frequencies with the sequence length."""
    device = rotary_emb.inv_freq.device
    positions = torch.arange(max_positions, device=device)[None]
    cos, sin = rotary_emb(torch.empty(0, dtype=torch.float32, device=device), positions)
    return cos[0].contiguous(), sin[0].contiguous()
