"""Timing the FP8 matmul's candidate tilings on the device, for fp8_plan's choice per weight
shape and row bucket (see fp8_plan's docstring): each candidate checked against the weight-only
product in fp32 first, then timed in a CUDA graph over every layer's weight of that shape."""

from __future__ import annotations

import logging

import torch

from qmigrate.engine import fp8
from qmigrate.engine.fp8_plan import BUCKETS, CANDIDATES, MAX_ERROR, SCALED_MM, W8, record

log = logging.getLogger(__name__)


def tune(groups: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]], dtype: torch.dtype,
         report: list | None = None) -> dict:
    """Time the candidates for each weight shape (n, k) -> [(e4m3 weight, scale)] of one model
    on their device and keep the fastest per bucket. `report`, when given, gets one row
    (bucket, n, k, candidate, microseconds per call) per timing. Returns the choices made."""
    made = {}
    for (n, k), weights in groups.items():
        device = weights[0][0].device
        gen = torch.Generator(device=device).manual_seed(n * 131 + k)
        for b in BUCKETS:
            x = torch.randn(b, k, device=device, dtype=dtype, generator=gen)
            best, best_us = None, float("inf")
            for cand in CANDIDATES[b]:
                try:
                    if cand is not SCALED_MM and (err := tiling_error(x, *weights[0], cand)) > MAX_ERROR:
                        log.warning("fp8 tune: %s at %d rows of [%d, %d] is %.3g off the reference: not used",
                                    cand, b, n, k, err)
                        continue
                    us = time_us(lambda w, s: fp8.product(x, w, s, None, cand), weights)
                except Exception as exc:   # noqa: BLE001 -- a tiling this GPU cannot take: skip it
                    log.info("fp8 tune %s at %d rows of [%d, %d]: %s", cand or "scaled_mm", b, n, k,
                             str(exc).splitlines()[0][:120])
                    continue
                if report is not None:
                    report.append((b, n, k, str(cand or "scaled_mm"), us))
                if us < best_us:
                    best, best_us = cand, us
            made[(b, n, k)] = best     # none ran: torch._scaled_mm
            record(b, n, k, best)
            log.info("fp8 matmul of [%d, %d] at %d rows: %s, %.1f us a call", n, k, b, best or "scaled_mm", best_us)
    return made


def tiling_error(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, how: W8, cols: int = 256) -> float:
    """How far a tiling's product is from the weight-only reference in fp32 (relative norm),
    over the first `cols` columns: a tiling this compiler gets wrong is never chosen."""
    cols = min(cols, weight.shape[0])
    want = x.float() @ (weight[:cols].float() * scale[:cols]).t()
    got = fp8.product(x, weight, scale, None, how)[:, :cols].float()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def time_us(call, weights, replays: int = 5) -> float:
    """Microseconds per call of `call(weight, scale)` over every weight, from CUDA graph replays."""
    for w, s in weights[:2]:       # compile, and the first launch's set-up
        call(w, s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w, s in weights:
            call(w, s)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2] * 1000 / len(weights)
