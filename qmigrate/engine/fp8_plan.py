"""Which FP8 matmul a projection of e4m3 weights runs, per weight shape and row count.

Up to 64 rows a step is bound by reading the weights, and the right tiles depend on the
shape: a 4096-wide projection needs its k cut (split-K) to give every multiprocessor work, a
28672-wide one does not. From 2 to 16 rows the tensor cores multiplying in fp16 win (Hopper
converts e4m3 to fp16 two values an instruction, to bf16 in several steps): on an H200, a
Llama-3.1-8B layer's four projections at 16 rows took 84.5 us against 97.0 in the bf16 form.
So when a model's projections are quantized (`fp8_tune.tune`), each distinct
weight shape is timed on the device at 1, 16 and 64 rows with a few candidate tilings of the
weight-read kernel (kernels/fp8_gemm.py), and at 64 rows against per-token quantization with
`torch._scaled_mm`; the fastest is kept for the rows of its bucket (1; 2-16; 17-64). Each
candidate is first checked against the weight-only product in fp32 (a tiling the compiler
gets wrong is refused), then runs in a CUDA graph over every layer's weight of that shape,
so launch overhead and the L2 cache stay out of the timing. Past 64 rows, and for a shape
never tuned past 16 rows, the product runs through `torch._scaled_mm` (`SCALED_MM`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

BUCKETS = (1, 16, 64)       # the largest row count of each bucket; the tuned row count too
MAX_ERROR = 1e-2            # a tiling further than this from the reference (bf16 rounding: ~3e-3) is refused


@dataclass(frozen=True)
class W8:
    """A tiling of the weight-read kernel."""
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = False      # the product as (w @ x.T).T (kernels/fp8_gemm.py)
    f16: bool = False       # the tensor cores multiply in fp16, one row included (kernels/fp8_gemm.py)

    def __str__(self) -> str:
        return (f"w8 {self.block_n}x{self.block_k} split {self.split_k} w{self.num_warps} s{self.num_stages}"
                + (" swap" if self.swap else "") + (" f16" if self.f16 else ""))


SCALED_MM = None            # the choice of per-token quantization and torch._scaled_mm

CANDIDATES = {
    1: (W8(16, 512, 1), W8(32, 512, 1), W8(16, 512, 2), W8(32, 512, 2), W8(64, 256, 1, 8), W8(16, 256, 4),
        W8(32, 1024, 1, 8), W8(16, 1024, 2, 8)),
    16: (W8(32, 256, 1), W8(32, 256, 2), W8(32, 128, 4), W8(64, 128, 4, swap=True),
         W8(64, 128, 4, swap=True, f16=True), W8(32, 256, 1, 4, 4, swap=True, f16=True),
         W8(64, 256, 2, 4, 4, swap=True, f16=True), W8(32, 256, 4, 4, 4, swap=True, f16=True),
         W8(128, 128, 1, 8, swap=True, f16=True)),
    64: (W8(32, 128, 1), W8(64, 128, 1), W8(32, 128, 2), W8(64, 64, 2), W8(64, 128, 1, swap=True),
         W8(64, 128, 4, swap=True), W8(128, 64, 2, 8, swap=True), W8(128, 128, 1, 8, swap=True), SCALED_MM),
}

_chosen: dict[tuple[int, int, int], W8 | None] = {}


def bucket(m: int) -> int | None:
    """The bucket of `m` rows (its largest row count), or None past the last."""
    return next((b for b in BUCKETS if m <= b), None)


def choice(m: int, n: int, k: int) -> W8 | None:
    """The tiling for m rows of x against an [n, k] weight, or SCALED_MM."""
    b = bucket(m)
    if b is None:
        return SCALED_MM
    if (b, n, k) in _chosen:
        return _chosen[(b, n, k)]
    return default(m, n, k)


def default(m: int, n: int, k: int, num_sms: int = 132) -> W8 | None:
    """The tiling of a shape not tuned: enough programs for two per multiprocessor, k cut
    into up to 4 slices where the columns alone give too few."""
    if m > 16:
        return SCALED_MM
    block_k = 512 if m == 1 else 256
    block_n = 32 if n >= 8192 else 16
    programs = -(-n // block_n)
    split_k = 1
    while split_k < 4 and programs * split_k < 2 * num_sms and k >= 2 * split_k * block_k:
        split_k *= 2
    return W8(block_n, block_k, split_k)


def forget() -> None:
    _chosen.clear()


def record(bucket_rows: int, n: int, k: int, how: W8 | None) -> None:
    """Keep `how` for the rows of a bucket against an [n, k] weight (what `fp8_tune.tune` found)."""
    _chosen[(bucket_rows, n, k)] = how
