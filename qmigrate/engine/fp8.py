"""FP8 (e4m3) arithmetic: what the `quantization` and `kv_cache_dtype` settings store and
how a value gets there and back.

Weights are quantized once, per output channel: w ≈ q * scale[row], q in e4m3, scale =
amax(|row|) / 448. A product of few rows (up to 64: decode steps, bound by the weight read)
reads the e4m3 weight and upcasts it in registers, the activations staying in their dtype
(kernels/fp8_gemm.py, tiled per weight shape by fp8_plan). Past that, activations are
quantized per token the same way (scale = amax(|token|) / 448, one fused kernel) and the
matmul runs on the FP8 tensor cores with both scales applied to its fp32 accumulator
(`torch._scaled_mm`, rowwise scaling: Hopper and later). The KV cache
stores K and V cast to e4m3 with a scale of 1.0 (vLLM's default): values past ±448 saturate.

Every cast here saturates at ±448 (a value past it becomes the largest finite e4m3, never
NaN), and NaN stays NaN.
"""

from __future__ import annotations

import torch

from qmigrate.engine import fp8_plan

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch arithmetic still works without triton
    triton = None

DTYPE = torch.float8_e4m3fn
MAX = 448.0                 # the largest finite e4m3 value
MIN_SCALE = 1e-12           # the scale of an all-zero row (its values stay zero)
QUANTIZATIONS = ("none", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def kv_dtype(setting: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for a kv_cache_dtype setting: "auto" is the model's."""
    return model_dtype if setting == "auto" else DTYPE


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == DTYPE


def unsupported(device: torch.device, what: str, need: tuple[int, int]) -> str | None:
    """Why `what` cannot run on `device` (one line), or None when it can: FP8 needs a CUDA GPU
    of compute capability `need` or later (8.9 for e4m3 casts, 9.0 for rowwise-scaled matmuls)."""
    device = torch.device(device)
    want = f"{need[0]}.{need[1]}"
    if device.type != "cuda":
        return f"{what} needs a CUDA GPU of compute capability {want} or later (FP8); this engine runs on the {device.type}"
    cap = torch.cuda.get_device_capability(device)
    if cap < need:
        name = torch.cuda.get_device_name(device)
        return f"{what} needs compute capability {want} or later (FP8); {name} has {cap[0]}.{cap[1]}"
    return None


def saturate(x: torch.Tensor, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    """x cast to `dtype`; into e4m3, values past ±448 become ±448."""
    if not is_fp8(dtype):
        return x.to(dtype)
    if is_fp8(x.dtype):
        return x
    return x.float().clamp(-MAX, MAX).to(dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] e4m3, scale [M, 1] fp32) with x ≈ q * scale, one scale per row.
    A Triton kernel on CUDA (one pass, one launch), plain torch elsewhere; the same result."""
    if x.is_cuda and triton is not None and x.shape[0] and x.shape[1] <= MAX_FUSED_K:
        return _quantize_rows_triton(x)
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / MAX).clamp(min=MIN_SCALE)
    return (xf / scale).clamp(-MAX, MAX).to(DTYPE), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale (scale broadcast over rows: [M, 1], or a scalar) in `dtype`."""
    return (q.float() * scale).to(dtype)


def matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] (bf16/fp16) @ dequantize(weight [N, K], weight_scale [N, 1]).T + bias, in x's
    dtype. On CUDA the product takes the path fp8_plan chose for its row count and weight
    shape: up to 64 rows (a step bound by the weight read) the weight-read kernel, x in its own
    dtype and the weight upcast as it is read (kernels/fp8_gemm.py); past that, x quantized
    per token and the product on the FP8 tensor cores. Elsewhere x is quantized per token and
    the product taken in fp32 (the reference of the second path)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x.is_cuda:
        how = fp8_plan.choice(x2.shape[0], *weight.shape) if triton is not None else fp8_plan.SCALED_MM
        return product(x2, weight, weight_scale, bias, how).view(*lead, weight.shape[0])
    xq, xs = quantize_rows(x2)
    out = (dequantize(xq, xs) @ dequantize(weight, weight_scale).t()).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*lead, weight.shape[0])


def weight_only(m: int, n: int, k: int) -> bool:
    """Whether m rows against an [n, k] weight run the weight-read kernel on CUDA (x not
    quantized) rather than per-token quantization and torch._scaled_mm."""
    return triton is not None and fp8_plan.choice(m, n, k) is not fp8_plan.SCALED_MM


def product(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
            how) -> torch.Tensor:
    """x [M, K] on CUDA through one path: a tiling of the weight-read kernel (fp8_plan.W8) or
    fp8_plan.SCALED_MM."""
    if how is not fp8_plan.SCALED_MM:
        from qmigrate.engine.kernels.fp8_gemm import w8_matmul
        if x.stride(1) != 1:
            x = x.contiguous()
        return w8_matmul(x, weight, weight_scale, bias, how.block_n, how.block_k, how.split_k, how.num_warps,
                         how.num_stages, how.swap, how.f16)
    xq, xs = quantize_rows(x)
    out = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale.view(1, -1), out_dtype=x.dtype)
    return out if bias is None else out + bias


def can_quantize(weight: torch.Tensor) -> bool:
    """The FP8 matmul's alignment: both dims multiples of 16."""
    return weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


MAX_FUSED_K = 32768


if triton is not None:
    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, k, stride_x, stride_q, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < k, other=0.0).to(tl.float32)
        # IEEE divisions, as torch's (triton's `/` is approximate)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 0), 448.0), 1e-12)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, tl.broadcast_to(scale, (BLOCK,))), -448.0), 448.0)
        tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=offs < k)
        tl.store(s_ptr + row, scale)

    def _quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m, k = x.shape
        assert x.stride(1) == 1
        q = torch.empty((m, k), dtype=DTYPE, device=x.device)
        scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(k)
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK=block,
                                    num_warps=4 if block <= 2048 else (8 if block <= 8192 else 16))
        return q, scale
