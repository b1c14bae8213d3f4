"""Rotary tables: cos and sin [max_positions, rotary_dim] fp32 per position, from the
checkpoint's own rotary module, so every static rope type transformers knows (default,
linear, llama3, yarn, longrope; a base per layer type) gives the frequencies it gives.

LongRoPE switches factors at `original_max_position_embeddings`: transformers decides per
forward from the largest position in it; here a position's table row decides (short
factors below that length, long ones from it), which is the same for every sequence that
stays below it. Dynamic NTK scaling changes every frequency with the sequence's length:
those models stay on the transformers runner.
"""

from __future__ import annotations

import inspect

import torch

STATIC_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(cfg, layer_type: str | None = None) -> dict:
    """The rope settings of a config (transformers 5's rope_parameters, or the older
    rope_scaling and rope_theta), for one layer type where they differ by type."""
    params = getattr(cfg, "rope_parameters", None)
    if params is None:
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    if layer_type is not None and layer_type in params and isinstance(params[layer_type], dict):
        params = params[layer_type]
    elif params and all(isinstance(v, dict) for v in params.values()):
        params = next(iter(params.values()))
    return dict(params)


def rope_type(params: dict) -> str:
    return params.get("rope_type", params.get("type", "default")) or "default"


def unsupported_rope(cfg) -> str | None:
    types = set(getattr(cfg, "layer_types", None) or [None])
    for layer_type in types:
        kind = rope_type(rope_parameters(cfg, layer_type))
        if kind not in STATIC_TYPES:
            return f"rope type {kind!r} (the fast runner has {', '.join(STATIC_TYPES)})"
    return None


@torch.no_grad()
def rope_tables(rotary_emb: torch.nn.Module, max_positions: int, layer_type: str | None = None,
                original_max: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, rotary_dim] fp32 (see the module's docstring)."""
    buffer = next(iter(rotary_emb.buffers()))
    device = buffer.device
    takes_type = "layer_type" in inspect.signature(rotary_emb.forward).parameters
    extra = {"layer_type": layer_type} if takes_type and layer_type is not None else {}
    x = torch.empty(0, dtype=torch.float32, device=device)
    bounds = [0, max_positions]
    if original_max and original_max < max_positions:
        bounds = [0, original_max, max_positions]
    cos, sin = [], []
    for lo, hi in zip(bounds, bounds[1:]):
        c, s = rotary_emb(x, torch.arange(lo, hi, device=device)[None], **extra)
        cos.append(c[0].float())
        sin.append(s[0].float())
    return torch.cat(cos).contiguous(), torch.cat(sin).contiguous()


def tables_for(model, max_positions: int) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
    """The tables of each layer type of a checkpoint (key None when all layers share one)."""
    cfg = model.config
    base = model.model
    params = rope_parameters(cfg)
    original = params.get("original_max_position_embeddings") if rope_type(params) == "longrope" else None
    types = getattr(cfg, "layer_types", None)
    rotary = base.rotary_emb
    if types and "layer_type" in inspect.signature(rotary.forward).parameters:
        return {t: rope_tables(rotary, max_positions, t, original) for t in sorted(set(types))}
    local = getattr(base, "rotary_emb_local", None)   # Gemma 3 before rope per layer type
    if types and local is not None:
        return {"sliding_attention": rope_tables(local, max_positions), "full_attention": rope_tables(rotary, max_positions)}
    return {None: rope_tables(rotary, max_positions, None, original)}
