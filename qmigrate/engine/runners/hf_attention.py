"""Attention over the gathered KV of a mixed batch, plugged into transformers' layers.

Decode rows (one query each) group the query heads that share a KV head and multiply
against the cached keys directly, so grouped-query models never copy K/V per query head;
transformers' own SDPA path repeats K/V to every query head whenever a mask is given,
which on a long batch moves several times more bytes than the attention itself reads.
Prefill falls back to SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "qmigrate"


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [B, Hq, N, D], key/value [B, Hkv, L, D], mask [B, 1, N, L] bool -> [B, N, Hq, D].

    A mask of None means plain causal attention, which is what transformers passes when
    it drives the same model itself (its own generate()).
    """
    batch, num_heads, num_queries, head_dim = query.shape
    num_kv = key.shape[1]
    group = num_heads // num_kv
    scale = scaling if scaling is not None else head_dim ** -0.5
    if num_queries == 1:
        q = query.reshape(batch, num_kv, group, head_dim)
        scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale      # [B, Hkv, G, L]
        if attention_mask is not None:
            scores = scores.masked_fill(~attention_mask.view(batch, 1, 1, -1), float("-inf"))
        probs = scores.softmax(dim=-1).to(value.dtype)
        out = torch.matmul(probs, value)                                     # [B, Hkv, G, D]
        return out.reshape(batch, 1, num_heads, head_dim), None
    if group > 1:
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
    if attention_mask is None and key.shape[2] != num_queries:
        # a plain causal prefill after a cached prefix (transformers' own generate() path)
        past = key.shape[2] - num_queries
        rows = torch.arange(num_queries, device=query.device)[:, None] + past
        attention_mask = torch.arange(key.shape[2], device=query.device)[None, :] <= rows
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scale,
                                         is_causal=attention_mask is None)
    return out.transpose(1, 2).contiguous(), None


def install(model) -> bool:
    """Route the model's attention through `attention`; False if this model cannot."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        AttentionInterface.register(NAME, attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)  # padded generate() still gets a mask
        model.set_attn_implementation(NAME)
    except (ImportError, AttributeError, ValueError, TypeError):
        return False
    return True
