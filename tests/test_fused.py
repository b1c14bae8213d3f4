"""Fused kernels: the torch fallbacks equal transformers' Llama modules, the Triton kernels equal the fallbacks.

Without CUDA the kernels run under the Triton interpreter, which must be switched on before
the kernels are defined; it stays on for the rest of this CPU-only process.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # conftest.py sets it first; kept for runs without it

from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import (LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding,  # noqa: E402
                                                      apply_rotary_pos_emb)

from qmigrate.engine.kernels import fused  # noqa: E402

if fused.triton is None:
    _NO_KERNELS = "triton is not installed"
elif not fused.INTERPRETED and not torch.cuda.is_available():
    _NO_KERNELS = "no CUDA, and the kernels were defined before TRITON_INTERPRET=1 could be set"
else:
    _NO_KERNELS = ""
needs_kernels = pytest.mark.skipif(bool(_NO_KERNELS), reason=_NO_KERNELS)
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HIDDEN, EPS = 4, 2, 16, 64, 1e-6
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
ROPES = {"default": {"rope_type": "default", "rope_theta": 10000.0}, "llama3": LLAMA3_ROPE}


def _config(rope: str = "default") -> LlamaConfig:
    return LlamaConfig(hidden_size=HIDDEN, num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS,
                       head_dim=HEAD_DIM, intermediate_size=128, max_position_embeddings=256,
                       rms_norm_eps=EPS, rope_parameters=dict(ROPES[rope]))


def _randn(*shape, dtype=torch.float32, seed=0, device="cpu", scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + 0.1).to(dtype=dtype, device=device)


def _nan_cache(num_blocks: int, block_size: int, dtype, device="cpu", num_kv_heads=NUM_KV_HEADS,
               head_dim=HEAD_DIM) -> torch.Tensor:
    return torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """New float tensors start as NaN, so an element a kernel forgets to write shows."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan_filled(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: nan_filled(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: nan_filled(empty_like(*a, **k)))


def _hf_rope(config, qkv, positions):
    """q, k rotated by transformers itself: [T, H, D] each."""
    rotary = LlamaRotaryEmbedding(config)
    num_tokens = qkv.shape[0]
    heads = qkv.view(num_tokens, -1, HEAD_DIM).transpose(0, 1)[None]     # [1, H, T, D]
    q, k = heads[:, :NUM_HEADS], heads[:, NUM_HEADS:NUM_HEADS + NUM_KV_HEADS]
    cos, sin = rotary(qkv[None], positions[None])                        # [1, T, D] in the model dtype
    q_embed, k_embed = apply_rotary_pos_emb(q, k, cos, sin)
    return q_embed[0].transpose(0, 1), k_embed[0].transpose(0, 1)


# ---- fallbacks against transformers ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_fallback_equals_llama_rms_norm(dtype):
    norm = LlamaRMSNorm(HIDDEN, eps=EPS)
    norm.weight.data = _randn(HIDDEN, seed=1)
    norm = norm.to(dtype)
    x = _randn(9, HIDDEN, dtype=dtype, scale=3.0)
    with torch.no_grad():
        expected = norm(x)
    got = fused.rms_norm(x, norm.weight.detach(), EPS, use_triton=False)
    assert got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.mark.parametrize("inplace", [False, True])
def test_add_rms_norm_fallback_equals_decoder_residual_add(inplace):
    norm = LlamaRMSNorm(HIDDEN, eps=EPS)
    norm.weight.data = _randn(HIDDEN, seed=1)
    x, residual = _randn(9, HIDDEN, seed=2), _randn(9, HIDDEN, seed=3)
    expected_residual = residual + x
    with torch.no_grad():
        expected = norm(expected_residual)
    y, new_residual = fused.add_rms_norm(x, residual.clone() if not inplace else residual, norm.weight.detach(),
                                         EPS, inplace=inplace, use_triton=False)
    assert torch.equal(new_residual, expected_residual) and torch.equal(y, expected)
    assert (new_residual is residual) == inplace


def test_silu_and_mul_fallback_equals_llama_mlp():
    torch.manual_seed(0)
    mlp = LlamaMLP(_config()).eval()
    x = _randn(7, HIDDEN, seed=4)
    with torch.no_grad():
        expected = mlp(x)
        gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
        assert torch.equal(mlp.down_proj(fused.silu_and_mul(gate_up, use_triton=False)), expected)
        # the fused projection: one GEMM over the concatenated weights may sum in another order
        merged = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        got = mlp.down_proj(fused.silu_and_mul(torch.nn.functional.linear(x, merged), use_triton=False))
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_rope_tables_equal_rotary_embedding(rope):
    config = _config(rope)
    cos, sin = fused.rope_tables(LlamaRotaryEmbedding(config), 256)
    positions = torch.tensor([0, 1, 5, 63, 64, 100, 255])
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(torch.empty(0), positions[None])
    assert cos.dtype == torch.float32 and cos.shape == (256, HEAD_DIM)
    assert torch.equal(cos[positions], hf_cos[0]) and torch.equal(sin[positions], hf_sin[0])


