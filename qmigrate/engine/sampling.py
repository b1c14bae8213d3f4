"""Token selection with randomness that belongs to the request, not to the process.

Sampled rows use the Gumbel-max trick: argmax(logits / T + g) with g = -log(-log(u)) draws
exactly from softmax(logits / T). The uniforms u come from an integer hash of
(seed, token index, vocabulary id), computed with the same integer arithmetic on any
device, so a seeded request draws the same token whatever batch, worker or GPU runs
its step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


@dataclass(slots=True)
class SamplingRows:
    """Per-row parameters of one batch, as tensors on the logits' device."""

    temperature: torch.Tensor   # float32 [B]; 0 = greedy
    top_p: torch.Tensor         # float32 [B]
    top_k: torch.Tensor         # int64 [B]; 0 = off
    seed: torch.Tensor          # int64 [B]
    index: torch.Tensor         # int64 [B]: generated-token index being sampled

    @classmethod
    def build(cls, temperature, top_p, top_k, seed, index, device) -> "SamplingRows":
        f = lambda xs, dt: torch.tensor(xs, dtype=dt, device=device)
        return cls(f(temperature, torch.float32), f(top_p, torch.float32), f(top_k, torch.int64),
                   f(seed, torch.int64), f(index, torch.int64))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # A 32-bit finaliser (xorshift-multiply) on int64 holders; multipliers < 2**31 keep the
    # products below 2**63, so no signed overflow happens on any backend.
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def uniforms(seed: torch.Tensor, index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1), a pure function of (seed, index, vocabulary id)."""
    vocab = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)
    row = _mix32(_mix32(seed & _MASK32) ^ _mix32((seed >> 32) + 0x9E37) ^ _mix32(index * 0x3C6EF35F))
    x = _mix32(row[:, None] ^ _mix32(vocab * 0x2545F491 + 0x6A09E667)[None, :])
    x = _mix32(x + row[:, None])
    return (x.to(torch.float64) + 0.5) / 4294967296.0


def sample(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """logits [B, V] float32 -> token ids [B] int64."""
    greedy = logits.argmax(dim=-1)
    is_sampled = rows.temperature > 0
    if not bool(is_sampled.any()):
        return greedy
    idx = is_sampled.nonzero().squeeze(1)
    x = logits[idx].float() / rows.temperature[idx, None]
    x = _filter_top_k(x, rows.top_k[idx])
    x = _filter_top_p(x, rows.top_p[idx])
    u = uniforms(rows.seed[idx], rows.index[idx], x.shape[-1])
    gumbel = -torch.log(-torch.log(u))
    drawn = (x.double() + gumbel).argmax(dim=-1)
    out = greedy.clone()
    out[idx] = drawn
    return out


def _filter_top_k(x: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    if not bool((top_k > 0).any()):
        return x
    vocab = x.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = x.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    return x.masked_fill(x < kth, float("-inf"))


def _filter_top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    if not bool((top_p < 1).any()):
        return x
    sorted_x, order = x.sort(dim=-1, descending=True)
    probs = sorted_x.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs   # mass strictly above each token
    drop_sorted = before > top_p[:, None]    # always keeps the most likely token
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))
