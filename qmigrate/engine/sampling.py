"""Token selection with randomness that belongs to the request, not to the process.

Sampled rows use the Gumbel-max trick: argmax(logits / T + g) with g = -log(-log(u)) draws
exactly from softmax(logits / T). The uniforms u come from an integer hash of
(seed, token index, vocabulary id), computed with the same integer arithmetic on any
device, so a seeded request draws the same token whatever batch, worker or GPU runs
its step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from qmigrate.engine.controls import StepControls

_MASK32 = 0xFFFFFFFF


@dataclass(slots=True)
class SamplingRows:
    """Per-row parameters of one batch, as tensors on the logits' device (None where no row
    samples: greedy rows read none of them)."""

    temperature: torch.Tensor | None   # float32 [B]; 0 = greedy
    top_p: torch.Tensor | None         # float32 [B]
    top_k: torch.Tensor | None         # int64 [B]; 0 = off
    seed: torch.Tensor | None          # int64 [B]
    index: torch.Tensor | None         # int64 [B]: generated-token index being sampled
    # Known on the host when the rows are built, so sampling never asks the device.
    is_sampled: bool = False
    is_top_k: bool = False
    is_top_p: bool = False

    @classmethod
    def build(cls, temperature, top_p, top_k, seed, index, device) -> "SamplingRows":
        return cls.from_arrays(host_arrays(temperature, top_p, top_k, seed, index), device)

    @classmethod
    def from_arrays(cls, arrays: "HostRows", device) -> "SamplingRows":
        # Built on the host, then copied without waiting: a blocking copy would wait for the
        # step in flight on the device, and the next step could not be queued behind it.
        # A step of greedy rows copies nothing.
        temperature, top_p, top_k, seed, index = arrays
        hot = temperature > 0
        if not hot.any():
            return cls(None, None, None, None, None)
        f = lambda a: torch.from_numpy(a).to(device, non_blocking=True)
        return cls(f(temperature), f(top_p), f(top_k), f(seed), f(index), True,
                   bool((top_k[hot] > 0).any()), bool((top_p[hot] < 1).any()))


# (temperature float32, top_p float32, top_k int64, seed int64, index int64), one entry a row
HostRows = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def host_arrays(temperature, top_p, top_k, seed, index) -> HostRows:
    return (np.asarray(temperature, dtype=np.float32), np.asarray(top_p, dtype=np.float32),
            np.asarray(top_k, dtype=np.int64), np.asarray(seed, dtype=np.int64),
            np.asarray(index, dtype=np.int64))


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


def sample(logits: torch.Tensor, rows: SamplingRows, controls: "StepControls | None" = None,
           slab: torch.Tensor | None = None, logits_out: list | None = None) -> torch.Tensor:
    """logits [B, V] float32 -> token ids [B] int64, without a host sync.

    Every row goes through the sampled path when any row samples (each row's result
    depends on that row alone); greedy rows then take their argmax. `controls` (with the
    ids `slab` its penalties count) changes its rows' logits first, and applies min_p
    after temperature (engine/controls.py). `logits_out` gets the logits after the controls
    (what logprobs are taken from: engine/logprobs.py)."""
    if controls is not None:
        logits = controls.apply(logits, slab)
    if logits_out is not None:
        logits_out.append(logits)
    greedy = logits.argmax(dim=-1)
    if not rows.is_sampled:
        return greedy
    is_sampled = rows.temperature > 0
    temperature = torch.where(is_sampled, rows.temperature, torch.ones_like(rows.temperature))
    x = logits.float() / temperature[:, None]
    if controls is not None:
        x = controls.filter_min_p(x)
    if rows.is_top_k:
        x = _filter_top_k(x, torch.where(is_sampled, rows.top_k, torch.zeros_like(rows.top_k)))
    if rows.is_top_p:
        x = _filter_top_p(x, torch.where(is_sampled, rows.top_p, torch.ones_like(rows.top_p)))
    u = uniforms(rows.seed, rows.index, x.shape[-1])
    gumbel = -torch.log(-torch.log(u))
    drawn = (x.double() + gumbel).argmax(dim=-1)
    return torch.where(is_sampled, drawn, greedy)


def _filter_top_k(x: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    vocab = x.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = x.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    return x.masked_fill(x < kth, float("-inf"))


def _filter_top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_x, order = x.sort(dim=-1, descending=True)
    probs = sorted_x.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs   # mass strictly above each token
    drop_sorted = before > top_p[:, None]    # always keeps the most likely token
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))