@pytest.mark.parametrize("rope", ["default", "llama3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_write_kv_fallback_equals_apply_rotary_pos_emb(rope, dtype):
    config = _config(rope)
    cos, sin = fused.rope_tables(LlamaRotaryEmbedding(config), 256)
    num_tokens, block_size = 6, 4
    qkv = _randn(num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, dtype=dtype, seed=5)
    positions = torch.tensor([3, 0, 200, 64, 17, 255])
    slots = torch.tensor([5, 0, -1, 11, 2, -1])
    k_cache, v_cache = _nan_cache(4, block_size, dtype), _nan_cache(4, block_size, dtype)
    q = fused.rope_and_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slots, NUM_HEADS, NUM_KV_HEADS,
                                HEAD_DIM, use_triton=False)
    q_hf, k_hf = _hf_rope(config, qkv, positions)
    v = qkv.view(num_tokens, -1, HEAD_DIM)[:, NUM_HEADS + NUM_KV_HEADS:]
    valid = slots >= 0
    assert q.is_contiguous() and torch.equal(q, q_hf)
    assert torch.equal(k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots[valid]], k_hf[valid])
    assert torch.equal(v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots[valid]], v[valid])
    assert int(k_cache.isnan().any(-1).any(-1).sum()) == 16 - int(valid.sum())  # nothing else written


# ---- kernels against the fallbacks -------------------------------------------------------------------

def _close(got, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # a couple of roundings apart in the model dtype
        torch.testing.assert_close(got, want, rtol=2 ** -6 if dtype == torch.bfloat16 else 2 ** -9, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 48])
def test_rms_norm_kernels_match_fallback(dtype, hidden, poisoned_outputs):
    x = _randn(5, hidden, dtype=dtype, seed=6, scale=2.0, device=KERNEL_DEVICE)
    w = _randn(hidden, dtype=dtype, seed=7, device=KERNEL_DEVICE)
    residual = _randn(5, hidden, dtype=dtype, seed=8, device=KERNEL_DEVICE)
    _close(fused.rms_norm(x, w, EPS, use_triton=True), fused.rms_norm(x, w, EPS, use_triton=False), dtype)
    want_y, want_res = fused.add_rms_norm(x, residual, w, EPS, use_triton=False)
    y, new_residual = fused.add_rms_norm(x, residual, w, EPS, use_triton=True)
    _close(y, want_y, dtype)
    assert torch.equal(new_residual, want_res)
    inplace = residual.clone()
    y, out = fused.add_rms_norm(x, inplace, w, EPS, inplace=True, use_triton=True)
    assert out is inplace and torch.equal(out, new_residual)


@needs_kernels
def test_rms_norm_kernel_on_a_strided_input_with_fp32_weight(poisoned_outputs):
    base = _randn(4, 80, dtype=torch.bfloat16, seed=9, device=KERNEL_DEVICE)
    x = base[:, 8:72]                                                   # rows 80 apart
    w = _randn(64, seed=10, device=KERNEL_DEVICE)
    got = fused.rms_norm(x, w, EPS, use_triton=True)
    assert got.dtype == torch.float32
    _close(got, fused.rms_norm(x, w, EPS, use_triton=False), torch.bfloat16)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [128, 1100])
def test_silu_and_mul_kernel_matches_fallback(dtype, inter, poisoned_outputs):
    gate_up = _randn(3, 2 * inter, dtype=dtype, seed=11, scale=3.0, device=KERNEL_DEVICE)
    got = fused.silu_and_mul(gate_up, use_triton=True)
    assert got.shape == (3, inter)
    _close(got, fused.silu_and_mul(gate_up, use_triton=False), dtype)


@needs_kernels
@pytest.mark.parametrize("dtype,head_dim,index_dtype,rotary", [
    (torch.float32, 16, torch.int64, 16), (torch.float32, 24, torch.int32, 24),
    (torch.float16, 16, torch.int32, 16), (torch.bfloat16, 16, torch.int64, 16),
    (torch.float32, 16, torch.int64, 8), (torch.bfloat16, 32, torch.int32, 24)])  # partial rotary
