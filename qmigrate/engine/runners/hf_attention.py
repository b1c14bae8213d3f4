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
    it drives the same model itself (its own generate()). The runner's mask is causal
    only: a layer's sliding window (`sliding_window`) is applied here, and so is Gemma 2's
    soft-capping of the scores (`softcap`: softcap * tanh(scores / softcap)).
    """
    batch, num_heads, num_queries, head_dim = query.shape
    num_kv, num_keys = key.shape[1], key.shape[2]
    group = num_heads // num_kv
    scale = scaling if scaling is not None else head_dim ** -0.5
    softcap, window = kwargs.get("softcap"), kwargs.get("sliding_window")
    if attention_mask is None and (window or (num_queries > 1 and num_keys != num_queries)):
        # plain causal attention after a cached prefix, as a mask
        past = num_keys - num_queries
        rows = torch.arange(num_queries, device=query.device)[:, None] + past
        attention_mask = (torch.arange(num_keys, device=query.device)[None, :] <= rows)[None, None]
    if window and num_keys > window:
        attention_mask = within_window(attention_mask, window)
    if num_queries == 1:
        q = query.reshape(batch, num_kv, group, head_dim)
        scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale      # [B, Hkv, G, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if attention_mask is not None:
            scores = scores.masked_fill(~attention_mask.reshape(-1, 1, 1, num_keys), float("-inf"))
        probs = scores.softmax(dim=-1).to(value.dtype)
        out = torch.matmul(probs, value)                                     # [B, Hkv, G, D]
        return out.reshape(batch, 1, num_heads, head_dim), None
    if group > 1:
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
    if softcap is not None:
        # SDPA has no soft-capping: the scores are formed here
        if attention_mask is None:
            attention_mask = torch.ones(num_queries, num_keys, dtype=torch.bool, device=query.device).tril()
        scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale  # [B, Hq, N, L]
        scores = (torch.tanh(scores / softcap) * softcap).masked_fill(~attention_mask, float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1).to(value.dtype), value)
        return out.transpose(1, 2).contiguous(), None
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scale,
                                         is_causal=attention_mask is None)
    return out.transpose(1, 2).contiguous(), None


def within_window(mask: torch.Tensor, window: int) -> torch.Tensor:
    """A causal mask [.., N, L] cut to the last `window` keys of each query (transformers'
    rule: key > query - window). A query's position is its row's last visible key."""
    keys = torch.arange(mask.shape[-1], device=mask.device)
    position = torch.where(mask, keys, -1).amax(dim=-1, keepdim=True)
    return mask & (keys > position - window)


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
