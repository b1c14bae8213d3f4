"""Self-attention over the paged pool: one q/k/v matmul, optional per-head q/k RMSNorm,
RoPE fused with the write of K and V into the pool, attention that reads the pool in place
(with a sliding window and logit soft-capping where the layer has them), the output matmul."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qmigrate.engine.kernels import fused
from qmigrate.engine.kernels import paged_attention as attn
from qmigrate.engine.layers.linear import Linear
from qmigrate.engine.layers.norms import RMSNorm


@dataclass(slots=True)
class Attention:
    qkv: Linear              # parts (q, k, v)
    o: Linear
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    cos: torch.Tensor        # [max_positions, rotary_dim] fp32
    sin: torch.Tensor
    window: int = 0          # a query sees the last `window` positions (its own included); 0: all
    softcap: float = 0.0     # scores -> softcap * tanh(scores / softcap); 0: none
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None

    def __call__(self, y: torch.Tensor, x, kv: tuple[torch.Tensor, torch.Tensor], shape, plans: dict) -> torch.Tensor:
        """y [T, H] -> [T, H]; x the step's inputs, kv this layer's (k_cache, v_cache)."""
        qkv = self.qkv(y)
        if self.q_norm is not None:
            qkv = self._norm_qk(qkv)
        k_cache, v_cache = kv
        q = fused.rope_and_write_kv(qkv, x.positions, self.cos, self.sin, k_cache, v_cache, x.slots,
                                    self.num_heads, self.num_kv_heads, self.head_dim)
        extra = {}
        if self.window:
            extra["window"] = self.window
        if self.softcap:
            extra["softcap"] = self.softcap
        if not shape.use_kernels:
            o = attn.paged_attention_reference(q, k_cache, v_cache, x.query_start, x.seq_lens, x.block_table,
                                               self.scale, **extra)
        elif shape.is_decode:
            shared = None if self.window else x.shared   # a window reads no shared prefix
            o = attn.decode_attention(q, k_cache, v_cache, x.seq_lens, x.block_table, self.scale, shared=shared,
                                      **extra)
        else:
            key = (self.num_heads, self.num_kv_heads, self.head_dim)
            if key not in plans:
                plans[key] = attn.prefill_plan(x.query_start, shape.num_tokens, shape.max_query_len, *key)
            o = attn.prefill_attention(q, k_cache, v_cache, x.query_start, x.seq_lens, x.block_table, self.scale,
                                       shape.max_query_len, plan=plans[key], **extra)
        return self.o(o.reshape(shape.num_tokens, -1))

    def _norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        t, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=1)
        q = self.q_norm(q.reshape(-1, d)).view(t, -1)
        k = self.k_norm(k.reshape(-1, d)).view(t, -1)
        return torch.cat([q, k, v], dim=1)

    @classmethod
    def of(cls, module, cfg, tables: tuple[torch.Tensor, torch.Tensor], window: int = 0) -> "Attention":
        num_heads = cfg.num_attention_heads
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        parts = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
        if hasattr(module, "qkv_proj"):
            qkv = Linear.of(module.qkv_proj, parallel="column", parts=parts)
        else:
            qkv = Linear.of(module.q_proj, module.k_proj, module.v_proj, parallel="column")
        norms = {}
        if getattr(module, "q_norm", None) is not None:
            norms = dict(q_norm=RMSNorm.of(module.q_norm), k_norm=RMSNorm.of(module.k_norm))
        scale = float(getattr(module, "scaling", head_dim ** -0.5))
        softcap = float(getattr(cfg, "attn_logit_softcapping", None) or 0.0)
        cos, sin = tables
        return cls(qkv, Linear.of(module.o_proj, parallel="row"), num_heads, num_kv_heads, head_dim, scale,
                   cos, sin, window, softcap, **norms)


def layer_windows(cfg) -> list[int]:
    """Each layer's sliding window (0: none), from the config as transformers reads it."""
    n = cfg.num_hidden_layers
    window = int(getattr(cfg, "sliding_window", None) or 0)
    types = getattr(cfg, "layer_types", None)
    if types:
        windows = [window if t == "sliding_attention" else 0 for t in types]
    elif getattr(cfg, "use_sliding_window", True) is False:
        windows = [0] * n
    else:
        windows = [window] * n
    # a window as long as the context masks nothing
    limit = int(getattr(cfg, "max_position_embeddings", 0) or 0)
    return [0 if limit and w >= limit else w for w in windows]