def test_rope_and_write_kv_kernel_matches_fallback(dtype, head_dim, index_dtype, rotary, poisoned_outputs):
    num_tokens, block_size, num_blocks, dev = 7, 4, 3, KERNEL_DEVICE
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary, 2).float() / rotary))
    freqs = torch.arange(64).float()[:, None] * inv_freq
    cos = torch.cat((freqs, freqs), -1).cos().to(dev)
    sin = torch.cat((freqs, freqs), -1).sin().to(dev)
    qkv = _randn(num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * head_dim, dtype=dtype, seed=12, scale=2.0,
                 device=dev)
    positions = torch.tensor([7, 0, 63, 31, 2, 2, 40], dtype=index_dtype, device=dev)
    slots = torch.tensor([5, -1, 0, 11, 3, -1, 8], dtype=index_dtype, device=dev)
    results = []
    for use_triton in (True, False):
        caches = [_nan_cache(num_blocks, block_size, dtype, dev, head_dim=head_dim) for _ in range(2)]
        q = fused.rope_and_write_kv(qkv, positions, cos, sin, *caches, slots, NUM_HEADS, NUM_KV_HEADS, head_dim,
                                    use_triton=use_triton)
        results.append((q, *caches))
    (q, k_cache, v_cache), (want_q, want_k, want_v) = results
    assert q.shape == (num_tokens, NUM_HEADS, head_dim) and q.is_contiguous()
    assert torch.equal(v_cache.nan_to_num(7.0), want_v.nan_to_num(7.0))
    written = ~want_k.isnan()
    assert torch.equal(~k_cache.isnan(), written)                    # every valid slot, and no other
    assert int(written.any(-1).any(-1).sum()) == 5
    # the kernel rounds to the model dtype wherever torch does: exact in every dtype
    assert torch.equal(q, want_q) and torch.equal(k_cache[written], want_k[written])
    if rotary < head_dim:  # the dims past the rotary ones pass through unchanged
        q_in = qkv.view(num_tokens, -1, head_dim)[:, :NUM_HEADS]
        assert torch.equal(q[..., rotary:], q_in[..., rotary:]) and not torch.equal(q[..., :rotary], q_in[..., :rotary])


@needs_kernels
def test_module_switch_sends_cpu_tensors_to_the_kernels(monkeypatch):
    calls = []
    launch = fused._launch_rms_norm
    monkeypatch.setattr(fused, "_launch_rms_norm", lambda *a: calls.append(1) or launch(*a))
    x, w = _randn(2, 64, device=KERNEL_DEVICE), _randn(64, device=KERNEL_DEVICE)
    fused.rms_norm(x, w, EPS)
    assert calls == ([1] if x.is_cuda else [])
    monkeypatch.setattr(fused, "TRITON_ON_CPU", True)
    fused.rms_norm(x, w, EPS)
    assert len(calls) == (2 if x.is_cuda else 1)


def test_empty_batch():
    x = torch.empty(0, 64)
    assert fused.rms_norm(x, torch.ones(64), EPS).shape == (0, 64)
    assert fused.silu_and_mul(torch.empty(0, 32)).shape == (0, 16)


# ---- on a GPU, in the model dtype --------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernels_match_fallback_on_cuda_in_bf16():
    dev, dtype = "cuda", torch.bfloat16
    hidden, inter, num_heads, num_kv_heads, head_dim, block_size = 2048, 5632, 32, 4, 64, 16
    num_tokens = 37
    x = _randn(num_tokens, hidden, dtype=dtype, seed=1, device=dev)
    residual = _randn(num_tokens, hidden, dtype=dtype, seed=2, device=dev)
    w = _randn(hidden, dtype=dtype, seed=3, device=dev)
    _close(fused.rms_norm(x, w, EPS, use_triton=True), fused.rms_norm(x, w, EPS, use_triton=False), dtype)
    y, new_residual = fused.add_rms_norm(x, residual, w, EPS, use_triton=True)
    want_y, want_residual = fused.add_rms_norm(x, residual, w, EPS, use_triton=False)
    assert torch.equal(new_residual, want_residual)
    _close(y, want_y, dtype)
    gate_up = _randn(num_tokens, 2 * inter, dtype=dtype, seed=4, scale=3.0, device=dev)
    _close(fused.silu_and_mul(gate_up, use_triton=True), fused.silu_and_mul(gate_up, use_triton=False), dtype)

    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=dev).float() / head_dim))
    freqs = torch.arange(2048, device=dev).float()[:, None] * inv_freq
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=5, device=dev)
    positions = torch.randint(0, 2048, (num_tokens,), device=dev, dtype=torch.int32)
    slots = torch.randperm(64 * block_size, device=dev)[:num_tokens]
    slots[::5] = -1
    results = []
    for use_triton in (True, False):
        caches = [_nan_cache(64, block_size, dtype, dev, num_kv_heads, head_dim) for _ in range(2)]
        q = fused.rope_and_write_kv(qkv, positions, cos, sin, *caches, slots, num_heads, num_kv_heads, head_dim,
                                    use_triton=use_triton)
        results.append([t.nan_to_num(7.0) for t in (q, *caches)])
    for got, want in zip(*results):  # the kernel rounds where torch does, so it is exact in bf16 too
        assert torch.equal(got, want)
