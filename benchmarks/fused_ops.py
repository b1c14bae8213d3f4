"""Time the fused Triton ops (RMSNorm, add + RMSNorm, SiLU-and-mul, RoPE + KV write) against
their eager forms on a CUDA GPU.

Run: python benchmarks/fused_ops.py"""

import torch

from qmigrate.engine.kernels import fused


def main() -> None:
    """Each fused op against its eager form, at 64 and 256 tokens (TinyLlama's shapes, bf16)."""
    from triton.testing import do_bench
    assert torch.cuda.is_available(), "timing needs a CUDA GPU"
    hidden, inter, num_heads, num_kv_heads, head_dim = 2048, 5632, 32, 4, 64
    dtype, dev, eps, block_size = torch.bfloat16, "cuda", 1e-5, 16
    num_blocks = 1024
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=dev).float() / head_dim))
    freqs = torch.arange(4096, device=dev).float()[:, None] * inv_freq
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=dev)
    v_cache = torch.zeros_like(k_cache)
    w = torch.randn(hidden, dtype=dtype, device=dev)
    print(f"{'op':<18}{'T':>6}{'fused us':>10}{'eager us':>10}{'speedup':>9}")
    for num_tokens in (64, 256):
        x = torch.randn(num_tokens, hidden, dtype=dtype, device=dev)
        res = torch.randn_like(x)
        gate_up = torch.randn(num_tokens, 2 * inter, dtype=dtype, device=dev)
        qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=dev)
        positions = torch.randint(0, 4096, (num_tokens,), device=dev)
        slots = torch.randperm(num_blocks * block_size, device=dev)[:num_tokens]
        cases = {
            "rms_norm": lambda t: fused.rms_norm(x, w, eps, use_triton=t),
            "add_rms_norm": lambda t: fused.add_rms_norm(x, res, w, eps, use_triton=t),
            "silu_and_mul": lambda t: fused.silu_and_mul(gate_up, use_triton=t),
            "rope_and_write_kv": lambda t: fused.rope_and_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slots,
                                                                   num_heads, num_kv_heads, head_dim, use_triton=t),
        }
        for name, fn in cases.items():
            fused_ms = do_bench(lambda: fn(True), return_mode="median")
            eager_ms = do_bench(lambda: fn(False), return_mode="median")
            print(f"{name:<18}{num_tokens:>6}{fused_ms * 1e3:>10.1f}{eager_ms * 1e3:>10.1f}"
                  f"{eager_ms / fused_ms:>8.2f}x")


if __name__ == "__main__":
    main()
